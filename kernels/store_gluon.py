"""NVIDIA Hopper fast path of the FP4 store (nvfp4, mxfp4 from bf16 rows of 128), written in Gluon: persistent
programs fed by TMA, the same codec helpers as the portable store (`kernels/store.py`), the same bytes.

Why a second kernel: the portable store loads each thread's whole blocks as 16-byte chunks straight into registers.
Each program stalls on its loads with nothing else in flight (ncu on the H200: the top stall is the first use of
the loaded input, the L1 near its peak throughput; docs/kernels/store.md). Here:
- a program owns every `n_programs`-th tile of R rows x 128 of one head (grid: 8-16 programs per SM, CONFIGS); its
  tiles arrive as TMA copies into shared memory (one instruction per tile, no registers, no L1 requests): as soon as
  a tile is in registers the next one is requested into its buffer (STAGES buffers; one measured best), so the next
  tile streams in while this one is encoded;
- the tile is read from shared memory in the layout the codecs want: a thread owns 32 consecutive elements of a row
  (one mx block, two nvfp4 blocks), so the block amax and the per-block scale work are thread-local, as in the
  portable kernel;
- the payload leaves as 16-byte stores (a thread's 4 words), the block scales as 1-2 byte stores;
- dead rows (slot -1, past the tensor) are loaded (TMA moves whole boxes; rows past the tensor read as 0) but never
  written;
- nvfp4's per-block work is cut where the bf16 input allows it (same bytes): the block amax as a tree of packed
  `max.xorsign.abs.bf16x2` (inline PTX), amax / 6 by a 3-instruction Markstein sequence (`kc.amax_div6`, exact for
  bf16 amax), and the rcp recipe's reciprocal gathered from a 256-entry table per outer scale (`kc.rcp_table`).
Bytes: `kc.fp4_quantize_blocks` + `kc.pack_nibble_words` (or `kc.fp4_scaled_words` with MUL_PACK), ported to Gluon
by `kernels/gluon_port.py`, with the portable store's codec choice (store.FAST_CODECS). Tests compare the bytes with
the torch codec and with the portable kernel (tests/kernels/test_kernels_store.py, marked gpu); CI compiles the kernel for
sm_90 (tests/kernels/test_kernel_compile.py).

It measured faster than the portable kernel for both formats at every size on the H200 (bench/sweep_quant_variants.py;
numbers in docs/kernels/store_gluon.md). Every launch also pays a fixed cost (the first tiles' latency, the last
tiles' encode, the launch): the reason 64M sits below 256M.

Where it runs: CUDA capability >= 9.0 (TMA), bf16 input [T, H, 128] with heads contiguous and 16-byte aligned rows,
4-bit block formats with 4-byte aligned payload rows, no `config=` override. Elsewhere (and on ROCm: gfx950 runs the
portable kernel, tested in CI under the interpreter) `store.launch_store` runs the portable kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton

from kvtool.formats import Format
from kvtool.formats.rules import NvRecipe
from kvtool.kernels import codecs as kc
from kvtool.kernels import paged_rows
from kvtool.kernels.gluon_port import port
from kvtool.kernels.platform import cuda_at_least, num_sms

__all__ = ["CONFIGS", "DIM", "MUL_PACK", "PACKED_AMAX", "RCP_LUT", "VARIANTS", "RcpTables", "applies", "device_ok",
           "launch", "rcp_lut"]

try:  # Gluon ships with Triton >= 3.5; without it the portable kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - the pinned Triton has it
    gluon = None

DIM = 128  # elements per row (one head)
# (rows per tile, tile buffers, programs per SM, warps) per block-scale element: each the best measured on the H200
# (the sweep: docs/kernels/store_gluon.md). One buffer is enough: the next tile is requested as soon as this one is
# in registers, and a shallower queue halves the load burst at the start. More programs than fit (registers, shared
# memory) lose much more.
CONFIGS = {"e8m0": (32, 1, 8, 4), "e4m3": (16, 1, 16, 2)}
# the scaled-words encode (kc.fp4_scaled_words) measured slower here for both families (H200,
# docs/kernels/store_gluon.md), so the Gluon store keeps the codes-then-pack encode
MUL_PACK = False
# nvfp4 (fast codec, codes-then-pack): the block amax by packed bf16x2 maxima (inline PTX `max.xorsign.abs.bf16x2`),
# and for the rcp recipe the per-block reciprocal gathered from a 256-entry table (kc.rcp_table) instead of the E4M3
# decode, multiply and IEEE reciprocal; same bytes
PACKED_AMAX = True
RCP_LUT = True
# Launch variants (`store.launch_store(variant=...)` passes them here), key -> what it overrides; None or absent keeps
# the default. The bench sweep (bench/sweep_quant_variants.py) re-measures them against the defaults above.
VARIANTS = {
    "GLUON_ROWS": "rows per tile (CONFIGS)",
    "GLUON_PROGRAMS": "programs per SM (CONFIGS)",
    "GLUON_WARPS": "warps per program (CONFIGS)",
    "GLUON_PACKED_AMAX": "nvfp4 fast codec: the block amax by packed bf16x2 maxima (PACKED_AMAX)",
    "GLUON_RCP_LUT": "nvfp4 rcp: the per-block reciprocal from a table (RCP_LUT)",
}

if gluon is not None:
    kg = port(kc)
    rows_g = port(paged_rows)

    @gluon.jit
    def _issue(x_desc, smem, bar, tt, hd, ok, R: gl.constexpr):
        """TMA copy of the tile of token tile `tt` and head `hd` into `smem`, completing on `bar`."""
        mbarrier.expect(bar, R * 128 * 2, pred=ok)
        tma.async_copy_global_to_shared(x_desc, [tt * R, hd * 128], bar, smem, pred=ok)

    @gluon.jit
    def _advance(tt, hd, step_tt, step_hd, num_heads):
        """(token tile, head) of tile t -> of tile t + n_programs, without an integer division per tile (tile t
        is token tile t // H, head t % H; step_tt, step_hd = divmod(n_programs, H))."""
        hd = hd + step_hd
        carry = (hd >= num_heads).to(gl.int32)
        return tt + step_tt + carry, hd - carry * num_heads

    @gluon.jit
    def _absmax_bf16x2(a, b):
        """Per 16-bit lane of two int32 words of bf16 pairs: max(|a|, |b|) (sign bits: a's xor b's, unused)."""
        return gl.inline_asm_elementwise("max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _block_amax(w, R: gl.constexpr, NB: gl.constexpr):
        """int32 words of bf16 pairs [R, 64] (a thread's words consecutive) -> fp32 block amax [R, NB]: a tree of
        packed bf16x2 maxima (one instruction per two elements and level) instead of one fp32 max per element."""
        WPB: gl.constexpr = 64 // NB  # words per block: 8 (nvfp4), 16 (mxfp4)
        a, b = gl.split(gl.reshape(w, [R, NB, WPB // 2, 2]))
        m = _absmax_bf16x2(a, b)
        a, b = gl.split(gl.reshape(m, [R, NB, WPB // 4, 2]))
        m = _absmax_bf16x2(a, b)
        a, b = gl.split(gl.reshape(m, [R, NB, WPB // 8, 2]))
        m = _absmax_bf16x2(a, b)
        if WPB == 16:
            a, b = gl.split(gl.reshape(m, [R, NB, 1, 2]))
            m = _absmax_bf16x2(a, b)
        m = gl.reshape(m, [R, NB])
        lo = (m << 16).to(gl.float32, bitcast=True)
        hi = (m & -65536).to(gl.float32, bitcast=True)
        return gl.maximum(gl.abs(lo), gl.abs(hi))

    @gluon.jit
    def _bf16_words_f32(w):
        """int32 words of two bf16 [R, W] -> fp32 [R, 2 W] in element order (low half first): one shift or mask
        per element (a bf16 register tensor converts with a byte permute plus a shift for the high half)."""
        lo = (w << 16).to(gl.float32, bitcast=True)
        hi = (w & -65536).to(gl.float32, bitcast=True)
        return gl.reshape(gl.join(lo, hi), [w.shape[0], 2 * w.shape[1]])

    @gluon.jit(do_not_specialize=["low7"])
    def store_tma_kernel(
        x_desc,  # TMA descriptor of x as [T, H * 128] bf16, box [R, 128]
        slot_ptr,  # [T] int32 / int64 slot per token, -1 skips it (PAGED only)
        payload_ptr,  # uint8: the cache buffer (PAGED) or the payload plane [T * H, PB]
        scale_ptr,  # uint8: the cache buffer (PAGED) or the scale plane [T * H, SB]
        n_tok,  # T
        num_heads,  # H
        n_tiles,  # cdiv(T, R) * H
        page_stride,  # cache bytes between pages (PAGED)
        head_stride,  # cache bytes between heads inside a page (PAGED)
        g_dec,  # fp32 nvfp4 decode-direction outer scale
        g_enc,  # fp32 fp32(1 / g_dec)
        rcp_ptr,  # fp32 [256]: kc.rcp_table for g_dec (nvfp4 rcp with RCP_LUT)
        low7,  # the int 7 at run time (kc.e2m1_encode)
        PAGED: gl.constexpr, PAGE: gl.constexpr, PB: gl.constexpr, SB: gl.constexpr,
        E8M0: gl.constexpr,  # mxfp4 (else nvfp4)
        BLOCK: gl.constexpr,  # elements per block scale
        RULE: gl.constexpr, RECIPE: gl.constexpr,
        FAST: gl.constexpr, MUL_PACK: gl.constexpr,  # the codec forms (store.FAST_CODECS / store.MUL_PACK)
        R: gl.constexpr,  # rows per tile
        STAGES: gl.constexpr,  # tiles in flight
        NW: gl.constexpr,  # warps (num_warps)
        PACKED_AMAX: gl.constexpr,  # nvfp4 fast codec: block amax by packed bf16x2 maxima (_block_amax)
        RCP_LUT: gl.constexpr,  # nvfp4 rcp: per-block reciprocal gathered from rcp_ptr
    ):
        # a thread owns 16 consecutive words (32 elements) of a row: 4 threads a row, 8 rows a warp, 8 NW rows a pass
        W_IN: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        n_mine = (n_tiles - pid + n_prog - 1) // n_prog
        smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, 128], x_desc.layout)
        # the same bytes as int32 words (the 128-byte swizzle permutes 16-byte chunks, whatever the element type)
        W_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        step_tt = n_prog // num_heads
        step_hd = n_prog % num_heads
        tt = pid // num_heads  # this iteration's tile
        hd = pid % num_heads
        tt_n = tt  # the next tile to load
        hd_n = hd
        for i in gl.static_range(STAGES):
            _issue(x_desc, smem.index(i), bars.index(i), tt_n, hd_n, i < n_mine, R)
            tt_n, hd_n = _advance(tt_n, hd_n, step_tt, step_hd, num_heads)

        rows = gl.arange(0, R, layout=gl.SliceLayout(1, W_IN))
        for k in range(n_mine):
            s = k % STAGES
            mbarrier.wait(bars.index(s), (k // STAGES) & 1)
            w = smem.index(s)._reinterpret(gl.int32, [R, 64], W_SMEM).load(W_IN)
            # every warp has read stage s: refill it with the tile STAGES ahead (generic reads before async writes)
            gl.thread_barrier()
            fence_async_shared()
            _issue(x_desc, smem.index(s), bars.index(s), tt_n, hd_n, k + STAGES < n_mine, R)
            tt_n, hd_n = _advance(tt_n, hd_n, step_tt, step_hd, num_heads)

            tok = tt * R + rows
            live, pay, sc = rows_g.row_addresses(tok, hd, n_tok, num_heads, slot_ptr, page_stride, head_stride,
                                                 PAGED, PAGE, PB, SB)
            tt, hd = _advance(tt, hd, step_tt, step_hd, num_heads)
            xb = gl.reshape(_bf16_words_f32(w), [R, 128 // BLOCK, BLOCK])  # bf16 -> fp32 is exact
            if MUL_PACK:
                words, sbytes = kg.fp4_scaled_words(xb, g_dec, g_enc, E8M0, RULE, RECIPE, True, R, 128, True)
            else:
                # the input is bf16 and this code is compiled: the 3-instruction amax / 6 (kc.amax_div6)
                if PACKED_AMAX:
                    S3: gl.constexpr = gl.SliceLayout(2, xb.type.layout)
                    amax = gl.convert_layout(_block_amax(w, R, 128 // BLOCK), S3, assert_trivial=True)
                else:
                    amax = None
                if RCP_LUT:
                    codes, sbytes = kg.fp4_quantize_blocks(xb, g_dec, g_enc, E8M0, RULE, RECIPE, True, FAST, low7,
                                                           True, amax, rcp_ptr)
                else:
                    codes, sbytes = kg.fp4_quantize_blocks(xb, g_dec, g_enc, E8M0, RULE, RECIPE, True, FAST, low7,
                                                           True, amax)
                words = kg.pack_nibble_words(gl.reshape(codes, [R, 128]), R, 128)
            W_L: gl.constexpr = words.type.layout
            wcols = gl.arange(0, 16, layout=gl.SliceLayout(0, W_L))
            w_live = gl.convert_layout(live, gl.SliceLayout(1, W_L))
            w_pay = gl.convert_layout(pay, gl.SliceLayout(1, W_L))
            wrow = (payload_ptr + w_pay).to(gl.pointer_type(gl.int32))
            gl.store(gl.expand_dims(wrow, 1) + gl.expand_dims(wcols, 0), words, mask=gl.expand_dims(w_live, 1))
            S_L: gl.constexpr = sbytes.type.layout
            scols = gl.arange(0, 128 // BLOCK, layout=gl.SliceLayout(0, S_L))
            s_live = gl.convert_layout(live, gl.SliceLayout(1, S_L))
            s_off = gl.convert_layout(sc, gl.SliceLayout(1, S_L))
            gl.store(scale_ptr + gl.expand_dims(s_off, 1) + gl.expand_dims(scols, 0), sbytes,
                     mask=gl.expand_dims(s_live, 1))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))


def device_ok(device: torch.device) -> bool:
    """Gluon, CUDA (not ROCm), compute capability >= 9.0 (TMA and the hardware E4M3 conversion)."""
    return cuda_at_least(device, (9, 0))


class RcpTables:
    """The reciprocal tables (kc.rcp_table) of the launches, one per (device, g_dec), computed once and kept; at most
    `limit` (`auto` outer scales give one per tensor amax), then it starts over."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.tables: dict[tuple[torch.device, float], torch.Tensor] = {}

    def get(self, device: torch.device, g_dec: float) -> torch.Tensor | None:
        """The table for (device, g_dec); None while a CUDA graph is being captured and the table does not exist yet
        (the kernel then divides, as the portable one does)."""
        key = (torch.device(device), float(g_dec))
        table = self.tables.get(key)
        if table is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return None
            table = torch.empty(256, dtype=torch.float32, device=key[0])
            kc.rcp_table[(1,)](table, float(g_dec))
            if len(self.tables) >= self.limit:
                self.tables.clear()
            self.tables[key] = table
        return table


_RCP_TABLES = RcpTables()


def rcp_lut(device: torch.device, g_dec: float) -> torch.Tensor | None:
    """kc.rcp_table for (device, g_dec) from the launches' kept tables (RcpTables.get)."""
    return _RCP_TABLES.get(device, g_dec)


def applies(x3: torch.Tensor, fmt: Format, words: bool) -> bool:
    """Whether `launch` can take this store: bf16 [T, H, 128] rows with heads contiguous and 16-byte aligned token
    rows, a 4-bit block format with word-aligned payload rows (`words`), on a device where `device_ok`."""
    if fmt.spec.payload_bits != 4 or not words or x3.dtype != torch.bfloat16 or x3.shape[2] != DIM:
        return False
    if not device_ok(x3.device):
        return False
    T, H, _ = x3.shape
    return (x3.stride(2) == 1 and (H == 1 or x3.stride(1) == DIM) and (T == 1 or (x3.stride(0) * 2) % 16 == 0)
            and x3.data_ptr() % 16 == 0)


def launch(x3: torch.Tensor, slots: torch.Tensor | None, payload: torch.Tensor, scales: torch.Tensor | None,
           fmt: Format, opts: dict, *, page_size: int, page_stride: int, head_stride: int, g_dec: float,
           g_enc: float, variant: Mapping[str, object] | None = None) -> None:
    """Launch `store_tma_kernel` (arguments as store.launch_store, after its checks; `opts` its FAST codec choice).
    `variant`: VARIANTS keys overriding this launch's defaults (CONFIGS' rows, programs and warps, PACKED_AMAX,
    RCP_LUT), the variants bench/sweep_quant_variants.py re-measures; store.launch_store has checked the keys."""
    variant = variant or {}
    rows, stages, programs, warps = CONFIGS[fmt.scale_element]
    GLUON_ROWS = variant.get("GLUON_ROWS") or rows
    GLUON_PROGRAMS = variant.get("GLUON_PROGRAMS") or programs
    GLUON_WARPS = variant.get("GLUON_WARPS") or warps
    GLUON_PACKED_AMAX, GLUON_RCP_LUT = variant.get("GLUON_PACKED_AMAX"), variant.get("GLUON_RCP_LUT")
    T, H, _ = x3.shape
    x2 = torch.as_strided(x3, (T, H * DIM), (x3.stride(0) if T > 1 else H * DIM, 1))
    layout = gl.NVMMASharedLayout.get_default_for([GLUON_ROWS, DIM], gl.bfloat16)
    desc = TensorDescriptor(x2, [T, H * DIM], [x2.stride(0), 1], [GLUON_ROWS, DIM], layout)
    n_tiles = triton.cdiv(T, GLUON_ROWS) * H
    grid = (min(n_tiles, num_sms(x3.device) * GLUON_PROGRAMS),)
    paged = slots is not None
    mul_pack = MUL_PACK
    fast_nv = fmt.scale_element == "e4m3" and bool(opts["FAST"]) and not mul_pack
    packed_amax = fast_nv and (PACKED_AMAX if GLUON_PACKED_AMAX is None else GLUON_PACKED_AMAX)
    table = None
    if fast_nv and fmt.recipe == NvRecipe.RCP and (RCP_LUT if GLUON_RCP_LUT is None else GLUON_RCP_LUT):
        table = rcp_lut(x3.device, g_dec)
    store_tma_kernel[grid](
        desc, slots if paged else payload, payload, scales if scales is not None else payload, T, H, n_tiles,
        page_stride, head_stride, g_dec, g_enc, table if table is not None else payload, 7,
        PAGED=paged, PAGE=page_size, PB=fmt.payload_bytes(DIM), SB=fmt.scale_bytes(DIM),
        E8M0=fmt.scale_element == "e8m0", BLOCK=fmt.block, RULE=int(fmt.scale_rule or 0),
        RECIPE=int(fmt.recipe or 0), FAST=bool(opts["FAST"]), MUL_PACK=mul_pack, R=GLUON_ROWS,
        STAGES=stages, NW=GLUON_WARPS, PACKED_AMAX=packed_amax, RCP_LUT=table is not None,
        num_warps=GLUON_WARPS)
