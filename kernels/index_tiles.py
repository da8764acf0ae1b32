"""Key tiles and query operands of the lightning-indexer scorer (`kernels/index_score.py`), split from it by concept:
the scorer's kernel and launch live there, its loop step and block bookkeeping in `kernels/index_blocks.py`; this
module turns a page of the index cache and the query rows into tensor-core operands.

- `load_query`: the bf16 query rows as dot B operands in the element order each key decode produces (bf16 rows,
  fp16 rows times 2**a, the four FP4 word quarters or even / odd bytes, or the block-diagonal quarters of POST_SCALE
  launches), and the fp32 column scale that undoes every fixed factor.
- `page_of`, `fetch`, `fetch_scales`: the loads of one key tile that never crosses a page.
- `tile_dot`, `post_scale`: decode a fetched tile (codecs from `kernels/codecs.py`) and dot it with the query.

Why each product is exact up to fp32 accumulation order is the exactness section of `kernels/index_score.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtool.formats import kernel_desc as kd
from kvtool.kernels import codecs as kc

__all__ = ["SK_E4M3", "SK_E8M0", "SK_ROW", "fetch", "fetch_scales", "load_query", "page_of", "post_scale", "tile_dot"]

# SCALE_KIND is a descriptor's `token_scale` code (kvtool.formats.kernel_desc): whole-tensor scales read as none
# there and arrive as the runtime `gscale`: the codes run none < row < e4m3 < e8m0, so `>= SK_E4M3` is a block scale.
SK_ROW = tl.constexpr(kd.SCALE_ROW)
SK_E4M3 = tl.constexpr(kd.SCALE_E4M3)
SK_E8M0 = tl.constexpr(kd.SCALE_E8M0)


@triton.jit
def _to_dot(x, DOT_F32: tl.constexpr):
    """fp32 values already exact in fp16 -> the dot operand type (fp16; fp32 under the interpreter)."""
    x16 = x.to(tl.float16)
    if DOT_F32:
        return x16.to(tl.float32)
    else:
        return x16


@triton.jit
def _pow2_up_down(amax):
    """Per row: (2**a, 2**-a) with amax * 2**a in [2**14, 2**15) (a clamped to +-126), by exponent bits."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    a = tl.minimum(tl.maximum(14 - e, -126), 126)
    return kc.exp2_int(a), kc.exp2_int(-a)


@triton.jit
def _q_operand(q_ptr, q_off, row_ok, up, idx, DOT_F32: tl.constexpr):
    """Query rows [MP] at element indices idx [K] (bf16), times 2**a per row, as a dot B operand [K, MP]."""
    q = tl.load(q_ptr + q_off[:, None] + idx[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    return tl.trans(_to_dot(q * up[:, None], DOT_F32))


@triton.jit
def _q_blockdiag(q_ptr, q_off, row_ok, up, idx, NSBP: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """The block-diagonal query operand of POST_SCALE launches: [K, MP NSBP], column b MP + r holds row r's elements
    idx [K] (times 2**a) where they lie in scale block b (idx // SCALE_BLOCK == b), else 0. One dot with undecorated
    E2M1 keys then gives every (block, row) partial score; the block scales multiply those (`post_scale`)."""
    MP: tl.constexpr = up.shape[0]
    c = tl.arange(0, NSBP * MP)
    bb = c // MP
    q_off2 = tl.reshape(tl.broadcast_to(q_off[None, :], [NSBP, MP]), [NSBP * MP])
    ok2 = tl.reshape(tl.broadcast_to(row_ok[None, :], [NSBP, MP]), [NSBP * MP])
    up2 = tl.reshape(tl.broadcast_to(up[None, :], [NSBP, MP]), [NSBP * MP])
    inblk = (idx[None, :] // SCALE_BLOCK) == bb[:, None]
    q = tl.load(q_ptr + q_off2[:, None] + idx[None, :], mask=ok2[:, None] & inblk, other=0.0).to(tl.float32)
    return tl.trans(_to_dot(q * up2[:, None], DOT_F32))


@triton.jit
def load_query(q_ptr, q_off, row_ok, gscale, D: tl.constexpr, PAYLOAD_BITS: tl.constexpr, NATIVE_FP8: tl.constexpr,
                FP4_WORDS: tl.constexpr, POST_SCALE: tl.constexpr, NSBP: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                DOT_F32: tl.constexpr):
    """Rows [MP] of bf16 queries -> (four dot B operands, column scale [MP] fp32). bf16 caches: the bf16 rows [D, MP]
    (four times the same). fp8: fp16 rows times 2**a. FP4: the four element orders of `kc.fp4_quarter` ([D/4, MP]
    each: column c of quarter K is element 8 (c // 2) + K + 4 (c % 2)), or without FP4_WORDS the even and odd
    elements of `kc.fp4_bytes` ([D/2, MP] each, twice); with POST_SCALE the quarters block-diagonal
    ([D/4, MP NSBP], see `_q_blockdiag`). The column scale undoes 2**a and carries
    the whole-tensor factor and the fixed power of two of the key decode (2**8 portable fp8, 2**14 FP4)."""
    c = tl.arange(0, D)
    if PAYLOAD_BITS == 16:
        q = tl.load(q_ptr + q_off[:, None] + c[None, :], mask=row_ok[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        colscale = tl.full(row_ok.shape, 1.0, tl.float32) * gscale
        return tl.trans(q), tl.trans(q), tl.trans(q), tl.trans(q), colscale
    elif PAYLOAD_BITS == 8:
        q = tl.load(q_ptr + q_off[:, None] + c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        up, down = _pow2_up_down(tl.max(tl.abs(q), axis=1))
        qa = tl.trans(_to_dot(q * up[:, None], DOT_F32))
        return qa, qa, qa, qa, down * (gscale if NATIVE_FP8 else gscale * 256.0)
    else:
        q = tl.load(q_ptr + q_off[:, None] + c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        up, down = _pow2_up_down(tl.max(tl.abs(q), axis=1))
        if POST_SCALE:
            cq = tl.arange(0, D // 4)
            idx = 8 * (cq // 2) + 4 * (cq % 2)
            qa = _q_blockdiag(q_ptr, q_off, row_ok, up, idx, NSBP, SCALE_BLOCK, DOT_F32)
            qb = _q_blockdiag(q_ptr, q_off, row_ok, up, idx + 1, NSBP, SCALE_BLOCK, DOT_F32)
            qc = _q_blockdiag(q_ptr, q_off, row_ok, up, idx + 2, NSBP, SCALE_BLOCK, DOT_F32)
            qd = _q_blockdiag(q_ptr, q_off, row_ok, up, idx + 3, NSBP, SCALE_BLOCK, DOT_F32)
        elif FP4_WORDS:
            cq = tl.arange(0, D // 4)
            idx = 8 * (cq // 2) + 4 * (cq % 2)
            qa = _q_operand(q_ptr, q_off, row_ok, up, idx, DOT_F32)
            qb = _q_operand(q_ptr, q_off, row_ok, up, idx + 1, DOT_F32)
            qc = _q_operand(q_ptr, q_off, row_ok, up, idx + 2, DOT_F32)
            qd = _q_operand(q_ptr, q_off, row_ok, up, idx + 3, DOT_F32)
        else:  # even and odd elements (the compiled code wants one return with one type per branch)
            ev = 2 * tl.arange(0, D // 2)
            qa = _q_operand(q_ptr, q_off, row_ok, up, ev, DOT_F32)
            qb = _q_operand(q_ptr, q_off, row_ok, up, ev + 1, DOT_F32)
            qc, qd = qa, qb
        return qa, qb, qc, qd, down * (gscale * 16384.0)


@triton.jit
def _scaled(x, f16, TILE_T: tl.constexpr, NSB: tl.constexpr):
    """fp16 [T, C] times a per-(token, scale block) fp16 factor f16 [T, NSB] (block b = columns b C/NSB ..)."""
    C: tl.constexpr = x.shape[1]
    return tl.reshape(tl.reshape(x, [TILE_T, NSB, C // NSB]) * f16[:, :, None], [TILE_T, C])


@triton.jit
def _f32_operand(x, DOT_F32: tl.constexpr):
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def page_of(bt_row, t0, t_lim, num_pages, PAGE: tl.constexpr):
    """Page id of the tile starting at token t0, or -1 (at or past t_lim, or a -1 / out-of-range table entry)."""
    pg = tl.load(bt_row + t0 // PAGE, mask=t0 < t_lim, other=-1)
    return tl.where((pg >= 0) & (pg < num_pages), pg, -1)


@triton.jit
def _tile_ok(pg, t0, t_lim, TILE_T: tl.constexpr, LEAN: tl.constexpr):
    """Load mask [TILE_T] of a key tile: per token (t < t_lim, page valid), or with LEAN per page only (pg >= 0: a
    scalar predicate; the tile lies inside that page, so its tokens past t_lim are readable memory, read as whatever
    the page holds, and the scorer masks their scores instead: `index_blocks.tile_step`)."""
    r = tl.arange(0, TILE_T)
    if LEAN:
        return (r >= 0) & (pg >= 0)
    else:
        return ((t0 + r) < t_lim) & (pg >= 0)


@triton.jit
def _in_page(t0, PAGE: tl.constexpr, TILE_T: tl.constexpr, LEAN: tl.constexpr):
    """Token offset of a tile in its page: t0 % PAGE, known to be 0 when tiles are whole pages (LEAN says so to the
    compiler instead of leaving it a remainder of the 64-bit tile start)."""
    if LEAN and TILE_T == PAGE:
        return 0
    else:
        return t0 % PAGE


@triton.jit
def fetch(data_ptr, pg, t0, t_lim, page_bytes, D: tl.constexpr, TILE_T: tl.constexpr, PAGE: tl.constexpr,
           PB: tl.constexpr, SB: tl.constexpr, PAYLOAD_BITS: tl.constexpr, SCALE_KIND: tl.constexpr,
           SCALE_BLOCK: tl.constexpr, FP4_WORDS: tl.constexpr, POST_SCALE: tl.constexpr, LEAN: tl.constexpr = False,
           QM: tl.constexpr = False):
    """Issue the loads of one key tile (tokens t0 .. t0 + TILE_T, all in page pg; token r's payload at byte
    r PB of the page's payload plane, its scales at r SB of the scale plane): (payload, scales) as stored: int16
    [T, D] (bf16; bf16 itself with QM, so that the loaded tile can feed the dot from shared memory unchanged),
    uint8 [T, D] (e4m3), uint32 words [T, D/8] (packed E2M1); scales as `fetch_scales` gives them.
    Tokens of page -1 read as 0 and touch no memory; tokens at or past t_lim too, unless LEAN (`_tile_ok`)."""
    r = tl.arange(0, TILE_T)
    if LEAN:
        ok = _tile_ok(pg, t0, t_lim, TILE_T, LEAN)
        pay = tl.maximum(pg, 0).to(tl.int64) * page_bytes + _in_page(t0, PAGE, TILE_T, LEAN) * PB
    else:
        ok = ((t0 + r) < t_lim) & (pg >= 0)
        pay = tl.maximum(pg, 0).to(tl.int64) * page_bytes + (t0 % PAGE) * PB
    if (PAYLOAD_BITS == 16) & QM:
        ptrs = data_ptr.to(tl.pointer_type(tl.bfloat16)) + pay // 2 + r[:, None] * (PB // 2) + tl.arange(0, D)[None, :]
    elif PAYLOAD_BITS == 16:
        ptrs = data_ptr.to(tl.pointer_type(tl.int16)) + pay // 2 + r[:, None] * (PB // 2) + tl.arange(0, D)[None, :]
    elif PAYLOAD_BITS == 8:
        ptrs = data_ptr + pay + r[:, None] * PB + tl.arange(0, D)[None, :]
    elif not FP4_WORDS:
        ptrs = data_ptr + pay + r[:, None] * PB + tl.arange(0, D // 2)[None, :]
    else:
        ptrs = data_ptr.to(tl.pointer_type(tl.uint32)) + pay // 4 + r[:, None] * (PB // 4) \
            + tl.arange(0, D // 8)[None, :]
    payload = tl.load(ptrs, mask=ok[:, None], other=0)
    scales = fetch_scales(data_ptr, pg, t0, t_lim, page_bytes, D, TILE_T, PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND,
                           SCALE_BLOCK, FP4_WORDS, POST_SCALE, LEAN)
    return payload, scales


@triton.jit
def fetch_scales(data_ptr, pg, t0, t_lim, page_bytes, D: tl.constexpr, TILE_T: tl.constexpr, PAGE: tl.constexpr,
                  PB: tl.constexpr, SB: tl.constexpr, PAYLOAD_BITS: tl.constexpr, SCALE_KIND: tl.constexpr,
                  SCALE_BLOCK: tl.constexpr, FP4_WORDS: tl.constexpr, POST_SCALE: tl.constexpr,
                  LEAN: tl.constexpr = False):
    """The scales of one key tile (see `fetch`) as stored: uint8 [T, D/block] block scales, one uint32 word [T] of
    four E8M0 bytes (mxfp4 with four blocks per token, without POST_SCALE), fp32 [T] row scales, or fp32 zeros [T]
    when there are none. FP4 without FP4_WORDS: the block scale of every payload byte, uint8 [T, D/2] (gathered: no
    reshape needed to apply it)."""
    r = tl.arange(0, TILE_T)
    if LEAN:
        ok = _tile_ok(pg, t0, t_lim, TILE_T, LEAN)
        sc = tl.maximum(pg, 0).to(tl.int64) * page_bytes + PAGE * PB + _in_page(t0, PAGE, TILE_T, LEAN) * SB
    else:
        ok = ((t0 + r) < t_lim) & (pg >= 0)
        sc = tl.maximum(pg, 0).to(tl.int64) * page_bytes + PAGE * PB + (t0 % PAGE) * SB
    if SCALE_KIND == SK_ROW:
        scales = tl.load(data_ptr.to(tl.pointer_type(tl.float32)) + sc // 4 + r, mask=ok, other=1.0)
    elif (PAYLOAD_BITS == 4) & (not FP4_WORDS):
        blk = tl.arange(0, D // 2) // (SCALE_BLOCK // 2)
        scales = tl.load(data_ptr + sc + r[:, None] * SB + blk[None, :], mask=ok[:, None], other=0)
    elif (SCALE_KIND == SK_E8M0) & (D // SCALE_BLOCK == 4) & (not POST_SCALE):  # four E8M0 bytes in one word
        scales = tl.load(data_ptr.to(tl.pointer_type(tl.uint32)) + sc // 4 + r, mask=ok, other=0)
    elif SCALE_KIND >= SK_E4M3:
        scales = tl.load(data_ptr + sc + r[:, None] * SB + tl.arange(0, D // SCALE_BLOCK)[None, :],
                         mask=ok[:, None], other=0)
    else:
        scales = tl.zeros([TILE_T], tl.float32)
    return scales


@triton.jit
def post_scale(acc, scales, TILE_T: tl.constexpr, NSBP: tl.constexpr, SCALE_KIND: tl.constexpr,
                NATIVE_FP8: tl.constexpr):
    """Partial scores fp32 [T, NSBP MP] (column b MP + r: row r over scale block b) times the tokens' block scales
    (uint8 [T, NSBP] E4M3 or E8M0, decoded to fp32, NaN codes to NaN), summed over the blocks: fp32 [T, MP]."""
    MP: tl.constexpr = acc.shape[1] // NSBP
    if SCALE_KIND == SK_E4M3:
        f = kc.e4m3_decode_any(scales, NATIVE_FP8)
    else:
        f = kc.e8m0_decode_any(scales)
    return tl.sum(tl.reshape(acc, [TILE_T, NSBP, MP]) * f[:, :, None], axis=1)


@triton.jit
def _kq(k, q, QM: tl.constexpr):
    """The first dot of a tile: keys [T, K] x query operand [K, MP] -> fp32 [T, MP], or with QM the same products
    as query rows x key columns, [MP, T] (see `tile_dot`)."""
    if QM:
        return tl.dot(tl.trans(q), tl.trans(k))
    else:
        return tl.dot(k, q)


@triton.jit
def _kq_acc(k, q, acc, QM: tl.constexpr):
    """`_kq` accumulated into acc (of the same orientation)."""
    if QM:
        return tl.dot(tl.trans(q), tl.trans(k), acc)
    else:
        return tl.dot(k, q, acc)


@triton.jit
def _oriented(acc, QM: tl.constexpr):
    """A dot chain's result as [T, MP] (a transposed view of the QM chain's [MP, T]: no data moves)."""
    if QM:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def tile_dot(payload, scales, qa, qb, qc, qd, D: tl.constexpr, TILE_T: tl.constexpr, PAYLOAD_BITS: tl.constexpr,
              SCALE_KIND: tl.constexpr, SCALE_BLOCK: tl.constexpr, NATIVE_FP8: tl.constexpr,
              FP4_WORDS: tl.constexpr, POST_SCALE: tl.constexpr, NSBP: tl.constexpr, DOT_F32: tl.constexpr,
              QM: tl.constexpr = False):
    """Decode one fetched key tile and dot it with the query rows: fp32 [TILE_T, MP], times any per-token factor
    (fp8 row scale, mxfp4 2**emax), before the column scale.

    Orientation. By default the keys are the dot's A operand, K [T, K] x Q^T [K, MP]: decoded keys feed the tensor
    cores from registers, but the accumulator spreads a tile's tokens over the warps, so a block max crosses warps
    (shared memory and a barrier per block; `index_blocks.part_nanmax` avoids that for decode). QM (query-major)
    computes the same products as Q [MP, K] x K^T [K, T]: the tokens of a row then sit in one thread quad, so the max
    over them is in-thread plus two shuffles, and the query, fixed for the whole loop, is the A operand. The key
    operand goes through shared memory (straight from the load for bf16; decoded keys are stored there first).
    The same products and the same fp32 sums per tile in either orientation."""
    if PAYLOAD_BITS == 16:
        if QM:  # loaded as bf16 (`fetch`)
            k = _f32_operand(payload, DOT_F32)
        elif DOT_F32:
            k = (payload.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            k = payload.to(tl.bfloat16, bitcast=True)
        acc = _oriented(_kq(k, qa, QM), QM)
    elif PAYLOAD_BITS == 8:
        if NATIVE_FP8:  # hardware e4m3 -> fp16 (two per instruction; NaN codes give NaN)
            k = payload.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:  # the value times 2**-8 (the column scale holds 2**8)
            k = kc.e4m3_decode_f16(payload, False)
        acc = _oriented(_kq(_f32_operand(k, DOT_F32), qa, QM), QM)
    elif POST_SCALE:  # undecorated E2M1 quarters x the block-diagonal query, then the block scales
        NW_: tl.constexpr = D // 8
        acc = _kq(_f32_operand(kc.fp4_quarter(payload, 0, TILE_T, NW_), DOT_F32), qa, QM)
        acc = _kq_acc(_f32_operand(kc.fp4_quarter(payload, 1, TILE_T, NW_), DOT_F32), qb, acc, QM)
        acc = _kq_acc(_f32_operand(kc.fp4_quarter(payload, 2, TILE_T, NW_), DOT_F32), qc, acc, QM)
        acc = _kq_acc(_f32_operand(kc.fp4_quarter(payload, 3, TILE_T, NW_), DOT_F32), qd, acc, QM)
        acc = post_scale(_oriented(acc, QM), scales, TILE_T, NSBP, SCALE_KIND, NATIVE_FP8)
    elif not FP4_WORDS:  # bytes: even and odd elements, each block scale gathered per byte [T, D/2]
        even, odd = kc.fp4_bytes(payload)
        if SCALE_KIND == SK_E4M3:
            if NATIVE_FP8:
                f16 = scales.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                f16 = kc.e4m3_decode_f16(scales)
        else:  # the same factors as the word path, from the gathered bytes
            f16, rowfac = kc.e8m0_tile_factors(scales)
        acc = _kq(_f32_operand(even * f16, DOT_F32), qa, QM)
        acc = _oriented(_kq_acc(_f32_operand(odd * f16, DOT_F32), qb, acc, QM), QM)
        if SCALE_KIND == SK_E8M0:
            acc = acc * rowfac[:, None]
    else:
        NW: tl.constexpr = D // 8  # uint32 words per token
        NSB: tl.constexpr = D // SCALE_BLOCK  # scale blocks per token
        if SCALE_KIND == SK_E4M3:
            if NATIVE_FP8:
                f16 = scales.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                f16 = kc.e4m3_decode_f16(scales)
        elif NSB == 4:
            f16, rowfac = kc.e8m0_word_factors(scales)
        else:
            f16, rowfac = kc.e8m0_tile_factors(scales)
        acc = _kq(_f32_operand(_scaled(kc.fp4_quarter(payload, 0, TILE_T, NW), f16, TILE_T, NSB), DOT_F32), qa, QM)
        acc = _kq_acc(_f32_operand(_scaled(kc.fp4_quarter(payload, 1, TILE_T, NW), f16, TILE_T, NSB), DOT_F32), qb,
                      acc, QM)
        acc = _kq_acc(_f32_operand(_scaled(kc.fp4_quarter(payload, 2, TILE_T, NW), f16, TILE_T, NSB), DOT_F32), qc,
                      acc, QM)
        acc = _kq_acc(_f32_operand(_scaled(kc.fp4_quarter(payload, 3, TILE_T, NW), f16, TILE_T, NSB), DOT_F32), qd,
                      acc, QM)
        acc = _oriented(acc, QM)
        if SCALE_KIND == SK_E8M0:
            acc = acc * rowfac[:, None]
    if SCALE_KIND == SK_ROW:
        acc = acc * scales[:, None]
    return acc
