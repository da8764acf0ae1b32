"""NVIDIA fast path of sparse-attention decode for FP4 K/V (nvfp4, mxfp4), written in Gluon (Triton's explicit-layout
dialect), so that decoded K and V are born in the tensor-core operand registers.

Why a second kernel: the portable kernel (`kernels/sparse_attn.py`) decodes E2M1 into blocked layouts that Triton
moves into the dot operand layouts through shared memory; its per-tile time did not depend on the bytes it loads and
ncu found it bound by those shared-memory round trips (see that module's docstring). Here, per tile of `tokens_per_tile`
tokens (128, one page; 64 also compiles) of one (request, KV head), 4 warps:
- S = Q K^T: Q [16 query heads, 128] is the mma.sync A operand (scaled per head by 2**a into fp16's range), K^T
  [128 dim slots, tile] the B operand, decoded in place from the 16 bytes of each token row that a thread's B
  registers need (dim slot c holds element `k_column_element(c)`; Q is loaded in the same order); warp w owns token
  columns 8 w .. 8 w + 7 of every 32;
- O [16, 128] is split by head-dim column across the warps: warp w owns elements 32 w .. 32 w + 31 (one E8M0 block,
  two E4M3 blocks; 16 fp32 registers a thread), and P [16, tile] reaches every warp through shared memory (the A
  operand of O += P V: stored with stmatrix, read back as ldmatrix fragments, so that every A register quad arrives
  whole);
- the softmax's reference is stale: p = 2**(s * f - m) with m the running max of the tiles before, which every
  warp knows, so no cross-warp max precedes the exp and nothing is rescaled while no score passes m + TAU (p <=
  2**TAU in fp16). Each warp's "passed" flag (each thread's own test of its scores, then one vote.any: no shuffles)
  rides with P through shared memory; after P's barrier any flag sends the whole CTA to the exact update (cross-warp
  max, rescale of O and the sums, P stored again), as on the first tile.
  The per-head factor f (2**-a times the softmax scale) rides in exp2's argument (one FFMA a score: the row maximum
  of the raw scores times a positive factor is the maximum of the scaled ones), and the causal mask runs only on a
  tile that holds tokens after the query;
- V [tile, 128] is the B operand: V's shared-memory tile read as fp16-sized units (4 elements) with ldmatrix.trans,
  which puts a unit of two consecutive tokens in one register (a B register pair once decoded), then
  `kc.e2m1_pairs` (`decode_v`, before the softmax: integer work beside the S dot's latency); the block factors
  multiply it after P's barrier (`scale_v`); output column n holds element `v_column_element(n)` and is stored in
  element order;
- block scales as fp16 factors, one HMUL2 per register pair: nvfp4 the E4M3 bytes (hardware conversion; code x scale
  is exact in fp16); mxfp4 the portable kernel's normalization, 2**(e - e_tok) with e_tok the token's largest E8M0
  exponent, and 2**e_tok applied in fp32 to the score column (K) or through P (V: P' = 2**(s + e_v - mv) with mv the
  running max of s + e_v, the portable kernel's JOINT form). Factors that several lanes need are computed once per
  token (a thread a token) into shared memory as [blocks, tokens]: V's for both formats, and mxfp4's K factors and
  score-column factors;
- K and V tiles come in as async copies (cp.async) into a STAGES-deep shared-memory ring (2: copies one tile ahead,
  their block ids and pages further ahead), so loads in flight hold no registers; V's ring is swizzled by token
  bits 1, 2 so that ldmatrix's eight rows sit in eight different 16-byte chunks; the loop ends
  after the row's last live selection slot (one vector load of the row's ids first), so that -1 padding and short
  contexts cost no tiles;
- one split writes the bf16 (or fp32) output itself; several write the portable kernel's fp32 partials (acc, m, l),
  and the last program of each (request, KV head) to arrive (an int32 arrival counter per pair: barrier, acq_rel
  atomic at GPU scope; the last one resets it) merges them as the portable `_combine_kernel` does and writes the
  output: no second launch (`fused_combine`).
Semantics are the portable kernel's (SPEC section 3): tokens after the query, -1 selection slots, selected blocks
wholly after the query and -1 pages are never read (score -inf; copies of zeros, V scales of tokens after the query
read as 0 factors), a row with no visible token gives zeros, whole-tensor factors (the nvfp4 outer scale, E2M1's 2**-14
unit) fold into the softmax scale and the final normalization. P is rounded once to fp16 (as the portable kernel's
default for fp16 dots).

Where the time goes: probes on the H200 put nearly all of a layer in the skeleton (page lookups, copies, dots,
softmax exchange) and little in the E2M1 decode, so the remaining gap to 70 % of copy is not the decode. The current
times, every step with its numbers, the probes, and the variants tried and not kept (TMA
tiles, deeper copies, more programs per SM, warp specialization, unrolling, wgmma P V, deferred P V):
docs/kernels/sparse_attn_gluon.md.

Where it runs: CUDA devices with Gluon and the hardware E4M3 conversion (capability >= 8.9); decode; nvfp4 or mxfp4
K and V; head dim 128; at most 16 query heads per KV head; 128-token selection blocks and pages. Elsewhere (gfx950
included) `sparse_decode` runs the portable kernel, whose code CI tests in the interpreter; CI compiles this one
for sm_90 (tests/kernels/test_kernel_compile.py) and the GPU tests compare it with the portable kernel and the reference.
"""

from __future__ import annotations

import math

import torch
import triton

from kvtool.errors import KernelArgumentError
from kvtool.formats import kernel_desc as kd
from kvtool.kernels import codecs as kc
from kvtool.kernels.platform import cuda_at_least, num_sms, pdl_ok

__all__ = [
    "BLOCK", "DEFAULT_FUSED_COMBINE", "DEFAULT_TOKENS_PER_TILE", "DIM", "MAX_GROUP", "MIN_PROGRAMS", "MIN_SPLIT_TOKENS",
    "NUM_WARPS", "PAYLOAD", "SCALE_BYTES", "TILE", "TILE_SIZES", "applies", "default_splits", "device_ok", "format_key",
    "plan", "sparse_decode", "split_counters", "twice_the_tokens"
]

try:  # Gluon ships with Triton >= 3.5; without it the portable kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the pinned Triton has it
    gluon = None

TILE = 64  # the layouts' base token count (half a page); a launch's tokens_per_tile picks 64- or 128-token tiles
BLOCK = 128  # selection block = page (tokens)
DIM = 128  # head dim
MAX_GROUP = 16  # query heads per KV head (the mma's M)
NUM_WARPS = 4  # each: 8 of every 32 token columns of S, 32 head-dim columns of O
PAYLOAD = DIM // 2  # nvfp4 payload bytes per token
# The two E2M1 formats this kernel reads, by (scale kind, block) of their descriptors: nvfp4 (E4M3 per 16 elements)
# and mxfp4 (E8M0 per 32); scale bytes per token.
NVFP4, MXFP4 = (kd.SCALE_E4M3, 16), (kd.SCALE_E8M0, 32)
SCALE_BYTES = {NVFP4: DIM // 16, MXFP4: DIM // 32}


def format_key(fmt) -> tuple[int, int] | None:
    """(scale kind, block) of an E2M1 format (the keys of SCALE_BYTES and MIN_PROGRAMS), None for other elements."""
    d = kd.kernel_desc(fmt)
    return (d.token_scale, d.block) if d.elem == kd.ELEM_E2M1 else None


def twice_the_tokens(layout, dim: int):
    """A linear layout at twice the tokens along `dim`: token bit 6 in one more register (64- -> 128-token tiles)."""
    reg = [list(b) for b in layout.reg_bases] + [[64 if i == dim else 0 for i in range(len(layout.shape))]]
    shape = list(layout.shape)
    shape[dim] *= 2
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=layout.lane_bases, warp_bases=layout.warp_bases,
                                      block_bases=layout.block_bases, shape=shape)


if gluon is not None:
    MS = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    AS = gl.DotOperandLayout(operand_index=0, parent=MS, k_width=2)
    BS = gl.DotOperandLayout(operand_index=1, parent=MS, k_width=2)
    # K words [64 tokens, 16 words]: BS's tokens (registers: token bit 5; lanes g: bits 0-2; warps: bits 3, 4), word
    # bits 0, 1 in registers, 2, 3 on the lanes t (BS's k bits 1, 2); scale bytes [64, 8] alike (block = word // 2)
    WK = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [32, 0]],
                                    lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[TILE, 16])
    SK = gl.DistributedLinearLayout(reg_bases=[[0, 1], [32, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[TILE, 8])
    Q_L = gl.BlockedLayout([1, 4], [4, 8], [NUM_WARPS, 1], [1, 0])
    O_L = gl.BlockedLayout([1, 4], [2, 16], [NUM_WARPS, 1], [1, 0])
    ML_L = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    P3 = gl.BlockedLayout([4, 1, 16], [1, 4, 8], [1, NUM_WARPS, 1], [2, 1, 0])  # the merge's [4 splits, 16, 128]
    e2m1_pairs = gluon.jit(kc.e2m1_pairs.fn)
    exp2_int = gluon.jit(kc.exp2_int.fn)
    pow2_f16 = gluon.jit(kc.pow2_f16.fn)

    @gluon.jit
    def pair_join(p):
        """int32 [...] holding two fp16 -> fp16 [..., 2] (low, high): a register split, no instruction (the int16
        truncation and join it replaces cost a PRMT per half on sm_90)."""
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=1)
        return gl.join(lo, hi)

    @gluon.jit
    def k_column_element(c):
        """K^T row c (a dim slot of the S dot) -> head-dim element (as the index scorer's column_element)."""
        w = ((c >> 5) & 3) + 4 * ((c >> 1) & 3)
        return 8 * w + ((c >> 3) & 3) + 4 * (c & 1)

    @gluon.jit
    def decode_k(words, f, lo3, sign8):
        """K words int32 [TT tokens, 16] (WK, or WK2 at 128 tokens), fp16 factors [TT, 8] (SK / SK2: one per 16
        elements) -> K^T fp16 [128, TT] in BS (dim slot c = k_column_element(c)), values * 2**-14 * factor."""
        TT: gl.constexpr = words.shape[0]
        f = gl.convert_layout(gl.reshape(gl.join(f, f), [TT, 16]), words.type.layout, assert_trivial=True)
        p0, p1, p2, p3 = e2m1_pairs(words, lo3, sign8)
        # [64 tokens, 16 w, h, k0, k1]
        x = gl.join(gl.join(pair_join(p0), pair_join(p1)), gl.join(pair_join(p2), pair_join(p3)))
        s = gl.join(f, f)
        s = gl.join(s, s)
        x = x * gl.join(s, s)
        x = gl.reshape(x, [TT, 2, 2, 2, 2, 2, 2, 2])  # token, w3, w2, w1, w0, h, k0, k1
        x = gl.permute(x, (3, 4, 7, 6, 1, 2, 5, 0))  # c bits high to low: w1, w0, k1, k0, w3, w2, h; then token
        return gl.convert_layout(gl.reshape(x, [128, TT]), BS, assert_trivial=True)

    @gluon.jit
    def byte_max(w):
        """int32 words -> the largest of their four bytes (unsigned)."""
        return gl.maximum(gl.maximum(w & 0xFF, (w >> 8) & 0xFF), gl.maximum((w >> 16) & 0xFF, (w >> 24) & 0xFF))

    @gluon.jit
    def e8m0_token_factors(words):
        """A tile's E8M0 scale words [TT] (a token's four block bytes, in FC's slice: a thread a token) -> (fp16 [4,
        TT] factors 2**(e - e_tok), int32 [TT] e_tok), e_tok the token's largest block exponent byte: <= 1 and finite
        for any bytes (stale ones after the query too)."""
        blk = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, FC)), 1)
        e_tok = byte_max(words)
        return pow2_f16(((gl.expand_dims(words, 0) >> (8 * blk)) & 0xFF) - gl.expand_dims(e_tok, 0)), e_tok

    @gluon.jit
    def load_repeated(view, layout: gl.constexpr, R: gl.constexpr):
        """A shared-memory table [X, N] or [X, N, Y] -> registers [X, N R] or [X, N R, Y] in `layout`, entry n
        repeated at n R .. n R + R - 1: loaded once and broadcast in registers (a broadcast, not an add of zeros),
        for factor tables that several elements of a thread share."""
        X: gl.constexpr = view.shape[0]
        N: gl.constexpr = view.shape[1]
        if len(view.shape) == 2:
            z = gl.reshape(gl.full([X, N * R], 0.0, view.dtype, layout=layout), [X, N, R])
            t = gl.expand_dims(view.load(gl.SliceLayout(2, z.type.layout)), 2)
            return gl.convert_layout(gl.reshape(gl.broadcast(t, z)[0], [X, N * R]), layout, assert_trivial=True)
        else:
            Y: gl.constexpr = view.shape[2]
            z = gl.reshape(gl.full([X, N * R, Y], 0.0, view.dtype, layout=layout), [X, N, R, Y])
            t = gl.expand_dims(view.load(gl.SliceLayout(2, z.type.layout)), 2)
            return gl.convert_layout(gl.reshape(gl.broadcast(t, z)[0], [X, N * R, Y]), layout, assert_trivial=True)

    @gluon.jit
    def e4m3_factors(sb):
        """int8 E4M3 scale bytes (any shape) -> their fp16 values (hardware conversion; E2M1 code x scale is exact in
        fp16). mxfp4's factors 2**(e - e_tok) come from the per-token pass (`pow2_f16`: the portable kernel's
        normalization, `attn_tiles.decode`, exact while a token's blocks lie within 2**9 of its largest)."""
        return sb.to(gl.float8e4nv, bitcast=True).to(gl.float16)

    @gluon.jit
    def _page(bid, table_row, pos):
        """A block's page; -1 for a -1 id or a block wholly after the query (never looked up)."""
        return gl.load(table_row + gl.maximum(bid, 0), mask=(bid >= 0) & (bid * 128 <= pos), other=-1)

    @gluon.jit
    def _combine(part_ptr, ml_ptr, out_ptr, head0, G: gl.constexpr, n_splits, v_scalar):
        """The split merge of the portable `_combine_kernel` for one (row, KV head) (query heads head0 .. head0 + G - 1
        flat), read past L1 (`.cg`: other programs wrote the partials). Four splits a round: their m, l and partial
        rows are loaded at once and merged online, so the last program waits one L2 round trip per four splits (the
        first form waited two per split: every load fed the next step)."""
        SL: gl.constexpr = gl.SliceLayout(2, P3)  # [4 splits, 16 heads]
        RL: gl.constexpr = gl.SliceLayout(0, P3)  # [16 heads, 128 columns]
        HL: gl.constexpr = gl.SliceLayout(1, RL)  # [16 heads] of the result
        sp = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, SL)), 1)
        hs = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, SL)), 0)
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, RL))
        c3 = gl.expand_dims(gl.expand_dims(cols, 0), 0)
        m_run = gl.full([16], float("-inf"), gl.float32, layout=HL)
        l_run = gl.full([16], 0.0, gl.float32, layout=HL)
        o = gl.full([16, 128], 0.0, gl.float32, layout=RL)
        for s0 in range(0, n_splits, 4):
            live = (hs < G) & (s0 + sp < n_splits)
            slot = (head0 + hs) * n_splits + s0 + sp  # [4, 16]
            m = gl.load(ml_ptr + slot * 2, mask=live, other=float("-inf"), cache_modifier=".cg")
            lv = gl.load(ml_ptr + slot * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
            part = gl.load(part_ptr + gl.expand_dims(slot, 2) * 128 + c3, mask=gl.expand_dims(live, 2), other=0.0,
                           cache_modifier=".cg")
            m_new = gl.maximum(m_run, gl.convert_layout(gl.max(m, axis=0), HL, assert_trivial=True))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_run - m_safe)  # 0 while nothing was seen
            w = gl.exp2(m - gl.expand_dims(gl.convert_layout(m_safe, gl.SliceLayout(0, SL), assert_trivial=True),
                                           0))  # a split that saw nothing has m = -inf: weight 0
            l_run = l_run * alpha + gl.convert_layout(gl.sum(w * lv, axis=0), HL, assert_trivial=True)
            o = o * gl.expand_dims(alpha, 1) + gl.sum(gl.expand_dims(w, 2) * part, axis=0)
            m_run = m_new
        t = gl.expand_dims(l_run, 1)
        empty = t == 0.0
        res = gl.where(empty, 0.0, o / gl.where(empty, 1.0, t)) * v_scalar
        ho = gl.arange(0, 16, layout=HL)
        gl.store(out_ptr + gl.expand_dims(head0 + ho, 1) * 128 + gl.expand_dims(cols, 0),
                 res.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(ho < G, 1))

    TAU = gl.constexpr(8.0)  # log2 headroom of the stale softmax reference: p <= 2**TAU in fp16
    @gluon.jit
    def thread_columns(x):
        """[16, TT] in MS -> [16, TT // (8 W), W, 4, 2]: axes 1 and 4 (column bits 5, 6 and bit 0) are a thread's
        registers, axis 3 (bits 1, 2) the lanes t, axis 2 (bits 3, 4) the warps; reducing axes 4 and 1 stays in
        registers."""
        TT: gl.constexpr = x.shape[1]
        W: gl.constexpr = x.type.layout.warps_per_cta[1]
        return gl.reshape(x, [16, TT // (8 * W), W, 4, 2])

    @gluon.jit
    def thread_row_sums(x):
        """[16, TT] in MS -> [16, NUM_WARPS, 4]: each thread's sums of its own columns, two a thread; the running
        sums of p, summed over lanes and warps once at the end (a lazy per-column sum held 16 registers a thread)."""
        return gl.sum(gl.sum(thread_columns(x), axis=4), axis=1)

    @gluon.jit
    def thread_flags(x, thr):
        """[16, TT] scores in MS and per-head bounds thr [16] (in the rows' slice of `thread_row_max`) -> int32 [8,
        W, 4], one element a thread: 1 where any of the thread's own scores passes its head's bound (registers only,
        no shuffles: `warp_any` then makes it the warp's flag with one vote)."""
        W: gl.constexpr = x.type.layout.warps_per_cta[1]
        over = (thread_row_max(x) > gl.expand_dims(gl.expand_dims(thr, 1), 2)).to(gl.int32)  # [16, W, 4]
        return gl.max(gl.reshape(over, [2, 8, W, 4]), axis=0)  # rows g and g + 8 (a register bit)

    @gluon.jit
    def thread_row_max(x):
        """[16, TT] in MS -> [16, W, 4]: each thread's max over its own columns (registers only)."""
        return gl.max(gl.max(thread_columns(x), axis=4), axis=1)

    @gluon.jit
    def warp_any(f):
        """int32 flags, one a thread -> 1 in every lane of a warp where any lane's flag is set (vote.any)."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.s32 $0, 1, 0, q; }",
            "=r,r", [f], dtype=gl.int32, is_pure=True, pack=1)

    # the warps' flags: thread_flags' [8, W, 4] stored as is (every lane its warp's vote), read back as the [1, W, 1]
    # slice (0, w, 0), every thread all W of them
    FLAG3_SMEM = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 2, 0])  # (0, w, 0) contiguous
    FLAG3_L = gl.BlockedLayout([1, NUM_WARPS, 1], [1, 1, 32], [1, 1, NUM_WARPS], [1, 2, 0])

    @gluon.jit
    def v_column_element(n):
        """Output column n of the P V dot -> head-dim element: B's n = g + 8 w + 32 r holds nibble r of
        half-word 8 w + g, element 32 w + 4 g + r."""
        return 32 * ((n >> 3) & 3) + 4 * (n & 7) + (n >> 5)

    @gluon.jit
    def pack_halves(lo, hi):
        """Two fp16 -> int32 holding them (lo in the low half): a register pair, no instruction."""
        return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def decode_v(vu, lo3, sign8):
        """V as fp16-sized units [TT tokens, 32] in BS (ldmatrix.trans fragments: unit u of a token holds its E2M1
        elements 4 u .. 4 u + 3, one nibble each) -> fp16 [tp, unit, tb0, r0, r1] (token 2 tp + tb0, element 4 unit
        + r), values * 2**-14 before the block factors (`scale_v`). A thread's register pair (tokens 2 tp, 2 tp + 1)
        of one unit is one int32 word whose nibbles K and K + 4 are element 4 u + K of the two tokens: e2m1_pairs'
        pair K, already in the B operand's order. Integer work only, so that it can run before the softmax (the
        factors come through shared memory after P's barrier)."""
        TT: gl.constexpr = vu.shape[0]
        a, b = gl.split(gl.permute(gl.reshape(vu, [TT // 2, 2, 32]), (0, 2, 1)))  # tokens 2 tp, 2 tp + 1 [tp, unit]
        p0, p1, p2, p3 = e2m1_pairs(pack_halves(a, b), lo3, sign8)
        return gl.join(gl.join(pair_join(p0), pair_join(p1)), gl.join(pair_join(p2), pair_join(p3)))

    @gluon.jit
    def scale_v(x, fac):
        """decode_v's [tp, unit, tb0, r0, r1] and the tile's block factors fp16 [NB blocks, TT] in shared memory
        (NB = 8: E4M3 blocks of 16 elements; 4: E8M0 blocks of 32) -> V fp16 [TT, 128 n] in BS, column n =
        v_column_element(n), values * 2**-14 * factor: one HMUL2 a register pair."""
        TP: gl.constexpr = x.shape[0]
        NB: gl.constexpr = fac.shape[0]
        X3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, x.type.layout))  # [tp, unit, tb0]
        # the factor of (tp, unit, tb0) is fac[unit // (32 // NB), 2 tp + tb0]: one 32-bit load a token pair,
        # broadcast over the units of a block and the elements of a unit (no zero adds)
        f = load_repeated(fac.reshape([NB, TP, 2]).permute((1, 0, 2)), X3, 32 // NB)
        x = x * gl.broadcast(gl.expand_dims(gl.expand_dims(f, 3), 4), x)[0]
        # x: [tp, unit, tb0, r0, r1] -> [k = 2 tp + tb0, n = 64 r1 + 32 r0 + unit]
        x = gl.permute(x, (0, 2, 4, 3, 1))
        return gl.convert_layout(gl.reshape(x, [2 * TP, 128]), BS, assert_trivial=True)

    # shared-memory tiles: payload words [tokens, 16] (K plain: a thread's four words are one LDS.128 over 8 rows x 4
    # chunks; V swizzled by token bits 1, 2 so that the four rows a V load instruction reads land in four different
    # 16-byte chunks), scale words [tokens, 2] (nvfp4) or [tokens] (mxfp4)
    K_SMEM = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    V_SMEM = gl.SwizzledSharedLayout(4, 2, 4, order=[1, 0])
    S2_SMEM = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    S1_SMEM = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    CP_W = gl.BlockedLayout([1, 4], [8, 4], [NUM_WARPS, 1], [1, 0])  # payload copies: 16 bytes a thread
    CP_S2 = gl.BlockedLayout([1, 2], [32, 1], [NUM_WARPS, 1], [1, 0])  # nvfp4 scale words: a token's 8 bytes a thread
    CP_S1 = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])  # mxfp4 scale words (64 tokens: warps 2, 3 repeat 0, 1)
    # V's ring read as fp16-sized units [tokens, 32] (4 E2M1 elements each; V_SMEM's bytes: the swizzle in units of
    # 8): a BS load of it is ldmatrix.trans, which hands each thread a unit of two consecutive tokens in one register
    VU_SMEM = gl.SwizzledSharedLayout(8, 2, 4, order=[1, 0])
    # V's block factors, computed once per token (a thread a token) into shared memory as fp16 [blocks, tokens] (and
    # mxfp4's e_tok as fp32 [tokens]); scale_v reads the factor pair of its token pair with one 32-bit load.
    # mxfp4: 2**(e - e_tok) from the token's E8M0 word (FC; K's factors too); nvfp4: its E4M3 bytes (FN)
    FC = gl.BlockedLayout([4, 1], [1, 32], [1, NUM_WARPS], [0, 1])  # [4 blocks, tokens]: a thread, a token
    FN = gl.BlockedLayout([1, 8], [32, 1], [NUM_WARPS, 1], [1, 0])  # [tokens, 8 blocks]: a thread, a token
    FAC_SMEM = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    # the token layouts at 128-token tiles (a page a tile): one more token bit (6) in registers
    WK2, SK2 = (twice_the_tokens(lay, 0) for lay in (WK, SK))
    P_SMEM = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])  # P [16, tile] fp16: ldmatrix rows without conflicts
    STAGES = gl.constexpr(2)  # shared-memory tiles: copies run one tile ahead

    @gluon.jit
    def _tile_block(j, ids_row, j_end, TPB: gl.constexpr):
        """Tile j's selected block id at TPB tiles per block (-1 at or past j_end)."""
        return gl.load(ids_row + j // TPB, mask=j < j_end, other=-1)

    @gluon.jit
    def _issue(kbuf, ksbuf, vbuf, vsbuf, bid, pg, j, k_ptr, v_ptr, head_k, head_v, stride_kp, stride_vp, pos,
               E8M0: gl.constexpr, OT: gl.constexpr):
        """Tile j's four async copies (K and V payload and scale words) into one stage; a dead tile (-1 id or page,
        wholly after the query) copies zeros; V's scale words of tokens after the query are zeros too (so that stale
        bytes there, a NaN scale, cannot reach the output through p = 0)."""
        SB: gl.constexpr = 4 if E8M0 else 8  # scale bytes per token
        TPB: gl.constexpr = 128 // OT  # tiles per 128-token block
        first = (j % TPB) * OT  # the tile's first token in its page
        tok0 = bid * 128 + first
        live = (bid >= 0) & (pg >= 0) & (tok0 <= pos)
        pgl = gl.maximum(pg, 0).to(gl.int64)
        kt = k_ptr + (pgl * stride_kp + head_k + first * 64)  # the tile's first payload byte
        vt = v_ptr + (pgl * stride_vp + head_v + first * 64)
        rw = gl.arange(0, OT, layout=gl.SliceLayout(1, CP_W))
        w_off = gl.expand_dims(rw, 1) * 16 + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, CP_W)), 0)
        async_copy.async_copy_global_to_shared(kbuf, kt.to(gl.pointer_type(gl.int32), bitcast=True) + w_off,
                                               mask=live)
        async_copy.async_copy_global_to_shared(vbuf, vt.to(gl.pointer_type(gl.int32), bitcast=True) + w_off,
                                               mask=live)
        # scale words start after the page's 128 x 64 payload bytes; the tile's first token is `first`
        ks = (kt + (128 * 64 - first * 64 + first * SB)).to(gl.pointer_type(gl.int32), bitcast=True)
        vs = (vt + (128 * 64 - first * 64 + first * SB)).to(gl.pointer_type(gl.int32), bitcast=True)
        if E8M0:
            rs = gl.arange(0, OT, layout=CP_S1)
            async_copy.async_copy_global_to_shared(ksbuf, ks + rs, mask=live)
            async_copy.async_copy_global_to_shared(vsbuf, vs + rs, mask=live)
        else:
            rs = gl.arange(0, OT, layout=gl.SliceLayout(1, CP_S2))
            s_off = gl.expand_dims(rs, 1) * 2 + gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, CP_S2)), 0)
            async_copy.async_copy_global_to_shared(ksbuf, ks + s_off, mask=live)
            async_copy.async_copy_global_to_shared(vsbuf, vs + s_off, mask=live)
        async_copy.commit_group()

    @gluon.jit
    def decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, ml_ptr, cnt_ptr, table_ptr, ctx_ptr, ids_ptr, qk_scale,
                      v_scalar, stride_qr, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_tb,
                      stride_ir, stride_ih, n_tiles, tiles_per_split, lo3, sign8, G: gl.constexpr,
                      SPLIT: gl.constexpr, E8M0: gl.constexpr, FUSED: gl.constexpr, OT: gl.constexpr,
                      NSEL: gl.constexpr, PDL: gl.constexpr = False):
        """Grid (requests, KV heads, splits); split s takes tiles s * tiles_per_split onward. O [16, 128] in MS, split
        by head-dim column across the warps; K and V tiles as async copies into a STAGES-deep shared-memory ring; every
        warp's S columns reach every warp through shared memory (P as the A operand [16 heads, OT tokens]) under one
        CTA-uniform softmax reference (stale: see the loop's comment); warp w decodes and multiplies head-dim elements
        32 w .. 32 w + 31 of all OT tokens of V. OT: tokens per tile, 64 (half a page) or 128 (a page: half the per-tile
        exchanges and barriers per token). Scale bytes sit after the page's 128 x 64 payload bytes: nvfp4 8 E4M3 bytes
        per token, mxfp4 4 E8M0 bytes per token (one word). FUSED (with SPLIT): the last split of a (request, KV head)
        to finish merges the partials (`cnt_ptr`: one int32 arrival counter per (request, KV head), zero before the
        launch and left zero after it). PDL: launched with programmatic dependent launch (`platform.LAUNCH_PDL`):
        wait for the kernels before, then release the next launch, ahead of any global access."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        TPB: gl.constexpr = 128 // OT  # tiles per 128-token selected block
        W: gl.constexpr = MS.warps_per_cta[1]  # warps (NUM_WARPS)
        if OT == 128:
            WKL: gl.constexpr = WK2
            SKL: gl.constexpr = SK2
        else:
            WKL: gl.constexpr = WK
            SKL: gl.constexpr = SK
        row = gl.program_id(0)
        h = gl.program_id(1)
        split = gl.program_id(2)
        n_splits = gl.num_programs(2)
        head_k = h.to(gl.int64) * stride_kh
        head_v = h.to(gl.int64) * stride_vh
        ids_row = ids_ptr + row.to(gl.int64) * stride_ir + h * stride_ih
        table_row = table_ptr + row.to(gl.int64) * stride_tb
        t0 = split * tiles_per_split
        n_end = gl.minimum(t0 + tiles_per_split, n_tiles)
        # the prologue's loads first, in dependency order (ids -> pages -> the first tile's copies), then the work
        # that needs a barrier (Q's layout change, the last-slot reduction)
        pos = gl.load(ctx_ptr + row) - 1
        # pipeline: tile j + 1's copies in flight while tile j computes (a 2-stage ring: with 3 stages and two tiles
        # in flight, the first tile waited longer for its data and the loop was no faster: sparse_attn_gluon.md);
        # ids 4 and pages 2 tiles ahead of their copies. The first ids are read up to the split's end, not j_end, so
        # that they need not wait for the context length (one dependent load less before the first copy): a slot
        # past the last live one is dead anyway (_issue)
        b0 = _tile_block(t0, ids_row, n_end, TPB)
        b1 = _tile_block(t0 + 1, ids_row, n_end, TPB)
        b2 = _tile_block(t0 + 2, ids_row, n_end, TPB)
        b3 = _tile_block(t0 + 3, ids_row, n_end, TPB)
        # the loop ends after the row's last live selection slot (SPEC pads selections with -1 at the end, and short
        # contexts select fewer than top-k blocks): trailing dead tiles cost nothing, not a dependent id -> page
        # load chain each. NSEL: the selection slots rounded up to a power of two
        sel = gl.arange(0, NSEL, layout=ML_L)
        sid = gl.load(ids_row + sel, mask=sel < n_tiles // TPB, other=-1)
        hq = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_L))
        cq = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
        q = gl.load(q_ptr + row.to(gl.int64) * stride_qr + gl.expand_dims(h * G + hq, 1) * stride_qh
                    + gl.expand_dims(k_column_element(cq), 0), mask=gl.expand_dims(hq < G, 1), other=0.0)
        pg0 = _page(b0, table_row, pos)
        pg1 = _page(b1, table_row, pos)
        pg2 = _page(b2, table_row, pos)
        kbufs = gl.allocate_shared_memory(gl.int32, [STAGES, OT, 16], K_SMEM)
        vbufs = gl.allocate_shared_memory(gl.int32, [STAGES, OT, 16], V_SMEM)
        if E8M0:
            ksbufs = gl.allocate_shared_memory(gl.int32, [STAGES, OT], S1_SMEM)
            vsbufs = gl.allocate_shared_memory(gl.int32, [STAGES, OT], S1_SMEM)
            fac_smem = gl.allocate_shared_memory(gl.float16, [4, OT], FAC_SMEM)  # V's [blocks, tokens]
            ev_smem = gl.allocate_shared_memory(gl.float32, [OT], S1_SMEM)
            kfac_smem = gl.allocate_shared_memory(gl.float16, [4, OT], FAC_SMEM)  # K's [blocks, tokens]
            kcol_smem = gl.allocate_shared_memory(gl.float32, [OT], S1_SMEM)  # K's 2**(e_tok - 127) a token
        else:
            ksbufs = gl.allocate_shared_memory(gl.int32, [STAGES, OT, 2], S2_SMEM)
            vsbufs = gl.allocate_shared_memory(gl.int32, [STAGES, OT, 2], S2_SMEM)
            fac_smem = gl.allocate_shared_memory(gl.float16, [8, OT], FAC_SMEM)
        p_smem = gl.allocate_shared_memory(gl.float16, [16, OT], P_SMEM)
        flag_smem = gl.allocate_shared_memory(gl.int32, [8, W, 4], FLAG3_SMEM)  # the warps' flags
        _issue(kbufs.index(0), ksbufs.index(0), vbufs.index(0), vsbufs.index(0), b0, pg0, t0, k_ptr, v_ptr, head_k,
               head_v, stride_kp, stride_vp, pos, E8M0, OT)
        q = q.to(gl.float32)
        e = ((gl.max(gl.abs(q), axis=1).to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
        a = gl.minimum(gl.maximum(14 - e, -126), 126)
        qa = gl.convert_layout((q * gl.expand_dims(exp2_int(a), 1)).to(gl.float16), AS)
        down = gl.convert_layout(exp2_int(-a) * qk_scale, gl.SliceLayout(1, MS))
        last = gl.max(gl.where((sid >= 0) & (sid * 128 <= pos), sel, -1), axis=0)
        j_end = gl.minimum(n_end, (last + 1) * TPB)
        tok_s = gl.arange(0, OT, layout=gl.SliceLayout(0, MS))
        m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MS))
        mv_i = m_i
        m_ref = gl.full([16, 1], 0.0, gl.float32, layout=MS)  # the exponents' references (m_i, mv_i; 0 for -inf)
        mv_ref = m_ref
        rows3 = thread_row_max(gl.full([16, OT], 0.0, gl.float32, layout=MS))  # [16, W, 4]: thread_flags' rows
        thr = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, gl.SliceLayout(2, rows3.type.layout)))
        thr_v = thr
        l_acc = thread_row_sums(gl.full([16, OT], 0.0, gl.float32, layout=MS))  # each thread's row sums
        acc = gl.full([16, 128], 0.0, gl.float32, layout=MS)
        for j in range(t0, j_end):
            st = (j - t0) % STAGES
            tok0 = b0 * 128 + (j % TPB) * OT
            live = (b0 >= 0) & (pg0 >= 0) & (tok0 <= pos)
            b4 = _tile_block(j + 4, ids_row, j_end, TPB)
            pg3 = _page(b3, table_row, pos)
            async_copy.wait_group(0)  # this thread's copies of tile j have landed
            gl.thread_barrier()  # everyone's have, and everyone is done with tile j - 1's stage (refilled next)
            sn = (j + 1 - t0) % STAGES
            _issue(kbufs.index(sn), ksbufs.index(sn), vbufs.index(sn), vsbufs.index(sn), b1, pg1, j + 1, k_ptr, v_ptr,
                   head_k, head_v, stride_kp, stride_vp, pos, E8M0, OT)
            if live:  # a dead tile (-1 id or page, wholly after the query) adds nothing: skipped (CTA-uniform)
                kw = kbufs.index(st).load(WKL)
                # the block factors of the tile, once per token (a thread a token) into shared memory
                if E8M0:
                    kf, ek_tok = e8m0_token_factors(ksbufs.index(st).load(gl.SliceLayout(0, FC)))
                    kfac_smem.store(kf)
                    kcol_smem.store(exp2_int(ek_tok - 127))
                    vf, e_tok = e8m0_token_factors(vsbufs.index(st).load(gl.SliceLayout(0, FC)))
                    fac_smem.store(vf)
                    ev_smem.store((e_tok - 127).to(gl.float32))
                    gl.thread_barrier()  # every thread's factors are stored
                    # K's factors per 16 elements (SKL's column j: block j // 2, a register bit)
                    f = load_repeated(kfac_smem.permute((1, 0)), SKL, 2)
                else:
                    ksb = ksbufs.index(st)._reinterpret(gl.int8, [OT, 8], S2_SMEM).load(SKL)
                    f = e4m3_factors(ksb)
                    # V's factors, read after P's barrier below: the E4M3 bytes, 0 after the query (stale bytes there
                    # may be NaN, and 0 x NaN is NaN)
                    vsb = vsbufs.index(st)._reinterpret(gl.int8, [OT, 8], S2_SMEM).load(FN)
                    tk = gl.expand_dims(tok0 + gl.arange(0, OT, layout=gl.SliceLayout(1, FN)), 1)
                    fv = gl.where(tk <= pos, e4m3_factors(vsb), 0.0)
                    fac_smem.store(gl.permute(fv, (1, 0)))
                s = mma_v2(qa, decode_k(kw, f, lo3, sign8), gl.full([16, OT], 0.0, gl.float32, layout=MS))
                if E8M0:
                    s = s * gl.expand_dims(kcol_smem.load(gl.SliceLayout(0, MS)), 0)
                if tok0 + (OT - 1) > pos:  # the tile holds tokens after the query (CTA-uniform)
                    s = gl.where(gl.expand_dims(tok0 + tok_s <= pos, 0), s, float("-inf"))
                if E8M0:
                    ev = ev_smem.load(gl.SliceLayout(0, MS))
                # V's units, token pairs joined by ldmatrix.trans (V_SMEM's swizzle keeps its 8 rows conflict-free)
                vu = vbufs.index(st)._reinterpret(gl.float16, [OT, 32], VU_SMEM).load(BS)
                vx = decode_v(vu, lo3, sign8)  # before the softmax: integer work beside the S dot's latency
                # scores in log2 units are s * down (down > 0 per head: the row max of s times down is theirs), so
                # the factor rides in exp2's argument as one FFMA. The exponent's reference is the running max of the
                # tiles before (m_i, CTA-uniform: no cross-warp max before the exp); while no warp's own raw max
                # passes thr = (m_i + TAU) / down, p <= 2**TAU and nothing is rescaled. A warp's "passed" flag rides
                # with P through shared memory; after P's barrier all warps see the same flags, and any flag sends
                # the whole CTA to the exact update (cross-warp max, rescale, P stored again). The first live tile
                # always takes it (m_i = -inf).
                down2 = gl.expand_dims(down, 1)
                p = gl.exp2(gl.fma(s, down2, -m_ref))
                past = thread_flags(s, thr)
                if E8M0:
                    # P' = 2**(s + e_v - mv) <= 1 (<= 2**TAU while stale): V decoded over each token's largest block,
                    # times P', is exact
                    sv = gl.fma(s, down2, gl.expand_dims(ev, 0))
                    past = past | thread_flags(sv, thr_v)
                    p_smem.store(gl.exp2(sv - mv_ref).to(gl.float16))
                else:
                    p_smem.store(p.to(gl.float16))
                flag_smem.store(warp_any(past))  # every lane its warp's flag
                gl.thread_barrier()
                fl = flag_smem.slice(0, 1, dim=0).slice(0, 1, dim=2).load(FLAG3_L)  # (0, w, 0): the warps' flags
                if gl.max(gl.max(gl.max(fl, axis=2), axis=1), axis=0) > 0:  # CTA-uniform: the exact update
                    m_new = gl.maximum(m_i, gl.max(s, axis=1) * down)  # across the warps
                    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = gl.expand_dims(gl.exp2(m_i - m_safe), 1)
                    m_ref = gl.expand_dims(m_safe, 1)
                    p = gl.exp2(gl.fma(s, down2, -m_ref))
                    l_acc = l_acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(2, l_acc.type.layout)), 2) \
                        + thread_row_sums(p)
                    m_i = m_new
                    thr = gl.convert_layout((m_i + TAU) / down, thr.type.layout)
                    if E8M0:
                        mv_new = gl.maximum(mv_i, gl.max(sv, axis=1))
                        mv_safe = gl.where(mv_new == float("-inf"), 0.0, mv_new)
                        alpha = gl.expand_dims(gl.exp2(mv_i - mv_safe), 1)
                        mv_ref = gl.expand_dims(mv_safe, 1)
                        p_smem.store(gl.exp2(sv - mv_ref).to(gl.float16))
                        mv_i = mv_new
                        thr_v = gl.convert_layout(mv_i + TAU, thr_v.type.layout)
                    else:
                        p_smem.store(p.to(gl.float16))
                    acc = acc * alpha
                    gl.thread_barrier()
                else:
                    l_acc = l_acc + thread_row_sums(p)
                # every warp's columns to every warp: stored, then read as ldmatrix A fragments (a convert_layout
                # read 16-byte rows whose halves the mma then copied into register quads: ~70 moves a tile)
                pa = p_smem.load(AS)
                acc = mma_v2(pa, scale_v(vx, fac_smem), acc)
            b0, b1, b2, b3 = b1, b2, b3, b4
            pg0, pg1, pg2 = pg1, pg2, pg3
        async_copy.wait_group(0)
        if E8M0:  # acc from mv_i's reference to m_i's (2**(mv - m) <= 2**127: e_v <= 127)
            mv_safe = gl.where(mv_i == float("-inf"), 0.0, mv_i)
            acc = acc * gl.expand_dims(gl.exp2(mv_safe - gl.where(m_i == float("-inf"), 0.0, m_i)), 1)
        l_tot = gl.sum(gl.sum(l_acc, axis=2), axis=1)  # [16]: over the lanes and warps, once
        o = gl.convert_layout(acc, O_L)  # [16, 128], column n = v_column_element(n)
        ho = gl.arange(0, 16, layout=gl.SliceLayout(1, O_L))
        cols = gl.expand_dims(v_column_element(gl.arange(0, 128, layout=gl.SliceLayout(0, O_L))), 0)
        heads = row.to(gl.int64) * (G * gl.num_programs(1)) + h * G + ho  # flat (row, query head)
        hmask = ho < G
        if SPLIT:
            gl.store(part_ptr + gl.expand_dims(heads * n_splits + split, 1) * 128 + cols, o,
                     mask=gl.expand_dims(hmask, 1))
            hm = gl.arange(0, 16, layout=ML_L)
            slot_m = (row.to(gl.int64) * (G * gl.num_programs(1)) + h * G + hm) * n_splits + split
            gl.store(ml_ptr + slot_m * 2, gl.convert_layout(m_i, ML_L), mask=hm < G)
            gl.store(ml_ptr + slot_m * 2 + 1, gl.convert_layout(l_tot, ML_L), mask=hm < G)
            if FUSED:
                gl.thread_barrier()
                cnt = cnt_ptr + row * gl.num_programs(1) + h
                arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
                if arrived == n_splits - 1:
                    gl.store(cnt, 0)
                    _combine(part_ptr, ml_ptr, out_ptr, row.to(gl.int64) * (G * gl.num_programs(1)) + h * G, G,
                             n_splits, v_scalar)
        else:
            l_o = gl.expand_dims(gl.convert_layout(l_tot, gl.SliceLayout(1, O_L)), 1)
            empty = l_o == 0.0
            res = gl.where(empty, 0.0, o / gl.where(empty, 1.0, l_o)) * v_scalar
            gl.store(out_ptr + gl.expand_dims(heads, 1) * 128 + cols, res.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(hmask, 1))


def device_ok(device: torch.device) -> bool:
    """This path runs on CUDA devices with Gluon and the hardware E4M3 conversion (capability >= 8.9)."""
    return cuda_at_least(device, (8, 9))


def applies(q: torch.Tensor, k_cache, v_cache, block_size: int) -> bool:
    """Shape and format conditions of this kernel (the device condition is `device_ok`): nvfp4 or mxfp4 K and V
    (one format), head dim 128, <= 16 query heads per KV head, 128-token blocks and pages."""
    rows, hq, d = q.shape
    hkv = k_cache.num_heads
    fam = format_key(k_cache.fmt)
    return (fam in SCALE_BYTES and format_key(v_cache.fmt) == fam and d == DIM and block_size == BLOCK
            and k_cache.page_size == BLOCK and v_cache.page_size == BLOCK and hq % hkv == 0
            and hq // hkv <= MAX_GROUP and all(c.payload_bytes == PAYLOAD and c.scale_bytes == SCALE_BYTES[fam]
                                               for c in (k_cache, v_cache))
            and all(c.data.stride(i) % 4 == 0 for c in (k_cache, v_cache) for i in (0, 1)))


# rows x KV heads from which the default launch takes this kernel, per format: below 16 the portable kernel's splits
# are faster on the H200, from 16 this kernel (the measurements: docs/kernels/sparse_attn_gluon.md).
MIN_PROGRAMS = {NVFP4: 16, MXFP4: 16}

TILE_SIZES = (TILE, BLOCK)  # the tokens per tile the kernel's layouts take: half a page or a page
DEFAULT_TOKENS_PER_TILE = 128  # a page a tile (64: half a page, also compiled and tested; see default_splits for both)
MIN_SPLIT_TOKENS = 256  # splits of fewer selected tokens lose to the merge and the pipeline fill (measured,
# docs/kernels/sparse_attn_gluon.md)


def default_splits(rows: int, num_kv_heads: int, n_tiles: int, device: torch.device, tile: int) -> int:
    """About two programs per SM, at least MIN_SPLIT_TOKENS of the n_tiles x tile selected tokens each: more splits
    than about two programs per SM lose to the merge and the pipeline fill (the split sweeps behind this rule, for 64-
    and 128-token tiles: docs/kernels/sparse_attn_gluon.md)."""
    return max(1, min(n_tiles * tile // MIN_SPLIT_TOKENS, 2 * num_sms(device) // max(1, rows * num_kv_heads)))


def _tile(tokens_per_tile: int | None) -> int:
    if tokens_per_tile is None:
        return DEFAULT_TOKENS_PER_TILE
    if isinstance(tokens_per_tile, bool) or tokens_per_tile not in TILE_SIZES:
        raise KernelArgumentError(f"sparse_decode: the Gluon kernel's tokens per tile must be one of {TILE_SIZES}, "
                                  f"got {tokens_per_tile!r}")
    return int(tokens_per_tile)


def plan(rows: int, num_kv_heads: int, topk: int, device: torch.device, num_splits: int | None = None,
         tokens_per_tile: int | None = None) -> tuple[int, int, int]:
    """A launch's (tokens per tile, tiles, splits): tokens_per_tile (one of TILE_SIZES, default
    DEFAULT_TOKENS_PER_TILE), the default splits unless num_splits, never an empty trailing split."""
    tile = _tile(tokens_per_tile)
    n_tiles = topk * (BLOCK // tile)
    splits = int(num_splits) if num_splits else default_splits(rows, num_kv_heads, n_tiles, device, tile)
    per = max(1, math.ceil(n_tiles / splits))
    return tile, n_tiles, max(1, math.ceil(n_tiles / per))


# Split decodes merge their partials in the last program of each (request, KV head) instead of a second launch.
DEFAULT_FUSED_COMBINE = True
_COUNTERS: dict = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """int32 arrival counters for the fused merge, zero between launches (each launch's last arrival resets its
    own), kept per device and grown on demand. Launches on one device share them: run split decodes of one device on
    one stream at a time (as a model's layers run), or pass fused_combine=False. None while a CUDA graph is being
    captured and the buffer is missing or too small (zeroing it there would only happen at replay): that launch then
    uses the combine kernel."""
    key = torch.device(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if key.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=key)
        _COUNTERS[key] = buf
    return buf


def sparse_decode(q: torch.Tensor, k_cache, v_cache, block_table: torch.Tensor, context_lens: torch.Tensor,
                  block_ids: torch.Tensor, qk_scale: float, v_scalar: float, num_splits: int | None,
                  out_dtype: torch.dtype, combine, *, tokens_per_tile: int | None = None,
                  fused_combine: bool | None = None) -> torch.Tensor:
    """The launch: inputs as checked by `sparse_attn.sparse_decode`; `applies` and `device_ok` hold. qk_scale: the
    softmax scale x log2(e) x K's folded factors (outer scale, E2M1 unit); v_scalar: V's. combine: the portable
    kernel's split combine kernel, launched after a split decode unless the merge is fused (`fused_combine`, default
    DEFAULT_FUSED_COMBINE). tokens_per_tile: see `plan`."""
    _tile(tokens_per_tile)
    if fused_combine is not None and not isinstance(fused_combine, bool):
        raise KernelArgumentError(f"sparse_decode: fused_combine must be True or False, got {fused_combine!r}")
    rows, hq, d = q.shape
    hkv, topk = k_cache.num_heads, block_ids.shape[-1]
    out = torch.empty(rows, hq, d, dtype=out_dtype, device=q.device)
    if rows == 0:
        return out
    tile, n_tiles, splits = plan(rows, hkv, topk, q.device, num_splits, tokens_per_tile)
    per = math.ceil(n_tiles / splits)
    fused = splits > 1 and (DEFAULT_FUSED_COMBINE if fused_combine is None else fused_combine)
    cnt = split_counters(q.device, rows * hkv) if fused else None
    fused = fused and cnt is not None
    if splits > 1:
        part = torch.empty(rows * hq * splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(rows * hq * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    cnt = cnt if fused else out  # unused without the fused merge
    pdl = pdl_ok(q.device)
    decode_kernel[(rows, hkv, splits)](
        q, k_cache.data, v_cache.data, out, part, ml, cnt, block_table, context_lens, block_ids, float(qk_scale),
        float(v_scalar), q.stride(0), q.stride(1), k_cache.data.stride(0), k_cache.data.stride(1),
        v_cache.data.stride(0), v_cache.data.stride(1), block_table.stride(0), block_ids.stride(0),
        block_ids.stride(1), n_tiles, per, 0x07070707, -0x7F7F7F80, G=hq // hkv, SPLIT=splits > 1,
        E8M0=k_cache.fmt.scale_element == "e8m0", FUSED=fused, OT=tile, NSEL=triton.next_power_of_2(max(topk, 1)),
        PDL=pdl, num_warps=NUM_WARPS, **({"launch_pdl": True} if pdl else {}))
    if splits > 1 and not fused:
        combine[(rows * hq,)](part, ml, out, float(v_scalar), splits, BLOCK_S=triton.next_power_of_2(splits), D=d,
                              PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out
