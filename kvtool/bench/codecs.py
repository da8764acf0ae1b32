"""`kvtool bench codecs`: quantize throughput of the torch codecs (kvtool/formats) beside their peers.

One table of cases: every MXFP4 rule, NVFP4 recipe (outer scale 1 and auto) and FP8 scale option quantizing one bf16
tensor [rows, 128], each next to the library that does the same job (torchao `to_mx` with the same ScaleCalculationMode,
torchao `nvfp4_quantize`, a plain torch cast for FP8). Bytes per case = the bf16 input read once + payload and scales
written once (SPEC section 6); the peer of a format is charged the same bytes. The report's `extra` holds, per kvtool
case, the speed-up over its peer (peer time / kvtool time): the issue's goal on a 2-core CPU is >= 2 for MXFP4 / NVFP4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvtool.bench.common import BenchCase, BenchReport, run_cases
from kvtool.formats import Format, get_format

__all__ = ["CODEC_ROWS", "CodecRow", "DIM", "codec_cases", "io_bytes", "render_speedups", "run_codec_bench", "speedups"]

DIM = 128


@dataclass(frozen=True)
class CodecRow:
    """One kvtool format and the peer that does the same job (None: no peer)."""

    label: str
    peer: str | None  # key of PEERS


# The table. Peers are named after what they call; a format without an equal peer has none.
CODEC_ROWS: tuple[CodecRow, ...] = (
    CodecRow("mxfp4-floor", "torchao to_mx FLOOR"),
    CodecRow("mxfp4-even", "torchao to_mx EVEN"),
    CodecRow("mxfp4-ceil", "torchao to_mx CEIL"),
    CodecRow("mxfp4-rceil", "torchao to_mx RCEIL"),
    CodecRow("nvfp4-rcp", "torchao nvfp4_quantize"),
    CodecRow("nvfp4-div", None),
    CodecRow("nvfp4-unrounded", None),
    CodecRow("nvfp4-rcp-auto", "torchao nvfp4_quantize per-tensor"),
    CodecRow("fp8-unit", "torch clamp + cast"),
    CodecRow("fp8-token", "torch amax / 448 + cast"),
    CodecRow("fp8-token-ds-pow2", None),
)


def _torchao():
    from kvtool.bench.common import quiet_third_party

    with quiet_third_party():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    return to_mx, ScaleCalculationMode, nvfp4_quantize


def _peers() -> dict[str, Callable[[torch.Tensor], Callable[[], object]]]:
    """Peer name -> (x -> zero-argument callable). torchao is optional: without it only the torch peers remain."""
    peers: dict[str, Callable] = {
        "torch clamp + cast": lambda x: lambda: x.float().clamp(-448, 448).to(torch.float8_e4m3fn),
        "torch amax / 448 + cast": lambda x: lambda: _fp8_token_peer(x),
    }
    try:
        to_mx, mode, nvfp4_quantize = _torchao()
    except ImportError:
        return peers
    for name in ("FLOOR", "EVEN", "CEIL", "RCEIL"):
        peers[f"torchao to_mx {name}"] = (lambda m: lambda x: lambda: to_mx(x, torch.float4_e2m1fn_x2, 32, m))(
            getattr(mode, name))
    peers["torchao nvfp4_quantize"] = lambda x: lambda: nvfp4_quantize(x)
    peers["torchao nvfp4_quantize per-tensor"] = lambda x: lambda: nvfp4_quantize(
        x, per_tensor_scale=x.abs().amax().float() / 2688.0)
    return peers


def _fp8_token_peer(x: torch.Tensor):
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def io_bytes(fmt: Format, x: torch.Tensor) -> int:
    """bf16 input read once + payload and scales written once (a per-tensor fp32 scale counts 4 bytes)."""
    rows = x.numel() // x.shape[-1]
    per_tensor = 4 if fmt.scale_element == "fp32-tensor" else 0
    return x.numel() * x.element_size() + rows * fmt.bytes_per_token(x.shape[-1]) + per_tensor


def codec_cases(x: torch.Tensor, rows: tuple[CodecRow, ...] = CODEC_ROWS) -> list[BenchCase]:
    """BenchCases for bf16 `x` [rows, D]: each kvtool format (public `Format.quantize`, finite check included), then
    its peer (same group, same bytes)."""
    peers = _peers()
    cases = []
    for row in rows:
        fmt = get_format(row.label)
        nbytes = io_bytes(fmt, x)
        cases.append(BenchCase(row.label, (lambda f: lambda: f.quantize(x))(fmt), nbytes, group=fmt.family,
                               note="kvtool torch"))
        if row.peer in peers:
            cases.append(BenchCase(row.peer, peers[row.peer](x), nbytes, group=fmt.family, note=f"peer of {row.label}"))
    return cases


def speedups(report: BenchReport, rows: tuple[CodecRow, ...] = CODEC_ROWS) -> dict[str, float]:
    """kvtool label -> peer time / kvtool time, for the rows that have a peer in the report."""
    times = {r.name: r.time_us for r in report.rows}
    return {row.label: times[row.peer] / times[row.label] for row in rows
            if row.peer in times and row.label in times}


def run_codec_bench(size_mb: float = 8.0, device: str = "cpu", seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> BenchReport:
    """Quantize a bf16 [rows, 128] tensor of `size_mb` MB (random normal, per-row magnitudes 1e-3 .. 1e3) with every
    case; returns the BenchReport with `extra['speedup_vs_peer']` and `extra['input']`."""
    from kvtool.backend import resolve_device

    device = str(resolve_device(device))  # KvtoolError for an unknown or absent device
    rows = max(1, int(size_mb * 1e6) // (2 * DIM))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=g) * 10.0 ** (torch.rand(rows, 1, generator=g) * 6 - 3)
    x = x.to(torch.bfloat16).to(device)
    report = run_cases(f"codecs: quantize bf16 [{rows}, {DIM}]", codec_cases(x), device, progress=progress)
    report.extra["input"] = {"rows": rows, "dim": DIM, "dtype": "bfloat16", "bytes": x.numel() * 2,
                             "threads": torch.get_num_threads()}
    report.extra["speedup_vs_peer"] = speedups(report)
    return report


def render_speedups(report: BenchReport, console) -> None:
    from rich.table import Table

    table = Table(title="speed-up over the peer (peer time / kvtool time; goal >= 2 for mxfp4 / nvfp4 on CPU)")
    table.add_column("format")
    table.add_column("peer")
    table.add_column("speed-up", justify="right")
    peer_of = {row.label: row.peer for row in CODEC_ROWS}
    for label, ratio in report.extra.get("speedup_vs_peer", {}).items():
        table.add_row(label, peer_of[label], f"{ratio:.2f}x")
    console.print(table)
