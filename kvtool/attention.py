"""The M3 sparse attention reference (SPEC section 3) in plain torch, and the same over paged, quantized caches.

`sparse_attention_ref` is the contract the Triton kernels (`kvtool.kernels.sparse_attn`) must equal up to fp32
accumulation order: for each KV head and each query head of its GQA group, softmax(q . K_sel^T * scale) V_sel over the
tokens of the selected blocks, causal (token s visible to the query at position p when s <= p, which is the "causal
inside its own block" rule, since blocks wholly after p are never selected by the indexer and are masked if they are).
Everything is computed in fp32 whatever the input dtype.

Edge rules (shared with the kernels and tested on both):
- A query whose selection holds no visible token (all -1, or only blocks after its position) returns zeros.
- Selected block ids are taken as listed: a block listed twice counts twice (the indexer never lists one twice).
- Non-finite K or V at a VISIBLE selected token is not guarded: the affected query's output becomes NaN (Inf in K gives
  an Inf score, and Inf - Inf = NaN in the softmax; engines behave alike). Non-finite values at tokens that are not
  selected or not visible never leak into the output (they are masked before any arithmetic touches them). The
  quantized caches cannot hold Inf at all: `PagedCache.store` refuses non-finite input (SPEC section 1).
"""

from __future__ import annotations

import math

import torch

from kvtool.backend import resolve_backend, triton_sparse_decode, triton_sparse_prefill
from kvtool.errors import InputError
from kvtool.paged import PagedCache

__all__ = [
    "all_blocks_selection", "dense_attention_ref", "paged_sparse_decode", "paged_sparse_decode_ref",
    "paged_sparse_prefill", "paged_sparse_prefill_ref", "random_block_selection", "sparse_attention_ref"
]

# Gathered K/V elements per chunk of queries (bounds the reference's memory: ~256 MB of fp32 for K plus V).
_CHUNK_ELEMENTS = 32 * 1024 * 1024


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise InputError(f"attention: q must be [Hq, Q, D] and k, v [S, Hkv, D], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    hq, nq, d = q.shape
    s, hkv, dk = k.shape
    if tuple(v.shape) != tuple(k.shape) or dk != d:
        raise InputError(f"attention: k and v must both be [S, Hkv, {d}], got {list(k.shape)} and {list(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise InputError(f"attention: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if q_pos.dim() != 1 or q_pos.shape[0] != nq:
        raise InputError(f"attention: q_pos must be [{nq}], got {list(q_pos.shape)}")
    return hq, nq, d, hkv


def _softmax_weights(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax pieces: scores [..., N] fp32 with -inf where masked -> (p [..., N] unnormalized, l [..., 1]).
    A fully masked row gets p = 0 and l = 0 (not NaN)."""
    m = scores.amax(-1, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    p = torch.exp(scores - m)
    return p, p.sum(-1, keepdim=True)


def _normalize(acc: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """acc / l, with zeros where l == 0 (the no-visible-token rule); a NaN l (an Inf score) stays NaN."""
    empty = l == 0
    return torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, torch.ones_like(l), l))


def sparse_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         block_ids: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """Sparse GQA attention over selected blocks, in fp32.

    q [Hq, Q, D], k / v [S, Hkv, D] (any float dtype), q_pos [Q] int (absolute position of each query; token s is
    visible when s <= q_pos), block_ids [Hkv, Q, topk] int (ids of `block_size`-token blocks, -1 padded), scale
    default 1/sqrt(D). Query head h uses KV head h // (Hq / Hkv). Returns fp32 [Hq, Q, D]; a query whose selection
    holds no visible token returns zeros (see the module docstring for the other edge rules)."""
    hq, nq, d, hkv = _check_qkv(q, k, v, q_pos)
    if block_ids.dim() != 3 or tuple(block_ids.shape[:2]) != (hkv, nq):
        raise InputError(f"attention: block_ids must be [{hkv}, {nq}, topk], got {list(block_ids.shape)}")
    if block_size <= 0:
        raise InputError(f"attention: block_size must be positive, got {block_size}")
    if block_ids.numel() and int(block_ids.min()) < -1:
        raise InputError(f"attention: block ids must be >= -1, got {int(block_ids.min())}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s_len, g, topk = k.shape[0], hq // hkv, block_ids.shape[2]
    device = q.device
    out = torch.zeros(hq, nq, d, dtype=torch.float32, device=device)
    if nq == 0 or topk == 0 or s_len == 0:
        return out
    kh = k.to(device).float().permute(1, 0, 2)  # [Hkv, S, D]
    vh = v.to(device).float().permute(1, 0, 2)
    pos = q_pos.to(device).long()
    ids = block_ids.to(device).long()
    offs = torch.arange(block_size, device=device)
    heads = torch.arange(hkv, device=device)[:, None, None]
    chunk = max(1, _CHUNK_ELEMENTS // (hkv * topk * block_size * d))
    for c0 in range(0, nq, chunk):
        c1 = min(nq, c0 + chunk)
        bid = ids[:, c0:c1]  # [Hkv, C, topk]
        tok = (bid[..., None] * block_size + offs).flatten(2)  # [Hkv, C, N]
        valid = (bid[..., None] >= 0).expand(-1, -1, -1, block_size).flatten(2)
        valid = valid & (tok <= pos[c0:c1, None]) & (tok < s_len)
        tok = torch.where(valid, tok, torch.zeros_like(tok))
        ksel = kh[heads, tok].masked_fill(~valid[..., None], 0.0)  # [Hkv, C, N, D]
        vsel = vh[heads, tok].masked_fill(~valid[..., None], 0.0)
        qg = q[:, c0:c1].to(device).float().reshape(hkv, g, c1 - c0, d)  # [Hkv, G, C, D]
        scores = torch.einsum("hgcd,hcnd->hgcn", qg, ksel) * scale
        p, l = _softmax_weights(scores.masked_fill(~valid[:, None], -math.inf))  # p [Hkv, G, C, N]
        acc = torch.einsum("hgcn,hcnd->hgcd", p, vsel)
        out[:, c0:c1] = _normalize(acc, l).reshape(hq, c1 - c0, d)
    return out


def dense_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """Plain causal GQA attention (the dense layers, and the non-sparse mode), in fp32.

    q [Hq, Q, D], k / v [S, Hkv, D], q_pos [Q] int (token s visible when s <= q_pos), scale default 1/sqrt(D).
    Returns fp32 [Hq, Q, D]; a query that sees no token (q_pos < 0) returns zeros. Equals `sparse_attention_ref` with
    every block selected."""
    hq, nq, d, hkv = _check_qkv(q, k, v, q_pos)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s_len, g = k.shape[0], hq // hkv
    device = q.device
    out = torch.zeros(hq, nq, d, dtype=torch.float32, device=device)
    if nq == 0 or s_len == 0:
        return out
    kh = k.to(device).float().permute(1, 0, 2)  # [Hkv, S, D]
    vh = v.to(device).float().permute(1, 0, 2)
    pos = q_pos.to(device).long()
    tok = torch.arange(s_len, device=device)
    finite_v = bool(torch.isfinite(vh).all())
    chunk = max(1, _CHUNK_ELEMENTS // (hq * s_len))
    for c0 in range(0, nq, chunk):
        c1 = min(nq, c0 + chunk)
        qg = q[:, c0:c1].to(device).float().reshape(hkv, g, c1 - c0, d)
        scores = torch.einsum("hgcd,hsd->hgcs", qg, kh) * scale  # [Hkv, G, C, S]
        visible = tok[None, :] <= pos[c0:c1, None]  # [C, S]
        p, l = _softmax_weights(scores.masked_fill(~visible, -math.inf))  # p [Hkv, G, C, S]
        acc = p @ vh[:, None]  # [Hkv, G, C, D]
        if not finite_v:  # 0 * Inf = NaN: recompute each query over its visible tokens only
            for c in range(c1 - c0):
                n = int(pos[c0 + c].clamp(min=-1, max=s_len - 1)) + 1
                acc[:, :, c] = p[:, :, c, :n] @ vh[:, :n]
        out[:, c0:c1] = _normalize(acc, l).reshape(hq, c1 - c0, d)
    return out


def all_blocks_selection(q_pos: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Block ids [Hkv, Q, max_blocks] int32 that select every block up to each query's own (-1 padded): dense causal
    attention expressed as a selection, so the sparse kernels also serve the dense layers."""
    pos = q_pos.long()
    nblocks = int(pos.max()) // block_size + 1 if pos.numel() else 1
    ids = torch.arange(nblocks, device=pos.device)[None, :].expand(pos.shape[0], -1)
    ids = torch.where(ids <= (pos // block_size)[:, None], ids, torch.full_like(ids, -1))
    return ids[None].expand(num_kv_heads, -1, -1).to(torch.int32).contiguous()


# ------------------------------------------------------------------------------------------ over paged caches (torch)
def _request_kv(k_cache: PagedCache, v_cache: PagedCache, block_table: torch.Tensor, req: int, length: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K, V [length, Hkv, D] fp32 of one request's first `length` tokens."""
    p = k_cache.page_size
    tok = torch.arange(length, device=block_table.device)
    pages = block_table[req].long()[tok // p] if length else tok
    if length and int(pages.min()) < 0:
        raise InputError(f"request {req}: a block-table entry below its context length is -1")
    slots = pages * p + tok % p
    return k_cache.dequantize(slots).to(device), v_cache.dequantize(slots).to(device)


def paged_sparse_prefill_ref(q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, block_table: torch.Tensor,
                             q_req: torch.Tensor, q_pos: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                             scale: float | None = None) -> torch.Tensor:
    """The torch path of `kvtool.kernels.sparse_attn.sparse_prefill`: each request's tokens dequantized from the paged
    caches, then `sparse_attention_ref`. q [N, Hq, D]; q_req, q_pos [N] int; block_ids [N, Hkv, topk]; block_table
    [B, max_pages]. Returns fp32 [N, Hq, D]."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    req_ids, pos = q_req.long().cpu(), q_pos.long().cpu()
    for r in torch.unique(req_ids).tolist():
        rows = torch.nonzero(req_ids == r).squeeze(1)
        length = int(pos[rows].max()) + 1
        k, v = _request_kv(k_cache, v_cache, block_table, r, max(length, 0), q.device)
        rows_d = rows.to(q.device)
        res = sparse_attention_ref(q[rows_d].transpose(0, 1), k, v, pos[rows].to(q.device),
                                   block_ids[rows_d].transpose(0, 1), block_size, scale)
        out[rows_d] = res.transpose(0, 1)
    return out


def paged_sparse_decode_ref(q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, block_table: torch.Tensor,
                            context_lens: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                            scale: float | None = None) -> torch.Tensor:
    """The torch path of `kvtool.kernels.sparse_attn.sparse_decode` (same arguments): one query per request at
    position context_lens[b] - 1. Returns fp32 [B, Hq, D]."""
    b = q.shape[0]
    req = torch.arange(b, device=q.device)
    return paged_sparse_prefill_ref(q, k_cache, v_cache, block_table, req, context_lens.to(q.device).long() - 1,
                                    block_ids, block_size, scale)


def paged_sparse_decode(q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, block_table: torch.Tensor,
                        context_lens: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                        scale: float | None = None, backend: str = "auto", **kernel_options) -> torch.Tensor:
    """Decode-step sparse attention with the backend resolved in one place: Triton (`backend.triton_sparse_decode`,
    bf16 out) or the torch path (`paged_sparse_decode_ref`, fp32 out). Shapes as in
    `kvtool.kernels.sparse_attn.sparse_decode`."""
    if resolve_backend(backend, q.device) == "torch":
        return paged_sparse_decode_ref(q, k_cache, v_cache, block_table, context_lens, block_ids, block_size, scale)
    return triton_sparse_decode(q, k_cache, v_cache, block_table, context_lens, block_ids, block_size, scale,
                                **kernel_options)


def paged_sparse_prefill(q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, block_table: torch.Tensor,
                         q_req: torch.Tensor, q_pos: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                         scale: float | None = None, backend: str = "auto", **kernel_options) -> torch.Tensor:
    """Prefill sparse attention, backend resolved as in `paged_sparse_decode`."""
    if resolve_backend(backend, q.device) == "torch":
        return paged_sparse_prefill_ref(q, k_cache, v_cache, block_table, q_req, q_pos, block_ids, block_size, scale)
    return triton_sparse_prefill(q, k_cache, v_cache, block_table, q_req, q_pos, block_ids, block_size, scale,
                                 **kernel_options)


def random_block_selection(q_pos: torch.Tensor, block_size: int, topk: int, num_kv_heads: int,
                           gen: torch.Generator | None = None, holes: bool = False) -> torch.Tensor:
    """Random selections for tests and synthetic runs: block ids [Hkv, Q, topk] int32. Each (head, query) gets
    min(topk, valid_blocks) distinct blocks among its valid ones (valid_blocks = q_pos // block_size + 1), always
    including its own, possibly partial, block (the M3 local block), in random order, -1 padded at the end; with
    `holes` the -1 entries are shuffled in among the ids too (kernels must not assume trailing padding)."""
    pos = q_pos.detach().cpu().long()
    nq = pos.shape[0]
    nb = int(pos.max()) // block_size + 1 if nq else 1
    valid = pos // block_size + 1  # [Q]
    keys = torch.rand(num_kv_heads, nq, nb, generator=gen)
    blocks = torch.arange(nb)
    keys = torch.where(blocks[None, None, :] < valid[None, :, None], keys, torch.full_like(keys, -1.0))
    keys = torch.where(blocks[None, None, :] == (valid - 1)[None, :, None], torch.full_like(keys, 2.0), keys)
    width = min(topk, nb)
    top = torch.topk(keys, width, dim=-1)
    ids = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, -1))
    if width < topk:
        ids = torch.cat([ids, torch.full((num_kv_heads, nq, topk - width), -1, dtype=ids.dtype)], -1)
    # random order of the chosen ids (own block not always first); -1 stays at the end unless `holes`
    order_keys = torch.rand(ids.shape, generator=gen) + torch.where(ids < 0, 0.0 if holes else 2.0, 0.0)
    ids = torch.gather(ids, -1, torch.argsort(order_keys, dim=-1))
    return ids.to(torch.int32).to(q_pos.device)
