"""NVIDIA fast path of the FP4 dequantize (nvfp4, mxfp4 rows of 128 to fp32 / bf16 / fp16), written in Gluon so that
each thread's registers line up with its output: the same codec helpers and the same bytes as the portable kernel
(`kernels/dequant.py`).

Why a second kernel: in the portable kernel Triton picks the load layout from the payload (a thread reads 16 bytes:
4 words, 32 elements) and the store layout from the output (a thread writes 16 bytes: 8 bf16), so every tile goes
through shared memory between decode and store (sm_90 SASS of the mxfp4 to bf16 kernel: STS.128 + LDSM + 7 barriers
per tile, 8.7 instructions per element). Here the layout is chosen once: a thread owns one int32 word of a row (8
elements; 16 threads a row), reads it with a 4-byte load (a row's 64 payload bytes in one coalesced request per half
warp), reads its block's scale byte (the threads of one block read the same byte: one broadcast request), expands
the 8 codes in registers and writes its 16 output bytes (bf16) with one 16-byte store, coalesced across the row. No
shared memory, no barrier.

Values: the portable kernel's, bit for bit (the same kc.* helpers through `gluon_port.port`): bf16 output with exact
packed bf16 products where no outer scale rounds (BF16_MATH), else the fp16 `code * 2**-14` expansion, one fp32
product order as the torch path, one rounding to the output dtype.

Where it runs: CUDA capability >= 9.0 (`store_gluon.device_ok`, the devices it was measured on), 4-bit block formats
with word-aligned payload rows, rows of 128, no `config=` override. Elsewhere (ROCm gfx950 included) the portable
kernel runs; CI tests that one under the interpreter and compiles this one for sm_90 (tests/test_kernel_compile.py);
the GPU tests compare the two byte for byte (tests/test_kernels_store.py, marked gpu).
"""

from __future__ import annotations

import triton

from kvtool.kernels import codecs as kc
from kvtool.kernels import paged_rows
from kvtool.kernels.gluon_port import port

try:  # Gluon ships with Triton >= 3.5; without it the portable kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - the pinned Triton has it
    gluon = None

DIM = 128  # elements per row
# (rows per program, words per thread, warps); set from the H200 sweep (bench/sweep_quant_variants.py ... dequant)
CONFIG = (32, 4, 4)
# stores marked streaming (`st.global.cs`: the output is not read again by this kernel) and loads evict-first
STREAM = False

if gluon is not None:
    DIM_C = gl.constexpr(DIM)
    kg = port(kc)
    rows_g = port(paged_rows)

    @gluon.jit
    def dequant_words_kernel(
        payload_ptr,  # uint8: the cache buffer (PAGED) or the payload plane [rows, PB]
        scale_ptr,  # uint8: the cache buffer (PAGED) or the scale plane [rows, SB]
        slot_ptr,  # [T] int32 / int64 slot per token, all valid (PAGED only)
        out_ptr,  # [T, H, 128] fp32 / bf16 / fp16 output, contiguous
        n_tok,  # T
        num_heads,  # H
        page_stride,  # cache bytes between pages (PAGED)
        head_stride,  # cache bytes between heads inside a page (PAGED)
        g_dec,  # fp32 nvfp4 decode-direction outer scale
        PAGED: gl.constexpr, PAGE: gl.constexpr, PB: gl.constexpr, SB: gl.constexpr,
        E8M0: gl.constexpr,  # mxfp4 (else nvfp4)
        BLOCK: gl.constexpr,  # elements per block scale
        OUT_BF16: gl.constexpr,  # output is bf16 (rounded by kc.bf16_encode)
        G_FOLD: gl.constexpr,  # nvfp4: 2**14 * g_dec is finite in fp32 (fold it into one multiply)
        BF16_MATH: gl.constexpr,  # bf16 out with exact packed bf16 products (E8M0, or E4M3 with g_dec = 1)
        STREAM: gl.constexpr,  # streaming stores, evict-first loads
        R: gl.constexpr,  # rows (tokens) per program
        WPT: gl.constexpr,  # consecutive words of a row per thread (1, 2 or 4)
        NW: gl.constexpr,  # warps (num_warps)
    ):
        # a thread owns WPT words (8 WPT elements) of a row: 16 / WPT threads a row, 2 WPT rows a warp
        W_L: gl.constexpr = gl.BlockedLayout([1, WPT], [2 * WPT, 16 // WPT], [NW, 1], [1, 0])
        tok = gl.program_id(0) * R + gl.arange(0, R, layout=gl.SliceLayout(1, W_L))
        head = gl.program_id(1)
        live, pay, sc = rows_g.row_addresses(tok, head, n_tok, num_heads, slot_ptr, page_stride, head_stride,
                                             PAGED, PAGE, PB, SB)
        wcols = gl.arange(0, DIM_C // 8, layout=gl.SliceLayout(0, W_L))
        mask = gl.expand_dims(live, 1) & gl.expand_dims(wcols < DIM_C // 8, 0)
        hint: gl.constexpr = "evict_first" if STREAM else ""
        wrow = (payload_ptr + pay).to(gl.pointer_type(gl.int32))
        words = gl.load(gl.expand_dims(wrow, 1) + gl.expand_dims(wcols, 0), mask=mask, other=0,
                        eviction_policy=hint)
        # the scale byte of each word's block (8 // BLOCK words share one: the same address, one request)
        sbytes = gl.load(scale_ptr + gl.expand_dims(sc, 1) + gl.expand_dims(wcols // (BLOCK // 8), 0), mask=mask,
                         other=0, eviction_policy=hint)
        if BF16_MATH:
            v3 = gl.reshape(kg.e2m1_words_bf16(words, R, DIM_C // 8), [R, DIM_C // 8, 8])  # value * 2**-126
            if E8M0:
                sv = kg.e8m0_decode_any(sbytes).to(gl.bfloat16)
            else:
                sv = kg.e4m3_decode_any(sbytes, True).to(gl.bfloat16)
            sv3 = gl.expand_dims(gl.convert_layout(sv, gl.SliceLayout(2, v3.type.layout), assert_trivial=True), 2)
            out3 = v3 * 8.507059173023462e37 * sv3  # (code * 2**-126) * 2**126 = code, then * S: exact
        else:
            v16 = gl.reshape(kg.e2m1_words_f16(words, R, DIM_C // 8), [R, DIM_C // 8, 8])  # value * 2**-14
            S3: gl.constexpr = gl.SliceLayout(2, v16.type.layout)
            if E8M0:
                s32 = gl.convert_layout(kg.e8m0_decode_any(sbytes), S3, assert_trivial=True)
                vb = (v16 * 16384.0).to(gl.float32) * gl.expand_dims(s32, 2)  # code exact in fp16
            else:
                s16 = gl.convert_layout(kg.e4m3_decode_any(sbytes, True).to(gl.float16), S3, assert_trivial=True)
                # (code * 2**-14 * S) * (2**14 * g_dec): the torch path's (code * S) * g_dec, one rounding alike
                if G_FOLD:
                    vb = (v16 * gl.expand_dims(s16, 2)).to(gl.float32) * (g_dec * 16384.0)
                else:  # 2**14 * g_dec would overflow fp32
                    vb = (v16 * gl.expand_dims(s16, 2)).to(gl.float32) * 16384.0 * g_dec
            if OUT_BF16:
                out3 = kg.bf16_encode(vb)
            else:
                out3 = vb.to(out_ptr.dtype.element_ty)
        out = gl.reshape(out3, [R, DIM_C])
        O_L: gl.constexpr = out.type.layout
        o_tok = gl.convert_layout(tok, gl.SliceLayout(1, O_L), assert_trivial=True)
        o_cols = gl.arange(0, DIM_C, layout=gl.SliceLayout(0, O_L))
        o_rows = o_tok.to(gl.int64) * num_heads + head
        o_mask = gl.expand_dims(o_tok < n_tok, 1) & gl.expand_dims(o_cols < DIM_C, 0)
        gl.store(out_ptr + gl.expand_dims(o_rows * DIM_C, 1) + gl.expand_dims(o_cols, 0), out, mask=o_mask,
                 cache_modifier=".cs" if STREAM else "")


def applies(out, fmt, words: bool, device_ok) -> bool:
    """Whether `launch` can take this dequantize: a 4-bit block format with word-aligned payload rows (`words`), rows
    of 128, on a device where `device_ok` (store_gluon's check)."""
    return (gluon is not None and fmt.spec.payload_bits == 4 and words and out.shape[2] == DIM
            and device_ok(out.device))


def launch(payload, scales, slots, out, fmt, *, page_size: int, page_stride: int, head_stride: int, g_dec: float,
           g_fold: bool, bf16_math: bool, GLUON_ROWS: int | None = None, GLUON_WPT: int | None = None,
           GLUON_WARPS: int | None = None, GLUON_STREAM: bool | None = None) -> None:
    """Launch `dequant_words_kernel` (arguments as dequant.launch_dequant after its checks; GLUON_* override CONFIG
    and STREAM, for sweeps)."""
    import torch

    rows, wpt, warps = GLUON_ROWS or CONFIG[0], GLUON_WPT or CONFIG[1], GLUON_WARPS or CONFIG[2]
    T, H, _ = out.shape
    paged = slots is not None
    dequant_words_kernel[(triton.cdiv(T, rows), H)](
        payload, scales if scales is not None else payload, slots if paged else payload, out, T, H, page_stride,
        head_stride, g_dec, PAGED=paged, PAGE=page_size, PB=fmt.payload_bytes(DIM), SB=fmt.scale_bytes(DIM),
        E8M0=fmt.scale_element == "e8m0", BLOCK=fmt.block, OUT_BF16=out.dtype == torch.bfloat16, G_FOLD=g_fold,
        BF16_MATH=bf16_math, STREAM=STREAM if GLUON_STREAM is None else GLUON_STREAM, R=rows, WPT=wpt, NW=warps,
        num_warps=warps)
