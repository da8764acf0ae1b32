"""Sparse GQA attention over paged, quantized K/V (the M3 decode and prefill attention, SPEC section 3), in Triton.

One program handles one query row (a decode step of one request, or one prefill query), one KV head and one split of
that row's selected tokens. The G query heads of the KV head share every K/V tile it loads: the scores are a
[G, D] x [D, T] dot and the output a [G, T] x [T, D] dot (G padded to 16 for the tensor cores), with an online softmax
in fp32. The selected tokens are walked tile by tile (T tokens of one page): tile i is sub-tile i % (block_size / T) of
selected block i // (block_size / T). When rows x KV heads are too few to fill the GPU, the tiles are split among
several programs (flash-decoding) that write fp32 partials (acc, max, sum), and a small combine kernel merges them.

Decoding happens in registers, through the shared helpers of `kernels/codecs.py`, into fp16 dot operands for every
quantized format (bf16 for bf16), in element order:
- E2M1 (nvfp4, mxfp4): the payload is read as int32 words and `e2m1_words_f16` expands each nibble with three
  integer ops (value * 2**-14, the factor folded into the softmax and output scales). The brief's even/odd split
  (q . k = q_even . k_lo + q_odd . k_hi) is not needed: the word expansion keeps the natural order for free (the
  eight nibbles of a word stay inside one thread), so one [G, D] x [D, T] dot and one accumulator serve, and the
  output needs no permutation. For V, even / odd byte decodes would let Triton load the bytes straight into the dot
  operand layout (no decoded V tile through shared memory), but only without block scales: the scale multiply, a
  second tensor operand, stops that hoist (offline sm_90 TTGIR probe). NVFP4 block scales multiply in
  fp16 exactly (code * scale has <= 5 significant bits). MXFP4 scales 2**e leave fp16's range, so each token is
  normalized by its largest block (2**e_tok, applied in fp32
  to the score column for K and to the probability column for V); the remaining 2**(e - e_tok) is exact in fp16
  while a token's blocks lie within 2**9 of each other (see `tiles.decode`).
- E4M3 (fp8): `e4m3_decode` by bits (portable, tested), or the hardware fp8 conversion behind `native_fp8`
  (`store.native_fp8`: CUDA capability >= 8.9 only, not ROCm); E4M3 values are exact in fp16. Per-token fp32
  scales multiply score columns (K)
  and probability columns (V, over the tile's largest so that P stays within fp16's range).
- Whole-tensor scalars (fp8 `tensor` scale, nvfp4 outer scale g_dec) fold into the softmax scale (K) and the final
  normalization (V): one multiply per row instead of one per element.
- P . V: with fp16 dots P is rounded once to fp16 (2**-12 relative per probability); with bf16 dots (bf16 cache) P
  is split into bf16 hi + lo parts (two dots), since one bf16 rounding (2**-9) would reach the verify-attn goal
  (max_rel <= 2e-3 against the fp32 reference). `precise_p` overrides either way.
Under the Triton interpreter the dots run in fp32 (bf16 dots give garbage there) on the same rounded operands.

Loop (Triton 3.6): with the lookups (block id -> page, two dependent loads) inside the iteration, Triton's
pipeliner issued tile i + 1's copies at the end of iteration i and waited for them at the top of i + 1, so every
tile paid a full memory latency. PREFETCH=1 (quantized default) loads tile i + 1's lookups during tile i and, with 3
stages, keeps one tile's copies in flight, with a 128-register cap (4 programs per SM); measured on the H200,
docs/kernels/sparse_attn.md. E2M1 tiles of 16 tokens are decoded 32 wide (see `_launch`).

Launch shape (measured on the H200 at M3's shape): the softmax denominators are per-column sums reduced after the
loop (LAZY_L: fewer barriers a tile; fp16-dot formats only, bf16 got slower), mxfp4 takes the E8M0 joint max
(JOINT), and `launch_plan` runs 2 warps a program where the tiles fill the GPU. Where the time goes (ncu, nvfp4
batch 256): the stalls, mostly shared-memory round trips (q re-read per tile, K/V words and scales after the async
copies, the decoded V tile and P for the P.V dot), come before the decode's instruction count; time per tile
follows neither occupancy, copies in flight, warps nor instruction count, so launch tuning cannot reach 70 % of copy
(the NVIDIA FP4 path, `sparse_attn_gluon.py`, exists for that reason). Tuning rounds, ncu numbers and the variants
measured slower (register caps, stages, tile sizes, PAIRED order, a fused split combine): docs/kernels/sparse_attn.md.

Masking: tokens after the query position, tiles of -1 selection slots and pages that are -1 are never loaded (masked
loads give 0, then the score is -inf), so stale or non-finite bytes outside the selection never leak into the output.
A row with no visible token returns zeros. Non-finite values at visible tokens (only a bf16 cache can hold them) give
NaN for the affected query heads, as the reference does (see kvtool.attention).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvtool.errors import KernelArgumentError
from kvtool.formats import kernel_desc as kd
from kvtool.kernels import attn_tiles as tiles
from kvtool.kernels import codecs as kc
from kvtool.kernels import sparse_attn_gluon as attn_gluon
from kvtool.kernels.attn_tiles import SCALE_E8M0, SCALE_ROW
from kvtool.kernels.platform import INTERPRET, pdl_ok
from kvtool.kernels.store import cache_scales
from kvtool.kernels.store import native_fp8 as store_native_fp8

__all__ = [
    "DEFAULT_JOINT", "DEFAULT_LAZY_L", "DEFAULT_STAGES", "DEFAULT_TILE", "E2M1_UNIT", "LOG2E", "PAGED_FIELDS",
    "RESIDENT", "launch_plan", "paired_order", "pairs_whole_pages", "sparse_decode", "sparse_prefill",
    "uses_fp16_dots", "uses_gluon"
]


LOG2E = 1.4426950408889634
# What the launchers read of a cache (kvtool.paged.PagedCache has them): the format, the uint8 pages [num_pages, H,
# page_bytes], the page size, heads, head dim and the whole-tensor amax the fp8 `tensor` / nvfp4 `auto` scales come
# from.
PAGED_FIELDS = ("fmt", "data", "page_size", "num_heads", "head_dim", "tensor_amax")
E2M1_UNIT = 2.0**14  # e2m1_words_f16 returns value * 2**-14
DEFAULT_TILE = 64  # tokens per tile on the GPU (launch_plan)
# One warp per merge program: a program merges one query head's S partial rows of D floats (S 2-32 at M3's decode
# shape), too little for four warps; on the H200 one warp ran the merge alone 1.05-2.1x faster than four there
# (bench/probe_attn_combine.py, docs/kernels/sparse_attn.md)
COMBINE_WARPS = 1
RESIDENT = 4  # programs per SM of the default quantized launch (2 warps: ~240 registers, 41 KB shared memory)
# Lazy sums measured faster for the fp16-dot formats and slower for bf16 (its hi + lo P dots need the registers),
# the joint max faster for mxfp4 (H200, docs/kernels/sparse_attn.md)
DEFAULT_LAZY_L = True  # softmax denominators reduced once after the loop, for fp16-dot formats (see _attend)
DEFAULT_JOINT = True  # E8M0 V factors through the softmax max (see _attend)
# Pipeline stages per loop (PREFETCH 2 / 1 / 0). PREFETCH=1: with the lookups one tile ahead, Triton's pipeliner
# keeps num_stages - 2 tiles' K/V copies in flight while one is computed; 3 stages measured best on the H200 (more
# cost shared memory and programs per SM; docs/kernels/sparse_attn.md)
DEFAULT_STAGES = {2: 1, 1: 3, 0: 2}
# Programmatic dependent launch of the portable kernel and its combine (see _launch): option pdl -> the PDL modes of
# (kernel, combine): 1 the next launch released at the start, 2 after the loop (kernel) or the stores (combine).
# "late-main": the kernel late, the combine at its start (vLLM's decode kernel and merge). Default: grids of at most
# PDL_EARLY_MAX_PROGRAMS programs per SM "early"; larger decode grids by their tiles per program (PDL_LATE_TILES:
# the first entry whose bound the program's tiles do not exceed; past the last, no PDL): short programs gain most
# from overlapping the launches, long ones not at all (the table measured on the H200: docs/kernels/sparse_attn.md).
PDL_MODES = {False: (0, 0), "early": (1, 1), "late": (2, 2), "late-main": (2, 1)}
PDL_EARLY_MAX_PROGRAMS = 1
PDL_LATE_TILES = ((2, "late"), (8, "late-main"))


# ------------------------------------------------------------------------------------------- host-side helpers
def paired_order(d: int) -> torch.Tensor:
    """The PAIRED column order of `kc.e2m1_words_paired` as an index tensor [d] (column -> element), for tests."""
    c = torch.arange(d)
    r = c % 8
    return c - r + ((r & 1) << 2) + (r & 2) + (r >> 2)



@triton.jit
def _attend(q, acc, m_i, l_i, mv_i, kp, ks, vp, vs, valid, qk_scale, D: tl.constexpr, T: tl.constexpr,
            ELEM: tl.constexpr, SCALE: tl.constexpr, QBLOCK: tl.constexpr, NATIVE_FP8: tl.constexpr,
            FP32_DOT: tl.constexpr, F16: tl.constexpr, P_SPLIT: tl.constexpr, PAIRED: tl.constexpr,
            LAZY_L: tl.constexpr, JOINT: tl.constexpr):
    """One tile of the online softmax: decode K, scores [BLOCK_G, T] in the log2 domain, update (m, l), decode V,
    accumulate P . V. Returns (acc, m_i, l_i, mv_i).
    - LAZY_L: l_i is [BLOCK_G, T] (per-column partial sums, rescaled like acc and summed over the columns once after
      the loop), which takes one of the cross-warp reductions (a shared-memory round trip with three barriers when
      the warps split the tile's columns) out of every tile.
    - JOINT (E8M0 V scales): V's per-token factor 2**e_v goes into P through the exponent: P' = 2**(s + e_v - mv)
      with mv_i the running max of s + e_v, reduced in the same cross-warp reduction as the softmax max m_i (one
      instead of two per tile, and no tile max of the V factors); acc is kept relative to mv_i (the kernel moves
      it to m_i's reference after the loop). Exact: e_v is an integer, every factor a power of two."""
    ROWSCALE: tl.constexpr = (SCALE == SCALE_ROW) or (SCALE == SCALE_E8M0)  # a per-token factor (see tiles.decode)
    PAIRED_K: tl.constexpr = PAIRED >= 1
    PAIRED_V: tl.constexpr = PAIRED == 1
    k, k_rs = tiles.decode(kp, ks, D, T, ELEM, SCALE, QBLOCK, NATIVE_FP8, F16, PAIRED_K)
    qk = tl.dot(q, tl.trans(tiles.dot_operand(k, F16, FP32_DOT)))
    if ROWSCALE:
        qk = qk * k_rs[None, :]
    s = tl.where(valid[None, :], qk * qk_scale, -float("inf"))

    if JOINT:
        e_v = (tl.max(vs.to(tl.int32), axis=1) - 127).to(tl.float32)  # V tokens' largest block exponents [T]
        sv = s + e_v[None, :]
        m_blk, mv_blk = tl.split(tl.max(tl.join(s, sv), axis=1))
        m_new = tl.maximum(m_i, m_blk)
        mv_new = tl.maximum(mv_i, mv_blk)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        mv_new = mv_i
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing visible yet: keep exp2 away from -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    if LAZY_L:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    v, v_rs = tiles.decode(vp, vs, D, T, ELEM, SCALE, QBLOCK, NATIVE_FP8, F16, PAIRED_V)
    v = tiles.dot_operand(v, F16, FP32_DOT)
    if JOINT:
        mv_safe = tl.where(mv_new == -float("inf"), 0.0, mv_new)
        p = tl.exp2(sv - mv_safe[:, None])  # <= 1; v (decoded over each token's largest block) times this is exact
        p_hi = tiles.dot_operand(p, F16, FP32_DOT)
        acc = tl.dot(p_hi, v, acc * tl.exp2(mv_i - mv_safe)[:, None])
        if P_SPLIT:
            acc = tl.dot(tiles.dot_operand(p - p_hi.to(tl.float32), F16, FP32_DOT), v, acc)
    elif ROWSCALE:
        # per-token V factors go into P, over the tile's largest so that P stays in [0, 1] (fp16 range)
        rv_max = tl.max(v_rs, axis=0)
        rv_max = tl.where(rv_max > 0, rv_max, 1.0)
        p = p * (v_rs / rv_max)[None, :]
        p_hi = tiles.dot_operand(p, F16, FP32_DOT)
        pv = tl.dot(p_hi, v)
        if P_SPLIT:
            pv = tl.dot(tiles.dot_operand(p - p_hi.to(tl.float32), F16, FP32_DOT), v, pv)
        acc = acc * alpha[:, None] + pv * rv_max
    else:
        p_hi = tiles.dot_operand(p, F16, FP32_DOT)
        acc = tl.dot(p_hi, v, acc * alpha[:, None])
        if P_SPLIT:
            acc = tl.dot(tiles.dot_operand(p - p_hi.to(tl.float32), F16, FP32_DOT), v, acc)
    return acc, m_new, l_i, mv_new


# ---------------------------------------------------------------------------------------------------- main kernel
@triton.jit
def _sparse_attn_kernel(
    q_ptr, k_ptr, v_ptr,  # q bf16 [R, Hq, D]; K / V cache data (bf16 view for bf16, else uint8) [pages, Hkv, bytes]
    out_ptr, part_ptr, ml_ptr,  # out bf16 / fp32 [R, Hq, D]; split partials: acc fp32 [R, Hq, S, D],
                                # (m, l) [R, Hq, S, 2]
    table_ptr, ctx_ptr, req_ptr, pos_ptr, ids_ptr,  # block_table int32 [B, W]; context_lens [B]; rows' request / pos
                                                    # [R]; ids [R, Hkv, topk]
    qk_scale, v_scalar,  # softmax scale * log2(e) * K's folded factors; V's folded factors
    stride_qr, stride_qh,  # q strides (elements)
    stride_kp, stride_kh, stride_vp, stride_vh,  # cache strides in BYTES (page, head)
    stride_tb, stride_ir, stride_ih,  # block-table row stride; selection strides (row, head)
    topk,  # selection width
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,  # query heads per KV head (padded), head dim
    P: tl.constexpr, BS: tl.constexpr, T: tl.constexpr,  # page size, selection block size, tokens per tile
    TW: tl.constexpr,  # tile width as decoded (T, or 32 for 16-token E2M1 tiles on the GPU, see launch_plan)
    ELEM: tl.constexpr, SCALE: tl.constexpr, QBLOCK: tl.constexpr,  # element kind, scale kind, elements per scale
    PB: tl.constexpr,  # payload bytes per token and head
    TILES: tl.constexpr,  # tiles each split walks (constexpr: the interpreter cannot loop to a runtime bound)
    DECODE: tl.constexpr,  # rows are requests (pos = context_len - 1); else rows read req_ptr / pos_ptr
    SPLIT: tl.constexpr,  # write partials for the combine kernel instead of the output
    NATIVE_FP8: tl.constexpr, FP32_DOT: tl.constexpr,  # hardware fp8 conversion; fp32 dots (the interpreter)
    F16: tl.constexpr,  # fp16 dots (formats whose values are exact in fp16) instead of bf16
    P_SPLIT: tl.constexpr,  # P as hi + lo parts (two P.V dots) instead of one rounding
    PREFETCH: tl.constexpr,  # hand pipelining: 2 loads of tile i + 1 and lookups of tile i + 2 overlap tile i; 1
                             # lookups of tile i + 1 only; 0 none
    PAIRED: tl.constexpr,  # E2M1 tiles in PAIRED column order: 1 K and V (q loaded and the output stored in that
                           # order too), 2 K only (q in that order), 0 neither
    LAZY_L: tl.constexpr,  # softmax denominators as per-column partial sums, reduced after the loop (see _attend)
    JOINT: tl.constexpr,  # E8M0 V factors through one joint max with the softmax max (see _attend)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (PDL_MODES): 0 none; 1 the next launch released at the
                            # start; 2 released after the loop
):
    if PDL:  # wait for the kernels before ahead of any global access (every input may come from the kernel before)
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
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
    TPB: tl.constexpr = BS // T

    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    q_cols = tl.arange(0, D)
    if PAIRED >= 1:
        q_cols = kc.paired_cols(q_cols)  # q in the K tiles' column order
    cols = tl.arange(0, D)
    if PAIRED == 1:
        cols = kc.paired_cols(cols)  # the accumulator and the output in the V tiles' column order
    q_rows = q_ptr + row.to(tl.int64) * stride_qr + (h * G + g)[:, None] * stride_qh
    q = tiles.dot_operand(tl.load(q_rows + q_cols[None, :], mask=gmask[:, None], other=0.0), F16, FP32_DOT)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    mv_i = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)  # JOINT: running max of s + e_v
    if LAZY_L:
        l_i = tl.zeros([BLOCK_G, TW], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)

    t_begin = split * TILES
    t_end = tl.minimum(t_begin + TILES, topk * TPB)  # this split's tiles: [t_begin, t_end)
    ids_row = ids_ptr + row.to(tl.int64) * stride_ir + h * stride_ih
    table_row = table_ptr + req.to(tl.int64) * stride_tb
    if PREFETCH == 2:
        # software pipeline by hand: while tile i is computed, the K/V loads of tile i + 1 are in flight and the
        # (block id -> page) lookups of tile i + 2 too, so no load latency sits on the loop's critical path
        s0, live, page = tiles.tile_meta(ids_row, table_row, t_begin, t_end, pos, TPB, BS, T, P)
        s0_n, live_n, page_n = tiles.tile_meta(ids_row, table_row, t_begin + 1, t_end, pos, TPB, BS, T, P)
        kp, ks, valid = tiles.load_raw(k_ptr, page, s0, live, pos, h, stride_kp, stride_kh, P, D, T, TW, PB, ELEM,
                                            SCALE, QBLOCK)
        vp, vs, valid = tiles.load_raw(v_ptr, page, s0, live, pos, h, stride_vp, stride_vh, P, D, T, TW, PB, ELEM,
                                            SCALE, QBLOCK)
        for it in range(TILES):
            kp_n, ks_n, valid_n = tiles.load_raw(k_ptr, page_n, s0_n, live_n, pos, h, stride_kp, stride_kh, P, D, T,
                                                 TW, PB, ELEM, SCALE, QBLOCK)
            vp_n, vs_n, valid_n = tiles.load_raw(v_ptr, page_n, s0_n, live_n, pos, h, stride_vp, stride_vh, P, D, T,
                                                 TW, PB, ELEM, SCALE, QBLOCK)
            s0_n2, live_n2, page_n2 = tiles.tile_meta(ids_row, table_row, t_begin + it + 2, t_end, pos, TPB, BS, T, P)
            acc, m_i, l_i, mv_i = _attend(q, acc, m_i, l_i, mv_i, kp, ks, vp, vs, valid, qk_scale, D, TW, ELEM,
                                          SCALE, QBLOCK, NATIVE_FP8, FP32_DOT, F16, P_SPLIT, PAIRED, LAZY_L,
                                          JOINT)
            kp, ks, vp, vs, valid = kp_n, ks_n, vp_n, vs_n, valid_n
            s0_n, live_n, page_n = s0_n2, live_n2, page_n2
    elif PREFETCH == 1:
        # lookups only: tile i + 1's (block id -> page) loads are in flight during tile i; its K/V loads are issued
        # in its own iteration (where Triton's pipeliner, num_stages >= 2, may move them earlier)
        s0_n, live_n, page_n = tiles.tile_meta(ids_row, table_row, t_begin, t_end, pos, TPB, BS, T, P)
        for it in range(TILES):
            s0, live, page = s0_n, live_n, page_n
            s0_n, live_n, page_n = tiles.tile_meta(ids_row, table_row, t_begin + it + 1, t_end, pos, TPB, BS, T, P)
            kp, ks, valid = tiles.load_raw(k_ptr, page, s0, live, pos, h, stride_kp, stride_kh, P, D, T, TW, PB, ELEM,
                                           SCALE, QBLOCK)
            vp, vs, valid = tiles.load_raw(v_ptr, page, s0, live, pos, h, stride_vp, stride_vh, P, D, T, TW, PB, ELEM,
                                           SCALE, QBLOCK)
            acc, m_i, l_i, mv_i = _attend(q, acc, m_i, l_i, mv_i, kp, ks, vp, vs, valid, qk_scale, D, TW, ELEM,
                                          SCALE, QBLOCK, NATIVE_FP8, FP32_DOT, F16, P_SPLIT, PAIRED, LAZY_L,
                                          JOINT)
    else:
        for it in range(TILES):  # the last split may run past the end: masked
            s0, live, page = tiles.tile_meta(ids_row, table_row, t_begin + it, t_end, pos, TPB, BS, T, P)
            kp, ks, valid = tiles.load_raw(k_ptr, page, s0, live, pos, h, stride_kp, stride_kh, P, D, T, TW, PB, ELEM,
                                           SCALE, QBLOCK)
            vp, vs, valid = tiles.load_raw(v_ptr, page, s0, live, pos, h, stride_vp, stride_vh, P, D, T, TW, PB, ELEM,
                                           SCALE, QBLOCK)
            acc, m_i, l_i, mv_i = _attend(q, acc, m_i, l_i, mv_i, kp, ks, vp, vs, valid, qk_scale, D, TW, ELEM,
                                          SCALE, QBLOCK, NATIVE_FP8, FP32_DOT, F16, P_SPLIT, PAIRED, LAZY_L,
                                          JOINT)

    if PDL == 2:  # the dependents' own wait still covers this program's stores below (it waits for completion)
        gdc_launch_dependents()
    if LAZY_L:
        l_i = tl.sum(l_i, axis=1)
    if JOINT:  # acc from mv_i's reference to m_i's (2**(mv - m) <= 2**127: e_v <= 127)
        mv_safe = tl.where(mv_i == -float("inf"), 0.0, mv_i)
        acc = acc * tl.exp2(mv_safe - tl.where(m_i == -float("inf"), 0.0, m_i))[:, None]
    heads = row.to(tl.int64) * G * (tl.num_programs(1)) + h * G + g  # flat (row, query head) index
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
    PDL: tl.constexpr = 0,  # programmatic dependent launch (PDL_MODES): 0 none, 1 (or True) the next launch released
                            # at the start, 2 after the store
):
    """One program per flat (row, query head) n: merge its num_splits partials (acc, m, l) into its output row."""
    if PDL:  # the partials come from the kernel before: wait for it before the first load
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
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
    if PDL == 2:
        gdc_launch_dependents()


# ------------------------------------------------------------------------------------------------------ launchers
def _scalar_of(cache, name: str) -> float:
    """The whole-tensor factor a cache's dequantized values carry (fp8 `tensor` scale, nvfp4 g_dec; else 1)."""
    if cache.fmt.scale_element == "fp32-tensor":
        if cache.tensor_amax is None:
            raise KernelArgumentError(f"{name}: an fp8 tensor-scaled cache without tensor_amax (nothing stored yet)")
        return cache_scales(cache)[0]
    return float(cache_scales(cache)[1])


def _check_caches(k_cache, v_cache, q: torch.Tensor, hq: int, d: int, block_size: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not all(hasattr(c, a) for a in PAGED_FIELDS):
            raise KernelArgumentError(f"{name} must be a paged cache ({', '.join(PAGED_FIELDS)}, as "
                                      f"kvtool.paged.PagedCache), got {type(c).__name__}")
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
                num_splits: int | None = None, tile_tokens: int | None = None,
                num_warps: int | None = None, quantized: bool = False,
                sms: int | None = None) -> tuple[int, int, int, int]:
    """(tokens per tile, splits, tiles per split, warps) the launchers use. Default tile: on the GPU 64 tokens
    (`DEFAULT_TILE`), in the interpreter whole pages (up to 128), since it pays per operation rather than per
    element. Default splits and warps on the GPU (`sms` SMs, queried when None; off the GPU 1 split):
    - quantized formats (fp16 dots) with enough tiles to fill every SM's `RESIDENT` programs: 2 warps per program
      and splits = RESIDENT x SMs // (rows x KV heads), one wave (faster than 4 warps on the H200 at M3's shape,
      docs/kernels/sparse_attn.md);
    - bf16: 4 warps and the largest power-of-two number of splits that keeps the grid within `RESIDENT` programs
      per SM (one wave), never more splits than tiles; where rows x KV heads fill two programs per SM to within
      1/8 (`pairs_whole_pages`), one split of whole-page tiles (up to 128 tokens) instead, which drops the combine
      launch and the partials (both rules measured on the H200 at M3's shape, batch 1 to 512;
      docs/kernels/sparse_attn.md);
    - quantized formats with too few tiles (batch 16 and below at M3's shape, not re-measured): 4 warps and about
      two programs per SM, never more splits than tiles.
    Explicit options win (a given tile keeps the power-of-two splits). Warps are capped at tile / 8 (the score dot
    [16, T] spreads its T columns over the warps 8 at a time; beyond that warps only hold copies)."""
    interp = INTERPRET
    programs = max(1, rows * num_kv_heads)
    if sms is None and torch.device(device).type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    whole = (not quantized and sms is not None and num_splits is None and tile_tokens is None
             and pairs_whole_pages(programs, sms))
    t = min(tile_tokens or (128 if interp or whole else DEFAULT_TILE), page_size)
    if page_size % t or (t < 16 and not interp):
        raise KernelArgumentError(f"a tile of {t} tokens must divide the page size {page_size} and be >= 16")
    n_tiles = topk * (block_size // t)
    fill = quantized and sms is not None and programs * n_tiles >= RESIDENT * sms
    if num_splits is None:
        splits = 1
        if sms is not None and not quantized and not whole:
            splits = 1 << (max(1, RESIDENT * sms // programs).bit_length() - 1)
        elif sms is not None and quantized:
            splits = RESIDENT * sms // programs if fill else math.ceil(2 * sms / programs)
        splits = max(1, min(n_tiles, splits))
    else:
        splits = int(num_splits)
    if splits < 1:
        raise KernelArgumentError(f"num_splits must be >= 1, got {splits}")
    warps = int(num_warps or (2 if fill else 4))
    if warps < 1 or warps & (warps - 1):
        raise KernelArgumentError(f"num_warps must be a power of two, got {warps}")
    warps = max(1, min(warps, t // 8))
    per = max(1, math.ceil(n_tiles / splits))
    return t, max(1, math.ceil(n_tiles / per)), per, warps  # no empty trailing splits


def pairs_whole_pages(programs: int, sms: int) -> bool:
    """Whether a bf16 decode grid of `programs` (rows x KV heads) runs one split of whole-page tiles by default:
    where they fill two programs per SM to within 1/8, the one grid size at which that measured faster than the
    split 64-token tiles on the H200 (M3's shape; below and above two per SM it was slower: docs/kernels/
    sparse_attn.md)."""
    return 2 * sms - sms // 8 <= programs <= 2 * sms


def uses_fp16_dots(fmt) -> bool:
    """The kernel runs fp16 dots for every quantized format (their tiles are exact in fp16 once whole-tensor and
    per-token factors are taken out, see `tiles.decode`), and bf16 dots for bf16 (whose range fp16 lacks)."""
    return fmt.element is not None


def _launch(q, k_cache, v_cache, block_table, block_ids, block_size, scale, num_splits, decode, ctx, req, pos,
            tile_tokens, num_warps, num_stages, native_fp8, out_dtype, precise_p, prefetch, paired, maxnreg, lazy_l,
            joint_max, pdl=None):
    rows, hq, d = q.shape
    hkv, topk = k_cache.num_heads, block_ids.shape[-1]
    fmt = k_cache.fmt
    interp = INTERPRET
    if native_fp8 is None:
        native_fp8 = store_native_fp8(q.device)  # the store's rule: CUDA (not ROCm) capability >= 8.9, compiled
    f16 = uses_fp16_dots(fmt)
    desc = kd.kernel_desc(fmt)
    e2m1 = desc.elem == kd.ELEM_E2M1
    t, splits, tiles_per_split, warps = launch_plan(rows, hkv, topk, block_size, k_cache.page_size, q.device,
                                                    num_splits, tile_tokens, num_warps, quantized=f16)
    # bf16 tiles feed the dots as loaded, which Triton's pipeliner handles (copies straight to shared memory)
    if prefetch is None:
        prefetch = 1 if f16 else 0
    prefetch = 2 if prefetch is True else 0 if prefetch is False else int(prefetch)
    # E2M1 tiles of 16 tokens compiled to wrong results on the H200 (Triton 3.6.0; with 2 and 4 warps, both column
    # orders, every loop; tiles of 32+ tokens were right): decode them 32 wide, the upper half masked (never loaded;
    # the interpreter runs the same padded path, so it is tested on CPU too)
    tw = max(t, 32) if e2m1 else t
    if prefetch not in (0, 1, 2):
        raise KernelArgumentError(f"prefetch must be 0, 1, 2 (or a bool), got {prefetch}")
    if paired not in (None, False, True, "k"):
        raise KernelArgumentError(f"paired must be a bool or 'k' (K tiles only), got {paired!r}")
    paired = 0 if not e2m1 or not paired else 2 if paired == "k" else 1
    if num_stages is None:
        num_stages = DEFAULT_STAGES[prefetch]
    if tw != t:
        warps = max(1, min(int(num_warps or 4), tw // 8))
    # 4-warp programs: 4 per SM (65536 registers; ptxas may spill a few bytes); 2-warp programs run uncapped (~240
    # registers, still 4 per SM; a larger cap with 2 stages measured slower, docs/kernels/sparse_attn.md)
    if maxnreg is None:
        maxnreg = 128 if f16 and warps == 4 else 0
    launch_opts = {"maxnreg": int(maxnreg)} if maxnreg and q.device.type == "cuda" and torch.version.cuda else {}
    # programmatic dependent launch (platform.LAUNCH_PDL): grids of at most PDL_EARLY_MAX_PROGRAMS programs per SM
    # release the next launch at their start (about a microsecond a layer saved, H200); larger decode grids release
    # it later or not at all (PDL_LATE_TILES), since dependents resident early beside a full machine of these
    # programs cost time (docs/kernels/sparse_attn.md); larger prefill grids launch without it; option pdl instead
    if pdl is not None and pdl not in PDL_MODES:
        raise KernelArgumentError(f"pdl must be one of {sorted(map(str, PDL_MODES))} or None, got {pdl!r}")
    if interp or not pdl_ok(q.device):
        pdl, pdl_combine = PDL_MODES[False]
    elif pdl is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        late = next((mode for most, mode in PDL_LATE_TILES if tiles_per_split <= most), False)
        pdl, pdl_combine = PDL_MODES["early" if rows * hkv * splits <= PDL_EARLY_MAX_PROGRAMS * sms
                                     else late if decode else False]
    else:
        pdl, pdl_combine = PDL_MODES[pdl]
    if pdl:
        launch_opts["launch_pdl"] = True
    if e2m1 and any(
            c.data.stride(i) % 4 for c in (k_cache, v_cache) for i in (0, 1)):
        raise KernelArgumentError("E2M1 caches are read as 4-byte words: page and head slabs must be 4-byte aligned "
                                  f"(page size {k_cache.page_size} x {fmt.bytes_per_token(d)} bytes per token)")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    unit = E2M1_UNIT if e2m1 else 1.0  # e2m1_words_f16's 2**-14
    qk_scale = scale * LOG2E * _scalar_of(k_cache, "k_cache") * unit
    v_scalar = _scalar_of(v_cache, "v_cache") * unit
    _check_out_dtype(out_dtype)
    out = torch.empty(rows, hq, d, dtype=out_dtype, device=q.device)
    if rows == 0:
        return out
    if splits > 1:
        part = torch.empty(rows * hq * splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(rows * hq * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    payload_view = torch.bfloat16 if desc.elem == kd.ELEM_BF16 else torch.uint8
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
        P=k_cache.page_size, BS=block_size, T=t, TW=tw,
        ELEM=desc.elem, SCALE=desc.token_scale,
        QBLOCK=max(fmt.block, 1), PB=fmt.payload_bytes(d), TILES=tiles_per_split,
        DECODE=decode, SPLIT=splits > 1, NATIVE_FP8=bool(native_fp8), FP32_DOT=interp, F16=f16,
        P_SPLIT=(not f16) if precise_p is None else bool(precise_p), PREFETCH=prefetch, PAIRED=paired,
        LAZY_L=(DEFAULT_LAZY_L and f16) if lazy_l is None else bool(lazy_l),
        JOINT=fmt.scale_element == "e8m0" and (DEFAULT_JOINT if joint_max is None else bool(joint_max)),
        PDL=pdl, num_warps=warps, num_stages=num_stages, **launch_opts,
    )
    if splits > 1:
        _combine_kernel[(rows * hq,)](part, ml, out, v_scalar, splits,
                                      BLOCK_S=triton.next_power_of_2(splits), D=d, PDL=pdl_combine,
                                      num_warps=COMBINE_WARPS, **({"launch_pdl": True} if pdl_combine else {}))
    return out


def uses_gluon(q: torch.Tensor, k_cache, v_cache, block_size: int) -> bool:
    """Whether `sparse_decode`'s default launch (no options) takes the Gluon fast path for these inputs."""
    return _use_gluon(q, k_cache, v_cache, block_size, None, {})


def _use_gluon(q, k_cache, v_cache, block_size: int, want: bool | None, portable: dict,
               scale: float | None = None) -> bool:
    """The NVIDIA fast path (`kernels/sparse_attn_gluon.py`) for FP4 decode: gluon=True requires it, False keeps
    the portable kernel; by default it runs where it applies, from `attn_gluon.MIN_PROGRAMS` requests x KV heads,
    unless a portable-kernel option is given or the softmax scale is not positive (the fast path folds the scale in
    after the row maximum)."""
    given = sorted(k for k, v in portable.items() if v is not None)
    if want and given:
        raise KernelArgumentError(f"sparse_decode: gluon=True does not take the portable kernel's options {given}")
    if want is False or given:
        return False
    if scale is not None and not float(scale) > 0:
        if want:
            raise KernelArgumentError(f"sparse_decode: gluon=True needs a positive softmax scale, got {scale}")
        return False
    ok = attn_gluon.device_ok(q.device) and attn_gluon.applies(q, k_cache, v_cache, block_size)
    least = attn_gluon.MIN_PROGRAMS[attn_gluon.format_key(k_cache.fmt)] if ok else 0
    if want is None and ok and q.shape[0] * k_cache.num_heads < least:
        return False  # small batches: the portable kernel's splits were faster (attn_gluon.MIN_PROGRAMS)
    if want and not ok:
        raise KernelArgumentError("sparse_decode: gluon=True needs a CUDA device with capability >= 8.9, nvfp4 or "
                                  "mxfp4 K and V, head dim 128, at most 16 query heads per KV head and 128-token "
                                  "blocks and pages")
    return ok


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise KernelArgumentError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def _check_q(q: torch.Tensor, name: str = "q") -> None:
    if q.dim() != 3 or q.dtype != torch.bfloat16 or q.stride(-1) != 1:
        raise KernelArgumentError(f"{name} must be bf16 [rows, Hq, D] with a contiguous last dim, got {q.dtype} "
                                  f"{list(q.shape)}")
    if q.shape[-1] % 32 or triton.next_power_of_2(q.shape[-1]) != q.shape[-1]:
        raise KernelArgumentError(f"head dim must be a power of two >= 32, got {q.shape[-1]}")


def sparse_decode(q: torch.Tensor, k_cache, v_cache, block_table: torch.Tensor,
                  context_lens: torch.Tensor, block_ids: torch.Tensor, block_size: int, scale: float | None = None,
                  num_splits: int | None = None, *, tile_tokens: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, native_fp8: bool | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, precise_p: bool | None = None,
                  prefetch: int | bool | None = None, paired: bool | str | None = None,
                  maxnreg: int | None = None, lazy_l: bool | None = None,
                  joint_max: bool | None = None, gluon: bool | None = None, gluon_tile: int | None = None,
                  fused_combine: bool | None = None, pdl: str | bool | None = None) -> torch.Tensor:
    """One decode step of sparse attention for B requests.

    q bf16 [B, Hq, D] (the token at position context_lens[b] - 1, already stored in the caches); k_cache / v_cache:
    PagedCache (same format, page size P and Hkv heads) on q's device; block_table int32 [B, max_pages] (-1 padded);
    context_lens int32 [B]; block_ids int32 [B, Hkv, topk] (ids of `block_size`-token blocks, -1 padded; block_size a
    multiple of P); scale default 1/sqrt(D). Query head h reads KV head h // (Hq / Hkv). Returns bf16 [B, Hq, D]
    (zeros for a request whose selection holds no visible token). num_splits: programs per (request, KV head) along
    the selected tokens (default: enough to fill the GPU; > 1 adds the combine kernel). out_dtype torch.float32 skips
    the final bf16 rounding (verification). Keyword options tune the launch (tokens per tile, warps, pipeline stages,
    hardware fp8 conversion; precise_p: P as hi + lo parts (two P.V dots) or one rounding; default: split for bf16
    dots, where one rounding costs ~2^-9 per probability, single for fp16 dots, ~2^-12; prefetch: 2 (True) the
    hand-pipelined loop (num_stages default 1), 1 page lookups one tile ahead (default for quantized formats;
    num_stages default 3: Triton's pipeliner keeps one tile's K/V copies in flight), 0 (False) none (default for
    bf16; num_stages 2); maxnreg: register cap per thread on CUDA (default 128 for quantized formats with 4 warps,
    0 = none); warps (default 2 or 4) and splits: see `launch_plan`; paired: E2M1 decoded in PAIRED order (fewer
    integer ops, but slower on the H200; default off), True for K and V, "k" for K only, see
    `kc.e2m1_words_paired`; lazy_l: softmax denominators as per-column sums reduced after the loop (default on for
    quantized formats); joint_max: E8M0 V factors through the softmax max (default on), see `_attend`; pdl:
    programmatic dependent launch releasing the next launch "early" (at the start) or "late" (after the loop and
    the combine's stores), "late-main" (the combine at its start), or False: none; default by grid size,
    PDL_EARLY_MAX_PROGRAMS and PDL_LATE_TILES). gluon: the
    NVIDIA fast path forced (True), refused (False) or where it applies (None, see `_use_gluon`); with gluon=True,
    gluon_tile (its tokens per tile, 64 or 128) and fused_combine (the split merge in the decode's last program, or
    the combine kernel) tune it (defaults: `attn_gluon.plan`, `attn_gluon.sparse_decode`). No host synchronization,
    so it can be captured in a CUDA graph."""
    _check_q(q)
    b, hq, d = q.shape
    _check_caches(k_cache, v_cache, q, hq, d, block_size)
    _check_int("block_table", block_table, (b, block_table.shape[-1] if block_table.dim() == 2 else -1), q.device)
    _check_int("context_lens", context_lens, (b,), q.device)
    _check_int("block_ids", block_ids, (b, k_cache.num_heads, block_ids.shape[-1]), q.device)
    portable = {"tile_tokens": tile_tokens, "num_warps": num_warps, "num_stages": num_stages, "native_fp8": native_fp8,
                "precise_p": precise_p, "prefetch": prefetch, "paired": paired, "maxnreg": maxnreg, "lazy_l": lazy_l,
                "joint_max": joint_max, "pdl": pdl}
    fast = {k: v for k, v in {"tokens_per_tile": gluon_tile, "fused_combine": fused_combine}.items() if v is not None}
    if fast and gluon is not True:
        raise KernelArgumentError("sparse_decode: gluon_tile and fused_combine tune the Gluon path: pass gluon=True")
    if _use_gluon(q, k_cache, v_cache, block_size, gluon, portable, scale):
        _check_out_dtype(out_dtype)
        if num_splits is not None and int(num_splits) < 1:
            raise KernelArgumentError(f"num_splits must be >= 1, got {num_splits}")
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        return attn_gluon.sparse_decode(q, k_cache, v_cache, block_table, context_lens, block_ids,
                                        scale * LOG2E * _scalar_of(k_cache, "k_cache") * E2M1_UNIT,
                                        _scalar_of(v_cache, "v_cache") * E2M1_UNIT, num_splits, out_dtype,
                                        _combine_kernel, **fast)
    return _launch(q, k_cache, v_cache, block_table, block_ids, block_size, scale, num_splits, True, context_lens,
                   context_lens, context_lens, tile_tokens, num_warps, num_stages, native_fp8, out_dtype,
                   precise_p, prefetch, paired, maxnreg, lazy_l, joint_max, pdl)


def sparse_prefill(q: torch.Tensor, k_cache, v_cache, block_table: torch.Tensor,
                   q_req: torch.Tensor, q_pos: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                   scale: float | None = None, num_splits: int | None = None, *, tile_tokens: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, native_fp8: bool | None = None,
                   out_dtype: torch.dtype = torch.bfloat16, precise_p: bool | None = None,
                   prefetch: int | bool | None = None, paired: bool | str | None = None,
                   maxnreg: int | None = None, lazy_l: bool | None = None,
                   joint_max: bool | None = None) -> torch.Tensor:
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
                   q_pos, tile_tokens, num_warps, num_stages, native_fp8, out_dtype, precise_p, prefetch, paired,
                   maxnreg, lazy_l, joint_max)
