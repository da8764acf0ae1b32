"""`kvtool bench attn`: one decode step of M3 sparse attention at the TP4 shape (16 query heads, 1 KV head, head dim
128, 128-token blocks and pages, top-16 blocks per request) for batch 1, 16, 64, 128, 256, per cache format.

Rows per (batch, format): the Triton kernel (`kvtool.kernels.sparse_attn.sparse_decode`'s default launch: for nvfp4
and mxfp4 on CUDA >= 8.9, from 16 requests x KV heads, the Gluon fast path of `kernels/sparse_attn_gluon.py`, with
the portable kernel's row beside it as "portable"), torch eager (gather the selected slots, dequantize, attention in
fp32: the unfused path), and once per batch PyTorch SDPA over the gathered, already dequantized bf16 tokens
(attention alone, the floor of an unfused engine). Bytes (SPEC section 6): the visible selected K/V tokens read once
(payload + scales), q read once, the output written once, plus the selection; SDPA is charged its bf16 K/V and mask.

How it is timed, the way engines run it: each case runs `layers` layers back to back (distinct caches and
selections per layer, enough of them that one step's K/V exceeds the H200's 50 MB L2 three times over, at most M3's
57 sparse layers), captured once in a CUDA graph and replayed (`BenchCase(cuda_graph=True)`); time and bytes are per
step of all those layers. On CUDA sm_90+ the kernels are launched with programmatic dependent launch
(`kernels/gluon_port.py`, LAUNCH_PDL; the Gluon decode always, the portable kernel for grids of at most one program
per SM), as engines launch their step kernels: each layer's programs are scheduled while the layer before drains, and
wait for it to finish before their first load. Torch eager is not graph-captured (it synchronizes), so it runs
eagerly.

Peers (`engines`, `--peer vllm`): an engine's own decode kernel (vLLM 0.33.0's `minimax_m3_sparse_attn_decode`) on the
same caches, selections, layer count and CUDA-graph replay, for the formats it takes; `report.extra["peer_ratios"]`
holds engine time / kvtool time per case (> 1: kvtool faster).

Goals (H200): >= 70 % of the copy bandwidth at batch 256 for nvfp4 and mxfp4; nvfp4 faster per step than fp8 at batch
>= 64. The report's `extra["goals"]` holds those checks.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvtool.attention import random_block_selection
from kvtool.backend import interpreting
from kvtool.bench.common import BenchCase, BenchReport, run_cases
from kvtool.formats import get_format
from kvtool.paged import PagedCache

__all__ = [
    "DEFAULT_BATCHES", "DEFAULT_FORMATS", "GEOMETRY", "L2_TARGET_BYTES", "MAX_LAYERS", "PROBE_KEEP", "SWEEP",
    "eager_sparse_decode", "layers_for", "render_goals", "run_attn_bench"
]

GEOMETRY = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128, "block_size": 128, "page_size": 128, "topk": 16}
DEFAULT_FORMATS = ("bf16", "fp8", "fp8-token", "nvfp4", "mxfp4")
DEFAULT_BATCHES = (1, 16, 64, 128, 256)
L2_TARGET_BYTES = 150e6  # three times the H200's 50 MB L2
MAX_LAYERS = 57  # M3's sparse layers
# Launch variants tried with --sweep (name, sparse_decode keyword options): the tuning rounds' candidates worth
# re-measuring (warps per program, 32-token tiles, stages / register cap, PAIRED K tiles, the lazy sums and the joint
# max off, more splits, two tiles' copies in flight, 8 programs per SM of 32-token tiles). The rounds and the variants
# dropped (a fused split combine): docs/kernels/sparse_attn.md.
SWEEP = (
    ("warps=2", {"num_warps": 2}), ("warps=4", {"num_warps": 4}),
    ("warps=2 stages=2 maxnreg=168", {"num_warps": 2, "num_stages": 2, "maxnreg": 168}),
    ("tile=32 warps=2", {"tile_tokens": 32, "num_warps": 2}), ("tile=32 warps=1", {"tile_tokens": 32, "num_warps": 1}),
    ("paired=k", {"paired": "k"}), ("lazy_l=0 joint_max=0", {"lazy_l": False, "joint_max": False}),
    ("splits=8", {"num_splits": 8}), ("stages=4", {"num_stages": 4}),
    ("tile=32 maxnreg=128 splits=4", {"tile_tokens": 32, "num_warps": 2, "maxnreg": 128, "num_splits": 4}),
    # bf16 against vLLM's decode (a page a tile, one P.V dot, 256 programs; docs/kernels/sparse_attn.md)
    ("tile=128", {"tile_tokens": 128}), ("tile=128 splits=4", {"tile_tokens": 128, "num_splits": 4}),
    ("tile=128 stages=3", {"tile_tokens": 128, "num_stages": 3}), ("splits=4", {"num_splits": 4}),
    ("precise_p=0", {"precise_p": False}), ("tile=128 precise_p=0", {"tile_tokens": 128, "precise_p": False}),
    ("prefetch=1", {"prefetch": 1}), ("prefetch=2", {"prefetch": 2}),
    ("prefetch=1 tile=128", {"prefetch": 1, "tile_tokens": 128}),
    ("prefetch=2 tile=128", {"prefetch": 2, "tile_tokens": 128}),
    ("prefetch=1 stages=4", {"prefetch": 1, "num_stages": 4}),
    # programmatic dependent launch of large decode grids (default: the next launch released after the loop and the
    # combine's stores, sparse_attn.PDL_MODES) off, released at the start as small grids do, or with the combine
    # releasing it at its start (vLLM's arrangement)
    ("pdl=0", {"pdl": False}), ("pdl=early", {"pdl": "early"}), ("pdl=late-main", {"pdl": "late-main"}),
    # the bf16 launch rule's neighbours (launch_plan, docs/kernels/sparse_attn.md): one split (no merge launch) and
    # 1-6 splits at both tile sizes, with PDL modes, 8 warps or 3 stages beside them
    ("splits=1", {"num_splits": 1}), ("tile=128 splits=1", {"tile_tokens": 128, "num_splits": 1}),
    ("splits=1 pdl=early", {"num_splits": 1, "pdl": "early"}), ("splits=1 pdl=late", {"num_splits": 1, "pdl": "late"}),
    ("tile=128 splits=1 pdl=late", {"tile_tokens": 128, "num_splits": 1, "pdl": "late"}),
    ("tile=128 splits=1 warps=8", {"tile_tokens": 128, "num_splits": 1, "num_warps": 8}),
    ("splits=2", {"num_splits": 2}), ("splits=3", {"num_splits": 3}), ("splits=5", {"num_splits": 5}),
    ("splits=6", {"num_splits": 6}), ("splits=4 pdl=late", {"num_splits": 4, "pdl": "late"}),
    ("splits=4 pdl=late-main", {"num_splits": 4, "pdl": "late-main"}),
    ("splits=2 warps=8", {"num_splits": 2, "num_warps": 8}), ("splits=4 warps=8", {"num_splits": 4, "num_warps": 8}),
    ("splits=4 stages=3", {"num_splits": 4, "num_stages": 3}),
    ("tile=128 splits=2 warps=8", {"tile_tokens": 128, "num_splits": 2, "num_warps": 8}),
    # 128-token tiles capped at 168 registers (no spills: 3 programs per SM instead of 2), 1-4 splits
    *((f"tile=128 maxnreg=168 splits={s}", {"tile_tokens": 128, "maxnreg": 168, "num_splits": s})
      for s in (1, 2, 3, 4)),
    ("tile=128 splits=2", {"tile_tokens": 128, "num_splits": 2}),
    ("tile=128 splits=3", {"tile_tokens": 128, "num_splits": 3}),
)

# Probes of the fixed cost per layer (sweep only): the default launch with only the first k selected blocks of every
# row left (k = 0: nothing is loaded; the time is launch, lookups, partial stores and the combine pass).
PROBE_KEEP = (0, 1, 4)


class _Step:
    """One batch's inputs for `layers` layers of one format: caches, selections, q; plus its byte count."""

    def __init__(self, fmt_name: str, batch: int, context: int, layers: int, device: str, gen: torch.Generator):
        geo = GEOMETRY
        hkv, d, p, bs = geo["num_kv_heads"], geo["head_dim"], geo["page_size"], geo["block_size"]
        self.fmt = get_format(fmt_name)
        self.batch, self.layers, self.device = batch, layers, device
        pages = math.ceil(context / p)
        self.ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
        # every request its own pages, shuffled in the pool (reads are page-granular and scattered, as in an engine)
        perm = torch.randperm(batch * pages, generator=gen).to(torch.int32)
        self.table = perm.reshape(batch, pages).contiguous().to(device)
        tok = torch.arange(context, device=device)
        slots = (self.table.long()[:, tok // p] * p + tok % p).reshape(-1)
        self.k, self.v, self.ids = [], [], []
        pos = self.ctx.long().cpu() - 1
        for _ in range(layers):
            for caches in (self.k, self.v):
                x = (torch.randn(batch * context, hkv, d, device=device) * 2).to(torch.bfloat16)
                amax = float(x.float().abs().max()) if self.fmt.needs_tensor_amax else None
                c = PagedCache.allocate(self.fmt, batch * pages, p, hkv, d, device=device, tensor_amax=amax)
                c.store(x, slots)
                caches.append(c)
            ids = random_block_selection(pos, bs, geo["topk"], hkv, gen).transpose(0, 1).contiguous()
            self.ids.append(ids.to(device))
        self.q = torch.randn(batch, geo["num_q_heads"], d, generator=gen).to(torch.bfloat16).to(device)
        self.context = context
        self.bytes = self.selection_bytes(self.ids)

    def selection_bytes(self, ids_per_layer: list[torch.Tensor]) -> int:
        """Bytes one pass over the layers must move: the selected, visible K and V tokens once, q, ids and output."""
        bs, d = GEOMETRY["block_size"], GEOMETRY["head_dim"]
        visible = 0
        for ids in ids_per_layer:
            tok0 = ids.long().cpu()[..., None] * bs + torch.arange(bs)
            visible += int(((ids.cpu()[..., None] >= 0) & (tok0 < self.context)).sum())
        io = 2 * self.q.numel() * 2 + ids_per_layer[0].numel() * 4 + self.batch * 4
        return visible * self.fmt.bytes_per_token(d) * 2 + len(ids_per_layer) * io

    def probe_ids(self, keep: int) -> list[torch.Tensor]:
        """The selections with only the first `keep` selected blocks of every (row, KV head) left (the rest -1)."""
        out = []
        for ids in self.ids:
            cut = ids.clone()
            cut[..., keep:] = -1
            out.append(cut)
        return out

    def kernel(self, ids_per_layer: list[torch.Tensor] | None = None, **options) -> Callable[[], object]:
        from kvtool.kernels.sparse_attn import sparse_decode

        bs = GEOMETRY["block_size"]
        ids_per_layer = self.ids if ids_per_layer is None else ids_per_layer
        return lambda: [sparse_decode(self.q, k, v, self.table, self.ctx, ids, bs, **options)
                        for k, v, ids in zip(self.k, self.v, ids_per_layer)]

    def engine(self, impl, ids_per_layer: list[torch.Tensor] | None = None) -> Callable[[], object]:
        """The engine's decode over the layers, as `kernel` runs kvtool's: `impl`'s module entry point
        `bench_attn_decode` (kvtool.engines.vllm_m3), set up once per layer here and run by the callable."""
        from kvtool.bench.index import _peer_fn

        make = _peer_fn(impl, "bench_attn_decode")
        ids_per_layer = self.ids if ids_per_layer is None else ids_per_layer
        fns = [make(impl, self.q, k, v, self.table, self.ctx, ids, GEOMETRY["block_size"])
               for k, v, ids in zip(self.k, self.v, ids_per_layer)]
        return lambda: [f() for f in fns]

    def eager(self) -> Callable[[], object]:
        return lambda: [eager_sparse_decode(self.q, k, v, self.table, self.ctx, ids, GEOMETRY["block_size"])
                        for k, v, ids in zip(self.k, self.v, self.ids)]


def _gather(cache: PagedCache, table, ctx, ids, block_size):
    """Selected tokens of each (request, KV head), dequantized: values [B, Hkv, N, D] fp32 and visibility
    [B, Hkv, N]."""
    b, hkv, topk = ids.shape
    p = cache.page_size
    tok = (ids.long()[..., None] * block_size + torch.arange(block_size, device=ids.device)).reshape(b, hkv, -1)
    valid = (ids[..., None] >= 0).expand(-1, -1, -1, block_size).reshape(b, hkv, -1) & (tok < ctx[:, None, None])
    tok = torch.where(valid, tok, torch.zeros_like(tok))
    pages = torch.gather(table.long(), 1, (tok // p).reshape(b, -1)).reshape(tok.shape)
    slots = torch.where(valid, pages * p + tok % p, torch.zeros_like(tok))
    x = cache.dequantize(slots.reshape(-1)).reshape(b, hkv, -1, hkv, cache.head_dim)
    x = torch.diagonal(x, dim1=1, dim2=3).permute(0, 3, 1, 2)  # head h's own tokens: [B, Hkv, N, D]
    return x, valid


def eager_sparse_decode(q, k_cache, v_cache, table, ctx, ids, block_size, scale=None):
    """The unfused torch path an engine without the kernel would run: gather + dequantize + masked softmax.
    q [B, Hq, D] -> bf16 [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k_cache.num_heads
    k, valid = _gather(k_cache, table, ctx, ids, block_size)
    v, _ = _gather(v_cache, table, ctx, ids, block_size)
    qg = q.float().reshape(b, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,bhnd->bhgn", qg, k) * (scale or 1 / math.sqrt(d))
    s = s.masked_fill(~valid[:, :, None], -math.inf)
    out = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1).nan_to_num(0.0), v.masked_fill(~valid[..., None], 0))
    return out.reshape(b, hq, d).to(torch.bfloat16)


def _sdpa_case(step: _Step, device: str) -> BenchCase:
    """SDPA over pre-gathered, dequantized bf16 tokens (the gather is not timed)."""
    import torch.nn.functional as F

    bs = GEOMETRY["block_size"]
    inputs = []
    for k_c, v_c, ids in zip(step.k, step.v, step.ids):
        k, valid = _gather(k_c, step.table, step.ctx, ids, bs)
        v, _ = _gather(v_c, step.table, step.ctx, ids, bs)
        inputs.append((k.to(torch.bfloat16), v.to(torch.bfloat16), valid[:, :, None, :]))
    q = step.q[:, :, None, :]  # [B, Hq, 1, D]

    def fn():
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True) for k, v, m in inputs]

    nbytes = sum(k.numel() * 2 * 2 + m.numel() for k, _, m in inputs) + step.layers * 2 * step.q.numel() * 2
    return BenchCase("torch SDPA (pre-gathered bf16)", fn, nbytes, f"batch {step.batch}",
                     f"{'graph' if device.startswith('cuda') else 'eager'} x {step.layers} layers",
                     cuda_graph=device.startswith("cuda"))


def layers_for(batch: int, context: int, fmt_name: str, device: str) -> int:
    """Enough layers that one step's selected K/V exceeds L2_TARGET_BYTES (GPU), capped at 57; 1 on the CPU."""
    if not device.startswith("cuda"):
        return 1
    g = GEOMETRY
    per_layer = batch * g["num_kv_heads"] * min(context, g["topk"] * g["block_size"]) * 2 * \
        get_format(fmt_name).bytes_per_token(g["head_dim"])
    return max(1, min(MAX_LAYERS, math.ceil(L2_TARGET_BYTES / per_layer)))


def run_attn_bench(batches=DEFAULT_BATCHES, formats=DEFAULT_FORMATS, context: int = 8000, device: str = "cuda",
                   peers: bool = True, sweep: bool = False, seed: int = 0,
                   progress: Callable[[str], None] | None = None, engines: list[str] | None = None) -> BenchReport:
    """Build the case table and run it (see the module docstring). On the CPU the kernel rows need
    TRITON_INTERPRET=1 (the interpreter; times are meaningless there, the run checks the plumbing)."""
    from kvtool.kernels import sparse_attn_gluon as attn_gluon
    from kvtool.bench.index import _peer_fn, peer_impls, peer_ratios
    from kvtool.kernels.sparse_attn import launch_plan, uses_gluon

    impls = peer_impls(engines, device)
    pairs: list[tuple[str, str, str]] = []
    skipped: list[str] = []
    gen = torch.Generator().manual_seed(seed)
    how = "graph" if device.startswith("cuda") else "eager"
    run_kernel = device.startswith("cuda") or interpreting()
    cases: list[BenchCase] = []
    steps: dict[tuple[int, str], _Step] = {}
    for batch in batches:
        group = f"batch {batch}"
        for name in formats:
            layers = layers_for(batch, context, name, device)
            if progress:
                progress(f"building batch {batch} {name} x {layers} layers")
            step = steps[(batch, name)] = _Step(name, batch, context, layers, device, gen)
            label = step.fmt.label
            if run_kernel:
                t, splits, _, warps = launch_plan(batch, GEOMETRY["num_kv_heads"], GEOMETRY["topk"],
                                                  GEOMETRY["block_size"], GEOMETRY["page_size"], torch.device(device),
                                                  quantized=step.fmt.element is not None)
                portable = f"{how} x {layers} layers; tile {t}, splits {splits}, warps {warps}"
                # where the default launch takes the NVIDIA fast path, the portable kernel's row goes beside it
                fast = uses_gluon(step.q, step.k[0], step.v[0], GEOMETRY["block_size"])
                note = portable
                if fast:
                    gtile, _, gsplits = attn_gluon.plan(batch, GEOMETRY["num_kv_heads"], GEOMETRY["topk"],
                                                        torch.device(device))
                    note = f"{how} x {layers} layers; Gluon fast path, tile {gtile}, splits {gsplits}"
                cases.append(BenchCase(f"triton {label}", step.kernel(), step.bytes, group, note,
                                       cuda_graph=device.startswith("cuda")))
                if fast:
                    cases.append(BenchCase(f"triton {label} portable", step.kernel(gluon=False), step.bytes, group,
                                           portable, cuda_graph=device.startswith("cuda")))
                for vname, options in SWEEP if sweep else ():
                    if "native_fp8" in options and step.fmt.scale_element == "e8m0":  # no E4M3 to convert
                        continue
                    cases.append(BenchCase(f"triton {label} {vname}", step.kernel(**options), step.bytes, group,
                                           f"{how} x {layers} layers", cuda_graph=device.startswith("cuda")))
                for keep in PROBE_KEEP if sweep else ():
                    ids = step.probe_ids(keep)
                    cases.append(BenchCase(f"triton {label} probe: {keep} of {GEOMETRY['topk']} blocks",
                                           step.kernel(ids), step.selection_bytes(ids), group,
                                           f"{how} x {layers} layers; default launch",
                                           cuda_graph=device.startswith("cuda")))
            for impl in impls if run_kernel else ():
                why = impl.unsupported("attend", step.fmt, device=device)
                make = _peer_fn(impl, "bench_attn_decode")
                if why or make is None:
                    skipped.append(f"{impl.name} {group} {label}: {why or 'no decode entry point'}")
                    continue
                cases.append(BenchCase(f"{impl.name} {label}", step.engine(impl), step.bytes, group,
                                       f"{how} x {layers} layers", cuda_graph=device.startswith("cuda")))
                for keep in PROBE_KEEP if sweep else ():  # the engine's fixed cost, probed as kvtool's
                    ids = step.probe_ids(keep)
                    cases.append(BenchCase(f"{impl.name} {label} probe: {keep} of {GEOMETRY['topk']} blocks",
                                           step.engine(impl, ids), step.selection_bytes(ids), group,
                                           f"{how} x {layers} layers", cuda_graph=device.startswith("cuda")))
                pairs.append((group, f"triton {label}", f"{impl.name} {label}"))
            if peers:
                cases.append(BenchCase(f"torch eager {label}", step.eager(), step.bytes, group,
                                       f"eager x {layers} layers"))
        if peers:
            cases.append(_sdpa_case(steps[(batch, formats[-1])], device))
    report = run_cases("M3 sparse decode attention, TP4 shape (16 q heads, 1 KV head, D 128, top-16 x 128)", cases,
                       device, progress=progress)
    layers = {f"batch {b} {steps[(b, n)].fmt.label}": steps[(b, n)].layers for (b, n) in steps}
    report.extra = {"geometry": {**GEOMETRY, "context": context}, "layers": layers,
                    "goals": _goals(report, batches, layers), "timing": _timing(device)}
    if impls:
        report.extra.update(peer_ratios=peer_ratios(report, pairs), peer_skipped=skipped,
                            peers=[f"{i.name}: {i.source}" for i in impls])
    if not run_kernel:
        report.extra["note"] = "kernel rows skipped: no CUDA device (set TRITON_INTERPRET=1 to run the interpreter)"
    return report


def _timing(device: str) -> str:
    """How the kernel rows were timed (the issue asks to say it)."""
    if not device.startswith("cuda"):
        return "eager calls (no CUDA device)"
    from kvtool.kernels.platform import pdl_ok

    pdl = ("with programmatic dependent launch (the Gluon decode always, the portable kernel for grids of at most "
           "one program per SM)" if pdl_ok(torch.device(device)) else "without programmatic dependent launch")
    return f"layers back to back in one CUDA graph, replayed; kernels launched {pdl}"


def _goals(report: BenchReport, batches, layers: dict[str, int]) -> list[dict]:
    """The issue-5 checks. Cases run different layer counts (enough to exceed L2), so times compare per layer."""
    by_name = {(r.group, r.name): r for r in report.rows}
    goals = []
    for fam in ("nvfp4-rcp", "mxfp4-rceil"):
        r = by_name.get(("batch 256", f"triton {fam}"))
        if r is not None:
            goals.append({"goal": f"{fam} >= 70 % of copy at batch 256", "value": round(r.frac_copy, 3),
                          "met": r.frac_copy >= 0.70})
    for batch in batches:
        group = f"batch {batch}"
        nv = by_name.get((group, "triton nvfp4-rcp"))
        for fp8 in ("fp8-unit", "fp8-token"):
            other = by_name.get((group, f"triton {fp8}"))
            if batch >= 64 and nv is not None and other is not None:
                nv_layer = nv.time_us / layers[f"{group} nvfp4-rcp"]
                other_layer = other.time_us / layers[f"{group} {fp8}"]
                goals.append({"goal": f"nvfp4 faster than {fp8} per layer at batch {batch}",
                              "value": round(other_layer / nv_layer, 3), "met": nv_layer < other_layer})
    return goals


def render_goals(report: BenchReport, console) -> None:
    from rich.table import Table

    from kvtool.bench.index import render_peers

    render_peers(report, console)
    if report.extra.get("timing"):
        console.print(f"timing: {report.extra['timing']}")
    goals = report.extra.get("goals") or []
    if not goals:
        return
    table = Table(title="Goals (value: fraction of copy, or fp8 time / nvfp4 time per layer)")
    for col in ("goal", "value", "met"):
        table.add_column(col)
    for g in goals:
        table.add_row(g["goal"], f"{g['value']:.3f}", "[green]yes[/green]" if g["met"] else "[red]no[/red]")
    console.print(table)
