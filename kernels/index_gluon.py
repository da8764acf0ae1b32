"""NVIDIA fast path of the lightning-indexer decode scorer for FP4 index caches (nvfp4, mxfp4), written in Gluon
(Triton's explicit-layout dialect) so that the decoded key tile is born in the tensor-core operand registers.

Why a second kernel: the portable scorer (`kernels/index_score.py`) decodes E2M1 words into a blocked layout and
Triton converts that to the dot operand layout through shared memory (STS, barrier, LDSM) before a wgmma that it
then waits on; ncu on the H200 put the largest share of the warp stalls on WARPGROUP.ARRIVE and on shared-memory
(MIO) waits (docs/kernels/index_gluon.md). Here every thread
loads the 16 bytes of each of its token rows that its mma.sync A-operand registers need and decodes them in place:
- the dot is `K [128 tokens, 128] x Q^T [128, 8]` (mma.sync m16n8k16, 4 warps, up to 8 index heads; mxfp4:
  `x Q'^T [128, 16]`, below);
- in the A operand (`A_L`) thread (lane 4 g + t) holds, per token row, the columns 2 t + {0, 1} + 8 m (m < 16). The
  order of the head dim inside a dot is free (the query is loaded in the same order), so column c is given the
  element `column_element(c)`: the thread's 32 elements of a row are bytes 16 t .. 16 t + 15 of the packed row (one
  16-byte load, words 4 t .. 4 t + 3 in `W_L`), and each fp16 pair register is nibbles K and K + 4 of one word,
  built by `kc.e2m1_pairs` (shared with sparse attention: 11 integer ops per word of eight elements);
- the joins / permute / reshape from words to the [128, 128] tile only rename registers: `gl.convert_layout(...,
  assert_trivial=True)` proves at compile time that no data moves;
- block scales: nvfp4 blocks 2 t, 2 t + 1 of a row (one fp16 factor per word, hardware E4M3 -> fp16, one HMUL2 per
  register); mxfp4 post-scaled like the portable kernel's default (POST_SCALE): the query is block-diagonal (16
  dot columns, one per head h and MX block b, in the order `mx_column`), so the undecorated E2M1 tile gives every
  (token, block, head) partial score, each multiplied by its fp32 block factor 2**e and the 4 blocks summed
  inside the thread (the column order puts a head's four blocks in one lane; a row's four E8M0 bytes are one
  4-byte load);
- the next tile's loads are issued before this tile's decode (register double buffer), as one inline-asm block
  per tile (`_fetch`): four 16-byte loads and four 2-byte (nvfp4) or 4-byte (mxfp4) scale loads at constant
  offsets from one address, predicated on the page, with no zero fill of the destinations (Triton's masked loads
  compute an address per load and zero every destination register first: ~30 instructions a tile); a tile without
  a page leaves stale registers, whose scores `_emit` discards. Page-table entries are read a block earlier still;
- each warp's 32 tokens of a block reduce to a partial maximum per head inside the warp (no barrier; the thread's
  register rows first, so the lane shuffles carry half as many values); the 4 partials go to shared memory, and
  at its end the program maxes them (one barrier) and stores one block score per head (`_block_scores`; a split
  longer than SMEM_BLOCKS stores the 4 partials instead, for the select pass to max);
- only the row's partial last block masks its tokens (the blocks before it only check their page, on the partial
  maxima);
- programs take `chunk_blocks_for` blocks of one request each: few per program where the batch and context are
  small (every SM busy), up to 32 where there are many (less per-program setup); each row's last
  `tail_blocks_for` blocks go to splits of a quarter of that, so that the grid ends on short programs.
Semantics are the portable kernel's (SPEC section 3, LEAN block scores): tokens at or past the context and tiles of
-1 pages score -inf, NaN scores win the block maximum, the column scale multiplies the block maxima, forced init /
local blocks get 1e30 / 1e29. Exactness: the same exact fp16 products as index_score (E2M1 x E4M3 and E2M1 x 2**k
in fp16, the query times 2**a), fp32 accumulation in another order.

Probes of the loop on the H200 put it mostly bound by its loads (near the byte floor for nvfp4; the current times
and the probes: docs/kernels/index_gluon.md), which is why the tile loads are one inline-asm block, the page lookups
run a block ahead and only the partial last block masks its tokens. mxfp4 executes about 1.17x nvfp4's
instructions a tile (twice the dot columns, the post-scale after the dot), about the ratio of their times: 1.3x its
byte floor against nvfp4's 1.1x. Every step,
its numbers, and the variants tried and dropped (TMA ring, L2 prefetch, register triple buffer, two blocks an
iteration, a PDL select pass, lower register caps, block rows in registers): docs/kernels/index_gluon.md.

Where it runs: CUDA devices with the hardware E4M3 conversion (capability >= 8.9) and Gluon; decode (one query per
request), head dim 128, 128-token blocks within pages of a multiple of 128 tokens, at most 8 (nvfp4) or 4 (mxfp4)
index heads. Elsewhere
(and on ROCm: gfx950 gets the portable kernel, whose code is tested in CI) `index_score` runs the portable kernel.
The interpreter cannot run Gluon: CI compiles this kernel for sm_90 (tests/kernels/test_kernel_compile.py); the GPU tests
compare it with the portable kernel and the reference (tests/kernels/test_kernels_index.py, marked gpu).
"""

from __future__ import annotations


import torch
import triton

from kvtool.kernels import codecs as kc
from kvtool.kernels import index_blocks as ib
from kvtool.kernels.platform import cuda_at_least, num_sms

__all__ = [
    "BALANCE_CHUNK", "BALANCE_PROGRAMS", "CHUNK_BLOCKS", "DEFAULT_SCALES", "DIM", "FILL_PROGRAMS", "HEADS_PAD",
    "MAXNREG", "MX_HEADS", "NUM_WARPS", "TAIL_DIV", "TAIL_MIN_CHUNK", "TAIL_PROGRAMS_PER_SM", "TOKENS", "aligned_16",
    "applies", "chunk_blocks_for", "decode_block_parts", "device_ok", "split_grid", "tail_blocks_for"
]

try:  # Gluon ships with Triton >= 3.5; without it the portable kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - the pinned Triton has it
    gluon = None

TOKENS = 128  # tokens per tile = one index block
DIM = 128  # head dim
HEADS_PAD = 8  # nvfp4: the dot's N, index heads padded to one mma n8 tile
MX_HEADS = 4  # mxfp4: heads per MX block in the block-diagonal query (N = 4 blocks x 4 heads)
NUM_WARPS = 4  # 32 tokens per warp; also the number of partial maxima per block (WP)
# blocks per program: at most CHUNK_BLOCKS; see chunk_blocks_for. Few blocks a program where the batch and context
# are small (every SM busy), up to 32 where there are many (less per-program setup): a fixed 32 lost up to 4x on
# small batches. Programs of at most CHUNK_BLOCKS blocks max their warps' partials in shared memory and store block
# scores (4x fewer bytes for the select pass; longer ones, from the chunk_blocks option, store the partials).
# The tail: each row's last `tail_blocks_for` blocks go to splits of ch // TAIL_DIV blocks, so that the grid's last
# programs are short and the GPU stays full to the end (uniform splits left the last program starting late);
# tail splits of 2 blocks (ch 8) lost. The sweeps: docs/kernels/index_gluon.md.
TAIL_DIV = 4
TAIL_MIN_CHUNK = 4  # no tail where its splits would be shorter
TAIL_PROGRAMS_PER_SM = 12  # the tail's programs: about 2.4 waves of 5 programs per SM
FILL_PROGRAMS = 3
BALANCE_PROGRAMS = 16
BALANCE_CHUNK = 16
CHUNK_BLOCKS = 32  # the most blocks per program (measured best with 8 / 16 on the H200, 64 and one wave slower;
# docs/kernels/index_gluon.md)

if gluon is not None:
    NW = gl.constexpr(NUM_WARPS)
    MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    A_L = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # A_L for [128, 128] fp16 (gl.to_linear_layout): registers -> col 1, row 8, cols 8 16 32 64, row 64; lanes ->
    # cols 2 4, rows 1 2 4; warps -> rows 16 32. The word tile [128 tokens, 16 words] keeps those rows; its word
    # bits 0, 1 sit in registers (four consecutive words: one 16-byte load) and bits 2, 3 on the lanes of cols 2, 4.
    _ROWS_REG = [[8, 0], [64, 0]]
    _ROWS_LANE = [[1, 0], [2, 0], [4, 0]]
    _ROWS_WARP = [[16, 0], [32, 0]]
    W_L = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]] + _ROWS_REG, lane_bases=[[0, 4], [0, 8]] + _ROWS_LANE,
                                     warp_bases=_ROWS_WARP, block_bases=[], shape=[TOKENS, 16])
    # nvfp4 block scales [128, 8] (block = word // 2): block bit 0 in a register, bits 1, 2 on those lanes
    S16_L = gl.DistributedLinearLayout(reg_bases=[[0, 1]] + _ROWS_REG, lane_bases=[[0, 2], [0, 4]] + _ROWS_LANE,
                                       warp_bases=_ROWS_WARP, block_bases=[], shape=[TOKENS, 8])
    # nvfp4 block-scale byte pairs [128, 4] (a row's blocks 2 t, 2 t + 1: one u16): the rows in registers as in W_L
    S8_L = gl.DistributedLinearLayout(reg_bases=_ROWS_REG, lane_bases=[[0, 1], [0, 2]] + _ROWS_LANE,
                                      warp_bases=_ROWS_WARP, block_bases=[], shape=[TOKENS, 4])
    # mxfp4 post-scaled dot: its [128, 16] accumulator (column n = 8 (block // 2) + 2 head + block % 2: `mx_column`;
    # MMA registers -> cols 1, 8, lanes -> cols 2, 4) seen as [128 tokens, block // 2, 4 heads, block % 2]: both
    # block bits in registers, so that the sum over a head's four blocks stays in the thread (no lane shuffles)
    L3 = gl.DistributedLinearLayout(reg_bases=[[0, 0, 0, 1], [8, 0, 0, 0], [0, 1, 0, 0], [64, 0, 0, 0]],
                                    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
                                    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[TOKENS, 2, 4, 2])
    F_L = gl.SliceLayout(2, L3)  # the block factors [128, block // 2, block % 2]: a row's four in its thread
    ROW_L = gl.SliceLayout(1, gl.SliceLayout(2, F_L))  # [128] a value per token row (its four E8M0 bytes as a u32)
    Q_L = gl.BlockedLayout([1, HEADS_PAD], [32, 1], [NUM_WARPS, 1], [1, 0])  # the query, once per program

    TOK = gl.constexpr(TOKENS)
    SMEM_BLOCKS = gl.constexpr(CHUNK_BLOCKS)  # block rows of the shared-memory block scores (the largest split)
    QS_L = gl.SwizzledSharedLayout(8, 1, 8, [0, 1])  # the query operand [128, NDOT], K contiguous: ldmatrix rows
    SMEM_L = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # rank 2: .index(block) gives a [NW, heads] view
    DIMC = gl.constexpr(DIM)
    HP = gl.constexpr(HEADS_PAD)
    MXH = gl.constexpr(MX_HEADS)
    e2m1_pairs = gluon.jit(kc.e2m1_pairs.fn)
    exp2_int = gluon.jit(kc.exp2_int.fn)
    nanmax = gluon.jit(ib.nanmax.fn)
    e8m0_from_field = gluon.jit(kc.e8m0_from_field.fn)

    @gluon.jit
    def column_element(c):
        """Column c of the decoded tile -> its element of the head dim. c's bits (low to high): h (the fp16 half:
        nibble K or K + 4), w2, w3 (the lane's words), k0, k1 (K), w0, w1 (the word in the lane's 16 bytes); the
        element is 8 w + K + 4 h (see `decode_tile`)."""
        w = ((c >> 5) & 3) + 4 * ((c >> 1) & 3)
        return 8 * w + ((c >> 3) & 3) + 4 * (c & 1)

    @gluon.jit
    def decode_tile(words, f16, lo3, sign8, SCALED: gl.constexpr):
        """Packed E2M1 words int32 [128, 16] (W_L) -> fp16 [128, 128] in A_L, column c holding element
        column_element(c) times 2**-14, times f16's factor of its word (SCALED: fp16 [128, 16] in W_L; else f16 is
        unused). lo3 / sign8: the run-time masks of `kc.e2m1_pairs`."""
        p0, p1, p2, p3 = e2m1_pairs(words, lo3, sign8)
        x0 = gl.join(p0.to(gl.int16), (p0 >> 16).to(gl.int16))
        x1 = gl.join(p1.to(gl.int16), (p1 >> 16).to(gl.int16))
        x2 = gl.join(p2.to(gl.int16), (p2 >> 16).to(gl.int16))
        x3 = gl.join(p3.to(gl.int16), (p3 >> 16).to(gl.int16))
        x = gl.join(gl.join(x0, x1), gl.join(x2, x3)).to(gl.float16, bitcast=True)  # [128, 16 w, h, k0, k1]
        if SCALED:
            s = gl.join(f16, f16)
            s = gl.join(s, s)
            x = x * gl.join(s, s)
        x = gl.reshape(x, [TOK, 2, 2, 2, 2, 2, 2, 2])  # token, w3, w2, w1, w0, h, k0, k1
        x = gl.permute(x, (0, 3, 4, 7, 6, 1, 2, 5))  # token, w1, w0, k1, k0, w3, w2, h: c's bits high to low
        return gl.convert_layout(gl.reshape(x, [TOK, DIMC]), A_L, assert_trivial=True)

    @gluon.jit
    def fold_blocks(x, E8M0: gl.constexpr, SUM: gl.constexpr):
        """[128, NDOT] in MMA -> [128, heads]: mxfp4's post-scaled columns (`mx_column`) summed (SUM) or maxed
        over the blocks (for values equal across blocks: store offsets, column scales), inside the thread; nvfp4:
        unchanged."""
        if E8M0:
            x4 = gl.reshape(x, [TOK, 2, 4, 2])
            if SUM:
                return gl.sum(gl.sum(x4, axis=3), axis=1)
            else:
                return gl.max(gl.max(x4, axis=3), axis=1)
        else:
            return x

    @gluon.jit
    def mx_column(head, block):
        """mxfp4's dot column of (head, MX block): 8 (block // 2) + 2 head + block % 2, so that in the mma.sync
        accumulator (lane 4 g + t holds columns 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t of its rows) the four blocks of
        head t sit in lane t's registers."""
        return 8 * (block // 2) + 2 * head + block % 2

    @gluon.jit
    def column_head(n, E8M0: gl.constexpr):
        """The index head of dot column n: mxfp4 `mx_column`'s inverse, nvfp4 the column itself."""
        if E8M0:
            return (n >> 1) % MXH
        else:
            return n

    @gluon.jit
    def mx_factors(sw):
        """mxfp4: a row's four E8M0 block-scale bytes as one int32 [128] (ROW_L, block b in byte b) -> fp32 block
        factors [128, block // 2, block % 2] (F_L; NaN for byte 255). Each byte is shifted into the exponent field
        and the rest masked off, for `kc.e8m0_from_field`: four ops a factor."""
        f01 = gl.join(e8m0_from_field((sw << 23) & 0x7F800000), e8m0_from_field((sw << 15) & 0x7F800000))
        f23 = gl.join(e8m0_from_field((sw << 7) & 0x7F800000), e8m0_from_field((sw >> 1) & 0x7F800000))
        return gl.convert_layout(gl.permute(gl.join(f01, f23), (0, 2, 1)), F_L, assert_trivial=True)

    @gluon.jit
    def mx_post_scale(acc, f):
        """mxfp4: partial scores fp32 [128, 16] (MMA; column `mx_column(head, block)`: the head's dot over that
        block's elements) times the tokens' fp32 block factors f (`mx_factors`)."""
        a4 = gl.convert_layout(gl.reshape(acc, [TOK, 2, 4, 2]), L3, assert_trivial=True) * gl.expand_dims(f, 2)
        return gl.convert_layout(gl.reshape(a4, [TOK, 16]), MMA, assert_trivial=True)

    @gluon.jit
    def nv_factors(sb):
        """nvfp4 E4M3 block-scale byte pairs int32 [128, 4] (S8_L: a row's blocks 2 i, 2 i + 1 as one u16) -> fp16
        [128, 16] (W_L): word w gets block w // 2 (hardware E4M3 -> fp16, exact; NaN codes give NaN). The conversion
        returns packed fp16 pairs (pack=2), so that the HMUL2s read their factors as .H0_H0 / .H1_H1 halves."""
        sb2 = gl.convert_layout(gl.reshape(gl.join(sb, sb), [TOK, 8]), S16_L, assert_trivial=True)
        f = gl.inline_asm_elementwise("{ .reg .b16 t; cvt.u16.u32 t, $1; cvt.rn.f16x2.e4m3x2 $0, t; }", "=r,r,r",
                                      [sb2], dtype=gl.float16, is_pure=True, pack=2)
        return gl.convert_layout(gl.reshape(gl.join(f, f), [TOK, 16]), W_L, assert_trivial=True)

    @gluon.jit
    def _page(bt_row, blk, n_blk, num_pages, PAGE: gl.constexpr):
        """Block blk's page: -1 if blk >= n_blk or the table entry is -1 / out of range."""
        pg = gl.load(bt_row + (blk * TOK) // PAGE, mask=blk < n_blk, other=-1)
        return gl.where((pg >= 0) & (pg < num_pages), pg, -1)

    @gluon.jit
    def _fetch(data_ptr, pg, blk, page_bytes, w_off, s_off, PAGE: gl.constexpr, PB: gl.constexpr, SB: gl.constexpr,
               E8M0: gl.constexpr):
        """Block blk's words int32 [128, 16] (W_L) and block scales (nvfp4: int32 [128, 4] (S8_L), each the u16 of
        a row's blocks 2 i, 2 i + 1; mxfp4: a row's four E8M0 bytes as one int32 [128] (ROW_L)) from page pg, by
        inline asm (PB 64, SB 8 / 4, 16-byte aligned: `applies`); nothing is loaded for page -1."""
        base = gl.maximum(pg, 0).to(gl.int64) * page_bytes
        row0 = (blk * TOK) % PAGE  # the block's first token in its page
        tile = data_ptr + base  # the page's first byte: one 64-bit sum, the rest 32-bit offsets (6 fewer SASS)
        # one address a thread (its first word), the rest constant offsets: W_L's registers hold words 0-3 of rows r,
        # r + 8, r + 64, r + 72 (64 bytes a row: +512, +4096, +4608); no zero fill (a tile without a page keeps stale
        # registers)
        wp = (tile.to(gl.pointer_type(gl.int32), bitcast=True) + (row0 * (PB // 4) + w_off)).to(gl.int64,
                                                                                              bitcast=True)
        live = (pg >= 0).to(gl.int32)
        words = gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $32, 0;"
            " @p ld.global.v4.b32 {$0, $1, $2, $3}, [$16];"
            " @p ld.global.v4.b32 {$4, $5, $6, $7}, [$16+512];"
            " @p ld.global.v4.b32 {$8, $9, $10, $11}, [$16+4096];"
            " @p ld.global.v4.b32 {$12, $13, $14, $15}, [$16+4608]; }",
            "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,"
            "l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [wp, gl.full(w_off.shape, 0, gl.int32, layout=w_off.type.layout) + live], dtype=gl.int32,
            is_pure=True, pack=16)
        sp = (tile + (row0 * SB + s_off)).to(gl.int64, bitcast=True)
        if E8M0:
            # ROW_L's registers: the four scale bytes of rows r, r + 8 (4 bytes a row: +32), r + 64, r + 72 (+256)
            sb = gl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $8, 0;"
                " @p ld.global.b32 $0, [$4]; @p ld.global.b32 $1, [$4+32];"
                " @p ld.global.b32 $2, [$4+256]; @p ld.global.b32 $3, [$4+288]; }",
                "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [sp, gl.full(s_off.shape, 0, gl.int32, layout=s_off.type.layout) + live],
                dtype=gl.int32, is_pure=True, pack=4)
        else:
            # S8_L's registers: the scale pairs of rows r, r + 8, r + 64, r + 72 (8 bytes a row: +64, +512, +576)
            sb = gl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $8, 0;"
                " @p ld.global.u16 $0, [$4]; @p ld.global.u16 $1, [$4+64];"
                " @p ld.global.u16 $2, [$4+512]; @p ld.global.u16 $3, [$4+576]; }",
                "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [sp, gl.full(s_off.shape, 0, gl.int32, layout=s_off.type.layout) + live],
                dtype=gl.int32, is_pure=True, pack=4)
        return words, sb

    @gluon.jit
    def _query_operand(q_ptr, b, stride_qb, stride_qh, gscale, HI: gl.constexpr, E8M0: gl.constexpr,
                       QSMEM: gl.constexpr):
        """Request b's query as the dot's B operand (in registers, or QSMEM: in shared memory) in the tile's column
        order, times 2**a per head (max in [2**14, 2**15)); mxfp4: block-diagonal (column `mx_column(head, block)`
        holds the head's elements of that MX block, 0 elsewhere). Also the partial maxima's column scales (2**-a
        times the outer scale, undoing the query's 2**a and the decode's 2**-14), put through the same reshapes and
        reductions as the scores."""
        NDOT: gl.constexpr = 16 if E8M0 else HP  # the dot's columns
        HEADS: gl.constexpr = 4 if E8M0 else HP
        c = gl.arange(0, DIMC, layout=gl.SliceLayout(1, Q_L))
        n = gl.arange(0, NDOT, layout=gl.SliceLayout(0, Q_L))
        el = gl.expand_dims(column_element(c), 1)
        head = column_head(n, E8M0)
        q = gl.load(q_ptr + b.to(gl.int64) * stride_qb + gl.expand_dims(head, 0) * stride_qh + el,
                    mask=gl.expand_dims(head < HI, 0), other=0.0)
        q = q.to(gl.float32)
        e = ((gl.max(gl.abs(q), axis=0).to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
        a = gl.minimum(gl.maximum(14 - e, -126), 126)
        q = q * gl.expand_dims(exp2_int(a), 0)
        if E8M0:
            q = gl.where(mx_column(gl.expand_dims(head, 0), el // 32) == gl.expand_dims(n, 0), q, 0.0)
        if QSMEM:  # read back by every tile (`_query_b`): 16 (nvfp4) / 32 (mxfp4) registers a thread fewer
            qt = gl.allocate_shared_memory(gl.float16, [DIMC, NDOT], QS_L, q.to(gl.float16))
        else:
            qt = gl.convert_layout(q.to(gl.float16), B_L)
        colscale = gl.convert_layout(exp2_int(-a) * (gscale * 16384.0), gl.SliceLayout(0, MMA))
        p_scale = gl.expand_dims(colscale, 0) + gl.full([TOK, NDOT], 0.0, gl.float32, layout=MMA)
        return qt, _warp_parts(fold_blocks(p_scale, E8M0, False), HEADS, False)

    @gluon.jit
    def _max(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _warp_parts(x, HEADS: gl.constexpr, NAN: gl.constexpr):
        """[128 tokens, HEADS] (MMA rows) -> [NW, HEADS]: warp w's tokens (rows 16 w + {0..15} + 64 r) combined
        inside the warp (no shared memory). The register row (64 r) goes first, in the thread, so that the lane
        shuffles carry half as many values. NAN: NaN wins (scores), else a plain maximum (offsets, scales)."""
        x4 = gl.reshape(x, [2, NW, 16, HEADS])
        if NAN:
            return gl.reduce(gl.reduce(x4, 0, nanmax), 1, nanmax)
        else:
            return gl.reduce(gl.reduce(x4, 0, _max), 1, _max)

    @gluon.jit
    def _part_offsets(n_out, HI: gl.constexpr, E8M0: gl.constexpr):
        """The partial maxima's store offsets (head * n_out + warp) and mask, in the partial maxima's layout."""
        NDOT: gl.constexpr = 16 if E8M0 else HP
        HEADS: gl.constexpr = 4 if E8M0 else HP
        tok = gl.arange(0, TOK, layout=gl.SliceLayout(1, MMA))
        col = gl.arange(0, NDOT, layout=gl.SliceLayout(0, MMA))
        head = column_head(col, E8M0)
        p_off = gl.expand_dims(head, 0) * n_out + gl.expand_dims((tok // 16) % NW, 1)  # head, warp
        p_off = _warp_parts(fold_blocks(p_off, E8M0, False), HEADS, False)
        return p_off, p_off < HI * n_out

    @gluon.jit
    def _query_b(qt, QSMEM: gl.constexpr):
        """The query operand in B_L for one tile's dot: loaded from shared memory (ldmatrix) with QSMEM."""
        if QSMEM:
            return qt.load(B_L)
        else:
            return qt

    @gluon.jit
    def _tile_dot(words, sb, qt, lo3, sign8, E8M0: gl.constexpr, QSMEM: gl.constexpr):
        """One 128-token tile's token scores fp32 [128, NDOT] (MMA): the decoded words [128, 16] (W_L) times the
        query operand; block scales sb: nvfp4 E4M3 byte pairs [128, 4] (S8_L), mxfp4 a row's E8M0 bytes [128]
        (ROW_L)."""
        NDOT: gl.constexpr = 16 if E8M0 else HP
        zero = gl.full([TOK, NDOT], 0.0, gl.float32, layout=MMA)
        if E8M0:  # undecorated E2M1 x the block-diagonal query, then the fp32 block factors
            acc = mx_post_scale(mma_v2(decode_tile(words, words, lo3, sign8, False), _query_b(qt, QSMEM), zero),
                                mx_factors(sb))
        else:
            acc = mma_v2(decode_tile(words, nv_factors(sb), lo3, sign8, True), _query_b(qt, QSMEM), zero)
        return acc

    @gluon.jit
    def _emit(acc, blk, ctx, valid, pg, out_row, p_off, p_mask, p_scale, smem, blk0, E8M0: gl.constexpr,
              INIT: gl.constexpr, LOCAL: gl.constexpr, MASK: gl.constexpr, SMEM: gl.constexpr):
        """Store block blk's NW partial maxima per head from its token scores acc (MMA): tokens at or past ctx and
        a tile without a page (pg -1) score -inf, NaN wins, the column scales multiply, forced init / local
        blocks get 1e30 / 1e29. MASK=False: the caller knows that every token is before ctx (only a missing page
        is handled, on the partial maxima)."""
        HEADS: gl.constexpr = 4 if E8M0 else HP
        if MASK:
            if (blk * TOK + TOK > ctx) | (pg < 0):  # a tile with tokens past the context or without a page
                tok = gl.arange(0, TOK, layout=gl.SliceLayout(1, MMA))
                keep = (blk * TOK + tok < ctx) & (pg >= 0)
                acc = gl.where(gl.expand_dims(keep, 1), acc, float("-inf"))
        part = _warp_parts(fold_blocks(acc, E8M0, True), HEADS, True)
        if MASK:
            part = gl.where(part == float("-inf"), part, part * p_scale)
        else:
            part = gl.where((part == float("-inf")) | (pg < 0), float("-inf"), part * p_scale)
        if blk >= valid - LOCAL:  # forced blocks: local, else init (they override NaN too)
            part = p_scale * 0.0 + 1e29
        elif blk < INIT:
            part = p_scale * 0.0 + 1e30
        if SMEM:  # the program's block rows, maxed over the warps at its end (`_block_scores`)
            smem.index(blk - blk0).store(part)
        else:
            gl.store(out_row + blk * NW + p_off, part, mask=p_mask)

    @gluon.jit
    def _block_scores(smem, out_row, blk0, n_blk, n_out, HI: gl.constexpr, E8M0: gl.constexpr):
        """The program's block scores: its blocks' NW partial maxima per head (shared memory, [SMEM_BLOCKS, NW,
        heads]) maxed (NaN wins) and stored at out_row[head * n_out + block] for its n_blk blocks."""
        HEADS: gl.constexpr = 4 if E8M0 else HP
        R_L: gl.constexpr = gl.BlockedLayout([NW, 1], [32 // HEADS, HEADS], [NW, 1], [1, 0])  # a block's parts a thread
        gl.thread_barrier()
        x = smem._reinterpret(gl.float32, [SMEM_BLOCKS * NW, HEADS], SMEM_L).load(R_L)
        x = gl.reduce(gl.reshape(x, [SMEM_BLOCKS, NW, HEADS]), 1, nanmax)
        i = gl.arange(0, SMEM_BLOCKS, layout=gl.SliceLayout(1, x.type.layout))
        h = gl.arange(0, HEADS, layout=gl.SliceLayout(0, x.type.layout))
        offs = gl.expand_dims(h, 0) * n_out + blk0 + gl.expand_dims(i, 1)
        gl.store(out_row + offs, x, mask=(gl.expand_dims(i, 1) < n_blk) & (gl.expand_dims(h, 0) < HI))

    @gluon.jit
    def decode_block_parts_kernel(
        q_ptr,  # bf16 [B, Hi, D] (decode queries), last dim contiguous
        data_ptr,  # uint8 [num_pages, 1, page_bytes]: the paged FP4 index cache
        bt_ptr,  # int32 [B, max_pages] block table (-1 = no page)
        ctx_ptr,  # int32 [B] context lengths (the query sits at ctx - 1)
        out_ptr,  # fp32 [B, Hi, NB] block scores (SMEM), else [B, Hi, NB * NW]: NW partial maxima a block
        pos_ptr,  # int32 [B]: written here, the query positions ctx - 1 (-1 for an empty row) for the select pass
        gscale,  # fp32 whole-tensor factor (nvfp4 outer scale, else 1)
        num_pages, page_bytes, n_out, ch,  # ch: blocks per program (splits < n_front; then ch // TAIL_DIV)
        lo3, sign8,  # int32 0x07070707, 0x80808080 at run time (kc.e2m1_pairs: one LOP3 per bit-select)
        stride_qb, stride_qh, stride_bt,  # strides in elements
        HI: gl.constexpr,  # index heads (<= 8)
        PAGE: gl.constexpr,  # tokens per page (a multiple of 128)
        PB: gl.constexpr,  # payload bytes per token (64)
        SB: gl.constexpr,  # scale bytes per token (8 nvfp4, 4 mxfp4)
        E8M0: gl.constexpr,  # mxfp4 (E8M0 scales of 32 elements), else nvfp4 (E4M3 of 16)
        INIT: gl.constexpr,  # forced init blocks
        LOCAL: gl.constexpr,  # forced local blocks
        SMEM: gl.constexpr = False,  # block scores (the warps' partials maxed in shared memory; ch <= SMEM_BLOCKS)
        QSMEM: gl.constexpr = True,  # the query operand in shared memory (else in registers)
        n_front=0,  # splits before the tail (last in the signature: elsewhere ptxas took 111 registers, not 93)
        TAIL_DIV: gl.constexpr = 4,  # the tail's splits take ch // TAIL_DIV blocks
    ):
        b = gl.program_id(0)
        split = gl.program_id(1)
        ctx = gl.load(ctx_ptr + b)
        if split == 0:
            gl.store(pos_ptr + b, gl.maximum(ctx - 1, -1))
        valid = (ctx + TOK - 1) // TOK  # valid blocks of the row (the query at ctx - 1)
        tail_ch = ch // TAIL_DIV
        blk0 = gl.minimum(split, n_front) * ch + gl.maximum(split - n_front, 0) * tail_ch
        gl.assume(blk0 >= 0)  # without these the loop's values left the uniform datapath: 93 -> 114 registers
        n_blk = gl.minimum(valid - blk0, gl.where(split < n_front, ch, tail_ch))
        gl.assume(n_blk <= ch)
        qt, p_scale = _query_operand(q_ptr, b, stride_qb, stride_qh, gscale, HI, E8M0, QSMEM)
        # per-tile offsets inside a page
        tr = gl.arange(0, TOK, layout=gl.SliceLayout(1, W_L))
        w_off = gl.expand_dims(tr, 1) * (PB // 4) + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, W_L)), 0)
        if E8M0:  # a row's four E8M0 bytes (mx_factors)
            s_off = PAGE * PB + gl.arange(0, TOK, layout=ROW_L) * SB
        else:
            sr = gl.arange(0, TOK, layout=gl.SliceLayout(1, S8_L))
            sc = 2 * gl.arange(0, 4, layout=gl.SliceLayout(0, S8_L))
            s_off = PAGE * PB + gl.expand_dims(sr, 1) * SB + gl.expand_dims(sc, 0)
        p_off, p_mask = _part_offsets(n_out, HI, E8M0)
        HEADS: gl.constexpr = 4 if E8M0 else HP
        if SMEM:
            smem = gl.allocate_shared_memory(gl.float32, [SMEM_BLOCKS, NW, HEADS], SMEM_L)
        else:
            smem = p_scale  # (unused)
        out_row = out_ptr + (b * HI).to(gl.int64) * n_out
        bt_row = bt_ptr + b.to(gl.int64) * stride_bt
        end = blk0 + n_blk
        # a register double buffer: block j + 1 loads while block j computes; pages are looked up one block earlier
        # still (block j + 2's in iteration j), so that a load's address never waits on its page-table entry
        pg = _page(bt_row, blk0, end, num_pages, PAGE)
        words, sb = _fetch(data_ptr, pg, blk0, page_bytes, w_off, s_off, PAGE, PB, SB, E8M0)
        pg1 = _page(bt_row, blk0 + 1, end, num_pages, PAGE)
        # the blocks wholly before ctx without the token mask, then the row's partial last block (one at most)
        full_end = gl.maximum(gl.minimum(end, ctx // TOK), blk0)
        for blk in range(blk0, full_end):
            pg2 = _page(bt_row, blk + 2, end, num_pages, PAGE)
            words_n, sb_n = _fetch(data_ptr, pg1, blk + 1, page_bytes, w_off, s_off, PAGE, PB, SB, E8M0)
            acc = _tile_dot(words, sb, qt, lo3, sign8, E8M0, QSMEM)
            _emit(acc, blk, ctx, valid, pg, out_row, p_off, p_mask, p_scale, smem, blk0, E8M0, INIT, LOCAL, False,
                  SMEM)
            pg, pg1, words, sb = pg1, pg2, words_n, sb_n
        if full_end < end:  # already loaded
            acc = _tile_dot(words, sb, qt, lo3, sign8, E8M0, QSMEM)
            _emit(acc, full_end, ctx, valid, pg, out_row, p_off, p_mask, p_scale, smem, blk0, E8M0, INIT, LOCAL,
                  True, SMEM)
        if SMEM:
            _block_scores(smem, out_row, blk0, n_blk, n_out, HI, E8M0)


# register caps by block-scale element: mxfp4's kernel took 140-168 registers uncapped (3 programs per SM), and a cap
# of 128 (4 per SM) was faster; with the query in shared memory it takes 100 uncapped and 87 under the cap (offline
# sm_90: 4 / 5 programs per SM). nvfp4 takes 75 uncapped (6 per SM); lower caps for either (more programs per SM) were
# no faster. Numbers: docs/kernels/index_gluon.md.
MAXNREG = {"e4m3": None, "e8m0": 128}
# The query operand (B of every tile's dot, [128, 8 or 16] fp16) in shared memory, read by ldmatrix each tile, rather
# than held in registers: 16 / 32 registers a thread of the query's 16 / 32 become 4 / 8 LDSM a tile, which leaves
# registers for more programs per SM; faster on the H200 (numbers: docs/kernels/index_gluon.md).
QUERY_SMEM = True


def device_ok(device: torch.device) -> bool:
    """This path runs on CUDA devices with Gluon and the hardware E4M3 conversion (capability >= 8.9)."""
    return cuda_at_least(device, (8, 9))


# Formats (by scale element) the launcher sends here by default: both, each faster than the portable kernel at every
# measured shape (docs/kernels/index_gluon.md). mxfp4 is post-scaled (block factors after the dot): relative fp16
# block factors multiplied into the decoded tile need byte repacks around every HMUL2.
DEFAULT_SCALES = ("e4m3", "e8m0")


def applies(iq4: torch.Tensor, cache, cfg, q_pos, scales=("e4m3", "e8m0")) -> bool:
    """Shape and format conditions of this kernel (the device condition is `device_ok`); scales: the FP4 block-scale
    elements accepted (DEFAULT_SCALES for the launcher's default)."""
    _, nq, hi, d = iq4.shape
    return (cache.fmt.spec.payload_bits == 4 and cache.fmt.scale_element in scales and d == DIM
            and cache.head_dim == DIM and cache.payload_bytes == DIM // 2 and cfg.block_size == TOKENS
            and cache.page_size % TOKENS == 0 and nq == 1 and q_pos is None and cache.num_heads == 1
            and 1 <= hi <= (HEADS_PAD if cache.fmt.scale_element == "e4m3" else MX_HEADS)
            and aligned_16(cache))


def aligned_16(cache) -> bool:
    """The tile loads are 16-byte vector loads at fixed offsets from each tile's first word (`_fetch`): the cache
    base and the page size in bytes must be multiples of 16 (the scale loads, 2 bytes a row nvfp4 and 4 mxfp4, are
    then aligned too)."""
    return cache.data.data_ptr() % 16 == 0 and cache.page_bytes % 16 == 0


def chunk_blocks_for(bsz: int, nb: int, sms: int) -> int:
    """Blocks per program of the default launch (a power of two, at most CHUNK_BLOCKS): the largest that still
    gives every SM FILL_PROGRAMS programs, and no more than BALANCE_CHUNK where BALANCE_PROGRAMS per SM would
    not be reached otherwise (few long programs leave SMs idle at the end: one wave of unequal shares)."""
    sizes = [c for c in (32, 16, 8, 4, 2, 1) if c <= CHUNK_BLOCKS]
    fill = next((c for c in sizes if bsz * triton.cdiv(nb, c) >= FILL_PROGRAMS * sms), 1)
    balance = next((c for c in sizes if bsz * triton.cdiv(nb, c) >= BALANCE_PROGRAMS * sms), 1)
    return min(fill, max(BALANCE_CHUNK, balance))


def tail_blocks_for(bsz: int, nb: int, ch: int, sms: int) -> int:
    """Blocks at the end of each row that go to short splits (ch // TAIL_DIV each): TAIL_PROGRAMS_PER_SM programs
    per SM in all, at most half the row; 0 where those splits would be shorter than TAIL_MIN_CHUNK."""
    tail_ch = ch // TAIL_DIV
    if tail_ch < TAIL_MIN_CHUNK or bsz == 0:
        return 0
    want = triton.cdiv(TAIL_PROGRAMS_PER_SM * sms * tail_ch, bsz)
    return min(nb // 2, triton.cdiv(want, tail_ch) * tail_ch)


def split_grid(nb: int, ch: int, tail_blocks: int) -> tuple[int, int]:
    """(n_front, splits) of a row of nb blocks: split s < n_front takes blocks s ch .. s ch + ch - 1, the later ones
    ch // TAIL_DIV each from n_front ch on (the kernel's blk0 / n_blk), the last one clipped at the row's valid
    blocks; at least tail_blocks blocks in the tail (none where ch // TAIL_DIV is 0)."""
    tail_ch = ch // TAIL_DIV
    if not tail_blocks or not tail_ch:
        return triton.cdiv(nb, ch), triton.cdiv(nb, ch)
    n_front = max(0, nb - tail_blocks) // ch
    return n_front, n_front + triton.cdiv(nb - n_front * ch, tail_ch)


def decode_block_parts(iq4: torch.Tensor, cache, block_table: torch.Tensor, context_lens: torch.Tensor, cfg,
                       nb: int, chunk_blocks: int | None = None, fill: bool = True,
                       tail_blocks: int | None = None, max_registers: int | None = None,
                       query_smem: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """iq4 bf16 [B, 1, Hi, 128] decode queries -> (fp32 [B, 1, Hi, nb, P] partial block maxima (their max is the
    block score with the forced blocks applied; -inf past each row's valid blocks; P = 1, the block scores, where
    the splits fit SMEM_BLOCKS, else NUM_WARPS), int32 [B, 1] query
    positions ctx - 1, -1 for an empty row: the select pass's input, written by the kernel instead of by a few
    small torch kernels). Inputs as checked by `index_score._check`; `applies` and `device_ok` hold.
    chunk_blocks: blocks per program (default `chunk_blocks_for`). fill=False leaves the blocks past each row's
    valid ones unwritten (the select pass reads only valid blocks). tail_blocks: each row's last blocks that go to
    splits of chunk // TAIL_DIV blocks (default `tail_blocks_for`, none when chunk_blocks is given). max_registers:
    the register cap (default MAXNREG by block-scale element). query_smem: the query operand in shared memory,
    read by every tile, or in registers (default QUERY_SMEM)."""
    bsz, _, hi, _ = iq4.shape
    if chunk_blocks:
        ch = chunk_blocks
    else:
        ch = chunk_blocks_for(bsz, nb, num_sms(iq4.device)) if bsz and nb else 1
    smem = ch <= CHUNK_BLOCKS
    parts = 1 if smem else NUM_WARPS
    shape = (bsz, 1, hi, nb * parts)
    out = torch.full(shape, float("-inf"), dtype=torch.float32, device=iq4.device) if fill else \
        torch.empty(shape, dtype=torch.float32, device=iq4.device)
    pos = torch.full((bsz, 1), -1, dtype=torch.int32, device=iq4.device) if nb == 0 else \
        torch.empty((bsz, 1), dtype=torch.int32, device=iq4.device)
    if bsz == 0 or nb == 0:
        return out.view(bsz, 1, hi, nb, parts), pos
    q = iq4[:, 0] if iq4.stride(-1) == 1 else iq4[:, 0].contiguous()
    gscale = cache.outer_scale() if cache.fmt.scale_element == "e4m3" else 1.0
    if tail_blocks is None:
        tail_blocks = tail_blocks_for(bsz, nb, ch, num_sms(iq4.device)) if chunk_blocks is None else 0
    n_front, n_splits = split_grid(nb, ch, tail_blocks)
    grid = (bsz, n_splits)
    cap = max_registers or MAXNREG[cache.fmt.scale_element]
    decode_block_parts_kernel[grid](
        q, cache.data, block_table, context_lens, out, pos, float(gscale), cache.num_pages, cache.page_bytes,
        nb * parts, ch, 0x07070707, -0x7F7F7F80, q.stride(0), q.stride(1), block_table.stride(0),
        HI=hi, PAGE=cache.page_size, PB=cache.payload_bytes, SB=cache.scale_bytes,
        E8M0=cache.fmt.scale_element == "e8m0", INIT=cfg.init_blocks, LOCAL=cfg.local_blocks,
        SMEM=smem, QSMEM=QUERY_SMEM if query_smem is None else bool(query_smem), n_front=n_front, TAIL_DIV=TAIL_DIV,
        num_warps=NUM_WARPS, **({"maxnreg": cap} if cap else {}))
    return out.view(bsz, 1, hi, nb, parts), pos
