"""`kvtool bench index`: the lightning-indexer scorers over paged index caches (M3: 4 index heads sharing one 128-d
key per token, 128-token blocks, top-16), per cache format, beside a torch eager scorer.

Cases:
- decode at batch 1, 16, 64 x context 8K, 32K, 150K: `score` (block scores written, `decode_block_scores`) and
  `score+topk` (the path engines run, `decode_topk`: block ids only; by default block scores then a select kernel,
  `in_kernel_topk` in --sweep is the single-pass variant); torch eager (gather + dequantize the
  keys, fp32 einsum, max-pool, forced blocks, top-k) beside them.
- prefill of one request at 4K and 32K tokens, every position a query (causal): `prefill_topk`, and torch eager in
  query chunks. Prefill is compute-bound (4 heads x Q x ctx / 2 x 128 MACs); its note gives TFLOP/s.

Bytes (SPEC section 6): the index cache read once (context x bytes per token: payload + scales), queries read once,
outputs written once (block scores fp32 or ids int32), plus the block table and context lengths.

Timing: each decode case scores `layers` layers back to back (distinct caches; enough that one step reads over three
times the H200's 50 MB L2, at most M3's 57 sparse layers), captured in a CUDA graph and replayed, so the numbers are
what an engine's step sees; time and bytes are per step of all those layers. Torch eager runs eagerly, one layer.

Peers (`engines`, `--peer vllm`): an engine's own kernels (kvtool.engines, e.g. vLLM 0.33.0's
`minimax_m3_index_decode` and `minimax_m3_index_score` + `minimax_m3_index_topk`) on the same caches, layer count and
CUDA-graph replay, for the formats they take; `report.extra["peer_ratios"]` holds engine time / kvtool time per case
(> 1: kvtool faster) and `report.extra["peer_skipped"]` what an engine cannot run.

Goals (H200, batch 64 x 150K): FP4 score+topk within 1.15x of its byte floor at the measured copy bandwidth; FP4
time <= 0.62x FP8 time; score+topk within 1.1x of score alone (`report.extra["goals"]`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvtool.backend import interpreting
from kvtool.bench.common import BenchCase, BenchReport, run_cases
from kvtool.formats import get_format
from kvtool.indexer import IndexerConfig, apply_forced, select_topk
from kvtool.paged import PagedCache

__all__ = [
    "DEFAULT_BATCHES", "DEFAULT_CONTEXTS", "DEFAULT_FORMATS", "DEFAULT_PREFILL", "FP4_ONLY", "GEOMETRY",
    "L2_TARGET_BYTES", "MAX_LAYERS", "SWEEP", "SWEEP_SHAPES", "eager_decode_topk", "eager_prefill_topk", "layers_for",
    "peer_impls", "peer_ratios", "render_goals", "render_peers", "run_index_bench"
]

GEOMETRY = {"index_heads": 4, "head_dim": 128, "page_size": 128}
DEFAULT_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
DEFAULT_BATCHES = (1, 16, 64)
DEFAULT_CONTEXTS = (8192, 32768, 150_000)
DEFAULT_PREFILL = (4096, 32768)
L2_TARGET_BYTES = 150e6  # three times the H200's 50 MB L2
MAX_LAYERS = 57  # M3's sparse layers
# --sweep: launch variants at the goal shape (name, kernels.index_score launch options, the families a row is for or
# None). The variants dropped after earlier rounds and every round's numbers: docs/kernels/index_score.md. The FP4
# byte decode (fp4_words=False) has far more SASS than the word decode at D = 128, so it is not swept.
# FP4 decode variants (post_scale: block scales after the dot, forced also where it is not the default; num_warps=1:
# one warp per 128-token tile, mma.sync instead of wgmma, no cross-warp block max) run for FP4 formats only.
# The `lean` option (kernels/index_score.py, LEAN_DEFAULT) autotuned and in both fixed loop kinds; warp partials
# toggled against each format's default.
SWEEP = (
    ("lean", {"lean": True}, None),
    ("lean pipelined s5", {"lean": True, "prefetch": False, "num_stages": 5, "num_warps": 4}, None),
    ("lean prefetch", {"lean": True, "prefetch": True, "num_stages": 1, "num_warps": 4}, None),
    ("lean warp partials", {"lean": True, "warp_partials": True}, ("mxfp4",)),
    ("lean no warp partials", {"lean": True, "warp_partials": False}, ("fp8", "nvfp4")),
    # two tiles per loop iteration (kernels/index_score.py, tile_pairs)
    ("pairs", {"tile_pairs": True}, None),
    ("pairs s3", {"tile_pairs": True, "prefetch": False, "num_stages": 3, "num_warps": 4}, None),
    ("pairs s5", {"tile_pairs": True, "prefetch": False, "num_stages": 5, "num_warps": 4}, None),
    # capped at 128 registers (4 programs per SM as the defaults)
    ("pairs s3 r128", {"tile_pairs": True, "prefetch": False, "num_stages": 3, "num_warps": 4,
                       "max_registers": 128}, None),
    ("pairs s5 r128", {"tile_pairs": True, "prefetch": False, "num_stages": 5, "num_warps": 4,
                       "max_registers": 128}, None),
    ("pairs prefetch", {"tile_pairs": True, "prefetch": True, "num_stages": 1, "num_warps": 4}, None),
    # the FP4 default on CUDA is the Gluon kernel (kernels/index_gluon.py): the portable kernel's default beside it,
    # and the Gluon kernel at fixed blocks per program (its default: index_gluon.chunk_blocks_for)
    ("portable", {"gluon": False}, ("nvfp4", "mxfp4")),
    # blocks per program of the portable kernel's context split (its CUDA decode default: at most
    # index_score.CUDA_DECODE_MAX_CHUNK_BLOCKS, 16)
    ("ch4", {"chunk_blocks": 4}, ("bf16", "fp8")),
    ("ch8", {"chunk_blocks": 8}, ("bf16", "fp8")),
    ("gluon ch16", {"gluon": True, "chunk_blocks": 16}, ("nvfp4", "mxfp4")),
    ("gluon ch32", {"gluon": True, "chunk_blocks": 32}, ("nvfp4", "mxfp4")),
    ("gluon ch64", {"gluon": True, "chunk_blocks": 64}, ("nvfp4", "mxfp4")),
    # the Gluon kernel's query operand in registers (its default: index_gluon.QUERY_SMEM) and register caps (its
    # default: index_gluon.MAXNREG; 80 / 72 registers a thread: 6 / 7 programs per SM)
    ("gluon query in registers", {"gluon": True, "query_smem": False}, ("nvfp4", "mxfp4")),
    ("gluon r80", {"gluon": True, "max_registers": 80}, ("mxfp4",)),
    ("gluon r72", {"gluon": True, "max_registers": 72}, ("nvfp4", "mxfp4")),
)
FP4_ONLY = ("post_scale",)
SWEEP_SHAPES = ((64, 32_768), (64, 150_000))  # (batch, context) of the decode rows that get the SWEEP variants


def _sweep_applies(options: dict, fmt, families=None) -> bool:
    """Variants that change nothing for a format are skipped: the FP4 decode options need FP4 keys; families, when
    given, lists the format families a row is for."""
    if families is not None and fmt.family not in families:
        return False
    if any(k in options for k in FP4_ONLY) or options.get("num_warps") == 1:
        return fmt.spec.payload_bits == 4
    return True


class _Decode:
    """One (batch, context, format) decode step over `layers` layers: caches, block table, queries, byte counts."""

    def __init__(self, fmt_name: str, batch: int, context: int, layers: int, device: str, gen: torch.Generator,
                 cfg: IndexerConfig):
        hi, d, p = GEOMETRY["index_heads"], GEOMETRY["head_dim"], GEOMETRY["page_size"]
        self.fmt, self.cfg, self.batch, self.context, self.layers = get_format(fmt_name), cfg, batch, context, layers
        pages = math.ceil(context / p)
        self.ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
        perm = torch.randperm(batch * pages, generator=gen).to(torch.int32)  # scattered pages, as in an engine
        self.table = perm.reshape(batch, pages).contiguous().to(device)
        tok = torch.arange(context, device=device)
        slots = (self.table.long()[:, tok // p] * p + tok % p).reshape(-1)
        self.caches = []
        for _ in range(layers):
            x = torch.randn(batch * context, 1, d, device=device) * torch.exp(torch.randn(d, device=device))
            c = PagedCache.allocate(self.fmt, batch * pages, p, 1, d, device=device,
                                    tensor_amax=float(x.abs().max()) if self.fmt.needs_tensor_amax else None)
            c.store(x.to(torch.bfloat16), slots)
            self.caches.append(c)
        self.iq = torch.randn(batch, hi, d, generator=gen).to(torch.bfloat16).to(device)
        nb = math.ceil(context / cfg.block_size)
        per_layer_in = batch * context * self.fmt.bytes_per_token(d) + self.iq.numel() * 2 + self.table.numel() * 4 \
            + batch * 4
        self.bytes_score = layers * (per_layer_in + batch * hi * nb * 4)
        self.bytes_topk = layers * (per_layer_in + batch * hi * cfg.topk * 4)

    def score(self, **kw) -> Callable[[], object]:
        from kvtool.kernels.index_score import decode_block_scores

        return lambda: [decode_block_scores(self.iq, c, self.table, self.ctx, self.cfg, max_context=self.context,
                                            **kw) for c in self.caches]

    def topk(self, **kw) -> Callable[[], object]:
        from kvtool.kernels.index_score import decode_topk

        return lambda: [decode_topk(self.iq, c, self.table, self.ctx, self.cfg, max_context=self.context, **kw)
                        for c in self.caches]

    def eager(self) -> Callable[[], object]:
        return lambda: eager_decode_topk(self.iq, self.caches[0], self.table, self.ctx, self.cfg, self.context)


def _keys_dense(cache: PagedCache, table: torch.Tensor, ctx: torch.Tensor, max_context: int):
    """Gather + dequantize every request's keys: fp32 [B, S, D] and validity [B, S]."""
    p = cache.page_size
    tok = torch.arange(max_context, device=table.device)
    valid = tok[None, :] < ctx[:, None]
    pages = table.long()[:, (tok // p).clamp(max=table.shape[1] - 1)]
    slots = torch.where(valid, pages * p + tok % p, torch.zeros_like(pages))
    k = cache.dequantize(slots.reshape(-1))[:, 0].reshape(*slots.shape, cache.head_dim)
    return k, valid


def eager_decode_topk(iq, cache, table, ctx, cfg: IndexerConfig, max_context: int) -> torch.Tensor:
    """The unfused torch path: gather + dequantize, fp32 scores, max-pool, forced blocks, top-k.
    iq bf16 [B, Hi, D] -> int32 [B, Hi, topk]."""
    k, valid = _keys_dense(cache, table, ctx, max_context)
    z = torch.einsum("bhd,bsd->hbs", iq.float(), k).masked_fill(~valid[None], -math.inf)  # [Hi, B, S]
    nb = math.ceil(max_context / cfg.block_size)
    z = torch.nn.functional.pad(z, (0, nb * cfg.block_size - max_context), value=-math.inf)
    pos = ctx.long() - 1
    b = apply_forced(z.view(*z.shape[:2], nb, cfg.block_size).amax(-1), pos.clamp(min=0), cfg)
    return select_topk(b, pos.clamp(min=0), cfg).transpose(0, 1)


def eager_prefill_topk(iq, cache, table, ctx, cfg: IndexerConfig, chunk: int = 1024) -> torch.Tensor:
    """Unfused prefill for one request (every position a query), in query chunks: iq bf16 [1, Q, Hi, D] ->
    int32 [1, Q, Hi, topk]."""
    n = int(ctx[0])
    k, _ = _keys_dense(cache, table, ctx, n)
    out = []
    for q0 in range(0, iq.shape[1], chunk):
        q = iq[0, q0:q0 + chunk].float().transpose(0, 1)  # [Hi, C, D]
        pos = torch.arange(n - iq.shape[1] + q0, n - iq.shape[1] + q0 + q.shape[1], device=iq.device)
        z = torch.matmul(q, k[0].t()).masked_fill(torch.arange(n, device=iq.device)[None, None] > pos[None, :, None],
                                                  -math.inf)
        nb = math.ceil(n / cfg.block_size)
        z = torch.nn.functional.pad(z, (0, nb * cfg.block_size - n), value=-math.inf)
        b = apply_forced(z.view(*z.shape[:2], nb, cfg.block_size).amax(-1), pos, cfg)
        out.append(select_topk(b, pos, cfg).transpose(0, 1))
    return torch.cat(out)[None]


def layers_for(batch: int, context: int, fmt_name: str, device: str) -> int:
    """Enough layers that one step's index cache exceeds L2_TARGET_BYTES (GPU), capped at 57; 1 on the CPU."""
    if not device.startswith("cuda"):
        return 1
    per_layer = batch * context * get_format(fmt_name).bytes_per_token(GEOMETRY["head_dim"])
    return max(1, min(MAX_LAYERS, math.ceil(L2_TARGET_BYTES / per_layer)))


def peer_impls(engines, device: str) -> list:
    """Engine implementations for `--peer` (names in kvtool.engines.protocol.IMPLS)."""
    from kvtool.engines.protocol import resolve_impl

    return [resolve_impl(e, "index") for e in engines or []]


def _peer_fn(impl, name: str):
    """The engine module's bench entry point `name` (kvtool.engines.vllm_m3.bench_index_decode, ...), or None."""
    import sys

    return getattr(sys.modules[type(impl).__module__], name, None)


def peer_ratios(report: BenchReport, pairs: list[tuple[str, str, str]]) -> list[dict]:
    """pairs (group, kvtool case, peer case) -> [{group, case, kvtool_us, peer_us, ratio = peer / kvtool}]."""
    rows = {(r.group, r.name): r for r in report.rows}
    out = []
    for group, ours, theirs in pairs:
        a, b = rows.get((group, ours)), rows.get((group, theirs))
        if a is not None and b is not None:
            out.append({"group": group, "case": ours, "peer": theirs, "kvtool_us": round(a.time_us, 2),
                        "peer_us": round(b.time_us, 2), "ratio": round(b.time_us / a.time_us, 3)})
    return out


def render_peers(report: BenchReport, console) -> None:
    from rich.table import Table

    ratios = report.extra.get("peer_ratios") or []
    if ratios:
        table = Table(title="Peers: engine kernel beside kvtool's (same data, same timing); ratio = engine / kvtool "
                            "(> 1: kvtool faster)")
        for col in ("group", "kvtool case", "peer case", "kvtool us", "peer us", "ratio"):
            table.add_column(col, justify="right" if col.endswith(("us", "ratio")) else "left")
        for r in ratios:
            table.add_row(r["group"], r["case"], r["peer"], f"{r['kvtool_us']:.1f}", f"{r['peer_us']:.1f}",
                          f"{r['ratio']:.3f}")
        console.print(table)
    for line in report.extra.get("peer_skipped") or []:
        console.print(f"peer skipped: {line}")


def _prefill_cases(fmt_name: str, context: int, device: str, gen: torch.Generator, cfg: IndexerConfig,
                   peers: bool, run_kernel: bool, engines: list | None = None,
                   pairs: list | None = None, skipped: list | None = None) -> list[BenchCase]:
    one = _Decode(fmt_name, 1, context, 1, device, gen, cfg)
    hi, d = GEOMETRY["index_heads"], GEOMETRY["head_dim"]
    iq = torch.randn(1, context, hi, d, generator=gen).to(torch.bfloat16).to(device)
    nbytes = context * one.fmt.bytes_per_token(d) + iq.numel() * 2 + context * hi * cfg.topk * 4
    flops = 2 * hi * d * context * (context + 1) / 2
    group, label = f"prefill {context}", one.fmt.label
    cases = []
    if run_kernel:
        from kvtool.kernels.index_score import prefill_topk

        fn = lambda: prefill_topk(iq, one.caches[0], one.table, one.ctx, cfg, max_context=context)  # noqa: E731
        cases.append(BenchCase(f"triton score+topk {label}", fn, nbytes, group, f"causal, {flops / 1e9:.0f} GFLOP",
                               cuda_graph=device.startswith("cuda")))
        for impl in engines or []:
            why = impl.unsupported("index", one.fmt, device=device)
            make = _peer_fn(impl, "bench_index_prefill")
            if why or make is None:
                skipped.append(f"{impl.name} {group} {label}: {why or 'no prefill entry point'}")
                continue
            cases.append(BenchCase(f"{impl.name} score+topk {label}", make(impl, iq, one.caches[0], one.table,
                                   one.ctx, cfg), nbytes, group, f"causal, {flops / 1e9:.0f} GFLOP",
                                   cuda_graph=device.startswith("cuda")))
            pairs.append((group, f"triton score+topk {label}", f"{impl.name} score+topk {label}"))
    if peers:
        fn = lambda: eager_prefill_topk(iq, one.caches[0], one.table, one.ctx, cfg)  # noqa: E731
        cases.append(BenchCase(f"torch eager {label}", fn, nbytes, group, "query chunks of 1024"))
    return cases


def run_index_bench(batches=DEFAULT_BATCHES, contexts=DEFAULT_CONTEXTS, prefill=DEFAULT_PREFILL,
                    formats=DEFAULT_FORMATS, device: str = "cuda", peers: bool = True, sweep: bool = False,
                    seed: int = 0, progress: Callable[[str], None] | None = None,
                    engines: list[str] | None = None) -> BenchReport:
    """Build the case table and run it (see the module docstring). On the CPU the kernel rows need
    TRITON_INTERPRET=1 (the interpreter: times are meaningless there, the run checks the plumbing). engines: peer
    names (`--peer`)."""
    cfg = IndexerConfig()
    impls = peer_impls(engines, device)
    pairs: list[tuple[str, str, str]] = []
    skipped: list[str] = []
    gen = torch.Generator().manual_seed(seed)
    on_cuda = device.startswith("cuda")
    how = "graph" if on_cuda else "eager"
    run_kernel = on_cuda or interpreting()
    cases: list[BenchCase] = []
    for batch in batches:
        for context in contexts:
            group = f"decode b{batch} x {context}"
            for name in formats:
                layers = layers_for(batch, context, name, device)
                if progress:
                    progress(f"building {group} {name} x {layers} layers")
                step = _Decode(name, batch, context, layers, device, gen, cfg)
                label, note = step.fmt.label, f"{how} x {layers} layers"
                if run_kernel:
                    cases.append(BenchCase(f"triton score {label}", step.score(), step.bytes_score, group, note,
                                           cuda_graph=on_cuda))
                    cases.append(BenchCase(f"triton score+topk {label}", step.topk(), step.bytes_topk, group, note,
                                           cuda_graph=on_cuda))
                    for vname, options, families in SWEEP if sweep and (batch, context) in SWEEP_SHAPES else ():
                        if not _sweep_applies(options, step.fmt, families):
                            continue
                        cases.append(BenchCase(f"triton score+topk {label} {vname}", step.topk(**options),
                                               step.bytes_topk, group, note, cuda_graph=on_cuda))
                for impl in impls if run_kernel else ():
                    why = impl.unsupported("index", step.fmt, device=device)
                    make = _peer_fn(impl, "bench_index_decode")
                    if why or make is None:
                        skipped.append(f"{impl.name} {group} {label}: {why or 'no decode entry point'}")
                        continue
                    fns = [make(impl, step.iq, c, step.table, step.ctx, cfg, context) for c in step.caches]
                    cases.append(BenchCase(f"{impl.name} score+topk {label}", lambda fns=fns: [f() for f in fns],
                                           step.bytes_topk, group, note, cuda_graph=on_cuda))
                    pairs.append((group, f"triton score+topk {label}", f"{impl.name} score+topk {label}"))
                if peers:
                    cases.append(BenchCase(f"torch eager {label}", step.eager(), step.bytes_topk // layers, group,
                                           "eager x 1 layer"))
    for context in prefill:
        for name in formats:
            if progress:
                progress(f"building prefill {context} {name}")
            cases += _prefill_cases(name, context, device, gen, cfg, peers, run_kernel, impls, pairs, skipped)
    report = run_cases("M3 lightning indexer (4 index heads, D 128, 128-token blocks, top-16)", cases, device,
                       progress=progress)
    report.extra = {"geometry": {**GEOMETRY, "block_size": cfg.block_size, "topk": cfg.topk},
                    "goals": _goals(report)}
    if impls:
        report.extra.update(peer_ratios=peer_ratios(report, pairs), peer_skipped=skipped,
                            peers=[f"{i.name}: {i.source}" for i in impls])
    if not run_kernel:
        report.extra["note"] = "kernel rows skipped: no CUDA device (set TRITON_INTERPRET=1 to run the interpreter)"
    return report


def _goals(report: BenchReport) -> list[dict]:
    """The issue's goals at batch 64 x 150K (only where those rows exist)."""
    rows = {(r.group, r.name): r for r in report.rows}
    group = "decode b64 x 150000"
    t = lambda name: rows.get((group, name))  # noqa: E731
    goals = []
    for fp4 in ("nvfp4-rcp", "mxfp4-rceil"):
        fused, score, fp8 = t(f"triton score+topk {fp4}"), t(f"triton score {fp4}"), t("triton score+topk fp8-unit")
        if fused is not None:
            floor_us = fused.bytes_moved / (report.copy_gbps * 1e9) * 1e6
            goals.append({"goal": f"{fp4} score+topk <= 1.15x byte floor", "value": fused.time_us / floor_us,
                          "target": 1.15, "met": fused.time_us <= 1.15 * floor_us})
        if fused is not None and fp8 is not None:
            goals.append({"goal": f"{fp4} time <= 0.62x fp8 time", "value": fused.time_us / fp8.time_us,
                          "target": 0.62, "met": fused.time_us <= 0.62 * fp8.time_us})
        if fused is not None and score is not None:
            goals.append({"goal": f"{fp4} score+topk <= 1.1x score alone", "value": fused.time_us / score.time_us,
                          "target": 1.1, "met": fused.time_us <= 1.1 * score.time_us})
    return goals


def render_goals(report: BenchReport, console) -> None:
    render_peers(report, console)
    for g in report.extra.get("goals", []):
        mark = "[green]met[/green]" if g["met"] else "[red]missed[/red]"
        console.print(f"goal: {g['goal']}: {g['value']:.3f} (target {g['target']}) {mark}")
