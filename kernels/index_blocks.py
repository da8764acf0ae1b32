"""The lightning-indexer scorer's loop step and block bookkeeping (`kernels/index_score.py`), split from it by concept:
`tile_step` is one iteration of the scorer's loop (fetch the next key tile, decode and dot this one through
`kernels/index_tiles.py`, fold the token scores into block maxima), and the helpers around it finish a block (forced
init / local blocks, NaN ranking, the write of a block score, per-warp partial maxima or a top-k candidate row).
The output modes and the forced-block keys are the scorer's constants, defined here once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtool.kernels import index_tiles as tiles

__all__ = [
    "INIT_SCORE", "LOCAL_SCORE", "MODE_BLOCKS", "MODE_TOKENS", "MODE_TOPK", "NAN_RANK", "col_nanmax", "finish_block",
    "nanmax", "pair_step", "part_nanmax", "tile_step", "write_forced"
]

MODE_TOKENS = tl.constexpr(0)  # write token scores [rows, S]
MODE_BLOCKS = tl.constexpr(1)  # write block scores [rows, NB] (forced blocks applied)
MODE_TOPK = tl.constexpr(2)  # write per-program top-k candidates [rows, splits * KC]
INIT_SCORE = tl.constexpr(1e30)  # kvtool.indexer.INIT_SCORE
LOCAL_SCORE = tl.constexpr(1e29)  # kvtool.indexer.LOCAL_SCORE
NAN_RANK = tl.constexpr(-1e30)  # kvtool.indexer.NAN_RANK


@triton.jit
def nanmax(a, b):
    # torch.amax semantics: NaN wins (tl.maximum's default leaves NaN handling to the hardware)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def col_nanmax(s, INTERP: tl.constexpr):
    """Max over axis 0 of fp32 [T, MP] with NaN winning. Compiled: one NaN-propagating max reduction. The
    interpreter runs a custom combine function element by element (slow), so there: numpy's max plus a NaN flag."""
    if INTERP:
        has_nan = tl.max((s != s).to(tl.int32), axis=0) > 0
        return tl.where(has_nan, float("nan"), tl.max(s, axis=0))
    else:
        return tl.reduce(s, 0, nanmax)


@triton.jit
def part_nanmax(s, WP: tl.constexpr, INTERP: tl.constexpr, LEAN: tl.constexpr = False):
    """Partial maxima of fp32 [T, MP] (NaN winning): [WP, MP], part p over the tokens t with (t // 16) % WP == p.
    With WP = num_warps that is what each warp of the dot's accumulator holds (sm_90 wgmma: warp w has tokens
    16 w .. 16 w + 15 of every 64), so the reduction stays inside warps: no shared memory, no barrier. The select pass
    takes the max of the parts. Correct for any layout (only the speed depends on the match). LEAN: the groups of 64
    tokens first (inside each thread), then the 16 tokens of a warp's slice (shuffles), so each shuffle carries one
    value per column instead of one per group: the same maxima (NaN-winning max is associative)."""
    T: tl.constexpr = s.shape[0]
    MPc: tl.constexpr = s.shape[1]
    s4 = tl.reshape(s, [T // (16 * WP), WP, 16, MPc])
    if INTERP:
        nan4 = (s4 != s4).to(tl.int32)
        has_nan = tl.max(tl.max(nan4, axis=2), axis=0) > 0
        return tl.where(has_nan, float("nan"), tl.max(tl.max(s4, axis=2), axis=0))
    elif LEAN:
        return tl.reduce(tl.reduce(s4, 0, nanmax), 1, nanmax)
    else:
        return tl.reduce(tl.reduce(s4, 2, nanmax), 0, nanmax)


@triton.jit
def finish_block(i, blk0, bmax, state, col, valid, out_ptr, out_row, row_ok, colscale, INIT: tl.constexpr,
                  LOCAL: tl.constexpr, MODE: tl.constexpr, WP: tl.constexpr, LEAN: tl.constexpr):
    """Block blk0 + i is scored (bmax [MP], or [WP, MP] partial maxima): apply the forced blocks, then write its block
    scores (WP > 1: its WP partial maxima at out_row + block WP + p) or put its rank key in column i of the top-k
    state [MP, CH]; returns the state. LEAN: bmax is of unscaled scores; the column scale (> 0, or 0) multiplies it
    here: rounding is monotone, so max(fl(c s)) = fl(c max(s)), the same numbers (-inf stays -inf also for c = 0)."""
    if LEAN:
        if WP > 1:
            bmax = tl.where(bmax == float("-inf"), bmax, bmax * colscale[None, :])
        else:
            bmax = tl.where(bmax == float("-inf"), bmax, bmax * colscale)
    blk = blk0 + i
    if LEAN and MODE == MODE_BLOCKS:  # forced blocks are written after the loop (`write_forced`)
        bsc = bmax
    else:
        forced_init = (blk < INIT) & (blk < valid)
        forced_local = (blk >= valid - LOCAL) & (blk < valid)
        bsc = tl.where(forced_local, LOCAL_SCORE, tl.where(forced_init, INIT_SCORE, bmax))
    if MODE == MODE_BLOCKS:
        if WP > 1:
            p = tl.arange(0, WP)
            tl.store(out_ptr + out_row[None, :] + blk * WP + p[:, None], bsc, mask=row_ok[None, :])
        else:
            tl.store(out_ptr + out_row + blk, bsc, mask=row_ok)
    if MODE == MODE_TOPK:
        key = tl.where(bsc != bsc, NAN_RANK, bsc)
        state = tl.where(col[None, :] == i, key[:, None], state)
    return state


@triton.jit
def write_forced(blk0, n_iter, valid, out_ptr, out_row, row_ok, INIT: tl.constexpr, LOCAL: tl.constexpr,
                  WP: tl.constexpr):
    """MODE_BLOCKS with LEAN: after the loop, overwrite the forced blocks among this program's blocks blk0 ..
    blk0 + n_iter - 1 (every one of their WP parts): 1e29 for the last LOCAL valid blocks of a row, else 1e30 for its
    first INIT valid blocks (the values `finish_block` gives otherwise, which override NaN too). Per row at most
    INIT + LOCAL blocks, instead of two comparisons per block and row in the loop. The loop's stores of the same
    addresses came from other threads, hence the barrier first (it orders the CTA's global writes)."""
    tl.debug_barrier()
    p = tl.arange(0, WP)
    for k in tl.static_range(INIT + LOCAL):
        if k < INIT:
            blk = tl.full(valid.shape, k, tl.int32)
            ok = (blk < valid) & (blk < valid - LOCAL)  # a block also local gets the local score below
            val = INIT_SCORE
        else:
            blk = valid - LOCAL + (k - INIT)
            ok = (blk >= 0) & (blk < valid)
            val = LOCAL_SCORE
        ok = ok & row_ok & (blk >= blk0) & (blk < blk0 + n_iter)
        if WP > 1:
            tl.store(out_ptr + out_row[None, :] + blk[None, :] * WP + p[:, None],
                     tl.full([WP, valid.shape[0]], val, tl.float32), mask=ok[None, :])
        else:
            tl.store(out_ptr + out_row + blk, tl.full(valid.shape, val, tl.float32), mask=ok)


@triton.jit
def tile_step(j, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row, data_ptr,
               qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes,
               D: tl.constexpr, PAGE: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr,
               PAYLOAD_BITS: tl.constexpr, SCALE_KIND: tl.constexpr, SCALE_BLOCK: tl.constexpr, BS: tl.constexpr,
               TILE_T: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, MODE: tl.constexpr,
               NATIVE_FP8: tl.constexpr, PREFETCH: tl.constexpr, ONE_POS: tl.constexpr, FP4_WORDS: tl.constexpr,
               POST_SCALE: tl.constexpr, NSBP: tl.constexpr, DOT_F32: tl.constexpr, WP: tl.constexpr,
               LEAN: tl.constexpr, QM: tl.constexpr = False):
    """Tile j of the program (tokens blk0 BS + j TILE_T ..). PREFETCH: it was fetched into (payload, scales) from
    page pg by the previous step; first issue the loads of tile j + 1 (page pg_next) and the page lookup of tile
    j + 2, so that memory works while this tile decodes and multiplies (a register double buffer). Otherwise fetch
    it here and let the compiler's software pipeline (num_stages) run the loads ahead. Then score it, fold it into
    the block maximum bmax, and finish the block at its last tile. Returns (payload, scales, pg, pg_next, bmax,
    state) for the next step (passed through unchanged without PREFETCH). POST_SCALE block scales load in the step
    (not pipelined by the compiler, which runs only dot-operand loads ahead; carrying them one tile ahead in
    registers measured slower on the H200, docs/kernels/index_score.md).
    LEAN (block modes): loads predicated per page (`tiles._tile_ok`), token masks only on tiles that need them
    (decode: the program's last tile or a -1 page; a runtime branch), column scale after the block max."""
    TPB: tl.constexpr = BS // TILE_T
    t0 = blk0 * BS + j * TILE_T
    t = t0 + tl.arange(0, TILE_T)
    if PREFETCH:
        cur_pay, cur_sc, cur_pg = payload, scales, pg
        payload, scales = tiles.fetch(data_ptr, pg_next, t0 + TILE_T, t_lim, page_bytes, D, TILE_T, PAGE, PB, SB,
                                      PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, FP4_WORDS, POST_SCALE, LEAN, QM)
        pg = pg_next
        pg_next = tiles.page_of(bt_row, t0 + 2 * TILE_T, t_lim, num_pages, PAGE)
    else:
        cur_pg = tiles.page_of(bt_row, t0, t_lim, num_pages, PAGE)
        cur_pay, cur_sc = tiles.fetch(data_ptr, cur_pg, t0, t_lim, page_bytes, D, TILE_T, PAGE, PB, SB,
                                      PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, FP4_WORDS, POST_SCALE, LEAN, QM)
    acc = tiles.tile_dot(cur_pay, cur_sc, qa, qb, qc, qd, D, TILE_T, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK,
                         NATIVE_FP8, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, QM)
    if ONE_POS:  # decode: every row sits at ctx - 1, so "t <= pos" is "t < t_lim"
        keep = ((t < t_lim) & (cur_pg >= 0))[:, None]
    else:
        keep = ((t < t_lim) & (cur_pg >= 0))[:, None] & (t[:, None] <= pos[None, :])
    if LEAN and MODE != MODE_TOKENS:
        if ONE_POS:
            if (t0 + TILE_T <= t_lim) & (cur_pg >= 0):  # every token valid: the common tile
                s = acc
            else:
                s = tl.where(keep, acc, float("-inf"))
        else:
            s = tl.where(keep, acc, float("-inf"))
    else:
        s = tl.where(keep, acc * colscale[None, :], float("-inf"))
    if MODE == MODE_TOKENS:
        tl.store(out_ptr + out_row[None, :] + t[:, None], s, mask=row_ok[None, :] & (t < n_out)[:, None])
    if WP > 1:
        bmax = nanmax(bmax, part_nanmax(s, WP, DOT_F32, LEAN))
    else:
        bmax = nanmax(bmax, col_nanmax(s, DOT_F32))
    if TPB == 1:
        state = finish_block(j, blk0, bmax, state, col, valid, out_ptr, out_row, row_ok, colscale, INIT, LOCAL,
                              MODE, WP, LEAN)
        bmax = tl.full(bmax.shape, float("-inf"), tl.float32)
    elif j % TPB == TPB - 1:
        state = finish_block(j // TPB, blk0, bmax, state, col, valid, out_ptr, out_row, row_ok, colscale, INIT,
                              LOCAL, MODE, WP, LEAN)
        bmax = tl.full(bmax.shape, float("-inf"), tl.float32)
    return payload, scales, pg, pg_next, bmax, state


@triton.jit
def pair_step(j, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row, data_ptr,
               qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes,
               D: tl.constexpr, PAGE: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr,
               PAYLOAD_BITS: tl.constexpr, SCALE_KIND: tl.constexpr, SCALE_BLOCK: tl.constexpr, BS: tl.constexpr,
               TILE_T: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, MODE: tl.constexpr,
               NATIVE_FP8: tl.constexpr, PREFETCH: tl.constexpr, ONE_POS: tl.constexpr, FP4_WORDS: tl.constexpr,
               POST_SCALE: tl.constexpr, NSBP: tl.constexpr, DOT_F32: tl.constexpr, WP: tl.constexpr,
               LEAN: tl.constexpr, QM: tl.constexpr = False):
    """Tiles j and j + 1 of the program (PAIR launches: the loop runs n_tiles // 2 of these, then one `tile_step`
    if n_tiles is odd), so that the loop's per-iteration bookkeeping (counter, pipeline stage indices, barriers of
    the cp.async ring) is paid once per two tiles. Where each tile is one block (TPB = 1) of a LEAN block-score
    launch without PREFETCH, both blocks are scored here and their maxima written by ONE store of the two blocks'
    adjacent outputs ([WP, MP, 2] or [MP, 2]), which halves the store's shared-memory round trip (the compiler
    converts the reduction's layout to a coalesced one through shared memory, one barrier per store) and takes one
    mask branch for both tiles. Otherwise two `tile_step` calls. Same numbers as two `tile_step` calls, bit for bit."""
    TPB: tl.constexpr = BS // TILE_T
    if TPB == 1 and LEAN and MODE == MODE_BLOCKS and not PREFETCH:
        t0 = blk0 * BS + j * TILE_T
        t = t0 + tl.arange(0, TILE_T)
        pg_a = tiles.page_of(bt_row, t0, t_lim, num_pages, PAGE)
        pg_b = tiles.page_of(bt_row, t0 + TILE_T, t_lim, num_pages, PAGE)
        pay_a, sc_a = tiles.fetch(data_ptr, pg_a, t0, t_lim, page_bytes, D, TILE_T, PAGE, PB, SB, PAYLOAD_BITS,
                                  SCALE_KIND, SCALE_BLOCK, FP4_WORDS, POST_SCALE, LEAN, QM)
        pay_b, sc_b = tiles.fetch(data_ptr, pg_b, t0 + TILE_T, t_lim, page_bytes, D, TILE_T, PAGE, PB, SB,
                                  PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, FP4_WORDS, POST_SCALE, LEAN, QM)
        acc_a = tiles.tile_dot(pay_a, sc_a, qa, qb, qc, qd, D, TILE_T, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK,
                               NATIVE_FP8, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, QM)
        acc_b = tiles.tile_dot(pay_b, sc_b, qa, qb, qc, qd, D, TILE_T, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK,
                               NATIVE_FP8, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, QM)
        if ONE_POS:
            keep_a = ((t < t_lim) & (pg_a >= 0))[:, None]
            keep_b = ((t + TILE_T < t_lim) & (pg_b >= 0))[:, None]
            if (t0 + 2 * TILE_T <= t_lim) & (pg_a >= 0) & (pg_b >= 0):  # both tiles whole: the common case
                s_a = acc_a
                s_b = acc_b
            else:
                s_a = tl.where(keep_a, acc_a, float("-inf"))
                s_b = tl.where(keep_b, acc_b, float("-inf"))
        else:
            keep_a = ((t < t_lim) & (pg_a >= 0))[:, None] & (t[:, None] <= pos[None, :])
            keep_b = ((t + TILE_T < t_lim) & (pg_b >= 0))[:, None] & ((t + TILE_T)[:, None] <= pos[None, :])
            s_a = tl.where(keep_a, acc_a, float("-inf"))
            s_b = tl.where(keep_b, acc_b, float("-inf"))
        if WP > 1:
            m_a = part_nanmax(s_a, WP, DOT_F32, LEAN)
            m_b = part_nanmax(s_b, WP, DOT_F32, LEAN)
            c = colscale[None, :]
        else:
            m_a = col_nanmax(s_a, DOT_F32)
            m_b = col_nanmax(s_b, DOT_F32)
            c = colscale
        # the column scale after the max, as `finish_block` does with LEAN (forced blocks come after the loop)
        m_a = tl.where(m_a == float("-inf"), m_a, m_a * c)
        m_b = tl.where(m_b == float("-inf"), m_b, m_b * c)
        blk = blk0 + j
        k2 = tl.arange(0, 2)
        if WP > 1:
            p = tl.arange(0, WP)
            offs = out_row[None, :, None] + blk * WP + p[:, None, None] + WP * k2[None, None, :]
            tl.store(out_ptr + offs, tl.join(m_a, m_b), mask=row_ok[None, :, None])
        else:
            tl.store(out_ptr + out_row[:, None] + blk + k2[None, :], tl.join(m_a, m_b), mask=row_ok[:, None])
    else:
        payload, scales, pg, pg_next, bmax, state = tile_step(
            j, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row,
            data_ptr, qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes, D,
            PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, BS, TILE_T, INIT, LOCAL, MODE, NATIVE_FP8,
            PREFETCH, ONE_POS, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, WP, LEAN, QM)
        payload, scales, pg, pg_next, bmax, state = tile_step(
            j + 1, payload, scales, pg, pg_next, bmax, state, blk0, t_lim, col, pos, valid, bt_row,
            data_ptr, qa, qb, qc, qd, colscale, out_ptr, out_row, row_ok, n_out, num_pages, page_bytes, D,
            PAGE, PB, SB, PAYLOAD_BITS, SCALE_KIND, SCALE_BLOCK, BS, TILE_T, INIT, LOCAL, MODE, NATIVE_FP8,
            PREFETCH, ONE_POS, FP4_WORDS, POST_SCALE, NSBP, DOT_F32, WP, LEAN, QM)
    return payload, scales, pg, pg_next, bmax, state
