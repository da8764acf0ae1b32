"""`kvtool bench quant`: the store (quantize-on-write into a paged cache) and gather-dequantize kernels at 64M to 1G
elements, per format, beside the torch eager codec and torchao's quantizers on the same data.

Per (size, format) the table has:
- `store [graph]` / `dequant [graph]` (CUDA only): the two kernels as engines run them, back to back in a CUDA graph
  (no validation, the dequant into a preallocated output): kernel time without Python launch cost. The goals use
  these rows;
- `store`: `kernels.store.store` of bf16 tokens [N, H, 128] into 128-token pages visited in a shuffled page order
  (what an engine's slot mapping looks like), no validation pass (engines guarantee finite input and valid slots),
  launched eagerly from Python (at 64M elements the launch path, ~40 us a call, is a third of the time);
- `dequant`: `kernels.dequant.gather_dequantize` of every token back to bf16 through the same slots;
- `eager quantize` / `eager dequant`: `fmt.quantize(x)` / `q.dequantize(bf16)` on the same GPU tensor (the torch
  reference as an engine would run it eagerly, without the finite check, which is not codec work);
- torchao's quantizer for the same job when torchao is importable (`to_mx` with the matching rule, `nvfp4_quantize`),
  else a row-less note "torchao: not installed".
Bytes (SPEC section 6): store = bf16 input + slot ids read once, payload + scales written once; dequant = payload +
scales + slot ids read once, bf16 output written once; peers are charged the bytes of the job they do (input read,
payload and scales written). Fractions are of the device-to-device copy bandwidth measured first in the same run.

Goals (H200): store and dequant >= 85 % of copy for nvfp4 and mxfp4 at >= 64M elements, and >= 20x the eager codec.
The current numbers are in bench/RESULTS.md; the run behind these goals (store and dequant): docs/kernels/store.md.
The eager `store` / `dequant` rows include the Python launch path, which matters at 64M.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Callable

import torch

from kvtool.backend import interpreting
from kvtool.bench.common import BenchCase, BenchReport, copy_bandwidth, run_cases
from kvtool.errors import InputError
from kvtool.formats import Format, get_format
from kvtool.paged import PagedCache

__all__ = [
    "DEFAULT_FORMATS", "DEFAULT_SIZES", "DIM", "GOAL_FAMILIES", "GOAL_FRACTION", "GOAL_MIN_ELEMENTS", "GOAL_SPEEDUP",
    "PAGE", "SUFFIXES", "goals", "kernels_available", "parse_configs", "parse_sizes", "quant_cases", "render_goals",
    "run_quant_bench", "torchao_status"
]

DIM = 128
PAGE = 128
DEFAULT_FORMATS = ("nvfp4", "mxfp4", "fp8", "fp8-token", "bf16")
DEFAULT_SIZES = "64M,256M,1G"
GOAL_FRACTION = 0.85
GOAL_SPEEDUP = 20.0
GOAL_FAMILIES = ("nvfp4", "mxfp4")
GOAL_MIN_ELEMENTS = 64 << 20
SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """'64M,256M,1G' -> element counts (K / M / G are powers of 1024)."""
    out = []
    for item in filter(None, (t.strip().upper() for t in text.split(","))):
        suffix = item[-1] if item[-1] in "KMG" else ""
        num = item[: len(item) - len(suffix)]
        try:
            n = int(float(num) * SUFFIXES[suffix])
        except ValueError:
            raise InputError(f"bad size {item!r} in --sizes (example: 64M,256M,1G)") from None
        if n < DIM:
            raise InputError(f"size {item!r} is below one row of {DIM} elements")
        out.append(n)
    if not out:
        raise InputError("--sizes is empty (example: 64M,256M,1G)")
    return out


def parse_configs(text: str | None) -> list[tuple[int, int]]:
    """'32x4,64x8' -> [(BLOCK_R, num_warps), ...] launch overrides to time beside the default table."""
    if not text:
        return []
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            rows, warps = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise InputError(f"bad config {item!r} in --configs (example: 32x4,64x8)") from None
        if rows < 1 or rows & (rows - 1) or warps not in (1, 2, 4, 8, 16):
            raise InputError(f"config {item!r}: rows must be a power of two, warps 1/2/4/8/16")
        out.append((rows, warps))
    return out


def kernels_available(device: str) -> bool:
    """Triton kernels run on CUDA, or on CPU under the interpreter (TRITON_INTERPRET=1 set before the run)."""
    return device.startswith("cuda") or interpreting()


def torchao_status() -> str:
    return "installed" if importlib.util.find_spec("torchao") is not None else "not installed"


def _torchao_peer(fmt: Format, x2: torch.Tensor) -> tuple[str, Callable[[], object]] | None:
    """torchao's quantizer doing the same job as `fmt` on x2 [rows, D] bf16, if there is one and torchao imports."""
    try:
        from kvtool.bench.common import quiet_third_party

        with quiet_third_party():
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    except Exception:  # noqa: BLE001 - any import failure means "no peer"
        return None
    if fmt.scale_element == "e8m0" and fmt.block == 32 and fmt.scale_rule is not None:  # OCP MX, a named rule
        mode = getattr(ScaleCalculationMode, fmt.scale_rule.name)
        return f"torchao to_mx {fmt.scale_rule.name}", lambda: to_mx(x2, torch.float4_e2m1fn_x2, fmt.block, mode)
    if fmt.scale_element == "e4m3" and fmt.outer_scale == "1":  # NVFP4 blocks, no per-tensor scale
        return "torchao nvfp4_quantize", lambda: nvfp4_quantize(x2)
    return None


class _Setup:
    """Inputs of one (size, format): bf16 tokens, a shuffled-page slot mapping, a filled cache, the eager QTensor."""

    def __init__(self, fmt: Format, n_elements: int, heads: int, device: str, seed: int):
        self.fmt = fmt
        self.tokens = max(1, n_elements // (heads * DIM))
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(self.tokens, heads, DIM, device=device, generator=gen)
        mag = torch.exp2(torch.randint(-8, 8, (self.tokens, heads, 1), device=device, generator=gen).float())
        self.x = (x * mag).to(torch.bfloat16)
        del x, mag
        pages = math.ceil(self.tokens / PAGE)
        perm = torch.randperm(pages, device=device, generator=gen)
        t = torch.arange(self.tokens, device=device)
        self.slots = perm[t // PAGE] * PAGE + t % PAGE
        amax = float(self.x.abs().amax().float()) if fmt.needs_tensor_amax else None
        self.tensor_amax = None if amax is None else torch.tensor(amax)
        self.cache = PagedCache.allocate(fmt, pages, PAGE, heads, DIM, device=device, tensor_amax=amax)
        rows = self.tokens * heads
        out_bytes = rows * fmt.bytes_per_token(DIM)
        self.store_bytes = self.x.numel() * 2 + self.slots.numel() * 8 + out_bytes
        self.dequant_bytes = out_bytes + self.slots.numel() * 8 + self.x.numel() * 2
        self.codec_bytes = self.x.numel() * 2 + out_bytes


def quant_cases(setup: _Setup, group: str, use_kernels: bool, eager: bool, configs: list[tuple[int, int]],
                device: str = "cpu") -> list[BenchCase]:
    """The BenchCases of one (size, format): kernel store / dequant (default config, then each override), eager
    torch quantize / dequant, and the torchao peer."""
    fmt, cases = setup.fmt, []
    if use_kernels:
        from kvtool.kernels import store_gluon
        from kvtool.kernels.dequant import gather_dequantize
        from kvtool.kernels.store import store

        store(setup.cache, setup.x, setup.slots, validate=False)  # fill the cache for the dequant cases
        if device.startswith("cuda"):
            # as engines run them: no validation, a preallocated output, back-to-back launches in a CUDA graph (the
            # kernel time alone; the eager rows below add the Python launch cost, which dominates small sizes)
            out = torch.empty_like(setup.x)
            cases.append(BenchCase("store [graph]", lambda: store(setup.cache, setup.x, setup.slots, validate=False),
                                   setup.store_bytes, group=group, note="triton, CUDA graph", cuda_graph=True))
            if store_gluon.applies(setup.x, fmt, True):  # the default above is the Hopper fast path: show both
                cases.append(BenchCase("store [graph, portable]", lambda: store(
                    setup.cache, setup.x, setup.slots, validate=False, gluon=False), setup.store_bytes, group=group,
                    note="portable triton kernel, CUDA graph", cuda_graph=True))
            cases.append(BenchCase("dequant [graph]", lambda: gather_dequantize(
                setup.cache, setup.slots, torch.bfloat16, validate=False, out=out), setup.dequant_bytes, group=group,
                note="triton, to bf16, CUDA graph", cuda_graph=True))
        for cfg in [None, *configs]:
            tag = "" if cfg is None else f" [{cfg[0]}x{cfg[1]}]"
            cases.append(BenchCase(
                f"store{tag}", (lambda c: lambda: store(setup.cache, setup.x, setup.slots, validate=False, config=c))(
                    cfg), setup.store_bytes, group=group, note="triton"))
            cases.append(BenchCase(
                f"dequant{tag}", (lambda c: lambda: gather_dequantize(setup.cache, setup.slots, torch.bfloat16,
                                                                       validate=False, config=c))(cfg),
                setup.dequant_bytes, group=group, note="triton, to bf16"))
    if eager:
        x2 = setup.x.reshape(-1, DIM)
        q = fmt.quantize(x2, tensor_amax=setup.tensor_amax, check_finite=False)
        cases.append(BenchCase("eager quantize", lambda: fmt.quantize(x2, tensor_amax=setup.tensor_amax,
                                                                      check_finite=False),
                               setup.codec_bytes, group=group, note="torch reference"))
        cases.append(BenchCase("eager dequant", lambda: q.dequantize(torch.bfloat16), setup.codec_bytes, group=group,
                               note="torch reference, to bf16"))
        peer = _torchao_peer(fmt, x2)
        if peer is not None:
            cases.append(BenchCase(peer[0], peer[1], setup.codec_bytes, group=group, note="torchao peer"))
    return cases


def goals(report: BenchReport) -> list[dict]:
    """The issue's goals per (size, format) of the goal families at >= 64M elements: store / dequant fraction of
    copy >= 0.85, and kernel speed-up over the eager codec >= 20x (eager time / kernel time)."""
    by_group: dict[str, dict[str, float]] = {}
    frac: dict[tuple[str, str], float] = {}
    for r in report.rows:
        by_group.setdefault(r.group, {})[r.name] = r.time_us
        frac[(r.group, r.name)] = r.frac_copy
    out = []
    for group, times in by_group.items():
        size_text, label = group.split(" ", 1)
        if get_format(label).family not in GOAL_FAMILIES or report.extra["elements"][size_text] < GOAL_MIN_ELEMENTS:
            continue
        for base, eager in (("store", "eager quantize"), ("dequant", "eager dequant")):
            # the engine-style row (CUDA graph: kernel time without Python launch cost) where there is one
            kind = f"{base} [graph]" if f"{base} [graph]" in times else base
            if kind not in times:
                continue
            out.append({"goal": f"{group} {kind} >= {GOAL_FRACTION:.0%} of copy", "value": frac[(group, kind)],
                        "met": frac[(group, kind)] >= GOAL_FRACTION})
            if eager in times:
                speedup = times[eager] / times[kind]
                out.append({"goal": f"{group} {kind} >= {GOAL_SPEEDUP:.0f}x eager", "value": speedup,
                            "met": speedup >= GOAL_SPEEDUP})
    return out


def run_quant_bench(sizes: list[int], formats: tuple[str, ...] = DEFAULT_FORMATS, device: str = "cuda",
                    heads: int = 1, eager: bool = True, configs: list[tuple[int, int]] | None = None, seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> BenchReport:
    """Time every (size, format) case; one report (copy bandwidth measured once, first). Each size's tensors are
    freed before the next size is built. `extra` holds the goals, sizes, torchao status and notes."""
    fmts = [get_format(name) for name in formats]
    use_kernels = kernels_available(device)
    copy = copy_bandwidth(device)
    report = None
    elements = {}
    for n in sizes:
        size_text = _size_text(n)
        elements[size_text] = n
        for fmt in fmts:
            group = f"{size_text} {fmt.label}"
            if progress:
                progress(f"setting up {group}")
            setup = _Setup(fmt, n, heads, device, seed)
            part = run_cases("quant", quant_cases(setup, group, use_kernels, eager, configs or [], device), device,
                             copy_gbps=copy, progress=progress)
            if report is None:
                report = part
            else:
                report.rows += part.rows
            del setup, part
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    report.title = f"quant: store / dequant, bf16 [tokens, {heads}, {DIM}], {PAGE}-token pages"
    notes = [f"torchao: {torchao_status()}"]
    if not use_kernels:
        notes.append("triton kernels skipped: they need --device cuda, or TRITON_INTERPRET=1 on CPU")
    report.extra.update({"elements": elements, "heads": heads, "dim": DIM, "page_size": PAGE,
                         "torchao": torchao_status(), "notes": notes})
    report.extra["goals"] = goals(report)
    return report


def _size_text(n: int) -> str:
    for suffix in ("G", "M", "K"):
        if n % SUFFIXES[suffix] == 0:
            return f"{n // SUFFIXES[suffix]}{suffix}"
    return str(n)


def render_goals(report: BenchReport, console) -> None:
    from rich.table import Table

    for note in report.extra.get("notes", []):
        console.print(f"note: {note}")
    rows = report.extra.get("goals") or []
    if not rows:
        return
    table = Table(title=f"Goals ({', '.join(GOAL_FAMILIES)} at >= 64M elements): fraction of copy, speed-up over eager")
    for col in ("goal", "value", "met"):
        table.add_column(col)
    for g in rows:
        table.add_row(g["goal"], f"{g['value']:.3f}", "[green]yes[/green]" if g["met"] else "[red]no[/red]")
    console.print(table)
