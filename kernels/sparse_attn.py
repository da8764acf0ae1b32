"""Sparse GQA attention over paged, quantized K/V (the M3 decode and prefill attention, SPEC section 3), in Triton.

One program handles one query row (a decode step of one request, or one prefill query), one KV head and one split of
that row's selected tokens. The G query heads of the KV head share every K/V tile it loads: the scores are a
[G, D] x [D, T] dot and the output a [G, T] x [T, D] dot (G padded to 16 for the tensor cores), with an online softmax
in fp32. The selected tokens are walked tile by tile (T tokens of one page): tile i is sub-tile i % (block_size / T) of
selected block i // (block_size / T). When rows x KV heads are too few to fill the GPU, the tiles are split among
several programs (flash-decoding) that write fp32 partials (acc, max, sum), and a small combine kernel merges them.

Decoding happens in registers, through the shared helpers of `kernels/codecs.py`:
- E2M1 (nvfp4, mxfp4): a packed byte holds elements 2j (low nibble) and 2j+1 (high nibble). The kernel never
  interleaves them: with q split into its even and odd columns, q . k = q_even . k_lo + q_odd . k_hi, and the output
  is kept as two accumulators, P . V_lo (even output columns) and P . V_hi (odd ones), interleaved once at the end
  (`tl.join`). Block scales multiply the decoded codes per 16 (E4M3) or 32 (E8M0) elements: code * scale is exact in
  bf16 (at most 5 significant bits), so the bf16 tensor-core dots see the dequantized values exactly.
- E4M3 (fp8): `e4m3_decode` by bits (portable, tested), or the hardware fp8 conversion behind `native_fp8`
  (CUDA capability >= 8.9 only). Per-token fp32 scales multiply score columns (K) and probability columns (V).
- Whole-tensor scalars (fp8 `tensor` scale, nvfp4 outer scale g_dec) fold into the softmax scale (K) and the final
  normalization (V): one multiply per row instead of one per element.
- P . V: P is split into bf16 hi + lo parts (two dots), so the probabilities keep ~16 bits instead of bf16's 8 and the
  kernel stays within accumulation noise of the fp32 reference (verify-attn goal: max_rel <= 2e-3).
Under the Triton interpreter the dots run in fp32 (bf16 dots give garbage there); the operands are the same values.

Masking: tokens after the query position, tiles of -1 selection slots and pages that are -1 are never loaded (masked
loads give 0, then the score is -inf), so stale or non-finite bytes outside the selection never leak into the output.
A row with no visible token returns zeros. Non-finite values at visible tokens (only a bf16 cache can hold them) give
NaN for the affected query heads, as the reference does (see kvtool.attention).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvtool.errors import KernelArgumentError
from kvtool.kernels import codecs as kc
from kvtool.paged import PagedCache

# Element and scale kinds (constexpr codes). The launcher maps Format fields onto them (formats are data).
ELEM_BF16 = tl.constexpr(0)
ELEM_E4M3 = tl.constexpr(1)
ELEM_E2M1 = tl.constexpr(2)
SCALE_NONE = tl.constexpr(0)  # no per-token scale (a whole-tensor scale, if any, is a folded scalar)
SCALE_ROW = tl.constexpr(1)  # one fp32 per (token, head)
SCALE_E4M3 = tl.constexpr(2)  # one E4M3 byte per BLOCK elements
SCALE_E8M0 = tl.constexpr(3)  # one E8M0 byte per BLOCK elements

_ELEMENT_CODE = {"bf16": 0, "e4m3": 1, "e2m1": 2}
_SCALE_CODE = {"none": 0, "fp32-tensor": 0, "fp32-row": 1, "e4m3": 2, "e8m0": 3}
LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------------- tile decoding
@triton.jit
def _dot_operand(x, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        return x.to(tl.float32)
    return x.to(tl.bfloat16)


@triton.jit
def _decode_e4m3(b, NATIVE_FP8: tl.constexpr):
    if NATIVE_FP8:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return kc.e4m3_decode(b)


@triton.jit
def _tile_plain(ptr, base, off, valid, D: tl.constexpr, ELEM: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """bf16 / e4m3 payload tile -> fp32 [T, D] (masked tokens 0). `ptr` is typed like the payload (bf16 or uint8);
    `base` is the byte offset of the (page, head) slab."""
    cols = tl.arange(0, D)
    if ELEM == ELEM_BF16:
        x = tl.load(ptr + base // 2 + off[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        return x.to(tl.float32)
    b = tl.load(ptr + base + off[:, None] * D + cols[None, :], mask=valid[:, None], other=0)
    return _decode_e4m3(b, NATIVE_FP8)


@triton.jit
def _tile_packed(ptr, base, off, valid, P: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                 BLOCK: tl.constexpr, T: tl.constexpr):
    """E2M1 payload tile with its block scales -> (lo, hi) fp32 [T, D/2]: the dequantized even and odd elements."""
    D2: tl.constexpr = D // 2
    NB: tl.constexpr = D // BLOCK
    b = tl.load(ptr + base + off[:, None] * D2 + tl.arange(0, D2)[None, :], mask=valid[:, None], other=0)
    sb = tl.load(ptr + base + P * D2 + off[:, None] * NB + tl.arange(0, NB)[None, :], mask=valid[:, None], other=0)
    if SCALE == SCALE_E4M3:
        s = kc.e4m3_decode(sb)
    else:
        s = kc.e8m0_decode(sb)
    s = s[:, :, None]  # [T, NB, 1]: element 2j (and 2j+1) belongs to block j // (BLOCK / 2)
    lo = tl.reshape(tl.reshape(kc.e2m1_decode_f32(b), [T, NB, BLOCK // 2]) * s, [T, D2])
    hi = tl.reshape(tl.reshape(kc.e2m1_decode_f32(b >> 4), [T, NB, BLOCK // 2]) * s, [T, D2])
    return lo, hi


@triton.jit
def _row_scale(ptr, base, off, valid, P: tl.constexpr, PB: tl.constexpr):
    """fp32 per-token scales [T] stored after the P payloads of the slab (masked tokens 1)."""
    sp = (ptr + base + P * PB).to(tl.pointer_type(tl.float32))
    return tl.load(sp + off, mask=valid, other=1.0)


@triton.jit
def _split_p(p, FP32_DOT: tl.constexpr):
    """fp32 probabilities -> (hi, lo) dot operands with hi + lo = p to ~16 bits."""
    hi = p.to(tl.bfloat16)
    lo = (p - hi.to(tl.float32)).to(tl.bfloat16)
    return _dot_operand(hi, FP32_DOT), _dot_operand(lo, FP32_DOT)


# ---------------------------------------------------------------------------------------------------- main kernel
@triton.jit
def _sparse_attn_kernel(
    q_ptr, k_ptr, v_ptr,  # q bf16 [R, Hq, D]; K / V cache data (bf16 view for bf16, else uint8) [pages, Hkv, bytes]
    out_ptr, part_ptr, ml_ptr,  # out bf16 or fp32 [R, Hq, D]; split partials: acc fp32 [R, Hq, S, D], (m, l) fp32 [R, Hq, S, 2]
    table_ptr, ctx_ptr, req_ptr, pos_ptr, ids_ptr,  # block_table int32 [B, W]; context_lens [B]; rows' request/pos [R]; ids [R, Hkv, topk]
    qk_scale, v_scalar,  # softmax scale * log2(e) * K's folded scalar; V's folded scalar
    stride_qr, stride_qh,  # q strides (elements)
    stride_kp, stride_kh, stride_vp, stride_vh,  # cache strides in BYTES (page, head)
    stride_tb, stride_ir, stride_ih,  # block-table row stride; selection strides (row, head)
    topk,  # selection width
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,  # query heads per KV head (padded), head dim
    P: tl.constexpr, BS: tl.constexpr, T: tl.constexpr,  # page size, selection block size, tokens per tile
    ELEM: tl.constexpr, SCALE: tl.constexpr, QBLOCK: tl.constexpr,  # element kind, scale kind, elements per scale
    PB: tl.constexpr,  # payload bytes per token and head
    TILES: tl.constexpr,  # tiles each split walks (constexpr: the interpreter cannot loop to a runtime bound)
    DECODE: tl.constexpr,  # rows are requests (pos = context_len - 1); else rows read req_ptr / pos_ptr
    SPLIT: tl.constexpr,  # write partials for the combine kernel instead of the output
    NATIVE_FP8: tl.constexpr, FP32_DOT: tl.constexpr,  # hardware fp8 -> fp32; fp32 dots (the interpreter)
    P_SPLIT: tl.constexpr,  # P as bf16 hi + lo (two dots) instead of one bf16 rounding
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if DECODE:
        req = row
        pos = tl.load(ctx_ptr + row) - 1
    else:
        req = tl.load(req_ptr + row)
        pos = tl.load(pos_ptr + row)
    PACKED: tl.constexpr = ELEM == ELEM_E2M1
    D2: tl.constexpr = D // 2
    TPB: tl.constexpr = BS // T

    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    q_rows = q_ptr + row.to(tl.int64) * stride_qr + (h * G + g)[:, None] * stride_qh
    if PACKED:
        j = tl.arange(0, D2)
        q_a = _dot_operand(tl.load(q_rows + 2 * j[None, :], mask=gmask[:, None], other=0.0), FP32_DOT)
        q_b = _dot_operand(tl.load(q_rows + 2 * j[None, :] + 1, mask=gmask[:, None], other=0.0), FP32_DOT)
        acc_a = tl.zeros([BLOCK_G, D2], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_G, D2], dtype=tl.float32)
    else:
        q_a = _dot_operand(tl.load(q_rows + tl.arange(0, D)[None, :], mask=gmask[:, None], other=0.0), FP32_DOT)
        acc_a = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)

    t_begin = split * TILES
    ids_row = ids_ptr + row.to(tl.int64) * stride_ir + h * stride_ih
    tile = tl.arange(0, T)
    for it in range(TILES):  # the last split may run past the end: masked
        i = t_begin + it
        bid = tl.load(ids_row + i // TPB, mask=i < topk * TPB, other=-1)
        s0 = bid * BS + (i % TPB) * T  # first token of the tile (all T tokens share one page: T divides P)
        live = (bid >= 0) & (s0 <= pos)
        page = tl.load(table_ptr + req.to(tl.int64) * stride_tb + s0 // P, mask=live, other=-1)
        live = live & (page >= 0)
        valid = live & (s0 + tile <= pos)
        off = s0 % P + tile
        page64 = tl.maximum(page, 0).to(tl.int64)
        k_base = page64 * stride_kp + h * stride_kh
        v_base = page64 * stride_vp + h * stride_vh

        # scores [BLOCK_G, T] in the log2 domain
        if PACKED:
            k_lo, k_hi = _tile_packed(k_ptr, k_base, off, valid, P, D, SCALE, QBLOCK, T)
            qk = tl.dot(q_a, tl.trans(_dot_operand(k_lo, FP32_DOT)))
            qk += tl.dot(q_b, tl.trans(_dot_operand(k_hi, FP32_DOT)))
        else:
            k = _tile_plain(k_ptr, k_base, off, valid, D, ELEM, NATIVE_FP8)
            qk = tl.dot(q_a, tl.trans(_dot_operand(k, FP32_DOT)))
        if SCALE == SCALE_ROW:
            qk = qk * _row_scale(k_ptr, k_base, off, valid, P, PB)[None, :]
        s = tl.where(valid[None, :], qk * qk_scale, -float("inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing visible yet: keep exp2 away from -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if SCALE == SCALE_ROW:
            p = p * _row_scale(v_ptr, v_base, off, valid, P, PB)[None, :]
        if P_SPLIT:
            p_hi, p_lo = _split_p(p, FP32_DOT)
        else:  # P rounded once to bf16 (faster, ~2^-9 relative per probability)
            p_hi = _dot_operand(p.to(tl.bfloat16), FP32_DOT)
        if PACKED:
            v_lo, v_hi = _tile_packed(v_ptr, v_base, off, valid, P, D, SCALE, QBLOCK, T)
            v_lo = _dot_operand(v_lo, FP32_DOT)
            v_hi = _dot_operand(v_hi, FP32_DOT)
            acc_a = tl.dot(p_hi, v_lo, acc_a * alpha[:, None])
            acc_b = tl.dot(p_hi, v_hi, acc_b * alpha[:, None])
            if P_SPLIT:
                acc_a = tl.dot(p_lo, v_lo, acc_a)
                acc_b = tl.dot(p_lo, v_hi, acc_b)
        else:
            v = _dot_operand(_tile_plain(v_ptr, v_base, off, valid, D, ELEM, NATIVE_FP8), FP32_DOT)
            acc_a = tl.dot(p_hi, v, acc_a * alpha[:, None])
            if P_SPLIT:
                acc_a = tl.dot(p_lo, v, acc_a)

    if PACKED:
        acc = tl.reshape(tl.join(acc_a, acc_b), [BLOCK_G, D])  # even / odd columns back to natural order
    else:
        acc = acc_a
    heads = row.to(tl.int64) * G * (tl.num_programs(1)) + h * G + g  # flat (row, query head) index
    cols = tl.arange(0, D)
    if SPLIT:
        slot = heads * num_splits + split
        tl.store(part_ptr + slot[:, None] * D + cols[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + slot * 2, m_i, mask=gmask)
        tl.store(ml_ptr + slot * 2 + 1, l_i, mask=gmask)
    else:
        empty = l_i == 0.0  # nothing visible: zeros (a NaN sum, from an Inf score, stays NaN)
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None]) * v_scalar
        tl.store(out_ptr + heads[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _combine_kernel(
    part_ptr, ml_ptr, out_ptr,  # partial acc fp32 [N, S, D], (m, l) fp32 [N, S, 2]; out bf16 / fp32 [N, D] (N = R * Hq)
    v_scalar,  # V's folded whole-tensor scalar
    num_splits,
    BLOCK_S: tl.constexpr, D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < num_splits
    m = tl.load(ml_ptr + (n * num_splits + sp) * 2, mask=smask, other=-float("inf"))
    l = tl.load(ml_ptr + (n * num_splits + sp) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == -float("inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # a split that saw nothing has m = -inf: weight 0
    w = tl.where(smask, w, 0.0)
    cols = tl.arange(0, D)
    acc = tl.load(part_ptr + (n * num_splits + sp)[:, None] * D + cols[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0)
    empty = total == 0.0
    out = tl.where(empty, 0.0, o / tl.where(empty, 1.0, total)) * v_scalar
    tl.store(out_ptr + n * D + cols, out.to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------------------------------------------------ launchers
def _scalar_of(cache: PagedCache, name: str) -> float:
    """The whole-tensor factor a cache's dequantized values carry (fp8 `tensor` scale, nvfp4 g_dec; else 1)."""
    if cache.fmt.scale_element == "fp32-tensor":
        if cache.tensor_amax is None:
            raise KernelArgumentError(f"{name}: an fp8 tensor-scaled cache without tensor_amax (nothing stored yet)")
        return cache.fp8_tensor_scale()
    return float(cache.outer_scale())


def _check_caches(k_cache: PagedCache, v_cache: PagedCache, q: torch.Tensor, hq: int, d: int, block_size: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, PagedCache):
            raise KernelArgumentError(f"{name} must be a kvtool.paged.PagedCache, got {type(c).__name__}")
        if c.data.device != q.device or c.data.dtype != torch.uint8 or not c.data.is_contiguous():
            raise KernelArgumentError(f"{name}: data must be contiguous uint8 on {q.device}")
        if c.head_dim != d:
            raise KernelArgumentError(f"{name}: head dim {c.head_dim} differs from q's {d}")
    if k_cache.fmt != v_cache.fmt or k_cache.page_size != v_cache.page_size or k_cache.num_heads != v_cache.num_heads:
        raise KernelArgumentError("k_cache and v_cache must share format, page size and head count")
    if hq % k_cache.num_heads:
        raise KernelArgumentError(f"query heads ({hq}) must be a multiple of KV heads ({k_cache.num_heads})")
    if block_size < 1 or block_size % k_cache.page_size:
        raise KernelArgumentError(f"block_size ({block_size}) must be a multiple of the page size "
                                  f"({k_cache.page_size})")


def _check_int(name: str, t: torch.Tensor, shape: tuple, device) -> None:
    if t.dtype != torch.int32 or t.device != device or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise KernelArgumentError(f"{name} must be a contiguous int32 tensor of shape {list(shape)} on {device}, "
                                  f"got {t.dtype} {list(t.shape)} on {t.device}")


def launch_plan(rows: int, num_kv_heads: int, topk: int, block_size: int, page_size: int, device: torch.device,
                num_splits: int | None = None, tile_tokens: int | None = None) -> tuple[int, int, int]:
    """(tokens per tile, splits, tiles per split) the launchers use. Default splits: about two programs per SM
    (rows x KV heads x splits), never more than the tiles; 1 off the GPU. Default tile: 64 tokens
    on the GPU, whole pages (up to 128) in the interpreter, which pays per operation rather than per element."""
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    t = min(tile_tokens or (128 if interp else 64), page_size)
    if page_size % t or (t < 16 and not interp):
        raise KernelArgumentError(f"a tile of {t} tokens must divide the page size {page_size} and be >= 16")
    n_tiles = topk * (block_size // t)
    if num_splits is None:
        splits = 1
        if torch.device(device).type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = max(1, min(n_tiles, math.ceil(2 * sms / max(1, rows * num_kv_heads))))
    else:
        splits = int(num_splits)
    if splits < 1:
        raise KernelArgumentError(f"num_splits must be >= 1, got {splits}")
    per = max(1, math.ceil(n_tiles / splits))
    return t, max(1, math.ceil(n_tiles / per)), per  # no empty trailing splits


def _launch(q, k_cache, v_cache, block_table, block_ids, block_size, scale, num_splits, decode, ctx, req, pos,
            tile_tokens, num_warps, num_stages, native_fp8, out_dtype, precise_p):
    rows, hq, d = q.shape
    hkv, topk = k_cache.num_heads, block_ids.shape[-1]
    fmt = k_cache.fmt
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if native_fp8 is None:
        native_fp8 = q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) >= (8, 9)
    t, splits, tiles_per_split = launch_plan(rows, hkv, topk, block_size, k_cache.page_size, q.device, num_splits,
                                             tile_tokens)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qk_scale = scale * LOG2E * _scalar_of(k_cache, "k_cache")
    v_scalar = _scalar_of(v_cache, "v_cache")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise KernelArgumentError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    out = torch.empty(rows, hq, d, dtype=out_dtype, device=q.device)
    if rows == 0:
        return out
    if splits > 1:
        part = torch.empty(rows * hq * splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(rows * hq * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    payload_view = torch.bfloat16 if fmt.element is None else torch.uint8
    k_data, v_data = k_cache.data.view(payload_view), v_cache.data.view(payload_view)
    g = hq // hkv
    grid = (rows, hkv, splits)
    _sparse_attn_kernel[grid](
        q, k_data, v_data, out, part, ml,
        block_table, ctx, req, pos, block_ids,
        qk_scale, v_scalar,
        q.stride(0), q.stride(1),
        k_cache.data.stride(0), k_cache.data.stride(1), v_cache.data.stride(0), v_cache.data.stride(1),
        block_table.stride(0), block_ids.stride(0), block_ids.stride(1),
        topk,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d,
        P=k_cache.page_size, BS=block_size, T=t,
        ELEM=_ELEMENT_CODE[fmt.element.name if fmt.element else "bf16"], SCALE=_SCALE_CODE[fmt.scale_element],
        QBLOCK=max(fmt.block, 1), PB=fmt.payload_bytes(d), TILES=tiles_per_split,
        DECODE=decode, SPLIT=splits > 1, NATIVE_FP8=bool(native_fp8), FP32_DOT=interp, P_SPLIT=bool(precise_p),
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _combine_kernel[(rows * hq,)](part, ml, out, v_scalar, splits,
                                      BLOCK_S=triton.next_power_of_2(splits), D=d, num_warps=4)
    return out


def _check_q(q: torch.Tensor, name: str = "q") -> None:
    if q.dim() != 3 or q.dtype != torch.bfloat16 or q.stride(-1) != 1:
        raise KernelArgumentError(f"{name} must be bf16 [rows, Hq, D] with a contiguous last dim, got {q.dtype} "
                                  f"{list(q.shape)}")
    if q.shape[-1] % 32 or triton.next_power_of_2(q.shape[-1]) != q.shape[-1]:
        raise KernelArgumentError(f"head dim must be a power of two >= 32, got {q.shape[-1]}")


def sparse_decode(q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, block_table: torch.Tensor,
                  context_lens: torch.Tensor, block_ids: torch.Tensor, block_size: int, scale: float | None = None,
                  num_splits: int | None = None, *, tile_tokens: int | None = None, num_warps: int = 4,
                  num_stages: int = 2, native_fp8: bool | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, precise_p: bool = True) -> torch.Tensor:
    """One decode step of sparse attention for B requests.

    q bf16 [B, Hq, D] (the token at position context_lens[b] - 1, already stored in the caches); k_cache / v_cache:
    PagedCache (same format, page size P and Hkv heads) on q's device; block_table int32 [B, max_pages] (-1 padded);
    context_lens int32 [B]; block_ids int32 [B, Hkv, topk] (ids of `block_size`-token blocks, -1 padded; block_size a
    multiple of P); scale default 1/sqrt(D). Query head h reads KV head h // (Hq / Hkv). Returns bf16 [B, Hq, D]
    (zeros for a request whose selection holds no visible token). num_splits: programs per (request, KV head) along
    the selected tokens (default: enough to fill the GPU; > 1 adds the combine kernel). out_dtype torch.float32 skips
    the final bf16 rounding (verification). Keyword options tune the launch (tokens per tile, warps, pipeline stages,
    hardware fp8 conversion; precise_p=False rounds P to bf16 once: one P.V dot instead of two, ~2^-9 relative
    error per probability). No host synchronization, so it can be captured in a CUDA graph."""
    _check_q(q)
    b, hq, d = q.shape
    _check_caches(k_cache, v_cache, q, hq, d, block_size)
    _check_int("block_table", block_table, (b, block_table.shape[-1] if block_table.dim() == 2 else -1), q.device)
    _check_int("context_lens", context_lens, (b,), q.device)
    _check_int("block_ids", block_ids, (b, k_cache.num_heads, block_ids.shape[-1]), q.device)
    return _launch(q, k_cache, v_cache, block_table, block_ids, block_size, scale, num_splits, True, context_lens,
                   context_lens, context_lens, tile_tokens, num_warps, num_stages, native_fp8, out_dtype,
                   precise_p)


def sparse_prefill(q: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, block_table: torch.Tensor,
                   q_req: torch.Tensor, q_pos: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                   scale: float | None = None, num_splits: int | None = None, *, tile_tokens: int | None = None,
                   num_warps: int = 4, num_stages: int = 2, native_fp8: bool | None = None,
                   out_dtype: torch.dtype = torch.bfloat16, precise_p: bool = True) -> torch.Tensor:
    """Sparse attention for N query rows of any requests (prefill, chunked prefill, speculative verify).

    q bf16 [N, Hq, D]; q_req int32 [N] (each row's request: its row of block_table [B, max_pages]); q_pos int32 [N]
    (absolute position: tokens s <= q_pos are visible, so the query's own block is causal); block_ids int32
    [N, Hkv, topk] (each row's own selection, -1 padded). Other arguments as in `sparse_decode`. Returns bf16
    [N, Hq, D]. One program per (row, KV head, split): rows that share blocks re-read them (from L2)."""
    _check_q(q)
    n, hq, d = q.shape
    _check_caches(k_cache, v_cache, q, hq, d, block_size)
    if block_table.dim() != 2:
        raise KernelArgumentError(f"block_table must be [B, max_pages], got {list(block_table.shape)}")
    _check_int("block_table", block_table, tuple(block_table.shape), q.device)
    _check_int("q_req", q_req, (n,), q.device)
    _check_int("q_pos", q_pos, (n,), q.device)
    _check_int("block_ids", block_ids, (n, k_cache.num_heads, block_ids.shape[-1]), q.device)
    return _launch(q, k_cache, v_cache, block_table, block_ids, block_size, scale, num_splits, False, q_pos, q_req,
                   q_pos, tile_tokens, num_warps, num_stages, native_fp8, out_dtype, precise_p)
