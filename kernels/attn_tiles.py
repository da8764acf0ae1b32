"""Tile loads and decodes of the sparse-attention kernels (`kernels/sparse_attn.py`), split from it by concept: that
module holds the online-softmax step, the kernels and their launchers; this one turns a selected block's page of the
K or V cache into dot operands.

- `tile_meta`: which page and tokens tile i of a request's selection covers, and whether it is live.
- `load_raw`: the payload and scale loads of one K or V tile (bf16, E4M3 or packed E2M1 words; row, E4M3 or E8M0
  scales), masked to the live tokens.
- `decode`: those bytes as dot operands (fp16 or bf16), with the codecs of `kernels/codecs.py`.
- `dot_operand`: rounding to the dot dtype (kept as fp32 values under the interpreter, whose bf16 / fp16 dots are
  wrong).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtool.formats import kernel_desc as kd
from kvtool.kernels import codecs as kc

__all__ = [
    "ELEM_BF16", "ELEM_E2M1", "ELEM_E4M3", "SCALE_E4M3", "SCALE_E8M0", "SCALE_NONE", "SCALE_ROW", "decode",
    "dot_operand", "load_raw", "tile_meta"
]

# Element and scale kinds: a format descriptor's `elem` and `token_scale` codes (kvtool.formats.kernel_desc, where
# they are numbered once), as constexprs.
ELEM_BF16 = tl.constexpr(kd.ELEM_BF16)
ELEM_E4M3 = tl.constexpr(kd.ELEM_E4M3)
ELEM_E2M1 = tl.constexpr(kd.ELEM_E2M1)
SCALE_NONE = tl.constexpr(kd.SCALE_NONE)  # no per-token scale (a whole-tensor scale, if any, is a folded scalar)
SCALE_ROW = tl.constexpr(kd.SCALE_ROW)  # one fp32 per (token, head)
SCALE_E4M3 = tl.constexpr(kd.SCALE_E4M3)  # one E4M3 byte per BLOCK elements
SCALE_E8M0 = tl.constexpr(kd.SCALE_E8M0)  # one E8M0 byte per BLOCK elements


@triton.jit
def dot_operand(x, F16: tl.constexpr, FP32_DOT: tl.constexpr):
    """Round to the dot dtype (fp16 or bf16); in the interpreter carry the rounded values as fp32."""
    if F16:
        y = x.to(tl.float16)
    else:
        y = x.to(tl.bfloat16)
    if FP32_DOT:
        y = y.to(tl.float32)
    return y


@triton.jit
def tile_meta(ids_row, table_row, i, i_end, pos, TPB: tl.constexpr, BS: tl.constexpr, T: tl.constexpr, P: tl.constexpr):
    """Tile i of a row's selection (tiles at or past i_end are dead) -> (s0 its first token, live, page). A dead
    tile (past the end, a -1 slot, wholly after the query, or a -1 page) has live False and page -1."""
    bid = tl.load(ids_row + i // TPB, mask=i < i_end, other=-1)
    s0 = bid * BS + (i % TPB) * T  # all T tokens share one page: T divides P
    live = (bid >= 0) & (s0 <= pos)
    page = tl.load(table_row + s0 // P, mask=live, other=-1)
    return s0, live & (page >= 0), page


@triton.jit
def load_raw(ptr, page, s0, live, pos, h, stride_p, stride_h, P: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
              TW: tl.constexpr, PB: tl.constexpr, ELEM: tl.constexpr, SCALE: tl.constexpr, QBLOCK: tl.constexpr):
    """Issue the loads of one K or V tile, as stored: (payload, scales, valid [T]). payload: int32 words [T, D/8]
    (E2M1, 4 packed bytes each), uint8 [T, D] (E4M3) or bf16 [T, D]; scales: uint8 [T, D/QBLOCK] (block scales),
    fp32 [T] (fp8 `token`) or an unused fp32 [T]. Tokens after the query or of a dead tile are masked: they read
    as 0 and touch no memory. `ptr` is the cache's uint8 data (a bf16 view for bf16)."""
    tile = tl.arange(0, TW)  # TW >= T: columns T.. (E2M1 16-token tiles padded to 32) are masked, never loaded
    valid = live & (tile < T) & (s0 + tile <= pos)
    off = s0 % P + tile
    base = tl.maximum(page, 0).to(tl.int64) * stride_p + h * stride_h  # bytes
    scales = tl.zeros([T], tl.float32)
    if ELEM == ELEM_E2M1:
        W: tl.constexpr = D // 8  # int32 words per token
        NB: tl.constexpr = D // QBLOCK
        wp = ptr.to(tl.pointer_type(tl.int32)) + base // 4  # slabs and payload rows are 4-byte aligned
        payload = tl.load(wp + off[:, None] * W + tl.arange(0, W)[None, :], mask=valid[:, None], other=0)
        scales = tl.load(ptr + base + P * (D // 2) + off[:, None] * NB + tl.arange(0, NB)[None, :],
                         mask=valid[:, None], other=0)
    elif ELEM == ELEM_E4M3:
        payload = tl.load(ptr + base + off[:, None] * D + tl.arange(0, D)[None, :], mask=valid[:, None], other=0)
        if SCALE == SCALE_ROW:
            sp = ptr.to(tl.pointer_type(tl.float32)) + (base + P * PB) // 4
            scales = tl.load(sp + off, mask=valid, other=0.0)
    else:
        payload = tl.load(ptr + base // 2 + off[:, None] * D + tl.arange(0, D)[None, :], mask=valid[:, None],
                          other=0.0)
    return payload, scales, valid


@triton.jit
def decode(payload, scales, D: tl.constexpr, T: tl.constexpr, ELEM: tl.constexpr, SCALE: tl.constexpr,
            QBLOCK: tl.constexpr, NATIVE_FP8: tl.constexpr, F16: tl.constexpr, PAIRED: tl.constexpr):
    """A tile as loaded by `load_raw` -> (x [T, D] in element order, masked tokens 0; rs [T] fp32 per-token factor).
    x is fp16 with F16, else fp32 (bf16 as loaded for bf16); the dequantized value of token t is x[t] * rs[t] (times
    the launcher's folded scalars). PAIRED (E2M1): x's columns in `kc.e2m1_words_paired` order.
    - E2M1 values carry 2**-14 (e2m1_words_f16; the launcher folds 2**14 into the scalars). With E4M3 block scales
      the fp16 product code * 2**-14 * scale is exact (<= 5 significant bits, on the fp16 grid down to 2**-24).
    - With E8M0 block scales 2**e, each token is normalized by its largest block, 2**e_tok (rs): blocks multiply by
      2**(e - e_tok) in fp16, exact while a token's blocks lie within 2**9 of its largest; smaller blocks round on
      fp16's subnormal grid (absolute error <= 2**(e_tok - 11), about 1e-4 of the token's largest value).
    - fp8 `token` scales come back as rs; E4M3 values are exact in fp16."""
    rs = tl.full([T], 1.0, tl.float32)  # unused unless a per-token factor applies
    if ELEM == ELEM_E2M1:
        NB: tl.constexpr = D // QBLOCK
        if SCALE == SCALE_E4M3:
            s = kc.e4m3_decode_to(scales, NATIVE_FP8, True)  # fp16, exact
        else:
            e = scales.to(tl.int32) - 127  # E8M0 exponents
            e_tok = tl.max(e, axis=1)
            s = kc.pow2_f16(e - e_tok[:, None])
            rs = kc.exp2_int(e_tok)
        if PAIRED:
            x = kc.e2m1_words_paired(payload, T, D // 8)
        else:
            x = kc.e2m1_words_f16(payload, T, D // 8)
        x = tl.reshape(tl.reshape(x, [T, NB, QBLOCK]) * s[:, :, None], [T, D])
    elif ELEM == ELEM_E4M3:
        x = kc.e4m3_decode_to(payload, NATIVE_FP8, F16)
        if SCALE == SCALE_ROW:
            rs = scales
    else:
        x = payload
    return x, rs
