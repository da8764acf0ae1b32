"""Top-k block selection for the lightning indexer: the in-register selection step shared by the scorer kernels
(`pick_next`), the merge kernel that turns per-program candidate lists into the final block ids, and the select
kernel that picks them from whole block-score rows (the default two-pass path of kernels/index_score.py).

Order (the same as `kvtool.indexer.select_topk`): rank keys descending (NaN already mapped to -1e30 by the caller,
forced blocks 1e30 / 1e29, -inf allowed), ties broken by block id (higher first for `higher-id`, lower first for
`lower-id`; `any` uses the higher-id order). With that strict total order, the top-k of a union of lists equals the
top-k of the union of each list's top-k, so splitting the context across programs and merging is exact.

The select pass (`select_from_block_scores`, default variant "packed") runs one row per program with 8 elements per
thread and ranks each element by one int64 (`packed_rank`: the key's order-preserving integer, then the tie id), so
each of the 16 steps is one max reduction; SELECT_VARIANTS lists the launch shapes measured (numbers:
docs/kernels/topk.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.errors import KernelArgumentError

__all__ = [
    "INT32_MAX", "INT64_MIN", "MAX_SELECT_BLOCKS", "NAN_RANK", "NO_ID", "SELECT_DEFAULT", "SELECT_VARIANTS",
    "merge_candidates", "packed_id", "packed_rank", "pick_next", "select_from_block_scores"
]

NO_ID = tl.constexpr(-1)  # "no block": padding of the output and of candidate lists
INT32_MAX = tl.constexpr(2147483647)
NAN_RANK = tl.constexpr(-1e30)  # kvtool.indexer.NAN_RANK: the key a NaN block score is ranked by
INT64_MIN = tl.constexpr(-9223372036854775808)  # "not available" in packed_rank's order (below every key)


@triton.jit
def pick_next(keys, ids, avail, HIGHER_ID: tl.constexpr):
    """One selection step over rows of candidates.

    keys fp32 [R, N] (no NaN), ids int32 [R, N] (unique per row), avail bool [R, N] ->
    (best key [R], best id [R] (-1 when nothing is available), avail with the picked entry removed).
    """
    k = tl.where(avail, keys, float("-inf"))
    best = tl.max(k, axis=1)
    cand = avail & (k == best[:, None])  # -inf == -inf, so -inf blocks stay selectable
    if HIGHER_ID:
        best_id = tl.max(tl.where(cand, ids, NO_ID), axis=1)
    else:
        low = tl.min(tl.where(cand, ids, INT32_MAX), axis=1)
        best_id = tl.where(low == INT32_MAX, NO_ID, low)
    avail = avail & (ids != best_id[:, None])
    return best, best_id, avail


@triton.jit
def _merge_kernel(
    key_ptr,  # fp32 [rows, NC_IN]: candidate rank keys
    id_ptr,  # int32 [rows, NC_IN]: candidate block ids, -1 = none
    out_ptr,  # int32 [rows, TOPK]: selected ids in rank order, -1 padded
    rows,  # number of rows
    NC_IN: tl.constexpr,  # candidates per row
    NC: tl.constexpr,  # NC_IN rounded up to a power of two
    TOPK: tl.constexpr,  # ids per output row
    ROWS: tl.constexpr,  # rows per program
    HIGHER_ID: tl.constexpr,  # tie rule: True = higher id first
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, NC)
    row_ok = r < rows
    m = row_ok[:, None] & (c[None, :] < NC_IN)
    offs = r[:, None].to(tl.int64) * NC_IN + c[None, :]
    keys = tl.load(key_ptr + offs, mask=m, other=float("-inf"))
    ids = tl.load(id_ptr + offs, mask=m, other=NO_ID)
    avail = m & (ids >= 0)
    for j in tl.static_range(TOPK):
        _, best_id, avail = pick_next(keys, ids, avail, HIGHER_ID)
        tl.store(out_ptr + r.to(tl.int64) * TOPK + j, best_id, mask=row_ok)


@triton.jit
def packed_rank(keys, ids, avail, HIGHER_ID: tl.constexpr):
    """keys fp32 [R, N] (no NaN), ids int32 [R, N] (>= 0, unique per row), avail bool [R, N] -> int64 [R, N] whose
    integer order is the selection order (key descending, then id by the tie rule), INT64_MIN where not available.
    One integer max per selection step then finds the next block, where `pick_next` needs two (key, then id)."""
    k = tl.where(keys == 0.0, 0.0, keys)  # -0 ties +0, as in the reference's float compare
    bits = k.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotonic in the value: negative floats' magnitude bits flipped
    if HIGHER_ID:
        tie = ids
    else:
        tie = 0x7FFFFFFF - ids
    return tl.where(avail, (ordered.to(tl.int64) << 32) | tie.to(tl.int64), INT64_MIN)


@triton.jit
def packed_id(best, HIGHER_ID: tl.constexpr):
    """The block id of a `packed_rank` value (int64 [R]) -> int32 [R], -1 for INT64_MIN (nothing available)."""
    lo = (best & 0xFFFFFFFF).to(tl.int32)
    if HIGHER_ID:
        bid = lo
    else:
        bid = 0x7FFFFFFF - lo
    return tl.where(best == INT64_MIN, NO_ID, bid)


@triton.jit
def _select_kernel(
    score_ptr,  # fp32 [rows, NB]: block scores, forced blocks applied (MODE_BLOCKS of kernels/index_score.py)
    pos_ptr,  # int32 [rows // HI]: the query position of each row group (-1 = padding)
    out_ptr,  # int32 [rows, TOPK] selected ids in rank order, -1 padded; SPLIT: int64 [rows, segments, TOPK]
    rows, HI, NB, BS,  # rows, rows per position (index heads), blocks per row, block size
    NC: tl.constexpr,  # columns per program (a power of two): the whole row, or one segment with SPLIT
    TOPK: tl.constexpr,  # ids per output row
    ROWS: tl.constexpr,  # rows per program
    HIGHER_ID: tl.constexpr,  # tie rule: True = higher id first
    PACKED: tl.constexpr,  # one int64 max per step (`packed_rank`), else two (`pick_next`: key, then id)
    SPLIT: tl.constexpr,  # program (i, s) takes columns s NC .. (s + 1) NC and writes its packed top-k
    PARTS: tl.constexpr = 1,  # scores hold PARTS partial maxima per block ([rows, NB, PARTS]): max them, NaN winning
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    seg = tl.program_id(1)
    c = seg * NC + tl.arange(0, NC)
    row_ok = r < rows
    pos = tl.load(pos_ptr + r // HI, mask=row_ok, other=-1)
    # the scores' loads do not wait for the position (both in flight at once); blocks past valid are masked after
    in_row = row_ok[:, None] & (c[None, :] < NB)
    offs = (r[:, None].to(tl.int64) * NB + c[None, :]) * PARTS
    keys = tl.load(score_ptr + offs, mask=in_row, other=float("-inf"))
    for p in tl.static_range(1, PARTS):
        part = tl.load(score_ptr + offs + p, mask=in_row, other=float("-inf"))
        keys = tl.maximum(keys, part, propagate_nan=tl.PropagateNan.ALL)
    valid = tl.where(pos >= 0, pos // BS + 1, 0)  # blocks past valid are never selected (-inf ones inside are)
    avail = in_row & (c[None, :] < valid[:, None])
    keys = tl.where(keys != keys, NAN_RANK, keys)
    ids = tl.broadcast_to(c[None, :], [ROWS, NC])
    if SPLIT:
        packed = packed_rank(keys, ids, avail, HIGHER_ID)
        base = (r.to(tl.int64) * tl.num_programs(1) + seg) * TOPK
        for j in tl.static_range(TOPK):
            best = tl.max(packed, axis=1)
            tl.store(out_ptr + base + j, best, mask=row_ok)
            packed = tl.where(packed == best[:, None], INT64_MIN, packed)  # ids are unique: removes exactly the pick
    elif PACKED:
        packed = packed_rank(keys, ids, avail, HIGHER_ID)
        for j in tl.static_range(TOPK):
            best = tl.max(packed, axis=1)
            tl.store(out_ptr + r.to(tl.int64) * TOPK + j, packed_id(best, HIGHER_ID), mask=row_ok)
            packed = tl.where(packed == best[:, None], INT64_MIN, packed)
    else:
        for j in tl.static_range(TOPK):
            _, best_id, avail = pick_next(keys, ids, avail, HIGHER_ID)
            tl.store(out_ptr + r.to(tl.int64) * TOPK + j, best_id, mask=row_ok)


@triton.jit
def _merge_packed_kernel(
    cand_ptr,  # int64 [rows, N_IN]: `packed_rank` candidates (INT64_MIN = none), the output of a SPLIT select
    out_ptr,  # int32 [rows, TOPK]: selected ids in rank order, -1 padded
    N_IN,  # candidates per row
    NC: tl.constexpr,  # N_IN rounded up to a power of two
    TOPK: tl.constexpr,
    HIGHER_ID: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NC)
    packed = tl.load(cand_ptr + r * N_IN + c, mask=c < N_IN, other=INT64_MIN)
    for j in tl.static_range(TOPK):
        best = tl.max(packed, axis=0)
        tl.store(out_ptr + r * TOPK + j, packed_id(best, HIGHER_ID))
        packed = tl.where(packed == best, INT64_MIN, packed)


MAX_SELECT_BLOCKS = 16384  # widest block-score row select_from_block_scores takes (2M tokens at 128-token blocks)
# Launch variants of the select pass (name -> packed, segment columns or 0 for whole rows, elements per thread[, rows
# per program, default 1]).
# "legacy": the first launch (rows of <= 2048 blocks two per program, 4 warps, 32 elements per thread, every step
# re-scanning 32 elements). "flat": one row per program, 8 elements per thread. "packed": the same with one int64 max
# per step (half the barriers). "splitN": N-column segments, one warp each (shuffles only, no barrier), then
# `_merge_packed_kernel`. "packed" (the default) measured fastest or tied at every shape on the H200; the table of
# SASS counts and times is in docs/kernels/topk.md.
# "packedR<n>": "packed" with n rows per program (n warps at 256 columns), for the many short rows of prefill.
SELECT_VARIANTS = {"legacy": (False, 0, 0), "flat": (False, 0, 8), "packed": (True, 0, 8),
                   "packedR2": (True, 0, 8, 2), "packedR4": (True, 0, 8, 4), "packedR8": (True, 0, 8, 8),
                   "split128": (True, 128, 4), "split256": (True, 256, 8), "split512": (True, 512, 16)}
SELECT_DEFAULT = "packed"


def select_from_block_scores(scores: torch.Tensor, pos: torch.Tensor, block_size: int, topk: int,
                             higher_id: bool = True, variant: str | None = None) -> torch.Tensor:
    """Top-k of whole block-score rows: scores fp32 [B, Q, Hi, NB] contiguous (forced blocks applied, -inf past
    the valid blocks, NaN allowed), or [B, Q, Hi, NB, P] holding P partial maxima per block (the block score is
    their max, NaN winning); pos int32 [B, Q] query positions (-1 = padding row) -> int32 [B, Q, Hi, topk]:
    ids in rank order (NaN ranked as -1e30, ties by the rule), only among the row's pos // block_size + 1 valid
    blocks, -1 padded. The same selection as kvtool.indexer.select_topk. variant: a SELECT_VARIANTS name (launch
    shape only; every variant selects the same ids)."""
    if scores.dim() not in (4, 5) or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise KernelArgumentError(f"select_from_block_scores: scores must be contiguous fp32 [B, Q, Hi, NB(, P)], "
                                  f"got {scores.dtype} {list(scores.shape)}")
    bsz, nq, hi, nb = scores.shape[:4]
    parts = scores.shape[4] if scores.dim() == 5 else 1
    if tuple(pos.shape) != (bsz, nq) or pos.dtype != torch.int32 or not pos.is_contiguous():
        raise KernelArgumentError(f"select_from_block_scores: pos must be contiguous int32 [{bsz}, {nq}], got "
                                  f"{pos.dtype} {list(pos.shape)}")
    if nb > MAX_SELECT_BLOCKS:
        raise KernelArgumentError(f"select_from_block_scores: at most {MAX_SELECT_BLOCKS} blocks per row, got {nb}")
    variant = variant or SELECT_DEFAULT
    if variant not in SELECT_VARIANTS:
        raise KernelArgumentError(f"select_from_block_scores: unknown variant {variant!r} "
                                  f"(known: {sorted(SELECT_VARIANTS)})")
    rows = bsz * nq * hi
    out = torch.empty(bsz, nq, hi, topk, dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    packed, seg, per_thread, *more = SELECT_VARIANTS[variant]
    per_program = more[0] if more else 1
    nc = triton.next_power_of_2(max(nb, 2))
    if variant == "legacy":
        per = max(1, min(16, 4096 // nc))
        per = 1 << (per.bit_length() - 1)
        _select_kernel[(triton.cdiv(rows, per),)](scores, pos, out, rows, hi, nb, block_size, NC=nc, TOPK=topk,
                                                  ROWS=per, HIGHER_ID=higher_id, PACKED=False, SPLIT=False,
                                                  PARTS=parts, num_warps=4 if nc <= 2048 else 8)
        return out
    if seg == 0 or nc <= seg:
        # `per_program` rows per program (default one), `per_thread` elements per thread (at most 8 warps)
        warps = max(1, min(8, per_program * nc // (32 * per_thread)))
        _select_kernel[(triton.cdiv(rows, per_program), 1)](
            scores, pos, out, rows, hi, nb, block_size, NC=nc, TOPK=topk, ROWS=per_program, HIGHER_ID=higher_id,
            PACKED=packed, SPLIT=False, PARTS=parts, num_warps=warps)
        return out
    # two levels: each program (row, segment) keeps its segment's packed top-k (one warp per segment: shuffle-only
    # reductions), then one program per row picks from those (exact: see the module docstring)
    n_seg = triton.cdiv(nb, seg)
    cand = torch.empty(rows, n_seg * topk, dtype=torch.int64, device=scores.device)
    _select_kernel[(rows, n_seg)](scores, pos, cand, rows, hi, nb, block_size, NC=seg, TOPK=topk, ROWS=1,
                                  HIGHER_ID=higher_id, PACKED=True, SPLIT=True, PARTS=parts, num_warps=1)
    ncand = triton.next_power_of_2(n_seg * topk)
    _merge_packed_kernel[(rows,)](cand, out, n_seg * topk, NC=ncand, TOPK=topk, HIGHER_ID=higher_id,
                                  num_warps=max(1, min(8, ncand // 256)))
    return out


def merge_candidates(keys: torch.Tensor, ids: torch.Tensor, topk: int, higher_id: bool = True) -> torch.Tensor:
    """keys fp32 [..., N] and ids int32 [..., N] (-1 = no candidate; each row's ids unique) -> int32 [..., topk]: the
    top-`topk` ids by (key descending, id by the tie rule), -1 where fewer candidates exist."""
    if keys.shape != ids.shape or keys.dtype != torch.float32 or ids.dtype != torch.int32:
        raise KernelArgumentError(f"merge_candidates: keys fp32 and ids int32 of one shape, got "
                                  f"{keys.dtype} {list(keys.shape)}, {ids.dtype} {list(ids.shape)}")
    lead, n = keys.shape[:-1], keys.shape[-1]
    keys, ids = keys.reshape(-1, n).contiguous(), ids.reshape(-1, n).contiguous()
    rows = keys.shape[0]
    out = torch.empty(rows, topk, dtype=torch.int32, device=keys.device)
    if rows == 0:
        return out.reshape(*lead, topk)
    nc = triton.next_power_of_2(max(n, 2))
    per = max(1, min(16, 4096 // nc))
    per = 1 << (per.bit_length() - 1)
    _merge_kernel[(triton.cdiv(rows, per),)](keys, ids, out, rows, NC_IN=n, NC=nc, TOPK=topk, ROWS=per,
                                            HIGHER_ID=higher_id, num_warps=4)
    return out.reshape(*lead, topk)
