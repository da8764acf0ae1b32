"""`verify-topk`: the lightning-indexer scorer over quantized paged index caches against (a) the reference scorer
fed the DEQUANTIZED cache and (b) the reference on the bf16 (or given) original keys, formats side by side.

(a) isolates the kernel: the same dequantized values, so every difference in the selected block SETS must be a tie,
i.e. between blocks whose reference scores are equal up to the fp32 accumulation bound
(`kvtool.indexer.accumulation_tolerance`). The goal is 100 % tie-aware agreement for every format; anything less
fails the run. `max_score_err` is the largest |kernel - reference| block score over blocks that are finite and not
forced in both (inf when the -inf / NaN patterns differ). (b) is what the format costs: exact-set agreement, recall@k
and relative block-score error against the selection on the original keys (kvtool.indexer.TopkMetrics defines them).

Inputs:
- a capture file (`kvtool capture`): per layer `layers.{i}.index_k` [S, D] and `layers.{i}.index_q` [S, Hi, D]; the
  queries at `max_queries` evenly spaced positions (with the last) go through the prefill scorer, causal.
- an index cache file (`kvtool quantize` output, or plain safetensors / .pt / .npy of float keys [S, D] or [S, 1, D])
  plus a query file holding [Q, Hi, D] queries for the last Q positions (Q = S: every position), matched by name
  (`...index_k` -> `...index_q`, or the file's only tensor). Float keys are quantized in memory to each format;
  an already quantized cache is checked in its own format, and (b) needs the original so it is skipped.
- `synthetic`: M3 decode (4 index heads, D = 128, 128-token blocks, top-16): one query per request at ctx - 1; keys
  with log-normal channel magnitudes and outlier channels (heavy tails, so a few channels decide the maxima), some
  blocks duplicated (exact ties) and some duplicated with a one-ulp change (near-ties); pages shuffled in the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvtool.backend import resolve_check_backend
from kvtool.errors import InputError
from kvtool.formats import Format, QTensor, get_format
from kvtool.indexer import (
    LOCAL_SCORE,
    IndexerConfig,
    TopkAccumulator,
    TopkMetrics,
    accumulation_tolerance,
    batched_reference,
    paged_keys,
    paged_reference,
)
from kvtool.paged import PagedCache, contiguous_slots

M3_DECODE = {"index_heads": 4, "head_dim": 128, "page_size": 128}


@dataclass
class TopkRow:
    layer: str  # layer id / tensor name, "synthetic", or "all" for the overall rows
    format: str
    rows: int  # (query, index head) rows compared
    vs_dequant: TopkMetrics  # (a) kernel vs the reference on the dequantized cache
    max_score_err: float  # (a) max |kernel - reference| finite, unforced block score
    tie_tol: float  # (a) the accumulation bound used for "equal reference scores"
    vs_original: TopkMetrics | None  # (b) kernel vs the reference on the original keys (None: no original)
    passed: bool  # (a) 100 % tie-aware and (b) recall >= min_recall


@dataclass
class VerifyTopkReport:
    source: str
    device: str
    backend: str  # triton | triton-interpreter | torch (torch: the candidate IS the reference path)
    config: dict
    formats: list[str]
    min_recall: float | None
    layers: list[TopkRow] = field(default_factory=list)
    overall: list[TopkRow] = field(default_factory=list)
    passed: bool = True
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------- building caches
def build_index_cache(fmt: Format, keys: list[torch.Tensor], page_size: int, device,
                      gen: torch.Generator | None = None) -> tuple[PagedCache, torch.Tensor, torch.Tensor]:
    """Store per-request index keys keys[b] [n_b, D] into a fresh paged cache of `fmt` (H = 1): returns (cache,
    block_table int32 [B, max_pages], context_lens int32 [B]) on `device`; pages shuffled when `gen` is given;
    whole-tensor scales take the amax over every request."""
    lens = [k.shape[0] for k in keys]
    table, _ = contiguous_slots(lens, page_size)
    num_pages = max(int(table.max()) + 1, 1)
    if gen is not None:
        perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
        table = torch.where(table >= 0, perm[table.clamp(min=0).long()], table)
    amax = max((float(k.float().abs().max()) for k in keys if k.numel()), default=0.0)
    cache = PagedCache.allocate(fmt, num_pages, page_size, 1, keys[0].shape[-1], device=device,
                                tensor_amax=amax if fmt.needs_tensor_amax else None)
    for b, k in enumerate(keys):
        if k.shape[0]:
            tok = torch.arange(k.shape[0])
            slots = table[b, tok // page_size].long() * page_size + tok % page_size
            cache.store(k[:, None].to(device), slots.to(device))
    return cache, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def cache_from_qtensor(q: QTensor, page_size: int, device) -> tuple[PagedCache, torch.Tensor, torch.Tensor]:
    """One request's already quantized keys (logical [S, D]) copied byte for byte into a paged cache."""
    fmt, (n, d) = q.fmt, (q.shape[0], q.shape[-1])
    amax = None
    if fmt.needs_tensor_amax:  # the cache derives whole-tensor scales from an amax: find one that reproduces them
        s = float(q.scales) if fmt.scale_element == "fp32-tensor" else float(q.outer_scale)
        amax = s * (448.0 if fmt.scale_element == "fp32-tensor" else 6.0 * 448.0)
    table, (slots,) = contiguous_slots([n], page_size)
    cache = PagedCache.allocate(fmt, max(int(table.max()) + 1, 1), page_size, 1, d, device=device, tensor_amax=amax)
    if amax is not None:
        got = cache.fp8_tensor_scale() if fmt.scale_element == "fp32-tensor" else cache.outer_scale()
        if got != s:
            raise InputError(f"cannot rebuild the whole-tensor scale {s!r} of a pre-quantized {fmt.label} cache; "
                             "pass the original float keys instead (they are quantized in memory)")
    page, off = slots // page_size, slots % page_size
    cache.payload_plane()[page, 0, off] = q.payload.reshape(n, -1).contiguous().view(torch.uint8).to(device)
    if cache.scale_bytes:
        cache.scale_plane()[page, 0, off] = q.scales.reshape(n, -1).contiguous().view(torch.uint8).to(device)
    return cache, table.to(device), torch.tensor([n], dtype=torch.int32, device=device)


def synthetic_index_keys(n: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [n, D] keys: normal values times log-normal channel magnitudes, 3 % of channels 8x (outliers); 5 % of the
    128-token blocks copy an earlier block (exact ties), 5 % copy one with one element nudged by a bf16 ulp."""
    chan = torch.exp(torch.randn(dim, generator=gen))
    chan = torch.where(torch.rand(dim, generator=gen) < 0.03, chan * 8.0, chan)
    x = (torch.randn(n, dim, generator=gen) * chan).to(torch.bfloat16)
    nb = n // 128
    for blk in range(1, nb):
        u = float(torch.rand((), generator=gen))
        if u < 0.10:
            src = int(torch.randint(0, blk, (), generator=gen))
            x[blk * 128:(blk + 1) * 128] = x[src * 128:(src + 1) * 128]
            if u >= 0.05:
                i = int(torch.randint(0, 128, (), generator=gen)) + blk * 128
                x[i, 0] = torch.nextafter(x[i, 0].float(), torch.tensor(math.inf)).to(torch.bfloat16) \
                    if x[i, 0] == 0 else x[i, 0] * (1 + 2.0 ** -7)
    return x


# ------------------------------------------------------------------------------------------------------ the runner
def _score_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over blocks finite and unforced in ref; inf when the NaN / +-inf patterns differ."""
    got, ref = got.float().cpu(), ref.float().cpu()
    if not (torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.equal(got == math.inf, ref == math.inf)
            and torch.equal(got == -math.inf, ref == -math.inf)):
        return math.inf
    real = torch.isfinite(ref) & (ref.abs() < LOCAL_SCORE)
    return float((got[real] - ref[real]).abs().max()) if real.any() else 0.0


class _Overall:
    def __init__(self):
        self.deq, self.orig, self.err, self.tol, self.rows = {}, {}, {}, {}, {}

    def add(self, label, ids, ref_ids, ref_scores, tol, err, orig_ids, orig_scores):
        self.deq.setdefault(label, TopkAccumulator()).update(ids, ref_ids, ref_scores, tol)
        if orig_ids is not None:
            self.orig.setdefault(label, TopkAccumulator()).update(ids, orig_ids, orig_scores)
        self.err[label] = max(self.err.get(label, 0.0), err)
        self.tol[label] = max(self.tol.get(label, 0.0), float(tol.max()) if tol.numel() else 0.0)
        self.rows[label] = self.rows.get(label, 0) + ids[..., 0].numel()


def _row(layer, label, rows, deq: TopkMetrics, err, tol, orig: TopkMetrics | None, min_recall) -> TopkRow:
    ok = deq.tie_aware_pct == 100.0 and (min_recall is None or orig is None or orig.recall >= min_recall)
    return TopkRow(layer, label, rows, deq, err, tol, orig, ok)


def _check_layer(layer: str, caches: list[tuple[str, tuple]], iq4: torch.Tensor, q_pos: torch.Tensor | None,
                 cfg: IndexerConfig, original, backend: str, report: VerifyTopkReport, overall: _Overall,
                 launch: dict | None = None) -> None:
    """One layer / synthetic step: for each (label, (cache, table, ctx)) run the candidate and compare.
    iq4 bf16 [B, Q, Hi, D]; q_pos [B, Q] or None (the last Q positions); original = (ids, scores) or None;
    launch: kernel launch options (kvtool.kernels.index_score.LAUNCH_OPTIONS; None = the autotuned launch)."""
    launch = launch or {}
    from kvtool.kernels import index_score as K

    for label, (cache, table, ctx) in caches:
        ref_ids, ref_scores = paged_reference(iq4, cache, table, ctx, cfg, q_pos)
        if backend == "triton" and iq4.shape[1] == 1 and q_pos is None:
            ids = K.decode_topk(iq4[:, 0], cache, table, ctx, cfg, **launch)[:, None]
            scores = K.decode_block_scores(iq4[:, 0], cache, table, ctx, cfg, **launch)[:, None]
        elif backend == "triton":
            ids = K.prefill_topk(iq4, cache, table, ctx, cfg, q_pos=q_pos, **launch)
            scores = K.prefill_block_scores(iq4, cache, table, ctx, cfg, q_pos=q_pos, **launch)
        else:
            ids, scores = ref_ids, ref_scores
        keys = [paged_keys(cache, table, int(n), b) for b, n in enumerate(ctx.tolist()) if n]
        ik = torch.cat(keys) if keys else torch.zeros(0, iq4.shape[-1], device=iq4.device)
        tol = accumulation_tolerance(iq4, ik)  # per row [B, Q, Hi]
        err = _score_error(scores, ref_scores)
        deq = TopkAccumulator().update(ids, ref_ids, ref_scores, tol).result()
        orig = None if original is None else TopkAccumulator().update(ids, *original).result()
        overall.add(label, ids, ref_ids, ref_scores, tol, err, *(original or (None, None)))
        row = _row(layer, label, ids[..., 0].numel(), deq, err, float(tol.max()) if tol.numel() else 0.0, orig,
                   report.min_recall)
        report.layers.append(row)
        report.passed &= row.passed


def _finish(report: VerifyTopkReport, overall: _Overall) -> VerifyTopkReport:
    for label in report.formats:
        if label in overall.deq:
            orig = overall.orig[label].result() if label in overall.orig else None
            row = _row("all", label, overall.rows[label], overall.deq[label].result(), overall.err[label],
                       overall.tol[label], orig, report.min_recall)
            report.overall.append(row)
            report.passed &= row.passed
    if report.backend == "torch":
        report.notes.append("torch backend: the candidate is the reference path itself, so (a) is 100 % by "
                            "definition; run on cuda (or TRITON_INTERPRET=1) to check the kernel")
    return report


def _cfg_dict(cfg: IndexerConfig, **extra) -> dict:
    return {"block_size": cfg.block_size, "topk": cfg.topk, "init_blocks": cfg.init_blocks,
            "local_blocks": cfg.local_blocks, "tie_rule": cfg.tie_rule, **extra}


# ------------------------------------------------------------------------------------------------------- entry points
def verify_topk_synthetic(formats: list[str], *, batch: int = 4, context_lens: str | None = None, seed: int = 0,
                          cfg: IndexerConfig | None = None, page_size: int = 128, device: str = "cpu",
                          backend: str = "auto", min_recall: float | None = None,
                          progress: Callable[[str], None] | None = None, launch: dict | None = None
                          ) -> VerifyTopkReport:
    """One M3 decode step for `batch` requests (see the module docstring). launch: kernel launch options (tests pin
    one launch to skip autotuning; None = the autotuned launch)."""
    from kvtool.workflows.verify_attn import parse_context_lens

    cfg = cfg or IndexerConfig()
    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    gen = torch.Generator().manual_seed(seed)
    lens = parse_context_lens(context_lens, batch, gen)
    hi, d = M3_DECODE["index_heads"], M3_DECODE["head_dim"]
    fmts = [get_format(f) for f in formats]
    report = VerifyTopkReport(f"synthetic (seed {seed})", str(dev), label,
                              _cfg_dict(cfg, index_heads=hi, head_dim=d, page_size=page_size, batch=batch,
                                        context_lens=lens), [f.label for f in fmts], min_recall)
    keys = [synthetic_index_keys(n, d, gen) for n in lens]
    iq4 = torch.randn(batch, 1, hi, d, generator=gen).to(torch.bfloat16)
    if batch > 1:
        iq4[-1, 0, 0] = 0  # one all-zero query row: every block ties
    original = batched_reference(iq4, keys, cfg)
    if progress:
        progress(f"synthetic decode step: batch {batch}, contexts {lens}")
    caches = [(f.label, build_index_cache(f, keys, page_size, dev, gen)) for f in fmts]
    overall = _Overall()
    _check_layer("synthetic", caches, iq4.to(dev), None, cfg, tuple(t.to(dev) for t in original), backend, report,
                 overall, launch)
    return _finish(report, overall)


def _query_rows(n: int, max_queries: int) -> torch.Tensor:
    if max_queries <= 0 or max_queries >= n:
        return torch.arange(n)
    return torch.unique(torch.linspace(0, n - 1, max_queries).round().long())


def _file_cfg(meta: dict, block_size, topk, tie_rule) -> IndexerConfig:
    return IndexerConfig(block_size=block_size or int(meta.get("block_size", 128)),
                         topk=topk or int(meta.get("topk", 16)), init_blocks=int(meta.get("init", 0)),
                         local_blocks=int(meta.get("local", 1)), tie_rule=tie_rule)


def verify_topk_capture(path: Path, formats: list[str], *, layers: list[int] | None = None, max_queries: int = 256,
                        page_size: int | None = None, block_size: int | None = None, topk: int | None = None,
                        tie_rule: str = "higher-id", device: str = "cpu", backend: str = "auto",
                        min_recall: float | None = None, progress: Callable[[str], None] | None = None,
                        launch: dict | None = None) -> VerifyTopkReport:
    """Every captured layer (or `layers`) of a `kvtool capture` file; see the module docstring."""
    from kvtool.workflows.capture import read_capture

    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    meta, tensors = read_capture(Path(path))
    cfg = _file_cfg(meta, block_size, topk, tie_rule)
    found = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.endswith(".index_k")})
    chosen = found if layers is None else layers
    missing = [i for i in chosen if i not in found]
    if missing or not chosen:
        raise InputError(f"{path}: no captured index layer(s) {missing or chosen} (the file has {found})")
    fmts = [get_format(f) for f in formats]
    page = page_size or cfg.block_size
    report = VerifyTopkReport(str(path), str(dev), label, _cfg_dict(cfg, page_size=page), [f.label for f in fmts],
                              min_recall)
    overall = _Overall()
    for i in chosen:
        ik, iq = tensors[f"layers.{i}.index_k"], tensors[f"layers.{i}.index_q"]
        rows = _query_rows(ik.shape[0], max_queries)
        _check_keys(str(i), fmts, ik, iq[rows], rows, cfg, page, dev, backend, report, overall, progress, launch)
    if max_queries > 0:
        report.notes.append(f"at most {max_queries} query positions per layer (evenly spaced, with the last)")
    return _finish(report, overall)


def _check_keys(layer, fmts, ik, iq, rows, cfg, page, dev, backend, report, overall, progress, launch=None) -> None:
    """Float keys ik [S, D] and queries iq [N, Hi, D] at positions rows [N]: every format, one request."""
    if ik.dim() != 2 or iq.dim() != 3 or iq.shape[-1] != ik.shape[-1]:
        raise InputError(f"layer {layer}: index keys must be [S, D] and queries [N, Hi, D], got "
                         f"{list(ik.shape)} and {list(iq.shape)}")
    iq4 = iq[None].to(torch.bfloat16)
    q_pos = rows[None].to(torch.int32)
    original = batched_reference(iq4, [ik], cfg, q_pos)
    if progress:
        progress(f"layer {layer}: {rows.numel()} queries x {iq.shape[1]} heads over {ik.shape[0]} keys")
    caches = [(f.label, build_index_cache(f, [ik], page, dev)) for f in fmts]
    _check_layer(layer, caches, iq4.to(dev), q_pos.to(dev), cfg, tuple(t.to(dev) for t in original), backend,
                 report, overall, launch)


def verify_topk_files(cache_path: Path, query_path: Path, formats: list[str], *, max_queries: int = 256,
                      page_size: int | None = None, block_size: int | None = None, topk: int | None = None,
                      tie_rule: str = "higher-id", device: str = "cpu", backend: str = "auto",
                      min_recall: float | None = None, progress: Callable[[str], None] | None = None,
                      launch: dict | None = None) -> VerifyTopkReport:
    """An index cache file (float keys, or a kvtool cache file) plus a query file; see the module docstring."""
    from kvtool.readers import open_input

    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    cfg = _file_cfg({}, block_size, topk, tie_rule)
    page = page_size or cfg.block_size
    report = VerifyTopkReport(f"{cache_path} + {query_path}", str(dev), label, _cfg_dict(cfg, page_size=page), [],
                              min_recall)
    overall = _Overall()
    with open_input(Path(cache_path)) as kf, open_input(Path(query_path)) as qf:
        pairs = _pair_entries(kf.entries, qf.entries)
        fmts = [get_format(f) for f in formats]
        for kname, qentry in pairs:
            kentry = kf.entries[kname]
            layer = kname.removesuffix(".index_k")
            iq = qentry.read(0, qentry.rows).reshape(qentry.shape)
            n = kentry.shape[0]
            if iq.dim() != 3 or iq.shape[0] > n:
                raise InputError(f"{qentry.name}: queries must be [Q <= {n}, Hi, D], got {list(iq.shape)}")
            rows = torch.arange(n - iq.shape[0], n)
            pick = _query_rows(iq.shape[0], max_queries)
            if kentry.quantized:
                q = kentry.read_q(0, kentry.rows)
                labels = [kentry.fmt.label]
                cache = cache_from_qtensor(q, page, dev)
                iq4 = iq[pick][None].to(torch.bfloat16)
                if progress:
                    progress(f"{kname}: pre-quantized {kentry.fmt.label}, {pick.numel()} queries")
                q_pos = rows[pick][None].to(torch.int32).to(dev)
                _check_layer(layer, [(kentry.fmt.label, cache)], iq4.to(dev), q_pos, cfg, None, backend, report,
                             overall, launch)
                report.notes.append(f"{kname} is already quantized ({kentry.fmt.label}): (b) needs the original keys")
            else:
                labels = [f.label for f in fmts]
                ik = kentry.read(0, kentry.rows).reshape(n, kentry.dim)
                _check_keys(layer, fmts, ik, iq[pick], rows[pick], cfg, page, dev, backend, report, overall,
                            progress, launch)
            report.formats += [x for x in labels if x not in report.formats]
    return _finish(report, overall)


def _pair_entries(keys: dict, queries: dict) -> list[tuple[str, object]]:
    """Key entries [S, D] / [S, 1, D] paired with query entries: `X.index_k` -> `X.index_q`, `X.k` -> `X.q`, or the
    query file's only entry."""
    out = []
    for name, e in keys.items():
        if not e.floating or len(e.shape) not in (2, 3) or (len(e.shape) == 3 and e.shape[1] != 1):
            continue
        for cand in (name.replace("index_k", "index_q"), name.replace(".k", ".q"), name):
            if cand in queries and (cand != name or len(queries) == 1):
                out.append((name, queries[cand]))
                break
        else:
            if len(queries) == 1:
                out.append((name, next(iter(queries.values()))))
    if not out:
        raise InputError(f"no index-key tensor ([S, D] or [S, 1, D]) with matching queries: keys {list(keys)}, "
                         f"queries {list(queries)}")
    return out
