"""Lightning-indexer scorers (SPEC section 3) over a paged index cache, for bf16, fp8, nvfp4 and mxfp4 caches.

One parameterized kernel scores a tile of (query, index head) rows against the keys of one request, block by block, and
emits token scores, block scores, or per-program top-k candidates (merged by `kernels/topk.py`); top-k runs by default
as block scores plus `topk.select_from_block_scores` (see `_launch`; for nvfp4 the scorer writes per-warp partial block
maxima instead, `index_blocks.part_nanmax`, and the select pass maxes them). It reads the cache as engines hold it:
`kvtool.paged.PagedCache` with H = 1, uint8 [num_pages, 1, page_bytes], per page `[P x payload][P x scale]`, a block
table [B, max_pages] int32 and context lengths [B] int32.

On CUDA devices (capability >= 8.9) FP4 decode block scores and top-k run the Gluon kernel of
`kernels/index_gluon.py` instead (`_use_gluon`), which decodes E2M1 straight into the tensor-core operand registers;
this kernel is the portable path: every other device, prefill, other shapes, and CI (the interpreter).

How it aims to stay bandwidth-bound (the goal shape and its byte floor: docs/kernels/index_score.md):
- MQA: all index heads (and, in prefill, a tile of queries) share each key, so one key tile is loaded and decoded once
  and scored against every row with one tensor-core dot `K [T, D] x Q^T [D, rows]` (K from registers, wgmma).
- the context is split across programs (grid = requests x query tiles x context splits); each program writes its
  block scores (4 bytes per block and head) or, with `in_kernel_topk`, keeps them in registers and emits only its
  top-k (key, id) pairs for a merge kernel; a select kernel (or the merge) picks the final ids.
- a tile never crosses a page (T = min(block, page, 128)): one scalar page lookup per tile, affine row addresses.
- FP4 keys are decoded from uint32 words, two elements per 32-bit op and never interleaved: "quarter" K of a tile
  holds nibbles K and K + 4 of every word (elements 8j + K, 8j + K + 4), which sit 16 bits apart like the two
  halves of an fp16 pair, so shl / and / shl / and-or builds both fp16 values at once (~2 integer ops per element
  instead of ~6); the query is loaded in the same four orders and the four quarter dots chain into one accumulator.
  Head dims below 128 decode bytes instead (`kc.fp4_bytes`, even / odd elements, two dots): their word tiles got
  layouts with lanes holding copies of each other, and D = 64 gave wrong selections on the H200 (Triton 3.6).
- POST_SCALE (default where the rows fit one 16-row dot: mxfp4 at D = 128 with up to 4 heads, nvfp4 with up to 2):
  block scales are applied after the dot instead of on each decoded element. The query operand is block-diagonal,
  Q' [D, (block, row)] (column b MP + r = row r on block b's elements, 0 elsewhere), so one chain of dots of the
  undecorated E2M1 quarters gives every (token, block, row) partial score; each is multiplied by its token's fp32
  block scale and the blocks are summed (`tiles.post_scale`): no per-element multiply, no relative-exponent trick for
  mxfp4 (E8M0 2**e applied in fp32). For mxfp4 the 4 blocks x 4 heads fill the 16 rows a dot is padded to anyway;
  nvfp4 at 4 heads (8 blocks, 32 rows) measured slower than scaling the elements, so it keeps that path.
- prefill (every key against many query tiles) is compute-bound, not bandwidth-bound: there the dots run query-major
  (`q_major`, `tiles.tile_dot`: Q [rows, D] x K^T, so a row's block max reduces inside a thread quad and bf16 keys
  feed the tensor cores from shared memory as loaded), and on CUDA FP4 and unit / tensor-scaled fp8 keys are decoded
  once per call into a bf16 copy of the chunk's pages (`decode_once`, `_decode_once`) instead of once per query tile.
- fp8 keys use the hardware e4m3 -> fp16 conversion where it exists (CUDA sm_89+), else an integer decode.
- the next tile's loads overlap this tile's math: either the compiler's cp.async pipeline (5 stages: the page lookup,
  then the payload, one tile ahead) or a register double buffer (PREFETCH); the autotuner picks per format.
Where the time goes: the FP4 scorer is bound by instruction issue, not bandwidth (about 40 % of its loop is the
E2M1 decode; SASS counts and times in docs/kernels/index_score.md), hence the word decode above and LEAN below.
tl.dot_scaled (e2m1 x bf16) on sm_90 decodes through shared memory with byte loads (more SASS per tile than this
whole loop): not used.

LEAN (launch option `lean`, block-score launches; LEAN_DEFAULT): where the ~200 non-math instructions of the loop
went (offline sm_90, nvfp4): per-row predicates of every payload load (t < t_lim), the token mask and the column
scale on every score (32 of 16 + 16 per thread), shuffles of both 64-token groups, and per-block forced-block tests in
64-bit (LLVM widens the loop counter). LEAN masks loads per page only (a tile lies in one valid page, so tokens past
the context are readable; their scores are masked), masks scores only on a tile that needs it (decode: the last
tile of a program or a -1 page, a runtime branch), multiplies the column scale into the block maxima (exact: rounding
is monotone), reduces the 64-token groups inside each thread before the shuffles, and writes forced blocks after the
loop. Same numbers bit for bit, a shorter loop body for every format (docs/kernels/index_score.md).

Exactness (why the kernel equals the reference on the dequantized cache up to fp32 accumulation order):
- bf16 caches: bf16 keys x bf16 queries, exact products, fp32 accumulation.
- fp8 / nvfp4 / mxfp4: keys are decoded to fp16, where E4M3 values and E2M1 x E4M3 products (<= 6 significant bits,
  magnitudes 2**-10 .. 2688) are exact. The bf16 query row is multiplied by a power of two 2**a that puts its max in
  [2**14, 2**15) and cast to fp16: exact (fp16 has 11 significant bits to bf16's 8) except for elements below
  2**-28 of the row max, which round at 2**-39 of it. The fp32 scores are multiplied back by 2**-a.
- FP4 bits decode to value * 2**-14 (exact, 0.5 as an fp16 subnormal); nvfp4 multiplies by the E4M3 scale in fp16
  (v * s * 2**-14 stays exact: a multiple of 2**-24, <= 6 significant bits) and 2**14 joins the fp32 column scale.
- mxfp4 scales 2**e span fp32's range, so each token's block factors are taken relative to its largest scale,
  2**(e - emax + 14) in fp16, and the token's score is multiplied by 2**(emax - 14) in fp32. Exact unless a token's
  block exponents span more than 23 binades (then the tiny blocks lose at most one fp16 subnormal step).
- POST_SCALE: the partial score of each block (exact products, fp32 sums) is multiplied by the fp32 block scale
  (E4M3 value or 2**e, exact) with one fp32 rounding, and the blocks are summed in fp32: the same sum in another
  fp32 order (within `kvtool.indexer.accumulation_tolerance`).
- fp8 `token` row scales, fp8 `tensor` scales and the nvfp4 outer scale multiply the fp32 score.
- Under the Triton interpreter (which mangles bf16/fp16 dots) the same values are dotted in fp32.
NaN codes (E4M3 0x7F/0xFF, E8M0 255) decode to NaN as in torch; a NaN token score makes its block NaN, ranked -1e30.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtool.errors import KernelArgumentError
from kvtool.formats import kernel_desc as kd
from kvtool.formats.registry import get_format
from kvtool.kernels import index_gluon
from kvtool.kernels.dequant import launch_dequant
from kvtool.kernels import index_tiles as tiles
from kvtool.kernels.index_blocks import MODE_BLOCKS, MODE_TOPK, pair_step, tile_step, write_forced
from kvtool.kernels.platform import INTERPRET  # the interpreter dots in fp32
from kvtool.kernels.store import cache_scales, native_fp8, require_tensor_scale
from kvtool.kernels.topk import MAX_SELECT_BLOCKS, merge_candidates, pick_next, select_from_block_scores

__all__ = [
    "FORMATS", "FP4_PAIR_LAUNCH", "IndexGeometry", "LAUNCH_OPTIONS", "LEAN_DEFAULT", "MIN_WORDS_DIM", "PREFILL_LAUNCH",
    "PORTABLE_OPTIONS", "POST_SCALE_DEFAULT_ROWS", "POST_SCALE_ROWS", "decode_block_scores", "decode_scores",
    "decode_topk", "max_warps", "prefill_block_scores", "prefill_options", "prefill_scores", "prefill_topk"
]


# ----------------------------------------------------------------------------------------------------------- kernel
@triton.jit
def _index_score_kernel(
    q_ptr,  # bf16 [B, Q, Hi, D], last dim contiguous
    data_ptr,  # uint8 [num_pages, 1, page_bytes]: the paged index cache
    bt_ptr,  # int32 [B, max_pages] block table (-1 = no page)
    ctx_ptr,  # int32 [B] context lengths
    pos_ptr,  # int32 [B, Q] query positions (-1 = padding row); POS_CTX: [B, 1], written here
    tile_pos_ptr,  # int32 [B * n_qtiles]: max position of each program's query tile
    out_ptr,  # fp32 [B, Q, Hi, n_out]: token scores, block scores or candidate keys
    id_ptr,  # int32 [B, Q, Hi, n_out]: candidate ids (MODE_TOPK only)
    gscale,  # fp32 whole-tensor factor: fp8 `tensor` scale or nvfp4 outer scale (else 1)
    Q, HI, num_pages, page_bytes, n_qtiles, n_out,  # sizes
    stride_qb, stride_qq, stride_qh, stride_bt, stride_pos,  # strides in elements
    D: tl.constexpr,  # head dim
    PAGE: tl.constexpr,  # tokens per page
    PB: tl.constexpr,  # payload bytes per token
    SB: tl.constexpr,  # scale bytes per token
    PAYLOAD_BITS: tl.constexpr,  # 16 bf16 | 8 e4m3 | 4 e2m1
    SCALE_KIND: tl.constexpr,  # 0 none | 1 fp32 row | 2 e4m3 block | 3 e8m0 block
    SCALE_BLOCK: tl.constexpr,  # elements per block scale (1 when none)
    BS: tl.constexpr,  # index block size (tokens)
    TILE_T: tl.constexpr,  # tokens per key tile: min(BS, PAGE, 128), so a tile lies in one page
    QT: tl.constexpr,  # queries per program
    HIP: tl.constexpr,  # index heads rounded up to a power of two
    MP: tl.constexpr,  # rows per program: max(16, QT * HIP)
    CH: tl.constexpr,  # blocks per program (context split)
    KC: tl.constexpr,  # candidates per program: min(topk, CH)
    INIT: tl.constexpr,  # forced init blocks
    LOCAL: tl.constexpr,  # forced local blocks
    HIGHER_ID: tl.constexpr,  # tie rule
    MODE: tl.constexpr,  # MODE_TOKENS | MODE_BLOCKS | MODE_TOPK
    NATIVE_FP8: tl.constexpr,  # hardware e4m3 -> fp16 conversion (CUDA sm_89+)
    FP4_WORDS: tl.constexpr,  # FP4: decode uint32 words in quarters (else bytes; see `kc.fp4_bytes`)
    POST_SCALE: tl.constexpr,  # FP4 words: block scales applied after the dot (block-diagonal query; tiles.post_scale)
    NSBP: tl.constexpr,  # POST_SCALE: scale blocks per token (dot rows MP NSBP); else 1
    PREFETCH: tl.constexpr,  # register double buffer of the next tile (else: the compiler's pipelining)
    DOT_F32: tl.constexpr,  # interpreter: dot in fp32
    WP: tl.constexpr = 1,  # MODE_BLOCKS: write WP partial maxima per block (index_blocks), else the block max
    LEAN: tl.constexpr = False,  # leaner loop bookkeeping (`index_blocks.tile_step`)
    PAIR: tl.constexpr = False,  # two tiles per loop iteration (`index_blocks.pair_step`), then an odd tail tile
    QM: tl.constexpr = False,  # query-major dots: Q [rows, D] x K^T, token maxima inside a thread quad (tile_dot)
    POS_CTX: tl.constexpr = False,  # every row's position is ctx - 1 (decode); also stored at pos_ptr + b (split 0)
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // n_qtiles
    r = tl.arange(0, MP)
    qi = (pid % n_qtiles) * QT + r // HIP
    h = r % HIP
    row_ok = (r < QT * HIP) & (qi < Q) & (h < HI)
    ctx = tl.load(ctx_ptr + b)
    if POS_CTX:  # decode: no position tensors made before the launch (each small torch op is a graph node)
        tile_pos = tl.maximum(ctx - 1, -1)
        pos = tl.where(row_ok, tile_pos, -1)
        if split == 0:
            tl.store(pos_ptr + b, tile_pos)  # for a select pass after this kernel
    else:
        pos = tl.load(pos_ptr + b * stride_pos + qi, mask=row_ok, other=-1)
        # scalars from memory, not tensor reductions: loop bounds must be scalars (also under the interpreter)
        tile_pos = tl.load(tile_pos_ptr + pid)  # max position over this program's rows (-1: none)
    valid = tl.where(pos >= 0, pos // BS + 1, 0)  # valid blocks per row
    t_end = tl.minimum(tile_pos + 1, ctx)  # no row sees a token at or past t_end
    blk0 = split * CH
    n_iter = tl.minimum((tile_pos + BS) // BS - blk0, CH)  # (tile_pos // BS + 1), also right for tile_pos = -1
    q_off = b.to(tl.int64) * stride_qb + qi.to(tl.int64) * stride_qq + h * stride_qh
    qa, qb, qc, qd, colscale = tiles.load_query(q_ptr, q_off, row_ok, gscale, D, PAYLOAD_BITS, NATIVE_FP8,
                                                FP4_WORDS, POST_SCALE, NSBP, SCALE_BLOCK, DOT_F32)
    out_row = ((b * Q + qi) * HI + h).to(tl.int64) * n_out
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    col = tl.arange(0, CH)
    state = tl.full([MP, CH], float("-inf"), tl.float32)
    if WP > 1:
        bmax = tl.full([WP, MP], float("-inf"), tl.float32)
    else:
        bmax = tl.full([MP], float("-inf"), tl.float32)
    TPB: tl.constexpr = BS // TILE_T
    n_tiles = n_iter * TPB
    t_lim = tl.minimum(t_end, (blk0 + tl.maximum(n_iter, 0)) * BS)  # this program's tokens end here
    pg = tiles.page_of(bt_row, blk0 * BS, t_lim, num_pages, PAGE)
    # without PREFETCH this first fetch is only the loop-carried value's initial form: masked off entirely (LEAN
    # loads are masked per page only, so by page -1)
    pg0 = pg
    if LEAN and not PREFETCH:
        pg0 = -1 - pg * 0
    payload, scales = tiles.fetch(data_ptr, pg0, blk0 * BS, t_lim if PREFETCH else 0, page_bytes, D, TILE_T, PAGE,
                                  PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, FP4_WORDS, POST_SCALE, LEAN, QM)
    pg_next = tiles.page_of(bt_row, blk0 * BS + TILE_T, t_lim, num_pages, PAGE)
    if PAIR:
        # the same steps as below, two per iteration; the odd tail tile after the loop (n_tiles > 0: C remainder
        # compiled, Python's in the interpreter)
        if DOT_F32:
            for jj in range(0, (CH * TPB) // 2):
                if jj < n_tiles // 2:
                    payload, scales, pg, pg_next, bmax, state = pair_step(
                        2 * jj, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row,
                        data_ptr, qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes,
                        D, PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, BS, TILE_T, INIT, LOCAL, MODE,
                        NATIVE_FP8, PREFETCH, QT == 1, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, WP, LEAN, QM)
        else:
            for jj in range(0, n_tiles // 2):
                payload, scales, pg, pg_next, bmax, state = pair_step(
                    2 * jj, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row,
                    data_ptr, qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes,
                    D, PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, BS, TILE_T, INIT, LOCAL, MODE,
                    NATIVE_FP8, PREFETCH, QT == 1, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, WP, LEAN, QM)
        if (n_tiles > 0) & (n_tiles % 2 == 1):
            payload, scales, pg, pg_next, bmax, state = tile_step(
                n_tiles - 1, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row,
                data_ptr, qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes, D,
                PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, BS, TILE_T, INIT, LOCAL, MODE, NATIVE_FP8,
                PREFETCH, QT == 1, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, WP, LEAN, QM)
    else:
        if DOT_F32:
            # the interpreter cannot take a loaded scalar as a loop bound: run every step, skip the empty ones
            for j in range(0, CH * TPB):
                if j < n_tiles:
                    payload, scales, pg, pg_next, bmax, state = tile_step(
                        j, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row,
                        data_ptr, qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes, D,
                        PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, BS, TILE_T, INIT, LOCAL, MODE, NATIVE_FP8,
                        PREFETCH, QT == 1, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, WP, LEAN, QM)
        else:
            for j in range(0, n_tiles):
                payload, scales, pg, pg_next, bmax, state = tile_step(
                    j, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row,
                    data_ptr, qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes, D,
                    PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, BS, TILE_T, INIT, LOCAL, MODE, NATIVE_FP8,
                    PREFETCH, QT == 1, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, WP, LEAN, QM)
    if LEAN and MODE == MODE_BLOCKS:
        write_forced(blk0, n_iter, valid, out_ptr, out_row, row_ok, INIT, LOCAL, WP)
    if MODE == MODE_TOPK:
        ids = tl.broadcast_to((blk0 + col)[None, :], [MP, CH])
        avail = (col[None, :] < n_iter) & (ids < valid[:, None])
        base_c = out_row + split * KC
        for j in tl.static_range(KC):
            best, best_id, avail = pick_next(state, ids, avail, HIGHER_ID)
            tl.store(out_ptr + base_c + j, best, mask=row_ok)
            tl.store(id_ptr + base_c + j, best_id, mask=row_ok)


# -------------------------------------------------------------------------------------------------------- launchers
def _configs():
    """Launch variants the autotuner times on the GPU: the compiler's cp.async pipeline (5 stages: with the page
    lookup in front, fewer stages leave no key tile in flight during the previous tile's math, per the SASS) or the
    register double buffer (PREFETCH). 4 warps: one warpgroup per 128-token tile (8 warps: `--sweep`). Two
    variants keep first-call compile time low (each key compiles both once)."""
    if INTERPRET:
        return [triton.Config({"PREFETCH": False}, num_warps=4, num_stages=1)]
    return [triton.Config({"PREFETCH": False}, num_warps=4, num_stages=5),
            triton.Config({"PREFETCH": True}, num_warps=4, num_stages=1)]


_tuned_kernel = triton.autotune(
    configs=_configs(), key=["PAYLOAD_BITS", "SCALE_KIND", "D", "BS", "MP", "CH", "MODE", "HI", "NATIVE_FP8",
                             "FP4_WORDS", "POST_SCALE", "WP", "LEAN", "PAIR", "QM"]
)(_index_score_kernel)
LAUNCH_OPTIONS = ("chunk_blocks", "q_tile", "prefetch", "num_warps", "num_stages", "fp4_words",
                  "in_kernel_topk", "post_scale", "warp_partials", "select", "lean", "tile_pairs",
                  "max_registers", "gluon", "tail_blocks", "q_major", "decode_once", "query_smem")
# launch options that pick a variant of the portable kernel: any of them given turns the Gluon fast path off
PORTABLE_OPTIONS = ("q_tile", "prefetch", "num_warps", "num_stages", "fp4_words", "in_kernel_topk",
                    "post_scale", "warp_partials", "lean", "tile_pairs", "q_major")

# Two-pass top-k: the scorer writes per-warp partial block maxima (`index_blocks.part_nanmax`; no cross-warp reduction
# in its loop, fewer barriers) and the select pass maxes them. Default for E2M1 keys that scale in the decode (nvfp4,
# measured faster on the H200); off for fp8 (slower with LEAN, below), for POST_SCALE (its scores come from a sum
# over scale blocks whose layout does not split by warp) and for bf16 (not measured). Option warp_partials
# overrides. Numbers: docs/kernels/index_score.md.


# Dot rows (queries x heads x scale blocks) of POST_SCALE launches: by default only where the block-diagonal query
# fits the 16 rows a dot is padded to anyway (mxfp4 at D = 128 with up to 4 heads, nvfp4 with up to 2); with more rows
# the wider dot and accumulator cost more than the per-element scaling saves (measured on the H200,
# docs/kernels/index_score.md).
# post_scale=True forces it up to POST_SCALE_ROWS rows (tests, sweeps).
POST_SCALE_DEFAULT_ROWS = 16
POST_SCALE_ROWS = 64

# LEAN (module docstring) for block-score launches only (the in-kernel top-k's SASS nearly doubled with it, offline).
# On by default: faster for every format on the H200 (docs/kernels/index_score.md).
LEAN_DEFAULT = True

# Launch option tile_pairs (kernel PAIR, `index_blocks.pair_step`): two tiles per loop iteration, so the loop counter
# (64-bit: LLVM widens it), cp.async ring indices and barriers are paid once per 256 tokens, and (tile = block, LEAN,
# pipelined) both blocks' maxima leave in one store: one shared-memory round trip (Triton converts the reduction's
# layout to a coalesced one for the store) per two blocks. The shorter loop takes more registers (3 programs per SM
# instead of 4), hence the 128-register cap; with it pairs measured faster for FP4 keys and slower for fp8 on the
# H200 (`kvtool bench index --sweep`; SASS counts and times in docs/kernels/index_score.md).
# So FP4 decode top-k launches of this kernel on CUDA (those the Gluon kernel
# does not take, e.g. gluon=False) default to FP4_PAIR_LAUNCH; prefill has its own launch (PREFILL_LAUNCH).
def _cuda_defaults(device: torch.device) -> bool:
    """Whether the launch defaults measured on CUDA (FP4_PAIR_LAUNCH, PREFILL_LAUNCH, decode once) apply: CUDA
    devices, not ROCm or the interpreter (FP4_PAIR_LAUNCH's register cap is a CUDA launch option)."""
    return device.type == "cuda" and torch.version.cuda is not None


FP4_PAIR_LAUNCH = {"tile_pairs": True, "prefetch": False, "num_stages": 5, "num_warps": 4, "max_registers": 128}

# Prefill (several queries per request) on CUDA: a fixed launch per key element width instead of the autotuned one.
# bf16 / fp8 keys: query-major dots (`index_tiles.tile_dot`) over 128 rows (32 queries x 4 heads), 4 warps, 3 stages;
# FP4 keys (where they are not decoded once, below): 64 rows, one program per query tile over its whole context.
# Measured fastest of the `bench/sweep_index_prefill.py` rows on the H200 (docs/kernels/index_score.md).
PREFILL_LAUNCH = {
    16: {"q_rows": 128, "num_warps": 4, "num_stages": 3, "prefetch": False, "q_major": True},
    8: {"q_rows": 128, "num_warps": 4, "num_stages": 3, "prefetch": False, "q_major": True},
    4: {"q_rows": 64, "chunk_blocks": 256, "num_warps": 4, "num_stages": 5, "prefetch": False},
}
# The prefill select pass: rows per program by the row's block count (power of two): short rows pack several rows
# into one program (at 32 blocks 4 rows took 8.3 us against 18.6 for one, H200); 256-block rows keep one per program.
PREFILL_SELECT = {32: "packedR4", 64: "packedR2"}
# Decode once (launch option decode_once; default for prefill on CUDA from DECODE_ONCE_MIN_QUERIES queries): a
# prefill chunk scores every key against many query tiles, so FP4 and unit / tensor-scaled fp8 keys are first decoded
# once into a bf16 copy of the chunk's pages (`_decode_once`), which the bf16 scorer then reads; the fixed factors
# (nvfp4 outer scale, fp8 tensor scale) stay out of the copy and multiply the fp32 scores, so every decoded value is
# exact in bf16 (E2M1 x E4M3: <= 6 significant bits; E2M1 x 2**e and E4M3 values within bf16's range). The copy costs
# 2 bytes per key element once (8 MB at 32K tokens, D = 128) instead of a key decode per query tile. Measured faster
# at 4096 and 32768 queries (128 and 1024 query tiles, compute-bound); with few query tiles the scorer is
# bandwidth-bound and reads 2 bytes per key element per tile instead of 1 (fp8) or 1/2 (FP4), so below
# DECODE_ONCE_MIN_QUERIES (32 tiles of 32 queries; not measured there) the keys are decoded in the kernel as before.
DECODE_ONCE_MIN_QUERIES = 1024
# Most blocks per program of the default context split; CUDA decode 16: at batch 64 on the H200 bf16 / fp8 keys took
# 2230 / 1228 us per 4 layers at 150K with 16 against 2529 / 1342 with 32 (bf16 at 32K: 537 against 638).
MAX_CHUNK_BLOCKS = 32
CUDA_DECODE_MAX_CHUNK_BLOCKS = 16
PREFILL_DEFAULT_ROWS = 64  # dot rows of a prefill query tile elsewhere (the interpreter, other devices)


def prefill_options(payload_bits: int, heads: int, nb: int, mode: int, options: dict) -> dict:
    """`options` with the measured prefill launch (PREFILL_LAUNCH) for keys of `payload_bits`, `heads` index heads
    and `nb` blocks filled in, unless an option it would override is given. Its whole-context programs only where
    the top-k runs in two passes (a program's in-kernel candidates take registers per block of its chunk); the
    select variant of PREFILL_SELECT for top-k launches."""
    plan = PREFILL_LAUNCH.get(payload_bits)
    if plan is None or any(options.get(k) is not None for k in ("q_tile", *plan)):
        return options
    plan = dict(plan)
    if "chunk_blocks" in plan:
        if mode == 0 or (mode == 2 and (options.get("in_kernel_topk") or nb > MAX_SELECT_BLOCKS)):
            del plan["chunk_blocks"]
        else:
            plan["chunk_blocks"] = min(plan["chunk_blocks"], triton.next_power_of_2(nb))
    rows = plan.pop("q_rows")
    select = PREFILL_SELECT.get(triton.next_power_of_2(max(nb, 2)))
    if select and mode == 2:
        plan["select"] = select
    return {**plan, "q_tile": max(1, rows // triton.next_power_of_2(heads)), **options}


@dataclass(frozen=True)
class _DecodedPages:
    """A bf16 index cache of decoded pages (`_decode_once`): the fields of a paged cache the scorer reads."""

    fmt: object
    data: torch.Tensor  # uint8 [pages, 1, page_size * head_dim * 2]
    page_size: int
    head_dim: int
    num_heads: int = 1
    scale_bytes: int = 0

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def page_bytes(self) -> int:
        return self.data.shape[2]

    @property
    def payload_bytes(self) -> int:
        return 2 * self.head_dim


def _whole_tensor_factor(cache) -> float:
    """The factor of a cache's scores that no element carries: the fp8 `tensor` scale or the nvfp4 outer scale (1
    where the format has none)."""
    return require_tensor_scale(cache) if cache.fmt.scale_element == "fp32-tensor" else cache_scales(cache)[1]


def _decode_once_applies(cache, nq: int, device: torch.device, options: dict) -> bool:
    """Whether a prefill launch first decodes its pages to bf16 (DECODE_ONCE_MIN_QUERIES): option decode_once, else
    on CUDA for FP4 keys and fp8 keys without row scales, from that many queries, unless a variant option of the
    kernel (q_tile, warps, ...) or of the Gluon path is given."""
    desc = kd.kernel_desc(cache.fmt)
    fits = desc.payload_bits == 4 or (desc.payload_bits == 8 and desc.token_scale == kd.SCALE_NONE)
    want = options.get("decode_once")
    if want is not None:
        if want and not fits:
            raise KernelArgumentError(f"index scorer: decode_once takes FP4 or unit / tensor-scaled fp8 keys, not "
                                      f"{cache.fmt.label}")
        return bool(want)
    varied = any(options.get(k) is not None for k in (*PORTABLE_OPTIONS, "chunk_blocks", "gluon", "max_registers"))
    return fits and not varied and nq >= DECODE_ONCE_MIN_QUERIES and _cuda_defaults(device)


@triton.jit
def _decoded_slots_kernel(bt_ptr, slot_ptr, table_ptr, width, stride_bt, num_pages, n_tok, PAGE: tl.constexpr,
                          BLOCK: tl.constexpr):
    """For the bf16 copy of `_decode_once`: token i of copy page i // PAGE (request b = page // width, table column
    page % width) reads slot `table[b, col] * PAGE + i % PAGE` (-1 where that entry is no page: a dead row the
    dequantize skips), and the copy's block table maps (b, col) to copy page b * width + col (-1 likewise)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_tok
    page = i // PAGE
    b = page // width
    pg = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + page % width, mask=live, other=-1)
    ok = (pg >= 0) & (pg < num_pages)
    tl.store(slot_ptr + i, tl.where(ok, pg * PAGE + i % PAGE, -1), mask=live)
    tl.store(table_ptr + page, tl.where(ok, page, -1), mask=live & (i % PAGE == 0))


def _decode_once(cache, block_table: torch.Tensor, max_context: int) -> tuple[_DecodedPages, torch.Tensor]:
    """The pages of every request's first ceil(max_context / page) table entries, decoded to bf16 without the fixed
    factors (nvfp4 outer scale, fp8 tensor scale; the caller multiplies the scores by them): (a bf16 cache of
    B x W pages, its block table int32 [B, W], -1 where the original entry is no page). Two launches: the slots and
    table (`_decoded_slots_kernel`), then the gather-dequantize."""
    page, d = cache.page_size, cache.head_dim
    width = min(block_table.shape[1], max(1, triton.cdiv(max_context, page)))
    n = block_table.shape[0] * width
    dev = block_table.device
    slots = torch.empty(n * page, dtype=torch.int32, device=dev)
    table = torch.empty(block_table.shape[0], width, dtype=torch.int32, device=dev)
    keys = torch.empty(n * page, 1, d, dtype=torch.bfloat16, device=dev)
    if n:
        block = 1024
        _decoded_slots_kernel[(triton.cdiv(n * page, block),)](block_table, slots, table, width,
                                                                block_table.stride(0), cache.num_pages, n * page,
                                                                PAGE=page, BLOCK=block)
        launch_dequant(cache.data, None, slots, keys, cache.fmt, page_size=page, page_stride=cache.data.stride(0),
                       head_stride=cache.data.stride(1), tensor_scale=1.0, g_dec=1.0)
    return _DecodedPages(get_format("bf16"), keys.view(torch.uint8).view(n, 1, page * d * 2), page, d), table


def _use_gluon(iq4, cache, cfg, q_pos, mode: int, options: dict) -> bool:
    """The NVIDIA fast path (`kernels/index_gluon.py`) for FP4 decode block scores and top-k: option gluon=True
    forces it (nvfp4 or mxfp4, where it applies), False keeps the portable kernel; by default it runs for the
    formats of index_gluon.DEFAULT_SCALES where it applies unless a portable-kernel variant option is given.
    Block-score and two-pass top-k launches only."""
    want = options.get("gluon")
    portable = [k for k in PORTABLE_OPTIONS if options.get(k) is not None]
    if want and portable:
        raise KernelArgumentError(f"index scorer: gluon=True does not take the portable kernel's options {portable}")
    if want is False or mode not in (1, 2) or portable:
        return False
    scales = ("e4m3", "e8m0") if want else index_gluon.DEFAULT_SCALES
    ok = index_gluon.device_ok(iq4.device) and index_gluon.applies(iq4, cache, cfg, q_pos, scales)
    if want and not ok:
        raise KernelArgumentError("index scorer: gluon=True needs a CUDA device with capability >= 8.9 and an FP4 "
                                  "decode launch of head dim 128, 128-token blocks and at most 8 (nvfp4) or 4 "
                                  "(mxfp4) index heads")
    return ok


# Smallest head dim for the FP4 word decode (`kc.fp4_quarter`): at D = 64 the H200 gave wrong selections (see the
# module docstring); the byte decode covers smaller heads. A module constant so that a GPU diagnostic can lower it.
MIN_WORDS_DIM = 128


def max_warps(tile_t: int, rows: int) -> int:
    """Warps for a [tile_t, rows] score tile (at most 4): mma spreads the tile over warps 16 tokens x 8 rows at a
    time; with more warps than those 16 x 8 pieces, warps hold copies of others' data, and sparse attention's E2M1
    join / reshape chain compiled to wrong results in that case on the H200 (Triton 3.6), so never launch more."""
    return max(1, min(4, (tile_t // 16) * (rows // 8)))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # CPU / interpreter: few, long programs (each program start costs more than a block there)


# The formats the tiles decode, by descriptor (element, per-token scale kind, block): bf16, fp8 (unit, tensor or
# token scale), nvfp4 (E4M3 per 16 elements) and mxfp4 (E8M0 per 32).
FORMATS = {(kd.ELEM_BF16, kd.SCALE_NONE, 0), (kd.ELEM_E4M3, kd.SCALE_NONE, 0), (kd.ELEM_E4M3, kd.SCALE_ROW, 0),
           (kd.ELEM_E2M1, kd.SCALE_E4M3, 16), (kd.ELEM_E2M1, kd.SCALE_E8M0, 32)}


def _format_key(fmt) -> tuple[int, int, int]:
    d = kd.kernel_desc(fmt)
    return d.elem, d.token_scale, d.block


def _check(iq4: torch.Tensor, cache, block_table: torch.Tensor, context_lens: torch.Tensor, cfg) -> None:
    dev = iq4.device
    fmt = cache.fmt
    if _format_key(fmt) not in FORMATS:
        raise KernelArgumentError(f"index scorer: unsupported cache format {fmt.label}")
    if iq4.dtype != torch.bfloat16:
        raise KernelArgumentError(f"index scorer: queries must be bf16, got {iq4.dtype}")
    if cache.num_heads != 1:
        raise KernelArgumentError(f"index scorer: the index cache has one (MQA) key head, got {cache.num_heads}")
    d = cache.head_dim
    least = 32 if fmt.spec.payload_bits == 4 else 16  # a tensor-core dot needs 16 along its inner dim (D/2 for FP4)
    if iq4.shape[-1] != d or d < least or d & (d - 1):
        raise KernelArgumentError(f"index scorer: head dim must match the cache ({d}, a power of two >= {least} "
                                  f"for {fmt.label}), got queries {list(iq4.shape)}")
    if cache.data.dtype != torch.uint8 or not cache.data.is_contiguous() or cache.data.device != dev:
        raise KernelArgumentError("index scorer: cache.data must be contiguous uint8 on the queries' device")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != iq4.shape[0] \
            or block_table.device != dev or block_table.stride(1) != 1:
        raise KernelArgumentError(f"index scorer: block_table must be int32 [B={iq4.shape[0]}, max_pages] on "
                                  f"{dev} with unit stride, got {block_table.dtype} {list(block_table.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (iq4.shape[0],) or context_lens.device != dev:
        raise KernelArgumentError(f"index scorer: context_lens must be int32 [{iq4.shape[0]}] on {dev}, got "
                                  f"{context_lens.dtype} {list(context_lens.shape)}")
    bs, page = cfg.block_size, cache.page_size
    if bs < 16 or bs & (bs - 1):
        raise KernelArgumentError(f"index scorer: block size must be a power of two >= 16, got {bs}")
    if page < 16 or page & (page - 1):
        raise KernelArgumentError(f"index scorer: page size must be a power of two >= 16, got {page}")
    if iq4.shape[2] > 16:
        raise KernelArgumentError(f"index scorer: at most 16 index heads, got {iq4.shape[2]}")


def _positions(q_pos, iq4: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """int32 [B, Q] positions (-1 = padding): given, or the last Q positions of each context (decode, one query per
    request, takes them from the context lengths inside the kernel instead: POS_CTX)."""
    b, nq = iq4.shape[:2]
    if q_pos is None:  # int32 throughout: few small kernels
        pos = context_lens[:, None] + torch.arange(-nq, 0, device=iq4.device, dtype=torch.int32)[None, :]
        return pos.clamp_(min=-1)
    q_pos = torch.as_tensor(q_pos, device=iq4.device)
    if tuple(q_pos.shape) != (b, nq):
        raise KernelArgumentError(f"index scorer: q_pos must be [{b}, {nq}], got {list(q_pos.shape)}")
    if bool((q_pos >= context_lens[:, None]).any()):
        raise KernelArgumentError("index scorer: a query position lies at or past its request's context length")
    return torch.where(q_pos < 0, -1, q_pos).to(torch.int32).contiguous()


def _launch(iq4, cache, block_table, context_lens, q_pos, cfg, mode: int, max_context: int | None, *,
            gscale: float | None = None, **options):
    """iq4 bf16 [B, Q, Hi, D] -> MODE_TOKENS fp32 [B, Q, Hi, S] | MODE_BLOCKS fp32 [B, Q, Hi, NB] |
    MODE_TOPK int32 [B, Q, Hi, cfg.topk]. Options (LAUNCH_OPTIONS, for tests and benchmark sweeps): chunk_blocks
    (blocks per program), q_tile (queries per program), fp4_words (FP4 word
    decode; default for head dims >= 128), in_kernel_topk (top-k: each program keeps candidates in registers and a
    merge kernel picks, instead of the default two passes: block scores, then `select_from_block_scores`; the
    block scores are 4 bytes per block and head, about 0.2 % of an FP4 cache's bytes, and two passes measured faster
    on the H200, docs/kernels/index_score.md), post_scale (FP4 words: block scales applied to the
    partial scores of a block-diagonal query after the dot; default where its dot rows fit 16, see
    POST_SCALE_DEFAULT_ROWS), warp_partials (two-pass top-k: per-warp partial block maxima, see
    the comment above the launchers), select (the select pass's launch variant, `topk.SELECT_VARIANTS`), tile_pairs
    (two tiles per loop iteration, `index_blocks.pair_step`; FP4 top-k on CUDA: FP4_PAIR_LAUNCH), and prefetch /
    num_warps / num_stages (a fixed launch instead of the autotuned one), max_registers (CUDA's maxnreg: the
    portable kernel's fixed launch, or the Gluon scorer's cap instead of `index_gluon.MAXNREG`),
    tail_blocks (the Gluon scorer's short final splits, `index_gluon.tail_blocks_for`; 0: none), query_smem (the
    Gluon scorer's query operand in shared memory or registers, `index_gluon.QUERY_SMEM`), q_major (query-major
    dots, `index_tiles.tile_dot`), decode_once (prefill: decode the keys to bf16 first, `_decode_once_applies`).
    gscale: the whole-tensor factor of the scores when `cache` is such a decoded copy (else the cache's own)."""
    bad = set(options) - set(LAUNCH_OPTIONS)
    if bad:
        raise KernelArgumentError(f"index scorer: unknown launch options {sorted(bad)} (known: {LAUNCH_OPTIONS})")
    _check(iq4, cache, block_table, context_lens, cfg)
    if max_context is None:
        max_context = int(context_lens.max()) if mode != 2 and iq4.shape[0] else block_table.shape[1] * cache.page_size
    nb = triton.cdiv(max(max_context, 1), cfg.block_size)
    if iq4.shape[1] > 1 and _decode_once_applies(cache, iq4.shape[1], iq4.device, options):
        decoded, table = _decode_once(cache, block_table, max_context)
        rest = {k: v for k, v in options.items() if k != "decode_once"}
        return _launch(iq4, decoded, table, context_lens, q_pos, cfg, mode, max_context,
                       gscale=_whole_tensor_factor(cache), **rest)
    if (mode == 1 or nb <= MAX_SELECT_BLOCKS) and _use_gluon(iq4, cache, cfg, q_pos, mode, options):
        parts, pos = index_gluon.decode_block_parts(iq4, cache, block_table, context_lens, cfg, nb,
                                                    options.get("chunk_blocks"), fill=mode == 1,
                                                    tail_blocks=options.get("tail_blocks"),
                                                    max_registers=options.get("max_registers"),
                                                    query_smem=options.get("query_smem"))
        if mode == 1:  # block scores already (one part), or the warps' partials: NaN-propagating max
            return parts[..., 0] if parts.shape[-1] == 1 else parts.amax(-1)
        return select_from_block_scores(parts, pos, cfg.block_size, cfg.topk, higher_id=cfg.tie_rule != "lower-id",
                                        variant=options.get("select"))
    if (_cuda_defaults(iq4.device) and cache.fmt.spec.payload_bits == 4 and mode == 2 and q_pos is None
            and iq4.shape[1] == 1 and not options.get("in_kernel_topk") and iq4.shape[-1] >= MIN_WORDS_DIM
            and not any(options.get(k) is not None for k in FP4_PAIR_LAUNCH)):
        options = {**FP4_PAIR_LAUNCH, **options}  # measured default (above); a register cap is CUDA-only
    if _cuda_defaults(iq4.device) and iq4.shape[1] > 1:  # measured on CUDA only
        options = prefill_options(cache.fmt.spec.payload_bits, iq4.shape[2], nb, mode, options)
    iq4 = iq4 if iq4.stride(-1) == 1 else iq4.contiguous()
    bsz, nq, hi, d = iq4.shape
    pos_ctx = nq == 1 and q_pos is None  # decode: the kernel takes positions from the context lengths (POS_CTX)
    pos = torch.empty(bsz, 1, dtype=torch.int32, device=iq4.device) if pos_ctx else \
        _positions(q_pos, iq4, context_lens)
    fmt, bs = cache.fmt, cfg.block_size
    desc = kd.kernel_desc(fmt)
    fp4_words = options.get("fp4_words")
    fp4_words = d >= 128 if fp4_words is None else bool(fp4_words)
    if fp4_words and fmt.spec.payload_bits == 4 and d < MIN_WORDS_DIM:
        raise KernelArgumentError(f"index scorer: the FP4 word decode needs a head dim >= {MIN_WORDS_DIM}, got {d}")
    hip = triton.next_power_of_2(hi)
    qt = options.get("q_tile") or (1 if nq == 1 else max(1, PREFILL_DEFAULT_ROWS // hip))
    qt = min(triton.next_power_of_2(qt), triton.next_power_of_2(nq))
    words = fp4_words and fmt.spec.payload_bits == 4
    nsb = d // fmt.block if words else 1
    post = options.get("post_scale")
    post_ok = words and qt * hip * nsb <= POST_SCALE_ROWS
    if post and not post_ok:
        raise KernelArgumentError(f"index scorer: post_scale needs the FP4 word decode and at most "
                                  f"{POST_SCALE_ROWS} dot rows (query tile x heads x scale blocks), got "
                                  f"{qt * hip * nsb if words else 'no word decode'}")
    post = (words and qt * hip * nsb <= POST_SCALE_DEFAULT_ROWS) if post is None else bool(post)
    nsbp = nsb if post else 1
    # rows of scores: a dot needs 16 rows (padded); POST_SCALE dots MP NSBP rows
    mp = max(16 // nsbp, qt * hip)
    n_qtiles = triton.cdiv(nq, qt)
    if qt == 1:  # one query per tile (decode): its position; no pad / max launches in the step's graph
        tile_pos = pos  # (not read with POS_CTX)
    else:
        tile_pos = torch.nn.functional.pad(pos, (0, n_qtiles * qt - nq), value=-1).view(bsz, n_qtiles, qt)
        tile_pos = tile_pos.amax(-1).contiguous() if bsz * nq else tile_pos.new_empty(0)
    ch = options.get("chunk_blocks")
    if ch is None:
        # about four programs per SM; powers of 4 so that few distinct kernels (and autotune keys) arise, at most
        # MAX_CHUNK_BLOCKS blocks; one block per program where there are fewer blocks than that (both measured best
        # on the H200, docs/kernels/index_score.md)
        want = triton.cdiv(nb * bsz * n_qtiles, 4 * _num_sms(iq4.device))
        ch = 1 if want <= 1 else 4
        while 1 < ch < min(want, 64):
            ch *= 4
        cuda_decode = nq == 1 and iq4.device.type == "cuda"
        ch = min(ch, CUDA_DECODE_MAX_CHUNK_BLOCKS if cuda_decode else MAX_CHUNK_BLOCKS)
    ch = triton.next_power_of_2(ch)
    splits = triton.cdiv(nb, ch)
    kc_ = min(cfg.topk, ch)
    two_pass = mode == 2 and not options.get("in_kernel_topk") and nb <= MAX_SELECT_BLOCKS
    kmode = 1 if two_pass else mode
    tile_t = min(bs, cache.page_size, 128)
    warps = max_warps(tile_t, mp * nsbp)
    wp_opt = options.get("warp_partials")
    wp = 1
    if wp_opt is None:
        wp_opt = not post and fmt.spec.payload_bits == 4
    if two_pass and wp_opt:
        # one part per warp of the fixed or autotuned (4-warp) launch, each part whole 16-token rows of the tile
        wp = min(options.get("num_warps") or warps, tile_t // 16)
        wp = 1 << (wp.bit_length() - 1)
    n_out = {0: max_context, 1: nb * wp, 2: splits * kc_}[kmode]
    if two_pass:  # the select pass reads only each row's valid blocks, every one of which a program writes
        out = torch.empty((bsz, nq, hi, n_out), dtype=torch.float32, device=iq4.device)
    else:  # block / token scores: -inf past the valid ones
        out = torch.full((bsz, nq, hi, n_out), float("-inf"), dtype=torch.float32, device=iq4.device)
    ids = torch.empty((bsz, nq, hi, n_out) if kmode == 2 else (1,), dtype=torch.int32, device=iq4.device)
    if bsz * nq and n_out:
        if gscale is None:
            gscale = _whole_tensor_factor(cache)
        args = (iq4, cache.data, block_table, context_lens, pos, tile_pos, out, ids, float(gscale),
                nq, hi, cache.num_pages, cache.page_bytes, n_qtiles, n_out,
                iq4.stride(0), iq4.stride(1), iq4.stride(2), block_table.stride(0), pos.stride(0))
        consts = dict(D=d, PAGE=cache.page_size, PB=cache.payload_bytes, SB=cache.scale_bytes,
                      PAYLOAD_BITS=desc.payload_bits, SCALE_KIND=desc.token_scale,
                      SCALE_BLOCK=fmt.block or 1, BS=bs, TILE_T=tile_t, QT=qt, HIP=hip, MP=mp,
                      CH=ch, KC=kc_, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks,
                      HIGHER_ID=cfg.tie_rule != "lower-id", MODE=kmode,
                      NATIVE_FP8=native_fp8(iq4.device),
                      FP4_WORDS=words, POST_SCALE=post, NSBP=nsbp, DOT_F32=INTERPRET, WP=wp,
                      LEAN=kmode == 1 and (LEAN_DEFAULT if options.get("lean") is None else bool(options["lean"])),
                      PAIR=bool(options.get("tile_pairs", False)), QM=bool(options.get("q_major", False)),
                      POS_CTX=pos_ctx)
        grid = (bsz * n_qtiles, splits)
        fixed = [k for k in ("prefetch", "num_warps", "num_stages", "max_registers") if options.get(k) is not None]
        if fixed or INTERPRET or warps < 4:
            # max_registers: a register cap (CUDA maxnreg; tile_pairs needs ~160 without it: 3 programs per SM
            # instead of 4); the interpreter has no registers
            cap = {} if INTERPRET or not options.get("max_registers") else {"maxnreg": int(options["max_registers"])}
            _index_score_kernel[grid](*args, **consts, PREFETCH=bool(options.get("prefetch", False)),
                                      num_warps=options.get("num_warps") or warps,
                                      num_stages=1 if INTERPRET else options.get("num_stages") or 1, **cap)
        else:
            _tuned_kernel[grid](*args, **consts)
    if mode != 2:
        return out
    if two_pass:
        parts = out.view(bsz, nq, hi, nb, wp) if wp > 1 else out
        return select_from_block_scores(parts, pos, bs, cfg.topk, higher_id=cfg.tie_rule != "lower-id",
                                        variant=options.get("select"))
    return merge_candidates(out, ids, cfg.topk, higher_id=cfg.tie_rule != "lower-id")


def _decode_q(iq: torch.Tensor) -> torch.Tensor:
    if iq.dim() != 3:
        raise KernelArgumentError(f"decode: iq must be [B, Hi, D], got {list(iq.shape)}")
    return iq[:, None]


def decode_scores(iq, cache, block_table, context_lens, cfg=None, max_context: int | None = None,
                  **options) -> torch.Tensor:
    """Token scores of one decode query per request: iq bf16 [B, Hi, D] at position ctx - 1 -> fp32
    [B, Hi, max_context] (`s >= ctx` is -inf; max_context defaults to max(context_lens), a host sync)."""
    cfg = cfg or _default_cfg()
    return _launch(_decode_q(iq), cache, block_table, context_lens, None, cfg, 0, max_context, **options)[:, 0]


def decode_block_scores(iq, cache, block_table, context_lens, cfg=None, max_context: int | None = None,
                        **options) -> torch.Tensor:
    """Block scores of one decode query per request: iq bf16 [B, Hi, D] -> fp32 [B, Hi, ceil(max_context / block)]:
    max-pooled (NaN propagates), forced blocks 1e30 / 1e29, -inf past the valid blocks (kvtool.indexer.block_scores)."""
    cfg = cfg or _default_cfg()
    return _launch(_decode_q(iq), cache, block_table, context_lens, None, cfg, 1, max_context, **options)[:, 0]


def decode_topk(iq, cache, block_table, context_lens, cfg=None, max_context: int | None = None,
                **options) -> torch.Tensor:
    """Fused decode score + top-k: iq bf16 [B, Hi, D] -> int32 block ids [B, Hi, cfg.topk] in rank order,
    k = min(topk, valid blocks) per row, -1 padded. No host sync (the split count comes from the block-table width
    unless max_context is given)."""
    cfg = cfg or _default_cfg()
    return _launch(_decode_q(iq), cache, block_table, context_lens, None, cfg, 2, max_context, **options)[:, 0]


def prefill_block_scores(iq, cache, block_table, context_lens, cfg=None, q_pos=None,
                         max_context: int | None = None, **options) -> torch.Tensor:
    """Many queries per request: iq bf16 [B, Q, Hi, D] at positions q_pos int [B, Q] (default ctx - Q .. ctx - 1;
    negative = padding row) -> fp32 block scores [B, Q, Hi, NB], causal inside the chunk."""
    cfg = cfg or _default_cfg()
    return _launch(iq, cache, block_table, context_lens, q_pos, cfg, 1, max_context, **options)


def prefill_topk(iq, cache, block_table, context_lens, cfg=None, q_pos=None, max_context: int | None = None,
                 **options) -> torch.Tensor:
    """Many queries per request: iq bf16 [B, Q, Hi, D] at positions q_pos [B, Q] (default ctx - Q .. ctx - 1;
    negative = padding row, all -1) -> int32 block ids [B, Q, Hi, cfg.topk], causal inside the chunk."""
    cfg = cfg or _default_cfg()
    return _launch(iq, cache, block_table, context_lens, q_pos, cfg, 2, max_context, **options)


def prefill_scores(iq, cache, block_table, context_lens, cfg=None, q_pos=None,
                   max_context: int | None = None, **options) -> torch.Tensor:
    """Token scores for many queries per request: iq bf16 [B, Q, Hi, D] -> fp32 [B, Q, Hi, max_context]."""
    cfg = cfg or _default_cfg()
    return _launch(iq, cache, block_table, context_lens, q_pos, cfg, 0, max_context, **options)


@dataclass(frozen=True)
class IndexGeometry:
    """What the scorer and the selection read of an indexer configuration (`cfg`: this or any object with these
    fields, `kvtool.indexer.IndexerConfig` among them). The defaults are M3's, as IndexerConfig's (a test keeps
    them equal): 128-token blocks, top-16, no init blocks, one local block, ties to the higher block id."""

    block_size: int = 128
    topk: int = 16
    init_blocks: int = 0
    local_blocks: int = 1
    tie_rule: str = "higher-id"  # 'higher-id' | 'lower-id' | 'any'


def _default_cfg() -> IndexGeometry:
    return IndexGeometry()
