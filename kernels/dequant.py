"""Dequantize: one Triton kernel that decodes rows of any cache format to fp32 / bf16 / fp16, either gathered from a
paged cache by slot ids (what attention reads) or from plain planes (the whole-tensor dequantize of
`kernels/quant.py`). Same values, bit for bit, as `PagedCache.dequantize` / `QTensor.dequantize`: the value is built
in fp32 in the torch path's order (`code * S`, then `* g_dec`) and rounded once to the output dtype.

Same tiling as the store (`kernels/store.py`): BLOCK_R whole rows per program, payload rows read as int32 words,
block scales as a short vector per row, output rows written whole. E2M1 words expand in registers (kc.e2m1_words_*:
three integer ops per value, no table) and, for bf16 output, the block scale applies with packed bf16 multiplies
where every product is exact (BF16_MATH), so no value goes through fp32. On the H200 it is memory bound with or
without BF16_MATH (the word decode is what made it so); what moved it further is cache policy, not instructions
(FP4_WORDS_CONFIG). A Gluon twin measured no faster, so this kernel is the only dequantize (the numbers:
docs/kernels/dequant.md).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvtool.errors import KernelArgumentError
from kvtool.formats import kernel_desc as kd
from kvtool.kernels import codecs as kc
from kvtool.kernels.paged_rows import row_addresses
from kvtool.kernels.store import (
    INTERPRET,
    SCALE_E8M0,
    SCALE_ROW,
    SCALE_TENSOR,
    KernelFormat,
    cache_scales,
    check_cache,
    check_slot_ids,
    launch_config,
    native_fp8,
    next_pow2,
    require_tensor_scale,
    row_mask,
    word_aligned,
)

__all__ = [
    "FP4_WORDS_CONFIG", "OUTPUT_DTYPES", "check_output_dtype", "gather_dequantize", "launch_dequant", "stream_ok"
]

OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# FP4 word rows, compiled: 16-row tiles of 2 warps, and on CUDA the output stores marked streaming (`st.global.cs`)
# and the payload / scale loads evict-first (STREAM): each byte is touched once. Measured faster than the 32 x 4 tiles
# without the hints on the H200 (the runs: docs/kernels/dequant.md). ROCm keeps no hints: not measured there.
FP4_WORDS_CONFIG = (16, 2)


@triton.jit
def _dequant_kernel(
    payload_ptr,  # uint8: the cache buffer (PAGED) or the payload plane [rows, PB]
    scale_ptr,  # uint8: the cache buffer (PAGED) or the scale plane [rows, SB] (unused when SB == 0)
    slot_ptr,  # [T] int32 / int64 slot per token, all valid (PAGED only)
    out_ptr,  # [T, H, D] fp32 / bf16 / fp16 output, contiguous
    n_tok,  # T
    num_heads,  # H
    page_stride,  # cache bytes between pages (PAGED)
    head_stride,  # cache bytes between heads inside a page (PAGED)
    tensor_scale,  # fp32 fp8 `tensor` scale s
    g_dec,  # fp32 nvfp4 decode-direction outer scale
    PAGED: tl.constexpr,  # read through slot_ptr from pages, else from planes
    PAGE: tl.constexpr,  # tokens per page (PAGED)
    D: tl.constexpr,  # elements per row
    DP: tl.constexpr,  # D padded to a power of two
    PB: tl.constexpr,  # payload bytes per row
    SB: tl.constexpr,  # scale bytes per row
    BITS: tl.constexpr,  # payload bits per element: 16 (bf16), 8 (e4m3), 4 (e2m1)
    SCALE: tl.constexpr,  # kernel_desc scale code (store.SCALE_*)
    BLOCK: tl.constexpr,  # elements per block scale (4-bit formats)
    OUT_BF16: tl.constexpr,  # output is bf16 (rounded by kc.bf16_encode)
    NATIVE_FP8: tl.constexpr,  # hardware e4m3 -> fp32 conversion (CUDA sm_89+, see kc.e4m3_decode_any)
    WORDS: tl.constexpr,  # 4-bit formats: payload rows read as int32 words (every row offset a multiple of 4)
    G_FOLD: tl.constexpr,  # nvfp4: 2**14 * g_dec is finite in fp32 (fold it into one multiply)
    BF16_MATH: tl.constexpr,  # 4-bit words to bf16 with exact packed bf16 multiplies (E8M0, or E4M3 with g_dec = 1)
    BLOCK_R: tl.constexpr,  # tokens per program
    STREAM: tl.constexpr = False,  # streaming output stores (`st.global.cs`), evict-first payload / scale loads
):
    # grid: (token tiles, heads), as in the store
    tok = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(1)
    live, pay, sc = row_addresses(tok, head, n_tok, num_heads, slot_ptr, page_stride, head_stride,
                                  PAGED, PAGE, PB, SB)
    cols = tl.arange(0, DP)
    if BITS == 4 and WORDS:
        # int32 words of 8 codes each, expanded in registers to fp16 `code * 2**-14` (three integer ops per value,
        # exact, see kc.e2m1_words_f16); the block scale then applies in fp16 where that is exact (E4M3: products of
        # <= 6 significant bits, >= 2**-24) or in fp32 (E8M0: 2**-127 .. 2**127); one rounding to the output dtype
        wcols = tl.arange(0, DP // 8)
        wrow = (payload_ptr + pay).to(tl.pointer_type(tl.int32))
        hint: tl.constexpr = "evict_first" if STREAM else ""
        words = tl.load(wrow[:, None] + wcols[None, :], mask=row_mask(live, wcols, PB // 4, DP // 8), other=0,
                        eviction_policy=hint)
        scols = tl.arange(0, DP // BLOCK)
        sbytes = tl.load(scale_ptr + sc[:, None] + scols[None, :], mask=row_mask(live, scols, SB, DP // BLOCK),
                         other=0, eviction_policy=hint)
        if BF16_MATH:
            # bf16 out, every product exact (E8M0: 2**-127 .. 2**127; E4M3 with g_dec = 1: <= 6 significant bits):
            # packed bf16 multiplies, no fp32 round trip (compiled only: the interpreter's bf16 math is not exact)
            vb = tl.reshape(kc.e2m1_words_bf16(words, BLOCK_R, DP // 8), [BLOCK_R, DP // BLOCK, BLOCK])
            if SCALE == SCALE_E8M0:
                sv = kc.e8m0_decode_any(sbytes).to(tl.bfloat16)
            else:
                sv = kc.e4m3_decode_any(sbytes, NATIVE_FP8).to(tl.bfloat16)
            vb = vb * 8.507059173023462e37 * sv[:, :, None]  # (code * 2**-126) * 2**126 = code, then * S
        else:
            v16 = tl.reshape(kc.e2m1_words_f16(words, BLOCK_R, DP // 8), [BLOCK_R, DP // BLOCK, BLOCK])
            if SCALE == SCALE_E8M0:
                vb = (v16 * 16384.0).to(tl.float32) * kc.e8m0_decode_any(sbytes)[:, :, None]  # code exact in fp16
            else:
                s16 = kc.e4m3_decode_any(sbytes, NATIVE_FP8).to(tl.float16)  # exact
                # (code * 2**-14 * S) * (2**14 * g_dec): the torch path's (code * S) * g_dec, one rounding alike
                if G_FOLD:
                    vb = (v16 * s16[:, :, None]).to(tl.float32) * (g_dec * 16384.0)
                else:  # 2**14 * g_dec would overflow fp32
                    vb = (v16 * s16[:, :, None]).to(tl.float32) * 16384.0 * g_dec
        v = tl.reshape(vb, [BLOCK_R, DP])
    elif BITS == 4:
        pcols = tl.arange(0, DP // 2)
        packed = tl.load(payload_ptr + pay[:, None] + pcols[None, :], mask=row_mask(live, pcols, PB, DP // 2),
                         other=0)
        v = kc.e2m1_decode_f32(kc.unpack_nibbles(packed, BLOCK_R, DP // 2))  # [BLOCK_R, DP]
        scols = tl.arange(0, DP // BLOCK)
        sbytes = tl.load(scale_ptr + sc[:, None] + scols[None, :], mask=row_mask(live, scols, SB, DP // BLOCK),
                         other=0)
        vb = tl.reshape(v, [BLOCK_R, DP // BLOCK, BLOCK])
        if SCALE == SCALE_E8M0:
            vb = vb * kc.e8m0_decode_any(sbytes)[:, :, None]
        else:
            vb = vb * kc.e4m3_decode_any(sbytes)[:, :, None] * g_dec  # (code * S) is exact; g_dec rounds once
        v = tl.reshape(vb, [BLOCK_R, DP])
    elif BITS == 8:
        codes = tl.load(payload_ptr + pay[:, None] + cols[None, :], mask=row_mask(live, cols, D, DP), other=0)
        v = kc.e4m3_decode_any(codes, NATIVE_FP8)
        if SCALE == SCALE_TENSOR:
            v = v * tensor_scale
        elif SCALE == SCALE_ROW:
            # the fp32 row scale from its 4 little-endian bytes (no 4-byte alignment needed)
            b4 = tl.arange(0, 4)
            sb = tl.load(scale_ptr + sc[:, None] + b4[None, :], mask=row_mask(live, b4, 4, 4), other=0)
            bits = tl.sum(sb.to(tl.int32) << (8 * b4)[None, :], axis=1)  # disjoint bytes: the sum is an OR
            v = v * bits.to(tl.float32, bitcast=True)[:, None]
    else:
        bf = payload_ptr.to(tl.pointer_type(tl.bfloat16))
        v = kc.bf16_decode(tl.load(bf + (pay // 2)[:, None] + cols[None, :], mask=row_mask(live, cols, D, DP),
                                   other=0.0))
    if BF16_MATH and BITS == 4 and WORDS:
        out = v
    elif OUT_BF16:
        out = kc.bf16_encode(v)
    else:
        out = v.to(out_ptr.dtype.element_ty)
    rows = tok.to(tl.int64) * num_heads + head
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], out, mask=row_mask(tok < n_tok, cols, D, DP),
             cache_modifier=".cs" if STREAM else "")


def launch_dequant(payload: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor | None, out: torch.Tensor,
                   fmt, *, page_size: int = 1, page_stride: int = 0, head_stride: int = 0,
                   tensor_scale: float = 1.0, g_dec: float = 1.0, config: tuple[int, int] | None = None,
                   variant: dict | None = None) -> None:
    """Launch `_dequant_kernel` into `out` [T, H, D] (contiguous). With `slots` [T] it gathers the tokens' rows from
    the pages of `payload` (the uint8 cache buffer), without it it reads the planes `payload` [T * H, PB] and
    `scales` [T * H, SB]."""
    T, H, D = out.shape
    if T * H == 0:
        return
    dp = next_pow2(D)
    paged = slots is not None
    kf = KernelFormat.of(fmt)
    pb = fmt.payload_bytes(D)
    g32 = np.float32(g_dec)
    with np.errstate(over="ignore"):
        g_fold = bool(np.isfinite(g32 * np.float32(16384.0)))
    words = word_aligned(payload, pb, page_stride, head_stride)
    fp4_words = kf.BITS == 4 and words and not INTERPRET
    if config is None and fp4_words:
        block_r, num_warps = FP4_WORDS_CONFIG
    else:
        block_r, num_warps = launch_config(dp, 8, config)  # 2-D tiles for every format
    # packed bf16 products are exact only where no outer scale rounds; compiled only (interpreter bf16 math)
    bf16_math = (out.dtype == torch.bfloat16 and fp4_words
                 and (kf.SCALE == kd.SCALE_E8M0 or float(g32) == 1.0))
    stream = fp4_words and stream_ok(out.device)
    opts = dict(WORDS=words, G_FOLD=g_fold, BF16_MATH=bf16_math, STREAM=stream)
    opts.update(variant or {})
    grid = (triton.cdiv(T, block_r), H)
    _dequant_kernel[grid](
        payload, scales if scales is not None else payload, slots if paged else payload, out, T, H,
        page_stride, head_stride, float(tensor_scale), float(g32),
        PAGED=paged, PAGE=page_size, D=D, DP=dp, PB=pb, SB=fmt.scale_bytes(D), BITS=kf.BITS,
        SCALE=kf.SCALE, BLOCK=kf.BLOCK, OUT_BF16=out.dtype == torch.bfloat16, NATIVE_FP8=native_fp8(out.device),
        BLOCK_R=block_r, num_warps=num_warps, **opts)


def stream_ok(device: torch.device) -> bool:
    """Whether the dequantize marks its FP4 traffic streaming (FP4_WORDS_CONFIG): CUDA builds (measured on the H200),
    not ROCm (not measured there)."""
    return device.type == "cuda" and torch.version.hip is None


def check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in OUTPUT_DTYPES:
        raise KernelArgumentError(f"dequantize: output dtype {dtype} is not one of fp32 / bf16 / fp16")


def gather_dequantize(cache, slots: torch.Tensor, dtype: torch.dtype = torch.float32, *, validate: bool = True,
                      config: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `PagedCache.dequantize`: the decoded values [N, H, D] (`dtype`: fp32, bf16 or fp16) of the
    tokens at `slots` (int32 / int64 [N], all valid, on the cache's device). `validate` checks the slot range (a host
    sync), as the torch path does. `out` (contiguous [N, H, D] of `dtype` on the cache's device) receives the values
    instead of a new tensor (engines reuse one buffer; also what CUDA-graph capture wants)."""
    check_cache(cache)
    check_output_dtype(dtype)
    check_slot_ids(slots, slots.shape[0] if slots.dim() == 1 else -1, cache.data.device, "gather: slots")
    if validate:
        kd.check_slots(slots, cache.num_slots, allow_skip=False)
    tensor_scale = require_tensor_scale(cache) if cache.fmt.scale_element == "fp32-tensor" else 1.0
    H, D = cache.num_heads, cache.head_dim
    shape = (slots.shape[0], H, D)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=cache.data.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != cache.data.device \
            or not out.is_contiguous():
        raise KernelArgumentError(f"gather: out must be contiguous {dtype} {list(shape)} on {cache.data.device}, "
                                  f"got {out.dtype} {list(out.shape)} on {out.device}")
    launch_dequant(cache.data, None, slots, out, cache.fmt, page_size=cache.page_size,
                   page_stride=cache.data.stride(0), head_stride=cache.data.stride(1), tensor_scale=tensor_scale,
                   g_dec=cache_scales(cache)[1], config=config)
    return out
