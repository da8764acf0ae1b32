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
- block scores alone (`verify_topk_scores`: a file, or EDGE_SCORES with -inf / NaN blocks and ties): only the top-k
  step is checked (kvtool's select kernel, an implementation's `select`).

Implementations (`impls`, kvtool.engines.protocol): each engine kernel runs on the same caches beside kvtool's and is
compared with the same references; a case it cannot run is a SKIPPED row with the reason. Every candidate selection
is classified row by row (`classify_rows`): exact, tie, a NaN / -inf policy difference (only non-finite blocks
differ), a DEFECT (a finite block left out while a lower-ranked block or a -1 took its place; invalid or repeated
ids), and whether its ids are in descending rank order; the rules (tie rule x NaN rule) it is consistent with are
listed. Without a kernel (CPU, no interpreter) kvtool's row compares the reference with itself: SKIPPED, not PASS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvtool.backend import (resolve_check_backend, triton_index_block_scores, triton_index_topk,
                            triton_select_topk)
from kvtool.errors import InputError
from kvtool.formats import Format, QTensor, get_format
from kvtool.formats.rotation import rotate, unrotate
from kvtool.indexer import (
    LOCAL_SCORE,
    apply_forced,
    IndexerConfig,
    TopkAccumulator,
    TopkMetrics,
    accumulation_tolerance,
    batched_reference,
    paged_keys,
    paged_reference,
    rank_keys,
    select_topk,
)
from kvtool.paged import PagedCache, contiguous_slots

__all__ = [
    "DIAGNOSES", "M3_DECODE", "MAX_EVIDENCE", "RULE_GRID", "SKIP_TORCH", "SelectionCheck", "TopkRow",
    "VerifyTopkReport", "build_index_cache", "cache_from_qtensor", "classify_rows", "diagnose", "edge_scores",
    "synthetic_index_keys", "verify_topk_capture", "verify_topk_files", "verify_topk_scores", "verify_topk_synthetic"
]

M3_DECODE = {"index_heads": 4, "head_dim": 128, "page_size": 128}


@dataclass
class TopkRow:
    layer: str  # layer id / tensor name, "synthetic", or "all" for the overall rows
    format: str
    rows: int  # (query, index head) rows compared
    vs_dequant: TopkMetrics | None  # (a) kernel vs the reference on the dequantized cache (None: skipped)
    max_score_err: float  # (a) max |kernel - reference| finite, unforced block score
    tie_tol: float  # (a) the accumulation bound used for "equal reference scores"
    vs_original: TopkMetrics | None  # (b) kernel vs the reference on the original keys (None: no original)
    passed: bool  # (a) 100 % tie-aware and (b) recall >= min_recall, no defect, rank order
    impl: str = "kvtool"  # which implementation ran: kvtool's kernel or an engine adapter's name
    verdict: str = ""  # PASS | FAIL | SKIPPED: <why>
    checks: "SelectionCheck | None" = None  # the row-by-row classification (None when skipped)


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
    impls: list[str] = field(default_factory=list)  # adapters run beside kvtool's kernel (name: source)
    verdict: str = "PASS"  # PASS | FAIL | SKIPPED: no kernel ran


# ------------------------------------------------------------------------------------------ classifying selections
@dataclass
class SelectionCheck:
    """Row-by-row classification of candidate selections against the reference (see classify_rows)."""

    rows: int = 0
    exact: int = 0
    tie: int = 0
    nonfinite: int = 0  # sets differ only in NaN / -inf blocks (a NaN policy difference, not a finite defect)
    defect: int = 0  # a finite block dropped for a lower one or a -1; invalid / repeated ids; ids in a padding row
    order_bad: int = 0  # ids not in descending rank order (ties and non-finite blocks aside), or -1 before an id
    consistent: list[str] = field(default_factory=list)  # "tie/nan" rules the candidate equals exactly, every row
    evidence: list[str] = field(default_factory=list)  # the first few failing rows, with ids and scores
    diagnosis: list[str] = field(default_factory=list)  # what a broken layout looks like (head-major, 1-indexed)

    @property
    def order_pct(self) -> float:
        return 100.0 * (self.rows - self.order_bad) / self.rows if self.rows else 100.0

    def ok(self, nan_rule: str) -> bool:
        allowed = self.exact + self.tie + (self.nonfinite if nan_rule == "any" else 0)
        return allowed == self.rows and self.defect == 0 and self.order_bad == 0

    def rule_text(self) -> str:
        if self.consistent:
            return ", ".join(self.consistent)
        if self.defect:
            return "none (defect)"
        if self.nonfinite:
            return "nan any"
        return "tie any" if self.order_bad == 0 else "none (order)"


MAX_EVIDENCE = 3
RULE_GRID = tuple((t, n) for t in ("higher-id", "lower-id") for n in ("low", "neg-inf"))


def _fmt_score(x: float) -> str:
    if x != x:
        return "NaN"
    if x >= 1e29:
        return "1e30 forced init" if x >= 1e30 else "1e29 forced local"
    return f"{x:.6g}"


def classify_rows(cand: torch.Tensor, ref_scores: torch.Tensor, pos: torch.Tensor, tol: torch.Tensor,
                  cfg: IndexerConfig, labels: list[str] | None = None) -> SelectionCheck:
    """cand int [R, K] candidate ids, ref_scores fp32 [R, NB] the reference block scores (forced applied, NaN kept),
    pos [R] query positions (negative: padding row), tol [R] accumulation bounds -> SelectionCheck. The reference
    selection follows cfg (tie and NaN rule); `labels[r]` names row r in the evidence."""
    cand, ref_scores = cand.detach().cpu().long(), ref_scores.detach().cpu().float()
    pos, tol = pos.detach().cpu().long().reshape(-1), tol.detach().cpu().double().reshape(-1)
    out = SelectionCheck()
    live = torch.nonzero(pos >= 0).flatten()
    dead = torch.nonzero(pos < 0).flatten()
    for r in dead.tolist():
        if bool((cand[r] >= 0).any()):
            out.defect += 1
            _evidence(out, labels, r, "ids in a padding row", cand[r].tolist(), None)
    if live.numel() == 0:
        return out
    c, sc, p, tl = cand[live], ref_scores[live], pos[live], tol[live]
    ref = {}
    for tie, nan in RULE_GRID + ((cfg.tie_rule if cfg.tie_rule != "any" else "higher-id", cfg.nan_rule),):
        rule_cfg = IndexerConfig(cfg.block_size, cfg.topk, cfg.init_blocks, cfg.local_blocks, tie,
                                 "low" if nan == "any" else nan)
        ref[(tie, nan)] = select_topk(sc, p, rule_cfg).long()
    base = ref[(cfg.tie_rule if cfg.tie_rule != "any" else "higher-id", cfg.nan_rule)]
    for tie, nan in RULE_GRID:
        if torch.equal(c, ref[(tie, nan)]):
            out.consistent.append(f"{tie}/{nan}")
    keys = rank_keys(sc, "low" if cfg.nan_rule == "any" else cfg.nan_rule).double()
    valid = (p // cfg.block_size + 1).tolist()
    c_l, b_l, k_l, s_l, t_l = c.tolist(), base.tolist(), keys.tolist(), sc.tolist(), tl.tolist()
    out.rows = len(c_l) + int(dead.numel())
    out.exact += int(dead.numel()) - out.defect
    for i, row in enumerate(c_l):
        r = int(live[i])
        kind, why = _classify_one(row, b_l[i], k_l[i], s_l[i], valid[i], min(cfg.topk, valid[i]), t_l[i],
                                  cfg.nan_rule == "any")
        setattr(out, kind, getattr(out, kind) + 1)
        bad_order = _order_bad(row, k_l[i], s_l[i], t_l[i], cfg.nan_rule == "any")
        out.order_bad += bad_order
        if kind in ("defect", "nonfinite"):
            _evidence(out, labels, r, why, row, b_l[i], s_l[i])
        elif bad_order:
            _evidence(out, labels, r, "ids not in descending rank order" + (
                " (ascending block ids)" if _ascending(row) else ""), row, b_l[i], s_l[i])
    return out


def _classify_one(row, ref_row, keys, scores, valid, k, tol, nan_any) -> tuple[str, str]:
    ids = [x for x in row if x >= 0]
    bad = [x for x in row if x < -1 or x >= valid]
    if bad:
        return "defect", f"invalid block ids {bad} (valid blocks 0..{valid - 1})"
    if len(set(ids)) != len(ids):
        return "defect", "a block id listed twice"
    if len(ids) > k:
        return "defect", f"{len(ids)} ids where at most {k} blocks can be chosen"
    if row == ref_row:
        return "exact", ""
    a, b = set(ids), {x for x in ref_row if x >= 0}
    only_a, only_b = sorted(a - b), sorted(b - a)
    lowest = min((keys[x] for x in ids), default=math.inf)
    for x in sorted(only_b, key=lambda y: -keys[y]):  # the best-ranked finite reference block the candidate left out
        fin = math.isfinite(scores[x])
        if fin and (len(ids) < k or lowest < keys[x] - tol):
            kept = min(ids, key=lambda y: keys[y]) if ids else None
            took = f"block {kept} (score {_fmt_score(scores[kept])}) kept" if kept is not None and                 keys[kept] < keys[x] - tol else "a -1 in its place"
            return "defect", f"finite block {x} (score {_fmt_score(scores[x])}) dropped while {took}"
    ka = sorted((keys[x] for x in only_a), reverse=True)
    kb = sorted((keys[x] for x in only_b), reverse=True)
    if len(ka) == len(kb) and all(abs(u - v) <= tol or u == v for u, v in zip(ka, kb)):
        return "tie", ""
    if all(not math.isfinite(scores[x]) for x in only_a + only_b):
        return "nonfinite", (f"NaN / -inf blocks differ: only in the candidate {only_a}, only in the reference "
                             f"{only_b}")
    return "defect", f"blocks {only_b} of the reference replaced by {only_a} (not ties)"


def _order_bad(row, keys, scores, tol, nan_any) -> int:
    """1 when the ids are not in descending rank order (within tol; under nan rule `any`, non-finite blocks may sit
    anywhere) or a -1 comes before an id."""
    seen_pad, prev = False, None
    for x in row:
        if x < 0:
            seen_pad = True
            continue
        if seen_pad or x >= len(keys):
            return 1
        if prev is not None and not (nan_any and not (math.isfinite(scores[x]) and math.isfinite(scores[prev]))):
            if keys[x] > keys[prev] + tol:
                return 1
        prev = x
    return 0


def _ascending(row) -> bool:
    ids = [x for x in row if x >= 0]
    return len(ids) > 1 and ids == sorted(ids)


def _evidence(out: SelectionCheck, labels, r, why, got, ref, scores=None) -> None:
    if len(out.evidence) >= MAX_EVIDENCE:
        return
    name = labels[r] if labels else f"row {r}"
    text = f"{name}: got {got}"
    if ref is not None:
        text += f", reference {ref}"
    if scores is not None:
        text += " (scores " + ", ".join(f"{j}:{_fmt_score(v)}" for j, v in enumerate(scores[:32])) + \
            (", ..." if len(scores) > 32 else "") + ")"
    out.evidence.append(f"{text}; {why}" if why else text)


# Reinterpretations of a candidate [B, Q, Hi, K] that a broken adapter produces, tried when a row set fails.
def _head_major(c: torch.Tensor) -> torch.Tensor:
    b, q, h, k = c.shape
    return c.reshape(h, b * q, k).transpose(0, 1).reshape(b, q, h, k)


DIAGNOSES = (
    ("the ids look head-major: [Hi, rows, topk] memory read as [rows, Hi, topk]", _head_major),
    ("the ids look 1-indexed (0 = none)", lambda c: torch.where(c > 0, c - 1, -1)),
)


def diagnose(cand: torch.Tensor, ref_scores: torch.Tensor, pos: torch.Tensor, tol: torch.Tensor,
             cfg: IndexerConfig) -> list[str]:
    """The DIAGNOSES under which a failing candidate [B, Q, Hi, K] becomes (nearly) all exact-or-tie."""
    found = []
    rows = cand[..., 0].numel()
    for text, fn in DIAGNOSES:
        try:
            alt = fn(cand.cpu().long())
        except RuntimeError:
            continue
        chk = classify_rows(alt.reshape(rows, -1), ref_scores.reshape(rows, -1), pos.reshape(-1), tol.reshape(-1),
                            cfg)
        if chk.rows and (chk.exact + chk.tie) >= 0.9 * chk.rows:
            found.append(text)
    return found


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
    """Per (implementation, format) accumulators for the overall rows."""

    def __init__(self):
        self.deq, self.orig, self.err, self.tol, self.rows, self.checks = {}, {}, {}, {}, {}, {}

    def add(self, key, ids, ref_ids, ref_scores, tol, err, orig_ids, orig_scores, check: SelectionCheck):
        self.deq.setdefault(key, TopkAccumulator()).update(ids, ref_ids, ref_scores, tol)
        if orig_ids is not None:
            self.orig.setdefault(key, TopkAccumulator()).update(ids, orig_ids, orig_scores)
        self.err[key] = max(self.err.get(key, 0.0), err)
        self.tol[key] = max(self.tol.get(key, 0.0), float(tol.max()) if tol.numel() else 0.0)
        self.rows[key] = self.rows.get(key, 0) + ids[..., 0].numel()
        acc = self.checks.setdefault(key, SelectionCheck())
        for name in ("rows", "exact", "tie", "nonfinite", "defect", "order_bad"):
            setattr(acc, name, getattr(acc, name) + getattr(check, name))
        acc.consistent = check.consistent[:] if acc.rows == check.rows else \
            [r for r in acc.consistent if r in check.consistent]
        acc.evidence += check.evidence[:max(0, MAX_EVIDENCE - len(acc.evidence))]
        acc.diagnosis += [d for d in check.diagnosis if d not in acc.diagnosis]


def _row(layer, label, rows, deq: TopkMetrics, err, tol, orig: TopkMetrics | None, min_recall,
         impl: str = "kvtool", check: SelectionCheck | None = None, nan_rule: str = "low") -> TopkRow:
    ok = (deq.tie_aware_pct == 100.0 or (check is not None and check.ok(nan_rule))) and \
        (min_recall is None or orig is None or orig.recall >= min_recall)
    if check is not None:
        ok = ok and check.ok(nan_rule)
    return TopkRow(layer, label, rows, deq, err, tol, orig, ok, impl, "PASS" if ok else "FAIL", check)


SKIP_TORCH = ("SKIPPED: no kernel ran (torch backend: the reference compared with itself; run on cuda, or on the "
              "CPU with TRITON_INTERPRET=1)")


def _skipped(layer, label, rows, impl, why) -> TopkRow:
    return TopkRow(layer, label, rows, None, math.nan, 0.0, None, True, impl, why, None)


def _candidates(iq4, cache, table, ctx, q_pos, cfg, backend, launch, impls):
    """(impl name, ids, scores or None, skip reason or None) for kvtool's kernel and each implementation."""
    from kvtool.engines.protocol import IndexCall

    out = []
    if backend == "triton":
        # the kernel refuses a recipe's format and scores the stored codes (k R) with bf16(q R): (q R) . (k R) = q . k
        ids = triton_index_topk(iq4, cache, table, ctx, cfg, q_pos, **launch)
        scores = triton_index_block_scores(iq4, cache, table, ctx, cfg, q_pos, **launch)
        out.append(("kvtool", ids, scores, None))
    else:  # the reference itself: (a) cannot fail, (b) still says what the format costs
        out.append(("kvtool", None, None, "reference"))
    for impl in impls:
        from kvtool.engines.protocol import ROTATION_SKIP

        why = ROTATION_SKIP if cache.fmt.rotation is not None else impl.unsupported(
            "index", cache.fmt, block_size=cfg.block_size, page_size=cache.page_size, head_dim=cache.head_dim,
            device=iq4.device)
        if why:
            out.append((impl.name, None, None, f"SKIPPED: {why}"))
            continue
        res = impl.index(IndexCall(iq4, cache, table, ctx, q_pos, cfg, int(ctx.max()) if ctx.numel() else 0))
        if tuple(res.ids.shape) != (*iq4.shape[:3], cfg.topk):
            raise InputError(f"--impl {impl.name}: ids must be [B, Q, Hi, topk] = {[*iq4.shape[:3], cfg.topk]}, got "
                             f"{list(res.ids.shape)}")
        out.append((impl.name, res.ids.to(iq4.device), None if res.scores is None else res.scores.to(iq4.device),
                    None))
    return out


def _row_labels(bsz: int, nq: int, hi: int, q_pos) -> list[str]:
    return [f"request {b} query {q}" + ("" if q_pos is None else f" (position {int(q_pos[b, q])})") + f" head {h}"
            for b in range(bsz) for q in range(nq) for h in range(hi)]


def _check_layer(layer: str, caches: list[tuple[str, tuple]], iq4: torch.Tensor, q_pos: torch.Tensor | None,
                 cfg: IndexerConfig, original, backend: str, report: VerifyTopkReport, overall: _Overall,
                 launch: dict | None = None, impls: list | None = None) -> None:
    """One layer / synthetic step: for each (label, (cache, table, ctx)) run every candidate and compare.
    iq4 bf16 [B, Q, Hi, D]; q_pos [B, Q] or None (the last Q positions); original = (ids, scores) or None;
    launch: kernel launch options (kvtool.kernels.index_score.LAUNCH_OPTIONS; None = the autotuned launch);
    impls: engine implementations (kvtool.engines.protocol) run beside kvtool's kernel."""
    launch = launch or {}
    bsz, nq, hi, _ = iq4.shape
    for label, (cache, table, ctx) in caches:
        q_ref = iq4
        if cache.fmt.rotation is not None:  # the query the kernel scores with, bf16(q R), taken back by R^T:
            # q_ref . deq(k) = bf16(q R) . codes, the kernel's product, so (a) stays an fp32-order check
            q_ref = unrotate(rotate(iq4, cache.fmt.rotation).to(iq4.dtype), cache.fmt.rotation)
        ref_ids, ref_scores = paged_reference(q_ref, cache, table, ctx, cfg, q_pos)
        keys = [paged_keys(cache, table, int(n), b) for b, n in enumerate(ctx.tolist()) if n]
        ik = torch.cat(keys) if keys else torch.zeros(0, iq4.shape[-1], device=iq4.device)
        tol = accumulation_tolerance(q_ref, ik)  # per row [B, Q, Hi]
        pos = (ctx.long()[:, None] - nq + torch.arange(nq, device=ctx.device)[None, :]) if q_pos is None \
            else q_pos.long()
        pos_rows = pos[:, :, None].expand(bsz, nq, hi).reshape(-1)
        labels = _row_labels(bsz, nq, hi, q_pos)
        for impl, ids, scores, skip in _candidates(iq4, cache, table, ctx, q_pos, cfg, backend, launch, impls or []):
            if skip == "reference":
                ids, scores = ref_ids, ref_scores
            elif skip:
                report.layers.append(_skipped(layer, label, ref_ids[..., 0].numel(), impl, skip))
                continue
            err = math.nan if scores is None else _score_error(scores, ref_scores)
            check = classify_rows(ids.reshape(-1, cfg.topk), ref_scores.reshape(-1, ref_scores.shape[-1]), pos_rows,
                                  tol.reshape(-1), cfg, labels)
            if not check.ok(cfg.nan_rule) and check.defect:
                check.diagnosis = diagnose(ids, ref_scores, pos[:, :, None].expand(bsz, nq, hi), tol, cfg)
            deq = TopkAccumulator().update(ids, ref_ids, ref_scores, tol).result()
            orig = None if original is None else TopkAccumulator().update(ids, *original).result()
            overall.add((impl, label), ids, ref_ids, ref_scores, tol, err, *(original or (None, None)), check)
            row = _row(layer, label, ids[..., 0].numel(), deq, err, float(tol.max()) if tol.numel() else 0.0, orig,
                       report.min_recall, impl, check, cfg.nan_rule)
            if skip == "reference" and row.passed:
                row.verdict = SKIP_TORCH
            report.layers.append(row)
            report.passed &= row.passed


def _finish(report: VerifyTopkReport, overall: _Overall) -> VerifyTopkReport:
    impls = ["kvtool"] + [i.split(":")[0] for i in report.impls]
    for impl in impls:
        for label in report.formats:
            key = (impl, label)
            if key in overall.deq:
                orig = overall.orig[key].result() if key in overall.orig else None
                row = _row("all", label, overall.rows[key], overall.deq[key].result(), overall.err[key],
                           overall.tol[key], orig, report.min_recall, impl, overall.checks[key],
                           report.config.get("nan_rule", "low"))
                if impl == "kvtool" and report.backend == "torch" and row.passed:
                    row.verdict = SKIP_TORCH
                report.overall.append(row)
                report.passed &= row.passed
    ran = [row for row in report.layers if not row.verdict.startswith("SKIPPED")]
    report.verdict = "FAIL" if not report.passed else ("PASS" if ran else "SKIPPED: no kernel ran")
    if report.backend == "torch":
        report.notes.append("torch backend: kvtool's rows compare the reference with itself, so (a) is SKIPPED (b "
                            "still measures the format); run on cuda (or TRITON_INTERPRET=1) to check the kernel")
    return report


def _cfg_dict(cfg: IndexerConfig, **extra) -> dict:
    return {"block_size": cfg.block_size, "topk": cfg.topk, "init_blocks": cfg.init_blocks,
            "local_blocks": cfg.local_blocks, "tie_rule": cfg.tie_rule, "nan_rule": cfg.nan_rule, **extra}


# ------------------------------------------------------------------------------------------------------- entry points
def verify_topk_synthetic(formats: list[str], *, batch: int = 4, context_lens: str | None = None, seed: int = 0,
                          cfg: IndexerConfig | None = None, page_size: int = 128, device: str = "cpu",
                          backend: str = "auto", min_recall: float | None = None,
                          progress: Callable[[str], None] | None = None, launch: dict | None = None,
                          impls: list | None = None) -> VerifyTopkReport:
    """One M3 decode step for `batch` requests (see the module docstring). launch: kernel launch options (tests pin
    one launch to skip autotuning; None = the autotuned launch); impls: `--impl` specs or implementation objects."""
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
    impls = _resolve_impls(impls, report)
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
                 overall, launch, impls)
    return _finish(report, overall)


def edge_scores(cfg: IndexerConfig) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Block-score rows that break selectors (raw scores: the selector applies forced blocks): fp32 [R, NB],
    positions [R], a name per row. The first is the vLLM 0.33.0 defect case of issue 29 (16 valid blocks scored 1..16,
    block 3 at -inf)."""
    nb, bs, inf, nan = 16, cfg.block_size, math.inf, math.nan
    rows, names, pos = [], [], []

    def add(name, vals, valid=nb):
        rows.append(torch.tensor(vals, dtype=torch.float32))
        names.append(name)
        pos.append(valid * bs - 1)

    ramp = [float(i + 1) for i in range(nb)]
    add("scores 1..16, block 3 -inf", [(-inf if i == 3 else v) for i, v in enumerate(ramp)])
    add("scores 1..16, block 5 NaN", [(nan if i == 5 else v) for i, v in enumerate(ramp)])
    add("scores 1..16, blocks 2 and 9 -inf", [(-inf if i in (2, 9) else v) for i, v in enumerate(ramp)])
    add("scores 1..16, block 0 NaN, block 7 -inf", [(nan if i == 0 else -inf if i == 7 else v)
                                                     for i, v in enumerate(ramp)])
    add("all equal (ties)", [1.0] * nb)
    add("all -inf", [-inf] * nb)
    add("6 valid blocks, block 1 -inf", [(-inf if i == 1 else v) for i, v in enumerate(ramp)], valid=6)
    add("6 valid blocks, block 4 NaN", [(nan if i == 4 else v) for i, v in enumerate(ramp)], valid=6)
    return torch.stack(rows), torch.tensor(pos), names


def verify_topk_scores(scores: torch.Tensor | None = None, q_pos: torch.Tensor | None = None, *,
                       cfg: IndexerConfig | None = None, names: list[str] | None = None, source: str = "edge cases",
                       device: str = "cpu", backend: str = "auto", impls: list | None = None) -> VerifyTopkReport:
    """The top-k step alone: raw block scores fp32 [R, NB] at positions q_pos [R] (default: `edge_scores`) through
    kvtool's select kernel and each implementation's `select`, against kvtool.indexer.select_topk. Row evidence
    names each row (`names`)."""
    cfg = cfg or IndexerConfig()
    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    if scores is None:
        scores, q_pos, names = edge_scores(cfg)
    if scores.dim() != 2 or q_pos is None or q_pos.reshape(-1).shape[0] != scores.shape[0]:
        raise InputError(f"block scores must be [R, NB] with one position per row, got {list(scores.shape)} and "
                         f"{None if q_pos is None else list(q_pos.shape)}")
    q_pos = q_pos.reshape(-1).long()
    if int(q_pos.max()) // cfg.block_size + 1 > scores.shape[1]:
        raise InputError(f"positions up to {int(q_pos.max())} need {int(q_pos.max()) // cfg.block_size + 1} "
                         f"blocks per row, the scores have {scores.shape[1]}")
    report = VerifyTopkReport(source, str(dev), label, _cfg_dict(cfg, rows=scores.shape[0]), ["scores"], None)
    impls = _resolve_impls(impls, report)
    forced = apply_forced(scores.float(), q_pos, cfg)
    ref = select_topk(forced, q_pos, cfg)
    tol = torch.zeros(scores.shape[0], dtype=torch.float64)
    labels = names or [f"row {r}" for r in range(scores.shape[0])]
    cands = []
    if backend == "triton":
        ids = triton_select_topk(forced.to(dev)[None, :, None].contiguous(),
                                 q_pos.to(torch.int32).to(dev)[None].contiguous(), cfg.block_size, cfg.topk,
                                 higher_id=cfg.tie_rule != "lower-id")[0, :, 0]
        cands.append(("kvtool", ids, None))
    else:
        cands.append(("kvtool", None, SKIP_TORCH))
    for impl in impls:
        why = None if hasattr(impl, "select") else f"{impl.name} has no select() (top-k over given scores)"
        why = why or impl.unsupported("select", None, device=dev)
        cands.append((impl.name, None if why else impl.select(scores.float().to(dev), q_pos.to(dev), cfg),
                      f"SKIPPED: {why}" if why else None))
    overall = _Overall()
    for impl, ids, skip in cands:
        if skip:
            report.layers.append(_skipped("scores", "scores", scores.shape[0], impl, skip))
            continue
        check = classify_rows(ids, forced, q_pos, tol, cfg, labels)
        deq = TopkAccumulator().update(ids.cpu(), ref, forced, tol).result()
        row = _row("scores", "scores", scores.shape[0], deq, math.nan, 0.0, None, None, impl, check, cfg.nan_rule)
        report.layers.append(row)
        report.passed &= row.passed
    return _finish(report, overall)


def _query_rows(n: int, max_queries: int) -> torch.Tensor:
    if max_queries <= 0 or max_queries >= n:
        return torch.arange(n)
    return torch.unique(torch.linspace(0, n - 1, max_queries).round().long())


def _file_cfg(meta: dict, block_size, topk, tie_rule, nan_rule="low") -> IndexerConfig:
    return IndexerConfig(block_size=block_size or int(meta.get("block_size", 128)),
                         topk=topk or int(meta.get("topk", 16)), init_blocks=int(meta.get("init", 0)),
                         local_blocks=int(meta.get("local", 1)), tie_rule=tie_rule, nan_rule=nan_rule)


def _resolve_impls(impls, report: VerifyTopkReport) -> list:
    """`--impl` specs (or objects) -> implementation objects, recorded in the report as "name: source"."""
    from kvtool.engines.protocol import resolve_impl

    out = [resolve_impl(i, "index") if isinstance(i, str) else i for i in impls or []]
    report.impls = [f"{i.name}: {i.source}" for i in out]
    return out


def verify_topk_capture(path: Path, formats: list[str], *, layers: list[int] | None = None, max_queries: int = 256,
                        page_size: int | None = None, block_size: int | None = None, topk: int | None = None,
                        tie_rule: str = "higher-id", device: str = "cpu", backend: str = "auto",
                        min_recall: float | None = None, progress: Callable[[str], None] | None = None,
                        launch: dict | None = None, impls: list | None = None,
                        nan_rule: str = "low") -> VerifyTopkReport:
    """Every captured layer (or `layers`) of a `kvtool capture` file; see the module docstring."""
    from kvtool.workflows.capture import read_capture

    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    meta, tensors = read_capture(Path(path))
    cfg = _file_cfg(meta, block_size, topk, tie_rule, nan_rule)
    found = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.endswith(".index_k")})
    chosen = found if layers is None else layers
    missing = [i for i in chosen if i not in found]
    if missing or not chosen:
        raise InputError(f"{path}: no captured index layer(s) {missing or chosen} (the file has {found})")
    fmts = [get_format(f) for f in formats]
    page = page_size or cfg.block_size
    report = VerifyTopkReport(str(path), str(dev), label, _cfg_dict(cfg, page_size=page), [f.label for f in fmts],
                              min_recall)
    impls = _resolve_impls(impls, report)
    overall = _Overall()
    for i in chosen:
        ik, iq = tensors[f"layers.{i}.index_k"], tensors[f"layers.{i}.index_q"]
        rows = _query_rows(ik.shape[0], max_queries)
        _check_keys(str(i), fmts, ik, iq[rows], rows, cfg, page, dev, backend, report, overall, progress, launch,
                    impls)
    if max_queries > 0:
        report.notes.append(f"at most {max_queries} query positions per layer (evenly spaced, with the last)")
    return _finish(report, overall)


def _check_keys(layer, fmts, ik, iq, rows, cfg, page, dev, backend, report, overall, progress, launch=None,
                impls=None) -> None:
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
                 report, overall, launch, impls)


def verify_topk_files(cache_path: Path, query_path: Path, formats: list[str], *, max_queries: int = 256,
                      page_size: int | None = None, block_size: int | None = None, topk: int | None = None,
                      tie_rule: str = "higher-id", device: str = "cpu", backend: str = "auto",
                      min_recall: float | None = None, progress: Callable[[str], None] | None = None,
                      launch: dict | None = None, impls: list | None = None,
                      nan_rule: str = "low", verify: bool = True) -> VerifyTopkReport:
    """An index cache file (float keys, or a kvtool cache file) plus a query file; see the module docstring.
    verify: check kvtool files' checksums and decoded codes as they are read (False trusts them)."""
    from kvtool.readers import open_input

    dev = torch.device(device)
    backend, label = resolve_check_backend(backend, dev)
    cfg = _file_cfg({}, block_size, topk, tie_rule, nan_rule)
    page = page_size or cfg.block_size
    report = VerifyTopkReport(f"{cache_path} + {query_path}", str(dev), label, _cfg_dict(cfg, page_size=page), [],
                              min_recall)
    impls = _resolve_impls(impls, report)
    overall = _Overall()
    with open_input(Path(cache_path), verify=verify) as kf, open_input(Path(query_path), verify=verify) as qf:
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
                             overall, launch, impls)
                report.notes.append(f"{kname} is already quantized ({kentry.fmt.label}): (b) needs the original keys")
            else:
                labels = [f.label for f in fmts]
                ik = kentry.read(0, kentry.rows).reshape(n, kentry.dim)
                _check_keys(layer, fmts, ik, iq[pick], rows[pick], cfg, page, dev, backend, report, overall,
                            progress, launch, impls)
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
