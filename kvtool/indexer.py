"""The MiniMax-M3 lightning indexer (SPEC section 3) as plain torch: token scores, block scores, top-k, and the top-k
metrics (SPEC section 6). Every Triton scorer is compared against these functions.

Semantics, for one request with index queries `iq` [Hi, Q, D] at positions `q_pos` [Q] and index keys `ik` [S, D]:
- token score `z[h, q, s] = iq[h, q] . ik[s]` in fp32 (no ReLU, no head weights, no head sum); `s > q_pos[q]` is -inf
  (whatever the key holds: a masked NaN key never leaks in).
- block score: max of `z` over the `block_size` tokens of a block; NaN if any unmasked token score in it is NaN (torch
  max semantics); a fully masked block is -inf. `valid_blocks = q_pos // block_size + 1`.
- forced blocks: the first `init_blocks` valid blocks get 1e30, then the last `local_blocks` valid blocks get 1e29
  (local wins where both apply). Blocks past `valid_blocks` stay -inf.
- top-k: `k = min(topk, valid_blocks)` ids per (head, query) in descending rank order, padded with -1. NaN ranks as
  -1e30 (so below every finite score, above -inf). Ties: `higher-id` (ATOM) prefers the higher block id, `lower-id`
  (vLLM's AMD selector) the lower, `any` leaves it to torch.topk.
- NaN / -inf (`nan_rule`): `low` (SPEC) ranks NaN as -1e30 and keeps every valid block, NaN or -inf, ahead of the
  padding; `neg-inf` ranks NaN as -inf; `any` ranks as `low` but lets a check accept any choice and order among
  non-finite blocks (an engine may leave them out for -1). A finite block left out for a lower one is never a rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.errors import InputError

__all__ = [
    "INIT_SCORE", "IndexerConfig", "LOCAL_SCORE", "NAN_RANK", "NAN_RULES", "TIE_RULES", "TopkAccumulator",
    "TopkMetrics", "accumulation_tolerance", "apply_forced", "batched_reference", "block_scores", "default_positions",
    "paged_keys", "paged_reference", "rank_keys", "reference_block_scores", "select_blocks", "select_topk",
    "token_scores", "topk_metrics"
]

TIE_RULES = ("higher-id", "lower-id", "any")
NAN_RULES = ("low", "neg-inf", "any")
INIT_SCORE = 1e30  # forced init blocks (fp32 1e30)
LOCAL_SCORE = 1e29  # forced local blocks: below init, above every real score
NAN_RANK = -1e30  # the key a NaN block score is ranked by


@dataclass(frozen=True)
class IndexerConfig:
    """Indexer geometry. M3 defaults: 128-token blocks, top-16, no init blocks, one local block, ATOM's tie rule."""

    block_size: int = 128
    topk: int = 16
    init_blocks: int = 0
    local_blocks: int = 1
    tie_rule: str = "higher-id"  # 'higher-id' | 'lower-id' | 'any'
    nan_rule: str = "low"  # 'low' | 'neg-inf' | 'any' (module docstring)

    def __post_init__(self):
        if self.block_size < 1 or self.topk < 1 or self.init_blocks < 0 or self.local_blocks < 0:
            raise InputError(f"indexer config out of range: {self}")
        if self.tie_rule not in TIE_RULES:
            raise InputError(f"unknown tie rule {self.tie_rule!r} (choose {'|'.join(TIE_RULES)})")
        if self.nan_rule not in NAN_RULES:
            raise InputError(f"unknown NaN rule {self.nan_rule!r} (choose {'|'.join(NAN_RULES)})")


# ------------------------------------------------------------------------------------------------ reference scorer
def _positions(q_pos, n: int, device) -> torch.Tensor:
    q_pos = torch.as_tensor(q_pos, device=device).long().reshape(-1)
    if q_pos.numel() != n:
        raise InputError(f"q_pos must hold one position per query ({n}), got {q_pos.numel()}")
    return q_pos


def token_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos) -> torch.Tensor:
    """iq [Hi, Q, D], ik [S, D] (any float dtype), q_pos [Q] int -> fp32 [Hi, Q, S]; `s > q_pos[q]` gives -inf."""
    if iq.dim() != 3 or ik.dim() != 2 or iq.shape[-1] != ik.shape[-1]:
        raise InputError(f"token_scores: iq must be [Hi, Q, D] and ik [S, D], got {list(iq.shape)}, {list(ik.shape)}")
    q_pos = _positions(q_pos, iq.shape[1], iq.device)
    z = torch.matmul(iq.float(), ik.float().t().to(iq.device))
    s = torch.arange(ik.shape[0], device=iq.device)
    return z.masked_fill(s[None, None, :] > q_pos[None, :, None], -math.inf)


def block_scores(scores: torch.Tensor, q_pos, cfg: IndexerConfig) -> torch.Tensor:
    """Token scores [Hi, Q, S] fp32 -> block scores [Hi, Q, ceil(S / block_size)] fp32: max-pooled per block (NaN
    propagates), fully masked blocks -inf, forced init blocks 1e30 then local blocks 1e29 (local wins)."""
    hi, nq, s = scores.shape
    q_pos = _positions(q_pos, nq, scores.device)
    bs = cfg.block_size
    nb = -(-s // bs)
    if nq and (int(q_pos.max()) >= s or int(q_pos.min()) < 0):
        raise InputError(f"query positions must lie in [0, {s}) (the keys given), got [{int(q_pos.min())}, "
                         f"{int(q_pos.max())}]")
    padded = torch.nn.functional.pad(scores.float(), (0, nb * bs - s), value=-math.inf)
    out = padded.view(hi, nq, nb, bs).amax(dim=-1)
    return apply_forced(out, q_pos, cfg)


def apply_forced(bscores: torch.Tensor, q_pos, cfg: IndexerConfig) -> torch.Tensor:
    """Block scores [..., Q, NB]: blocks past `valid_blocks` -> -inf, forced init 1e30, then local 1e29."""
    q_pos = _positions(q_pos, bscores.shape[-2], bscores.device)
    nb = bscores.shape[-1]
    valid = (q_pos // cfg.block_size + 1)[:, None]  # [Q, 1]
    ids = torch.arange(nb, device=bscores.device)[None, :]  # [1, NB]
    out = bscores.masked_fill(ids >= valid, -math.inf)
    out = out.masked_fill((ids < cfg.init_blocks) & (ids < valid), INIT_SCORE)
    return out.masked_fill((ids >= valid - cfg.local_blocks) & (ids < valid), LOCAL_SCORE)


def rank_keys(bscores: torch.Tensor, nan_rule: str = "low") -> torch.Tensor:
    """The values block scores are ranked by: NaN -> -1e30 (-inf under nan_rule 'neg-inf'), the rest unchanged."""
    nan = -math.inf if nan_rule == "neg-inf" else NAN_RANK
    return torch.nan_to_num(bscores.float(), nan=nan, posinf=math.inf, neginf=-math.inf)


def select_topk(bscores: torch.Tensor, q_pos, cfg: IndexerConfig) -> torch.Tensor:
    """Block scores [Hi, Q, NB] -> int32 block ids [Hi, Q, cfg.topk] in descending rank order; row q keeps
    k = min(topk, valid_blocks(q_pos[q])) ids, only among its valid blocks, and pads with -1. NaN ranks as -1e30;
    ties follow cfg.tie_rule (`any` accepts any tie order; the reference then uses the higher-id order)."""
    *lead, nq, nb = bscores.shape
    q_pos = _positions(q_pos, nq, bscores.device)
    keys = rank_keys(bscores, cfg.nan_rule)
    valid = (q_pos // cfg.block_size + 1)[:, None]  # [Q, 1]
    # Lexicographic order by stable sorts, least significant first: tie id, then rank key, then validity (a valid
    # -inf block must beat an invalid one).
    order = torch.arange(nb, device=keys.device).expand_as(keys)
    if cfg.tie_rule != "lower-id":
        order = order.flip(-1)
    perm = torch.sort(keys.gather(-1, order), dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, perm)
    perm = torch.sort((order < valid).to(torch.int8), dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, perm)
    width = min(cfg.topk, nb)
    out = torch.full((*lead, nq, cfg.topk), -1, dtype=torch.int32, device=bscores.device)
    out[..., :width] = order[..., :width].to(torch.int32)
    k = torch.clamp(valid, max=cfg.topk)  # [Q, 1]
    return out.masked_fill(torch.arange(cfg.topk, device=out.device)[None, :] >= k, -1)


def select_blocks(iq: torch.Tensor, ik: torch.Tensor, q_pos, cfg: IndexerConfig) -> torch.Tensor:
    """One request: iq [Hi, Q, D], ik [S, D], q_pos [Q] -> int32 block ids [Hi, Q, cfg.topk] (-1 padded)."""
    return select_topk(block_scores(token_scores(iq, ik, q_pos), q_pos, cfg), q_pos, cfg)


def reference_block_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos, cfg: IndexerConfig) -> torch.Tensor:
    """One request: block scores [Hi, Q, NB] fp32 with forced blocks applied (what select_topk ranks)."""
    return block_scores(token_scores(iq, ik, q_pos), q_pos, cfg)


# ------------------------------------------------------------------------------------------------ top-k metrics
@dataclass
class TopkMetrics:
    """Candidate selections A against reference selections B, over `rows` rows (head x query).

    - exact_pct: % of rows whose id sets are equal.
    - tie_aware_pct: % of rows whose sets are equal, or differ only by ties: sorting the reference scores of A \\ B
      and of B \\ A gives equal lists (up to `tie_tol`, absolute, on the reference score scale).
    - recall: mean over rows of |A n B| / |B| (forced blocks included; rows with empty B count 1).
    - rel_score_err: mean over rows of |sum R[A'] - sum R[B']| / sum |R[B']|, where R are the reference block scores
      and A', B' drop forced blocks and blocks with non-finite R; rows with sum |R[B']| = 0 count 0 when the sums agree.
      rel_score_err_max is the max over rows.
    """

    rows: int
    exact_pct: float
    tie_aware_pct: float
    recall: float
    rel_score_err: float
    rel_score_err_max: float


@dataclass
class TopkAccumulator:
    """Running sums for TopkMetrics; `update(cand, ref, ref_scores)` per layer or request, `result()` at the end."""

    rows: int = 0
    exact: int = 0
    tie_aware: int = 0
    recall_sum: float = 0.0
    err_sum: float = 0.0
    err_max: float = 0.0

    def update(self, cand: torch.Tensor, ref: torch.Tensor, ref_scores: torch.Tensor,
               tie_tol: float | torch.Tensor = 0.0) -> "TopkAccumulator":
        """cand, ref: int [..., K] block ids (-1 = none); ref_scores: [..., NB] the reference block scores (forced
        values included); tie_tol: absolute tolerance for "equal reference scores" (scalar or [...] per row)."""
        if cand.shape[:-1] != ref.shape[:-1] or ref.shape[:-1] != ref_scores.shape[:-1]:
            raise InputError(f"top-k metrics: shapes differ: {list(cand.shape)}, {list(ref.shape)}, "
                             f"{list(ref_scores.shape)}")
        nb = ref_scores.shape[-1]
        a = _membership(cand.reshape(-1, cand.shape[-1]), nb)  # [R, NB] bool
        b = _membership(ref.reshape(-1, ref.shape[-1]), nb)
        r = ref_scores.reshape(-1, nb).double().to(a.device)
        tol = torch.as_tensor(tie_tol, dtype=torch.float64, device=a.device).expand(ref_scores.shape[:-1]).reshape(-1)
        n = a.shape[0]
        if n == 0:
            return self
        exact = (a == b).all(dim=-1)
        self.rows += n
        self.exact += int(exact.sum())
        self.tie_aware += int(_tie_equal(a & ~b, b & ~a, rank_keys(r).double(), tol).sum())
        nb_ref = b.sum(-1)
        recall = torch.where(nb_ref > 0, (a & b).sum(-1).double() / nb_ref.clamp(min=1), torch.ones_like(r[:, 0]))
        self.recall_sum += float(recall.sum())
        real = torch.isfinite(r) & (r.abs() < LOCAL_SCORE)  # forced blocks carry 1e29 / 1e30
        ra = torch.where(a & real, r, 0.0).sum(-1)
        rb = torch.where(b & real, r, 0.0).sum(-1)
        den = torch.where(b & real, r.abs(), 0.0).sum(-1)
        diff = (ra - rb).abs()
        err = torch.where(den > 0, diff / den.clamp(min=1e-300), torch.where(diff > 0, math.inf, 0.0))
        self.err_sum += float(err.sum())
        self.err_max = max(self.err_max, float(err.max()))
        return self

    def result(self) -> TopkMetrics:
        n = max(self.rows, 1)
        return TopkMetrics(self.rows, 100.0 * self.exact / n if self.rows else 100.0,
                           100.0 * self.tie_aware / n if self.rows else 100.0,
                           self.recall_sum / n if self.rows else 1.0, self.err_sum / n, self.err_max)


def topk_metrics(cand: torch.Tensor, ref: torch.Tensor, ref_scores: torch.Tensor,
                 tie_tol: float | torch.Tensor = 0.0) -> TopkMetrics:
    """TopkMetrics of candidate ids `cand` [..., K] against reference ids `ref` [..., K'] (-1 = none), with the
    reference block scores `ref_scores` [..., NB]."""
    return TopkAccumulator().update(cand, ref, ref_scores, tie_tol).result()


def _membership(ids: torch.Tensor, nb: int) -> torch.Tensor:
    """int ids [R, K] (-1 = none) -> bool [R, NB] set membership."""
    ids = ids.long()
    m = torch.zeros(ids.shape[0], nb + 1, dtype=torch.bool, device=ids.device)
    m.scatter_(1, torch.where(ids < 0, nb, ids).clamp(max=nb), True)
    return m[:, :nb]


def _tie_equal(only_a: torch.Tensor, only_b: torch.Tensor, keys: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """Per row: are the sorted reference keys of the blocks only in A equal (within tol) to those only in B?"""
    same_count = only_a.sum(-1) == only_b.sum(-1)
    sa = torch.where(only_a, keys, -math.inf).sort(dim=-1, descending=True).values
    sb = torch.where(only_b, keys, -math.inf).sort(dim=-1, descending=True).values
    both = torch.isinf(sa) & torch.isinf(sb) & (sa == sb)  # -inf padding (or equal infinities)
    close = both | ((sa - sb).abs() <= tol[:, None])
    return same_count & close.all(dim=-1)


def accumulation_tolerance(iq: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
    """Per query row, a bound on |reference - kernel| block scores from fp32 accumulation order alone: each of the two
    length-D dot products errs by at most ~D * 2**-24 * sum|q_i k_i| <= D * 2**-24 * |q| max|k| (Cauchy-Schwarz).
    iq [..., D], ik [S, D] -> float64 [...] (0 for empty keys)."""
    d = iq.shape[-1]
    qn = iq.double().norm(dim=-1).nan_to_num(0.0, 0.0, 0.0)
    kn = float(ik.double().norm(dim=-1).nan_to_num(0.0, 0.0, 0.0).max()) if ik.numel() else 0.0
    return 2.0 * d * 2.0 ** -24 * qn * kn


# ------------------------------------------------------------------------------------- paged cache (torch reference)
def paged_keys(cache, block_table: torch.Tensor, context_len: int, b: int) -> torch.Tensor:
    """The dequantized index keys fp32 [context_len, D] of request b of a paged cache (H = 1)."""
    t = torch.arange(context_len, device=block_table.device)
    pages = block_table[b].long()[t // cache.page_size]
    slots = pages * cache.page_size + t % cache.page_size
    return cache.dequantize(slots.to(cache.data.device))[:, 0, :]


def default_positions(q_count: int, context_lens: torch.Tensor) -> torch.Tensor:
    """Positions int64 [B, Q] of the last Q tokens of each context (-1 where the context is shorter)."""
    pos = context_lens[:, None].long() - q_count + torch.arange(q_count, device=context_lens.device)[None, :]
    return torch.where(pos < 0, -1, pos)


def paged_reference(iq: torch.Tensor, cache, block_table: torch.Tensor, context_lens: torch.Tensor,
                    cfg: IndexerConfig, q_pos=None, max_context: int | None = None):
    """The reference on the dequantized paged cache, batched like the kernels: iq [B, Q, Hi, D] at positions q_pos
    [B, Q] (default: the last Q positions; negative = padding row) -> (ids int32 [B, Q, Hi, topk], block scores fp32
    [B, Q, Hi, NB] with NB = ceil(max_context / block_size)). Padding rows give -1 ids and -inf scores."""
    keys = [paged_keys(cache, block_table, int(n), b) for b, n in enumerate(context_lens.cpu().tolist())]
    return batched_reference(iq, keys, cfg, q_pos, max_context)


def batched_reference(iq: torch.Tensor, keys: list[torch.Tensor], cfg: IndexerConfig, q_pos=None,
                      max_context: int | None = None):
    """The reference over per-request keys: iq [B, Q, Hi, D], keys[b] [ctx_b, D] (any float dtype) -> (ids int32
    [B, Q, Hi, topk], block scores fp32 [B, Q, Hi, NB]); positions as in `paged_reference`."""
    bsz, nq, hi, _ = iq.shape
    dev = iq.device
    ctx = [int(k.shape[0]) for k in keys]
    max_context = max(ctx + [0]) if max_context is None else max_context
    nb = -(-max_context // cfg.block_size)
    pos = default_positions(nq, torch.tensor(ctx)) if q_pos is None else torch.as_tensor(q_pos).cpu().long()
    ids = torch.full((bsz, nq, hi, cfg.topk), -1, dtype=torch.int32, device=dev)
    scores = torch.full((bsz, nq, hi, nb), -math.inf, device=dev)
    for b in range(bsz):
        rows = torch.nonzero(pos[b] >= 0).flatten()
        if rows.numel() == 0:
            continue
        p, rows = pos[b, rows].to(dev), rows.to(dev)
        bsc = block_scores(token_scores(iq[b, rows].transpose(0, 1), keys[b].to(dev), p), p, cfg)  # [Hi, Qv, nbb]
        scores[b, rows, :, :bsc.shape[-1]] = bsc.transpose(0, 1)
        ids[b, rows] = select_topk(bsc, p, cfg).transpose(0, 1)
    return ids, scores
