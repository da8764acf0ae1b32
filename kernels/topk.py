"""Top-k block selection for the lightning indexer: the in-register selection step shared by the scorer kernels
(`pick_next`), the merge kernel that turns per-program candidate lists into the final block ids, and the select
kernel that picks them from whole block-score rows (the default two-pass path of kernels/index_score.py).

Order (the same as `kvtool.indexer.select_topk`): rank keys descending (NaN already mapped to -1e30 by the caller,
forced blocks 1e30 / 1e29, -inf allowed), ties broken by block id (higher first for `higher-id`, lower first for
`lower-id`; `any` uses the higher-id order). With that strict total order, the top-k of a union of lists equals the
top-k of the union of each list's top-k, so splitting the context across programs and merging is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.errors import KernelArgumentError

NO_ID = tl.constexpr(-1)  # "no block": padding of the output and of candidate lists
INT32_MAX = tl.constexpr(2147483647)
NAN_RANK = tl.constexpr(-1e30)  # kvtool.indexer.NAN_RANK: the key a NaN block score is ranked by


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
def _select_kernel(
    score_ptr,  # fp32 [rows, NB]: block scores, forced blocks applied (MODE_BLOCKS of kernels/index_score.py)
    pos_ptr,  # int32 [rows // HI]: the query position of each row group (-1 = padding)
    out_ptr,  # int32 [rows, TOPK]: selected ids in rank order, -1 padded
    rows, HI, NB, BS,  # rows, rows per position (index heads), blocks per row, block size
    NC: tl.constexpr,  # NB rounded up to a power of two
    TOPK: tl.constexpr,  # ids per output row
    ROWS: tl.constexpr,  # rows per program
    HIGHER_ID: tl.constexpr,  # tie rule: True = higher id first
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, NC)
    row_ok = r < rows
    pos = tl.load(pos_ptr + r // HI, mask=row_ok, other=-1)
    valid = tl.where(pos >= 0, pos // BS + 1, 0)  # blocks past valid are never selected (-inf ones inside are)
    avail = row_ok[:, None] & (c[None, :] < valid[:, None]) & (c[None, :] < NB)
    keys = tl.load(score_ptr + r[:, None].to(tl.int64) * NB + c[None, :], mask=avail, other=float("-inf"))
    keys = tl.where(keys != keys, NAN_RANK, keys)
    ids = tl.broadcast_to(c[None, :], [ROWS, NC])
    for j in tl.static_range(TOPK):
        _, best_id, avail = pick_next(keys, ids, avail, HIGHER_ID)
        tl.store(out_ptr + r.to(tl.int64) * TOPK + j, best_id, mask=row_ok)


MAX_SELECT_BLOCKS = 16384  # widest block-score row select_from_block_scores takes (2M tokens at 128-token blocks)


def select_from_block_scores(scores: torch.Tensor, pos: torch.Tensor, block_size: int, topk: int,
                             higher_id: bool = True) -> torch.Tensor:
    """Top-k of whole block-score rows: scores fp32 [B, Q, Hi, NB] contiguous (forced blocks applied, -inf past
    the valid blocks, NaN allowed), pos int32 [B, Q] query positions (-1 = padding row) -> int32 [B, Q, Hi, topk]:
    ids in rank order (NaN ranked as -1e30, ties by the rule), only among the row's pos // block_size + 1 valid
    blocks, -1 padded. The same selection as kvtool.indexer.select_topk."""
    if scores.dim() != 4 or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise KernelArgumentError(f"select_from_block_scores: scores must be contiguous fp32 [B, Q, Hi, NB], got "
                                  f"{scores.dtype} {list(scores.shape)}")
    bsz, nq, hi, nb = scores.shape
    if tuple(pos.shape) != (bsz, nq) or pos.dtype != torch.int32 or not pos.is_contiguous():
        raise KernelArgumentError(f"select_from_block_scores: pos must be contiguous int32 [{bsz}, {nq}], got "
                                  f"{pos.dtype} {list(pos.shape)}")
    if nb > MAX_SELECT_BLOCKS:
        raise KernelArgumentError(f"select_from_block_scores: at most {MAX_SELECT_BLOCKS} blocks per row, got {nb}")
    rows = bsz * nq * hi
    out = torch.empty(bsz, nq, hi, topk, dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    nc = triton.next_power_of_2(max(nb, 2))
    per = max(1, min(16, 4096 // nc))
    per = 1 << (per.bit_length() - 1)
    _select_kernel[(triton.cdiv(rows, per),)](scores, pos, out, rows, hi, nb, block_size, NC=nc, TOPK=topk,
                                              ROWS=per, HIGHER_ID=higher_id, num_warps=4 if nc <= 2048 else 8)
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
