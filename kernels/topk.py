"""Top-k block selection for the lightning indexer: the in-register selection step shared by the scorer kernels
(`pick_next`), and the merge kernel that turns per-program candidate lists into the final block ids.

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
