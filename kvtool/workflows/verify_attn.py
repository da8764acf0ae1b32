"""`verify-attn`: sparse attention over quantized paged K/V against (a) the reference on the DEQUANTIZED cache and
(b) the reference on the bf16 original K/V, side by side for several formats.

(a) isolates the kernel: same selected blocks, same dequantized values, so anything beyond fp32 accumulation noise is
a kernel bug (goal: max_rel <= 2e-3; the published NVFP4 kernel reached 0.0046). The kernel is run with an fp32
output here so that (a) measures its arithmetic; `bf16_out_max_rel` adds the rounding of the bf16 output the engine
path writes (at most half a bf16 ulp, i.e. up to 2^-8 relative to the largest value's binade). (b) is what the format
costs: the attention output with quantized K/V against the unquantized truth.

Inputs:
- a capture file (`kvtool capture`): per layer `layers.{i}.q` [S, Hq, D], `.k` / `.v` [S, Hkv, D], `.index_q`
  [S, Hi, D], `.index_k` [S, D]. Every query position (or `max_queries` of them, evenly spaced, always with the last)
  attends through the prefill path to the blocks the reference indexer (`kvtool.indexer.select_blocks`, the file's
  block size / top-k / init / local) picks from the bf16 index tensors; index head h selects for KV head h (Hi = Hkv,
  or Hi = 1 shared by all).
- `synthetic`: M3 at TP4 (16 query heads, 1 KV head, head dim 128, 128-token blocks and pages, top-16), one decode
  step for `batch` requests with ragged contexts, random K/V with outlier channels, random selections that always
  hold the query's own (partial) block, pages shuffled in the pool, and the pool's unused bytes filled with 0xFF
  (NaN in bf16 / fp8 / E4M3 scales) so that any read outside the selection shows up.

Which kernel: capture files run the prefill kernel (`sparse_prefill`: many query positions per request); the
synthetic step runs the decode kernel engines run for a decode step (`sparse_decode`), whose default launch takes the
NVIDIA Gluon fast path for nvfp4 / mxfp4 where it applies (`kernels/sparse_attn_gluon.py`: CUDA >= 8.9, M3's head
shape, from 16 requests). `kernel` picks: "auto" (that default), "portable" (the portable Triton kernel), or
"gluon" (the fast path, an error where it cannot run). Each row's `kernel` says which one ran.

Implementations (`impls`, kvtool.engines.protocol: `--impl vllm` or module:function) run on the same caches and
selections beside kvtool's kernel, through the same metrics; rows say which implementation ran (`impl`). An engine
whose output path rounds P or its partial outputs to bf16 (`precision` "bf16") is held to the tolerance plus the bf16
rounding bound 2^-8. A case an implementation cannot run is SKIPPED with its reason; without a kernel (CPU, no
interpreter) kvtool's rows compare the reference with itself and are SKIPPED too, never PASS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvtool.attention import (
    paged_sparse_prefill_ref,
    random_block_selection,
    sparse_attention_ref,
)
from kvtool.backend import (resolve_check_backend, triton_sparse_decode, triton_sparse_prefill,
                            triton_uses_gluon)
from kvtool.errors import InputError
from kvtool.formats import Format, get_format
from kvtool.formats.rotation import rotate, unrotate
from kvtool.metrics import ValueAccumulator, ValueMetrics
from kvtool.paged import PagedCache, contiguous_slots

__all__ = [
    "AttnRow", "BF16_BOUND", "DEFAULT_TOLERANCE", "KERNELS", "M3_TP4", "SKIP_TORCH", "VerifyAttnReport", "build_paged",
    "parse_context_lens", "synthetic_kv", "verify_attn_file", "verify_attn_synthetic"
]

DEFAULT_TOLERANCE = 2e-3
M3_TP4 = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 128, "block_size": 128, "page_size": 128, "topk": 16}


@dataclass
class AttnRow:
    layer: str  # layer id, or "all" for the overall rows
    format: str  # format label
    queries: int
    vs_dequant: ValueMetrics | None  # kernel (fp32 out) vs the reference on the dequantized cache (None: skipped)
    bf16_out_max_rel: float  # the same, with the kernel's bf16 output rounding
    vs_original: ValueMetrics | None  # kernel vs the reference on the bf16 original K/V
    passed: bool  # vs_dequant.max_rel within the tolerance (and no NaN)
    kernel: str = ""  # which kernel ran: "decode gluon", "decode portable", "prefill", "torch" ("" for overall rows)
    impl: str = "kvtool"  # kvtool's kernel or an engine adapter's name
    verdict: str = ""  # PASS | FAIL | SKIPPED: <why>
    tolerance: float = 0.0  # the bound this row was held to


@dataclass
class VerifyAttnReport:
    source: str
    device: str
    backend: str  # triton | triton-interpreter | torch (torch: the candidate IS the reference path)
    geometry: dict
    selection: str
    tolerance: float
    formats: list[str]
    layers: list[AttnRow] = field(default_factory=list)
    overall: list[AttnRow] = field(default_factory=list)
    passed: bool = True
    notes: list[str] = field(default_factory=list)
    impls: list[str] = field(default_factory=list)  # "name: source" of the implementations run beside kvtool's
    verdict: str = "PASS"  # PASS | FAIL | SKIPPED: no kernel ran


BF16_BOUND = 2.0 ** -8  # bf16 rounding of P / partial outputs, relative to the largest output (half an ulp, low binade)


# ----------------------------------------------------------------------------------------------- synthetic inputs
def synthetic_kv(n: int, num_heads: int, head_dim: int, gen: torch.Generator, outliers: bool = True) -> torch.Tensor:
    """Random K or V [n, H, D] bf16: normal values times per-channel magnitudes (log-normal, and ~3 % of the channels
    8x larger, as real post-RoPE keys have outlier channels), so that block scales see realistic spreads."""
    x = torch.randn(n, num_heads, head_dim, generator=gen)
    if outliers:
        chan = torch.exp(0.5 * torch.randn(num_heads, head_dim, generator=gen))
        big = torch.rand(num_heads, head_dim, generator=gen) < 0.03
        x = x * torch.where(big, chan * 8.0, chan)
    return x.to(torch.bfloat16)


def build_paged(fmt: Format, ks: list[torch.Tensor], vs: list[torch.Tensor], page_size: int, device,
                gen: torch.Generator | None = None, garbage: bool = True,
                spare_pages: int = 1) -> tuple[PagedCache, PagedCache, torch.Tensor]:
    """Store each request's K / V ([n_b, H, D]) into fresh paged caches of `fmt`: returns (k_cache, v_cache,
    block_table int32 [B, max_pages] on `device`). Pages are shuffled in the pool when `gen` is given; with
    `garbage` the pool starts as 0xFF bytes (NaN for bf16, fp8 and E4M3 scales) so unwritten slots are poison.
    Whole-tensor scales (fp8 tensor, nvfp4 auto) take the amax over all requests."""
    lens = [k.shape[0] for k in ks]
    heads, dim = ks[0].shape[1], ks[0].shape[2]
    table, _ = contiguous_slots(lens, page_size)
    used = int(table.max()) + 1 if table.numel() and int(table.max()) >= 0 else 0
    num_pages = used + spare_pages
    if gen is not None:
        perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
        table = torch.where(table >= 0, perm[table.clamp(min=0).long()], table)
    caches = []
    for xs in (ks, vs):
        amax = max((float(x.float().abs().max()) for x in xs if x.numel()), default=0.0)
        c = PagedCache.allocate(fmt, num_pages, page_size, heads, dim, device=device,
                                tensor_amax=amax if fmt.needs_tensor_amax else None)
        if garbage:
            c.data.fill_(0xFF)
        for b, x in enumerate(xs):
            if x.shape[0]:
                tok = torch.arange(x.shape[0])
                slots = table[b, tok // page_size].long() * page_size + tok % page_size
                c.store(x.to(device), slots.to(device))
        caches.append(c)
    return caches[0], caches[1], table.to(device)


def parse_context_lens(text: str | None, batch: int, gen: torch.Generator, max_len: int = 8192) -> list[int]:
    """'4096' (all requests), '1,200,70000' (one per request) or None (seeded random lengths in [1, max_len])."""
    if text is None:
        return [int(x) for x in torch.randint(1, max_len + 1, (batch,), generator=gen)]
    try:
        lens = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise InputError(f"bad --context-lens {text!r} (examples: 4096 or 1,200,70000)") from None
    if len(lens) == 1:
        lens = lens * batch
    if len(lens) != batch or min(lens) < 1:
        raise InputError(f"--context-lens needs 1 or {batch} positive lengths (one per request), got {text!r}")
    return lens


# ------------------------------------------------------------------------------------------------------ the runner
class _Scores:
    """Per-format accumulators for the overall rows."""

    def __init__(self):
        self.deq, self.deq16, self.orig, self.queries = {}, {}, {}, {}

    def add(self, label, out: torch.Tensor, ref_deq: torch.Tensor, ref_orig: torch.Tensor) -> None:
        self.deq.setdefault(label, ValueAccumulator()).update(out, ref_deq)
        self.deq16.setdefault(label, ValueAccumulator()).update(out.to(torch.bfloat16).float(), ref_deq)
        self.orig.setdefault(label, ValueAccumulator()).update(out, ref_orig)
        self.queries[label] = self.queries.get(label, 0) + out.shape[0]


def _row(layer: str, label: str, queries: int, deq: ValueMetrics, deq16: ValueMetrics, orig: ValueMetrics,
         tol: float, kernel: str = "", impl: str = "kvtool") -> AttnRow:
    ok = math.isfinite(deq.max_rel) and deq.max_rel <= tol
    return AttnRow(layer, label, queries, deq, deq16.max_rel, orig, ok, kernel, impl, "PASS" if ok else "FAIL", tol)


SKIP_TORCH = ("SKIPPED: no kernel ran (torch backend: the reference compared with itself; run on cuda, or on the "
              "CPU with TRITON_INTERPRET=1)")


def _skipped(layer, label, queries, impl, why) -> AttnRow:
    return AttnRow(layer, label, queries, None, math.nan, None, True, "", impl, why)


def _impl_tolerance(impl, tol: float) -> float:
    return tol + BF16_BOUND if getattr(impl, "precision", "fp32") == "bf16" else tol


def _resolve_impls(impls, report: VerifyAttnReport) -> list:
    from kvtool.engines.protocol import resolve_impl

    out = [resolve_impl(i, "attend") if isinstance(i, str) else i for i in impls or []]
    report.impls = [f"{i.name}: {i.source}" for i in out]
    return out


KERNELS = ("auto", "portable", "gluon")
_GLUON_OPTION = {"auto": None, "portable": False, "gluon": True}  # sparse_decode's `gluon` option per choice


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise InputError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")


def _run_case(layer: str, fmts: list[Format], q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
              q_req: torch.Tensor, q_pos: torch.Tensor, ids: torch.Tensor, ref_orig: torch.Tensor, block_size: int,
              page_size: int, device, backend: str, gen: torch.Generator, report: VerifyAttnReport,
              scores: _Scores, decode: bool = False, kernel: str = "auto", impls: list | None = None) -> None:
    """One layer (or synthetic step): q [N, Hq, D] bf16, per-request K/V, rows' request / position, ids
    [N, Hkv, topk]; ref_orig [N, Hq, D] fp32 (the reference on the original K/V). decode: the rows are one decode
    step (row b is request b at its last position): run the decode kernel, with `kernel`'s choice of launch."""
    from kvtool.engines.protocol import AttnCall

    for fmt in fmts:
        k_cache, v_cache, table = build_paged(fmt, ks, vs, page_size, device, gen)
        q_ref = q
        if fmt.rotation is not None:  # the kernel's query is bf16(q R); R^T takes it back for the reference, so
            # q_ref . deq(K) = bf16(q R) . codes and (a) stays a check of the kernel's arithmetic
            q_ref = unrotate(rotate(q, fmt.rotation).to(q.dtype), fmt.rotation)
        ref_deq = paged_sparse_prefill_ref(q_ref, k_cache, v_cache, table, q_req, q_pos, ids, block_size)
        if backend != "triton":  # the reference itself: (a) cannot fail, (b) still says what the format costs
            _add_row(layer, fmt.label, ref_deq, ref_deq, ref_orig, report, scores, "torch", "kvtool",
                     report.tolerance)
            report.layers[-1].verdict = SKIP_TORCH
        else:
            _kvtool_row(layer, fmt, q, k_cache, v_cache, table, q_req, q_pos, ids, ref_deq, ref_orig, block_size,
                        report, scores, decode, kernel)
        for impl in impls or []:
            from kvtool.engines.protocol import ROTATION_SKIP

            why = ROTATION_SKIP if fmt.rotation is not None else impl.unsupported(
                "attend", fmt, block_size=block_size, page_size=page_size, head_dim=q.shape[-1], device=q.device)
            if why:
                report.layers.append(_skipped(layer, fmt.label, q.shape[0], impl.name, f"SKIPPED: {why}"))
                continue
            call = AttnCall(q, k_cache, v_cache, table, q_req.to(torch.int32), q_pos.to(torch.int32),
                            ids.to(torch.int32), block_size, decode, 1.0 / math.sqrt(q.shape[-1]))
            out = impl.attend(call).float()
            if tuple(out.shape) != tuple(q.shape):
                raise InputError(f"--impl {impl.name}: output must be [N, Hq, D] = {list(q.shape)}, got "
                                 f"{list(out.shape)}")
            _add_row(layer, fmt.label, out, ref_deq, ref_orig, report, scores, "decode" if decode else "prefill",
                     impl.name, _impl_tolerance(impl, report.tolerance))


def _add_row(layer, label, out, ref_deq, ref_orig, report, scores, used, impl, tol) -> None:
    m_deq = ValueAccumulator().update(out, ref_deq).result()
    m16 = ValueAccumulator().update(out.to(torch.bfloat16).float(), ref_deq).result()
    m_orig = ValueAccumulator().update(out, ref_orig).result()
    scores.add((impl, label), out, ref_deq, ref_orig)
    row = _row(layer, label, out.shape[0], m_deq, m16, m_orig, tol, used, impl)
    report.layers.append(row)
    report.passed &= row.passed


def _kvtool_row(layer, fmt, q, k_cache, v_cache, table, q_req, q_pos, ids, ref_deq, ref_orig, block_size, report,
                scores, decode, kernel) -> None:
    # the backend refuses a recipe's format (the kernel decodes the SPEC codecs) and, for a rotated format, runs the
    # kernel on the codes of K R and V R with q R: softmax((q R)(K R)^T) (V R) = out R, brought back by R^T
    if decode:
        gluon = _GLUON_OPTION[kernel]
        out = triton_sparse_decode(q, k_cache, v_cache, table, (q_pos + 1).to(torch.int32), ids.to(torch.int32),
                                   block_size, out_dtype=torch.float32, gluon=gluon).float()
        ran = gluon if gluon is not None else triton_uses_gluon(q, k_cache, v_cache, block_size)
        used = "decode gluon" if ran else "decode portable"
    else:
        out = triton_sparse_prefill(q, k_cache, v_cache, table, q_req.to(torch.int32), q_pos.to(torch.int32),
                                    ids.to(torch.int32), block_size, out_dtype=torch.float32).float()
        used = "prefill"
    _add_row(layer, fmt.label, out, ref_deq, ref_orig, report, scores, used, "kvtool", report.tolerance)


def _finish(report: VerifyAttnReport, scores: _Scores) -> VerifyAttnReport:
    tols = {row.impl: row.tolerance for row in report.layers if row.vs_dequant is not None}
    for impl in ["kvtool"] + [i.split(":")[0] for i in report.impls]:
        for label in report.formats:
            key = (impl, label)
            if key in scores.deq:
                row = _row("all", label, scores.queries[key], scores.deq[key].result(), scores.deq16[key].result(),
                           scores.orig[key].result(), tols.get(impl, report.tolerance), "", impl)
                if impl == "kvtool" and report.backend == "torch":
                    row.verdict = SKIP_TORCH
                report.overall.append(row)
                report.passed &= row.passed
    ran = [row for row in report.layers if not row.verdict.startswith("SKIPPED")]
    report.verdict = "FAIL" if not report.passed else ("PASS" if ran else "SKIPPED: no kernel ran")
    if report.backend == "torch":
        report.notes.append("torch backend: kvtool's rows compare the reference with itself, so (a) is SKIPPED (b "
                            "still measures the format); run on cuda (or TRITON_INTERPRET=1) to check the kernel")
    return report


def verify_attn_synthetic(formats: list[str], *, batch: int = 4, context_lens: str | None = None, seed: int = 0,
                          device: str = "cpu", backend: str = "auto", tolerance: float = DEFAULT_TOLERANCE,
                          geometry: dict | None = None, kernel: str = "auto",
                          progress: Callable[[str], None] | None = None, impls: list | None = None
                          ) -> VerifyAttnReport:
    """One decode step at M3's TP4 shape (or `geometry`, keys as M3_TP4) for `batch` requests, through the decode
    kernel (`kernel`: auto | portable | gluon; see the module docstring). Returns the report (per-format rows under
    layer 'synthetic' and 'all')."""
    _check_kernel(kernel)
    geo = {**M3_TP4, **(geometry or {})}
    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    gen = torch.Generator().manual_seed(seed)
    lens = parse_context_lens(context_lens, batch, gen)
    fmts = [get_format(f) for f in formats]
    hq, hkv, d, bs = geo["num_q_heads"], geo["num_kv_heads"], geo["head_dim"], geo["block_size"]
    report = VerifyAttnReport(f"synthetic (seed {seed})", str(dev), label, {**geo, "batch": batch,
                              "context_lens": lens}, "random (own block always selected)", tolerance,
                              [f.label for f in fmts])
    impls = _resolve_impls(impls, report)
    ks = [synthetic_kv(n, hkv, d, gen) for n in lens]
    vs = [synthetic_kv(n, hkv, d, gen, outliers=False) for n in lens]
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16)
    pos = torch.tensor(lens) - 1
    ids = torch.cat([random_block_selection(pos[b:b + 1], bs, geo["topk"], hkv, gen) for b in range(batch)], 1)
    ids = ids.transpose(0, 1).contiguous()  # [B, Hkv, topk]
    ref_orig = torch.cat([sparse_attention_ref(q[b:b + 1].transpose(0, 1), ks[b], vs[b], pos[b:b + 1],
                                               ids[b:b + 1].transpose(0, 1), bs).transpose(0, 1)
                          for b in range(batch)])
    if progress:
        progress(f"synthetic step: batch {batch}, contexts {lens}")
    scores = _Scores()
    _run_case("synthetic", fmts, q.to(dev), ks, vs, torch.arange(batch, device=dev), pos.to(dev), ids.to(dev),
              ref_orig.to(dev), bs, geo["page_size"], dev, backend, gen, report, scores, decode=True, kernel=kernel,
              impls=impls)
    return _finish(report, scores)


def _query_rows(n: int, max_queries: int) -> torch.Tensor:
    if max_queries <= 0 or max_queries >= n:
        return torch.arange(n)
    return torch.unique(torch.linspace(0, n - 1, max_queries).round().long())


def verify_attn_file(path: Path, formats: list[str], *, layers: list[int] | None = None, max_queries: int = 256,
                     page_size: int | None = None, seed: int = 0, device: str = "cpu", backend: str = "auto",
                     tolerance: float = DEFAULT_TOLERANCE, kernel: str = "auto",
                     progress: Callable[[str], None] | None = None, impls: list | None = None,
                     block_size: int | None = None, topk: int | None = None) -> VerifyAttnReport:
    """Every captured layer (or `layers`) of a capture file, through the prefill kernel (`kernel` "gluon", the
    decode-only fast path, is refused); see the module docstring."""
    _check_kernel(kernel)
    if kernel == "gluon":
        raise InputError("kernel 'gluon' is the decode kernel's fast path: capture files run the prefill kernel "
                         "(use --synthetic for a decode step)")
    from kvtool.indexer import IndexerConfig, select_blocks
    from kvtool.workflows.capture import read_capture

    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    meta, tensors = read_capture(Path(path))
    cfg = IndexerConfig(block_size=block_size or int(meta.get("block_size", 128)), topk=topk or int(meta.get("topk", 16)),
                        init_blocks=int(meta.get("init", 0)), local_blocks=int(meta.get("local", 1)))
    found = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.endswith(".q")})
    chosen = found if layers is None else layers
    missing = [i for i in chosen if i not in found]
    if missing or not chosen:
        raise InputError(f"{path}: no captured layer(s) {missing or chosen} (the file has {found})")
    page = page_size or cfg.block_size
    fmts = [get_format(f) for f in formats]
    gen = torch.Generator().manual_seed(seed)
    report = VerifyAttnReport(str(path), str(dev), label, {"block_size": cfg.block_size, "page_size": page,
                              "topk": cfg.topk, "init_blocks": cfg.init_blocks, "local_blocks": cfg.local_blocks},
                              "reference indexer (kvtool.indexer.select_blocks) on the bf16 index tensors",
                              tolerance, [f.label for f in fmts])
    impls = _resolve_impls(impls, report)
    scores = _Scores()
    for i in chosen:
        t = {kind: tensors[f"layers.{i}.{kind}"] for kind in ("q", "k", "v", "index_q", "index_k")}
        s_len, hq, d = t["q"].shape
        hkv, hi = t["k"].shape[1], t["index_q"].shape[1]
        if hi not in (1, hkv):
            raise InputError(f"layer {i}: {hi} index heads for {hkv} KV heads (need one per KV head, or one)")
        rows = _query_rows(s_len, max_queries)
        sel = select_blocks(t["index_q"].transpose(0, 1)[:, rows], t["index_k"], rows, cfg)  # [Hi, N, topk]
        ids = sel.expand(hkv, -1, -1).transpose(0, 1).contiguous()  # [N, Hkv, topk]
        q = t["q"][rows].to(torch.bfloat16)
        ref_orig = sparse_attention_ref(q.transpose(0, 1), t["k"], t["v"], rows, ids.transpose(0, 1),
                                        cfg.block_size).transpose(0, 1)
        report.geometry.update({"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "positions": s_len})
        if progress:
            progress(f"layer {i}: {rows.numel()} of {s_len} queries")
        _run_case(str(i), fmts, q.to(dev), [t["k"]], [t["v"]], torch.zeros_like(rows).to(dev), rows.to(dev),
                  ids.to(dev), ref_orig.to(dev), cfg.block_size, page, dev, backend, gen, report, scores,
                  impls=impls)
    if max_queries > 0:
        report.notes.append(f"at most {max_queries} query positions per layer (evenly spaced, with the last)")
    return _finish(report, scores)
