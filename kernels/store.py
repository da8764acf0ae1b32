"""Quantize-on-write: one Triton kernel that encodes rows of bf16 / fp16 / fp32 values in any cache format and writes
payload and scales either into a paged cache through a slot mapping (engines' store) or into plain planes (the whole
tensor quantize of `kernels/quant.py`). Every codec step comes from `kernels/codecs.py`; the kernel only moves bytes.
On Hopper, bf16 rows of 128 into nvfp4 / mxfp4 go to the TMA-fed Gluon store instead (`kernels/store_gluon.py`, same
bytes; `launch_store(gluon=...)`), which measured faster on the H200 (docs/kernels/store_gluon.md); the notes below
are this portable kernel's.

Design for bandwidth (the work is memory bound only if the integer pipe keeps up: a bf16 row of D = 128 is 256 B in,
68-132 B out, and Hopper's ALU pipe runs at half the FP32 rate):
- one program = BLOCK_R whole rows of one head (grid: token tiles x heads, no division per row); no atomics, no state
  shared between programs; dead rows (slot -1, tail) are neither read nor written;
- block formats load each row as 16-byte chunks joined in registers so that one thread owns whole 16 / 32-element
  blocks (`load_blocks`): the block amax needs no shuffle and the per-block scale work runs once per block; the
  nibble pack (`reshape [R, D/2, 2] + split`) is register-local; one shared-memory layout conversion then gives
  16-byte payload stores of whole rows, and the block scales go out as a short contiguous vector per row;
- 8 / 16-bit formats use plain 2-D tiles (16-byte vectors of a row per thread);
- slot math per row in int32 (page = slot // PAGE, PAGE a constexpr: a shift for powers of two), byte offsets in
  int64 so caches and inputs past 2 GiB work.

Why it is built so: on the H200 the store is bound by instruction issue and the L1, not by DRAM (most of its
instructions are the per-element encoder; ncu puts the L1/TEX throughput near its peak), so the encode is kept short:
nvfp4 encodes through the multiply-pipe pack (MUL_PACK), mxfp4 keeps the integer encode. Measurements, ncu profiles
and the variants measured slower (one row per thread, lane-split blocks, persistent programs, 2x / 0.5x rows per
program): docs/kernels/store.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtool.errors import KernelArgumentError, LayoutError
from kvtool.formats import Format
from kvtool.formats import kernel_desc as kd
from kvtool.formats.codecs import fp8_row_scale, nvfp4_outer_scale
from kvtool.formats.registry import require_finite
from kvtool.kernels import codecs as kc
from kvtool.kernels import store_gluon
from kvtool.kernels.paged_rows import row_addresses
from kvtool.kernels.platform import INTERPRET

__all__ = [
    "BLOCK_FORMAT_CONFIGS", "FAST_CODECS", "INPUT_DTYPES", "KernelFormat", "LAUNCH_CONFIGS", "MUL_PACK",
    "SCALE_E4M3", "SCALE_E8M0", "SCALE_NONE", "SCALE_ROW", "SCALE_TENSOR", "VARIANTS", "cache_scales", "check_cache",
    "check_floating", "check_slot_ids", "check_variant", "launch_config", "launch_store", "load_blocks", "load_f32",
    "native_fp8", "next_pow2", "outer_scales", "require_tensor_scale", "row_mask", "store", "word_aligned"
]

# Scale kinds as kernel constexprs, keyed by Format.scale_element (the format is data; the kernel reads this number).
SCALE_NONE = tl.constexpr(kd.SCALE_NONE)  # the scale kind codes are numbered once, in kvtool.formats.kernel_desc
SCALE_TENSOR = tl.constexpr(kd.SCALE_TENSOR)
SCALE_ROW = tl.constexpr(kd.SCALE_ROW)
SCALE_E4M3 = tl.constexpr(kd.SCALE_E4M3)
SCALE_E8M0 = tl.constexpr(kd.SCALE_E8M0)

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------------------------- shared @jit parts
@triton.jit
def row_mask(live, cols, N: tl.constexpr, NP: tl.constexpr):
    """[R, NP] store/load mask: live rows, and columns < N only when the tile is padded (NP > N), so that unpadded
    tiles keep a per-row mask that does not split 16-byte vectors."""
    if NP == N:
        return tl.broadcast_to(live[:, None], (live.shape[0], NP))
    else:
        return live[:, None] & (cols[None, :] < N)


@triton.jit
def load_f32(ptrs, mask):
    """Masked load (0 where masked) converted to fp32; bf16 by bits (exact, also for bf16 subnormals)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if x.dtype.is_bf16():
        return kc.bf16_decode(x)
    else:
        return x.to(tl.float32)


@triton.jit
def load_blocks(x_ptr, x_off, live, D: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr, VEC: tl.constexpr):
    """Rows at `x_off` [R] (live mask [R]) -> fp32 [R, NBP, BLOCK]: NBP blocks per row (the ones past D are 0).

    Loaded as BLOCK // VEC separate chunks of VEC elements (16 bytes) per block and joined in registers, so that one
    thread holds whole blocks: the block amax needs no shuffle, and the per-block scale work (exponent, E4M3 scale,
    divisions) runs once per block and thread instead of on every thread that holds a piece of the block. A 2-D load
    would give each thread one 16-byte vector of a row (the block spread over 2-4 threads). Chunk loads hit the same
    sectors one after another, so DRAM traffic is unchanged."""
    R: tl.constexpr = x_off.shape[0]
    CH: tl.constexpr = BLOCK // VEC
    blk = tl.arange(0, NBP)[None, :, None]
    p = x_ptr + x_off[:, None, None] + blk * BLOCK + tl.arange(0, VEC)[None, None, :]  # [R, NBP, VEC], chunk 0
    if NBP * BLOCK == D:
        m = tl.broadcast_to(live[:, None, None], (R, NBP, VEC))
    else:
        m = tl.broadcast_to(live[:, None, None] & (blk * BLOCK < D), (R, NBP, VEC))
    # join(a, b) adds a last dim of 2; chunk c = sum of its binary digits, lowest digit innermost after the join
    if CH == 1:
        xb = load_f32(p, m)
    elif CH == 2:
        j = tl.join(load_f32(p, m), load_f32(p + VEC, m))  # [R, NBP, VEC, c]
        xb = tl.reshape(tl.permute(j, (0, 1, 3, 2)), [R, NBP, BLOCK])
    elif CH == 4:
        j = tl.join(tl.join(load_f32(p, m), load_f32(p + VEC, m)),
                    tl.join(load_f32(p + 2 * VEC, m), load_f32(p + 3 * VEC, m)))  # [R, NBP, VEC, c & 1, c >> 1]
        xb = tl.reshape(tl.permute(j, (0, 1, 4, 3, 2)), [R, NBP, BLOCK])
    else:
        j = tl.join(tl.join(tl.join(load_f32(p, m), load_f32(p + VEC, m)),
                            tl.join(load_f32(p + 2 * VEC, m), load_f32(p + 3 * VEC, m))),
                    tl.join(tl.join(load_f32(p + 4 * VEC, m), load_f32(p + 5 * VEC, m)),
                            tl.join(load_f32(p + 6 * VEC, m), load_f32(p + 7 * VEC, m))))  # [.., VEC, c0, c1, c2]
        xb = tl.reshape(tl.permute(j, (0, 1, 5, 4, 3, 2)), [R, NBP, BLOCK])
    return xb


# ----------------------------------------------------------------------------------------------------------- kernel
@triton.jit(do_not_specialize=["low7"])
def _store_kernel(
    x_ptr,  # [T, H, D] bf16 / fp16 / fp32 rows, last dim contiguous
    slot_ptr,  # [T] int32 / int64 slot per token, -1 skips it (PAGED only)
    payload_ptr,  # uint8: the cache buffer (PAGED) or the payload plane [T * H, PB]
    scale_ptr,  # uint8: the cache buffer (PAGED) or the scale plane [T * H, SB] (unused when SB == 0)
    n_tok,  # T
    num_heads,  # H
    low7,  # the int 7 at run time (see kc.e2m1_encode)
    stride_xt,  # x stride (elements) between tokens
    stride_xh,  # x stride (elements) between heads
    page_stride,  # cache bytes between pages (PAGED)
    head_stride,  # cache bytes between heads inside a page (PAGED)
    tensor_scale,  # fp32 fp8 `tensor` scale s
    g_dec,  # fp32 nvfp4 decode-direction outer scale
    g_enc,  # fp32 fp32(1 / g_dec)
    PAGED: tl.constexpr,  # write through slot_ptr into pages, else into planes
    PAGE: tl.constexpr,  # tokens per page (PAGED)
    D: tl.constexpr,  # elements per row
    DP: tl.constexpr,  # D padded to a power of two
    PB: tl.constexpr,  # payload bytes per row
    SB: tl.constexpr,  # scale bytes per row
    BITS: tl.constexpr,  # payload bits per element: 16 (bf16), 8 (e4m3), 4 (e2m1)
    SCALE: tl.constexpr,  # kernel_desc scale code (SCALE_*)
    BLOCK: tl.constexpr,  # elements per block scale (4-bit formats)
    RULE: tl.constexpr,  # ScaleRule (mxfp4)
    RECIPE: tl.constexpr,  # NvRecipe (nvfp4)
    DS_FLOOR: tl.constexpr,  # fp8 token: DeepSeek amax floor
    POW2: tl.constexpr,  # fp8 token: power-of-two scale
    NATIVE_FP8: tl.constexpr,  # hardware fp32 -> e4m3 conversion (CUDA sm_89+, see kc.e4m3_encode)
    VEC: tl.constexpr,  # x elements per 16 bytes (8 for bf16 / fp16, 4 for fp32)
    WORDS: tl.constexpr,  # 4-bit formats: payload as int32 words (every row offset a multiple of 4 bytes)
    BLOCK_R: tl.constexpr,  # tokens per program
    FAST: tl.constexpr = True,  # 4-bit formats: the *_quantize_block_fast codecs (see FAST_CODECS)
    BF16_AMAX: tl.constexpr = False,  # bf16 input, compiled: nvfp4's amax / 6 in 3 instructions (kc.amax_div6)
    MUL_PACK: tl.constexpr = False,  # 4-bit formats with WORDS: kc.*_scale_block + kc.e2m1_words (see MUL_PACK)
):
    # grid: (token tiles, heads); one program = BLOCK_R tokens of one head, no integer division per row
    tok = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(1)
    live, pay, sc = row_addresses(tok, head, n_tok, num_heads, slot_ptr, page_stride, head_stride,
                                  PAGED, PAGE, PB, SB)
    x_off = tok.to(tl.int64) * stride_xt + head * stride_xh
    # dead rows (slot -1, tail) are not read: skipped tokens cost no bandwidth
    if BITS == 4:
        # whole blocks per thread (see load_blocks; a coalesced row tile with the block amax as a shuffle reduction
        # measured slower on the H200, docs/kernels/store.md: it repeats the per-block scale work on every lane of a
        # block)
        xb = load_blocks(x_ptr, x_off, live, D, BLOCK, DP // BLOCK, VEC)  # [BLOCK_R, DP / BLOCK, BLOCK] fp32
        if MUL_PACK:  # (the launcher sets it only with WORDS)
            # sign, nibble mask and pack on the multiply pipe (kc.e2m1_words): fewer ALU-pipe ops per element
            words, sbytes = kc.fp4_scaled_words(xb, g_dec, g_enc, SCALE == SCALE_E8M0, RULE, RECIPE, NATIVE_FP8,
                                                BLOCK_R, DP, BF16_AMAX)
            wcols = tl.arange(0, DP // 8)
            wrow = (payload_ptr + pay).to(tl.pointer_type(tl.int32))
            tl.store(wrow[:, None] + wcols[None, :], words, mask=row_mask(live, wcols, PB // 4, DP // 8))
        elif WORDS:
            codes, sbytes = kc.fp4_quantize_blocks(xb, g_dec, g_enc, SCALE == SCALE_E8M0, RULE, RECIPE, NATIVE_FP8,
                                                   FAST, low7, BF16_AMAX)
            # 8 codes -> one int32 word per lane, 4-byte stores of whole payload rows (PB and every row offset are
            # multiples of 4: checked by the launcher)
            words = kc.pack_nibble_words(tl.reshape(codes, [BLOCK_R, DP]), BLOCK_R, DP)
            wcols = tl.arange(0, DP // 8)
            wrow = (payload_ptr + pay).to(tl.pointer_type(tl.int32))
            tl.store(wrow[:, None] + wcols[None, :], words, mask=row_mask(live, wcols, PB // 4, DP // 8))
        else:
            codes, sbytes = kc.fp4_quantize_blocks(xb, g_dec, g_enc, SCALE == SCALE_E8M0, RULE, RECIPE, NATIVE_FP8,
                                                   FAST, low7, BF16_AMAX)
            packed = kc.pack_nibbles(tl.reshape(codes, [BLOCK_R, DP]), BLOCK_R, DP)
            pcols = tl.arange(0, DP // 2)
            tl.store(payload_ptr + pay[:, None] + pcols[None, :], packed, mask=row_mask(live, pcols, PB, DP // 2))
        scols = tl.arange(0, DP // BLOCK)
        tl.store(scale_ptr + sc[:, None] + scols[None, :], sbytes, mask=row_mask(live, scols, SB, DP // BLOCK))
    else:
        cols = tl.arange(0, DP)
        x = load_f32(x_ptr + x_off[:, None] + cols[None, :], row_mask(live, cols, D, DP))  # [BLOCK_R, DP], padding 0
        if BITS == 8:
            if SCALE == SCALE_NONE:
                codes = kc.e4m3_encode(x, NATIVE_FP8)
            elif SCALE == SCALE_TENSOR:
                codes = kc.fp8_encode_scaled(x, tl.zeros_like(x) + tensor_scale, NATIVE_FP8)
            else:
                s = kc.fp8_row_scale(tl.max(tl.abs(x), axis=1), DS_FLOOR, POW2)  # [BLOCK_R]
                codes = kc.fp8_encode_scaled(x, tl.broadcast_to(s[:, None], x.shape), NATIVE_FP8)
                # the fp32 scale as its 4 little-endian bytes: the scale field needs no 4-byte alignment
                b4 = tl.arange(0, 4)
                sb = (s.to(tl.int32, bitcast=True)[:, None] >> (8 * b4)[None, :]) & 0xFF
                tl.store(scale_ptr + sc[:, None] + b4[None, :], sb.to(tl.uint8), mask=row_mask(live, b4, 4, 4))
            tl.store(payload_ptr + pay[:, None] + cols[None, :], codes, mask=row_mask(live, cols, D, DP))
        else:
            bf = payload_ptr.to(tl.pointer_type(tl.bfloat16))  # PB = 2 D and every offset is even
            tl.store(bf + (pay // 2)[:, None] + cols[None, :], kc.bf16_encode(x), mask=row_mask(live, cols, D, DP))


# ---------------------------------------------------------------------------------------------- launcher helpers
@dataclass(frozen=True)
class KernelFormat:
    """A format's kernel descriptor (kvtool.formats.kernel_desc) as the store / dequantize kernels' constexprs."""

    BITS: int
    SCALE: int
    BLOCK: int
    RULE: int
    RECIPE: int
    DS_FLOOR: bool
    POW2: bool

    @classmethod
    @functools.lru_cache(maxsize=256)
    def of(cls, fmt: Format) -> "KernelFormat":
        d = kd.kernel_desc(fmt)
        return cls(BITS=d.payload_bits, SCALE=d.scale, BLOCK=d.block or 1, RULE=d.rule, RECIPE=d.recipe,
                   DS_FLOOR=d.ds_floor, POW2=d.pow2)

    def constexprs(self) -> dict:
        return dict(BITS=self.BITS, SCALE=self.SCALE, BLOCK=self.BLOCK, RULE=self.RULE, RECIPE=self.RECIPE,
                    DS_FLOOR=self.DS_FLOOR, POW2=self.POW2)


# Tokens (rows of one head) per program and warps, by padded row length: 2-D tiles of about 4K elements for the 8 / 16
# bit formats (32 fp32 values a thread over 4 warps), and 8K for the block formats, whose tiles put one row per lane
# and the blocks across warps (`load_blocks`): 64 rows x 128 are 2 rows of one mx block (4 nvfp4 blocks) a thread,
# which halves the per-row work per element against 32 rows (fewer sm_90 ALU ops per element; docs/kernels/store.md).
# The interpreter gets one small config (many rows per program are
# only slower there). Override per call with `config=` (bench `--configs`) to tune on a new device.
LAUNCH_CONFIGS = {32: (128, 4), 64: (64, 4), 128: (32, 4), 256: (16, 4), 512: (8, 4), 1024: (4, 8)}
BLOCK_FORMAT_CONFIGS = {32: (256, 4), 64: (128, 4), 128: (64, 4), 256: (32, 4), 512: (16, 4), 1024: (8, 8)}


def launch_config(dp: int, bits: int, config: tuple[int, int] | None = None, block: int = 32
                  ) -> tuple[int, int]:
    """(BLOCK_R, num_warps) for rows of `dp` (padded) elements of a `bits`-bit payload (4-bit: `block` elements per
    scale); `config` overrides."""
    if config is not None:
        return config
    if INTERPRET:
        return max(1, min(8, 1024 // dp)), 4
    table, elements = (BLOCK_FORMAT_CONFIGS, 8192) if bits == 4 else (LAUNCH_CONFIGS, 4096)
    rows, warps = table.get(dp, (max(1, elements // dp), 4 if dp < 1024 else 8))
    if bits == 4 and block < 32:
        # nvfp4: the same 2 blocks per thread as mxfp4 (measured faster than 4 on the H200, docs/kernels/store.md)
        rows = max(1, rows * block // 32)
    return rows, warps


# Block codec per scale element: the *_quantize_block_fast helpers (same bytes) or the originals; each default is
# the one measured faster for its element on the H200 (bench/sweep_quant_variants.py; docs/kernels/store.md).
# `variant={"FAST": ...}` overrides.
FAST_CODECS = {"e4m3": True, "e8m0": False}
# Encode per scale element for word-aligned 4-bit rows: True = the block codec up to the scaled values
# (kc.mxfp4_scale_block / kc.nvfp4_scale_block, nvfp4 zero-scale rule folded into the fma) and kc.e2m1_words (sign,
# nibble mask and pack on the multiply pipe: fewer ALU-pipe ops per element). On for nvfp4, off for mxfp4, whose
# fewer registers let more warps queue on the L1 (see the module docstring); both measured on the H200 with the
# FAST_CODECS bench (docs/kernels/store.md). `variant={"MUL_PACK": ...}` overrides.
MUL_PACK = {"e4m3": True, "e8m0": False}
# Launch variants (`variant=` of launch_store / store), key -> what it overrides; an absent key keeps the default.
# The portable kernel's encode (FAST, MUL_PACK: defaults per scale element above) and the Hopper store's launch
# (store_gluon.VARIANTS, ignored where the portable kernel runs). Tests run every encode through them and
# bench/sweep_quant_variants.py re-measures them; any other key is a KernelArgumentError.
VARIANTS = {
    "FAST": "4-bit formats: the *_quantize_block_fast codecs (FAST_CODECS)",
    "MUL_PACK": "4-bit formats with word rows: kc.*_scale_block + kc.e2m1_words (MUL_PACK)",
    **store_gluon.VARIANTS,
}


def check_variant(variant: Mapping[str, object] | None) -> Mapping[str, object]:
    """`variant` (None: no overrides) after checking its keys against VARIANTS (KernelArgumentError otherwise)."""
    if not variant:
        return {}
    if not isinstance(variant, Mapping):
        raise KernelArgumentError(f"store: variant must be a mapping of VARIANTS keys, got {type(variant).__name__}")
    bad = sorted(set(variant) - set(VARIANTS))
    if bad:
        raise KernelArgumentError(f"store: unknown variant keys {bad} (known: {sorted(VARIANTS)})")
    return variant


def check_floating(x: torch.Tensor, name: str) -> None:
    if x.dtype not in INPUT_DTYPES:
        raise KernelArgumentError(f"{name}: dtype {x.dtype} is not one of bf16 / fp16 / fp32")
    if x.numel() and x.stride(-1) != 1:
        raise KernelArgumentError(f"{name}: the last dimension must be contiguous (stride 1), got {x.stride()}")


def check_slot_ids(slots: torch.Tensor, n: int, device: torch.device, name: str) -> None:
    if slots.dtype not in (torch.int32, torch.int64):
        raise KernelArgumentError(f"{name}: dtype must be int32 or int64, got {slots.dtype}")
    if slots.dim() != 1 or slots.shape[0] != n:
        raise KernelArgumentError(f"{name}: must be [{n}], got {list(slots.shape)}")
    if slots.device != device:
        raise KernelArgumentError(f"{name}: on {slots.device}, the cache is on {device}")
    if not slots.is_contiguous():
        raise KernelArgumentError(f"{name}: must be contiguous")


def check_cache(cache) -> None:
    data = cache.data
    if data.dtype != torch.uint8 or data.dim() != 3 or not data.is_contiguous():
        raise KernelArgumentError(f"cache data must be contiguous uint8 [pages, H, page_bytes], got {data.dtype} "
                                  f"{list(data.shape)}")
    if cache.num_slots >= 2**31:
        raise KernelArgumentError(f"{cache.num_slots} slots: slot ids must fit in int32")


@functools.lru_cache(maxsize=64)
def native_fp8(device: torch.device) -> bool:
    """Whether kernels on `device` may use the hardware fp32 -> e4m3 conversion: compiled (not the interpreter), CUDA
    (not ROCm: gfx950's fp8 types differ), compute capability 8.9 or newer. Everywhere else the integer encoder runs."""
    if INTERPRET or device.type != "cuda" or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=256)
def outer_scales(g_dec: float) -> tuple[float, float]:
    """(g_dec, g_enc) as the torch codec computes them: g_enc = fp32(1 / fp32(g_dec))."""
    g = torch.tensor(g_dec, dtype=torch.float32)
    return float(g), float(1.0 / g)


def launch_store(x3: torch.Tensor, slots: torch.Tensor | None, payload: torch.Tensor, scales: torch.Tensor | None,
                 fmt: Format, *, page_size: int = 1, page_stride: int = 0, head_stride: int = 0,
                 tensor_scale: float = 1.0, g_dec: float = 1.0, config: tuple[int, int] | None = None,
                 variant: Mapping[str, object] | None = None, gluon: bool | None = None) -> None:
    """Launch `_store_kernel` on x3 [T, H, D] (last dim contiguous). With `slots` it writes pages of `payload` (the
    uint8 cache buffer; `scales` is ignored), without it the planes `payload` [T * H, PB] and `scales` [T * H, SB].
    `gluon`: None takes the Hopper fast path (kernels/store_gluon.py) where it applies, False never, True requires
    it (KernelArgumentError where it cannot run); a `config` means the portable kernel. `variant`: VARIANTS
    overrides (tests, bench sweeps); the bytes are the same for every variant."""
    variant = check_variant(variant)
    T, H, D = x3.shape
    if T * H == 0:
        return
    dp = next_pow2(D)
    g_dec, g_enc = outer_scales(g_dec)
    paged = slots is not None
    pb = fmt.payload_bytes(D)
    bits = fmt.spec.payload_bits
    opts = dict(WORDS=word_aligned(payload, pb, page_stride, head_stride),
                FAST=variant.get("FAST", FAST_CODECS.get(fmt.scale_element, False)),
                BF16_AMAX=x3.dtype == torch.bfloat16 and not INTERPRET)  # (the interpreter's fma rounds twice)
    opts["MUL_PACK"] = bool(variant.get("MUL_PACK", MUL_PACK.get(fmt.scale_element, False))) and opts["WORDS"]
    # the Hopper fast path (kernels/store_gluon.py) where it applies; gluon=False or a config forces this one
    tuning = {k: v for k, v in variant.items() if k in store_gluon.VARIANTS}
    use_gluon = gluon is not False
    fast_ok = config is None and store_gluon.applies(x3, fmt, opts["WORDS"])
    if gluon and not fast_ok:
        raise KernelArgumentError("gluon=True: the Gluon store needs CUDA capability >= 9.0, bf16 rows of 128 with "
                                  "contiguous heads, a 4-bit block format with word-aligned rows, and no config")
    if use_gluon and fast_ok:
        store_gluon.launch(x3, slots, payload, scales, fmt, opts, page_size=page_size, page_stride=page_stride,
                           head_stride=head_stride, g_dec=g_dec, g_enc=g_enc, variant=tuning)
        return
    block_r, num_warps = launch_config(dp, bits, config, fmt.block or 32)
    grid = (triton.cdiv(T, block_r), H)
    _store_kernel[grid](
        x3, slots if paged else payload, payload, scales if scales is not None else payload, T, H, 7,
        x3.stride(0), x3.stride(1), page_stride, head_stride, tensor_scale, g_dec, g_enc,
        PAGED=paged, PAGE=page_size, D=D, DP=dp, PB=pb, SB=fmt.scale_bytes(D),
        **KernelFormat.of(fmt).constexprs(), NATIVE_FP8=native_fp8(x3.device), VEC=16 // x3.element_size(),
        BLOCK_R=block_r, num_warps=num_warps, **opts)


def word_aligned(buf: torch.Tensor, pb: int, *strides: int) -> bool:
    """Whether every payload row of `pb` bytes starts on a 4-byte boundary (int32 word access): the buffer, the row
    size and the page / head strides are multiples of 4."""
    return buf.data_ptr() % 4 == 0 and pb % 4 == 0 and all(s % 4 == 0 for s in strides)


# ----------------------------------------------------------------------------------------------------- the store
def store(cache, x: torch.Tensor, slot_mapping: torch.Tensor, *, validate: bool = True,
          config: tuple[int, int] | None = None, gluon: bool | None = None,
          variant: Mapping[str, object] | None = None) -> None:
    """Triton twin of `PagedCache.store`: quantize x [N, H, D] (bf16 / fp16 / fp32, last dim contiguous) in the
    cache's format and write token i's payload and scales to slot `slot_mapping[i]` (int32 / int64 [N], -1 skips).

    Same bytes as the torch path. `validate` (default) also checks what the torch path checks on values: finite
    input (InputError, nothing written) and slot ids in range (LayoutError); both cost a pass over the data and a host
    sync, so engines that guarantee them pass False. Whole-tensor scales come from `cache.tensor_amax`, frozen from the
    first store as in the torch path. `gluon`: the Hopper fast path's switch; `variant`: launch overrides (VARIANTS;
    both see launch_store)."""
    variant = check_variant(variant)
    check_cache(cache)
    if x.dim() != 3 or tuple(x.shape[1:]) != (cache.num_heads, cache.head_dim):
        raise KernelArgumentError(f"store: x must be [N, {cache.num_heads}, {cache.head_dim}], got {list(x.shape)}")
    check_floating(x, "store: x")
    if x.device != cache.data.device:
        raise KernelArgumentError(f"store: x is on {x.device}, the cache on {cache.data.device}")
    check_slot_ids(slot_mapping, x.shape[0], cache.data.device, "store: slot_mapping")
    if validate:
        cache.check_store_args(x, slot_mapping)
        require_finite(x[slot_mapping >= 0], "store")
    cache.freeze_tensor_amax(x)
    tensor_scale, g_dec = cache_scales(cache)
    launch_store(x, slot_mapping, cache.data, None, cache.fmt, page_size=cache.page_size,
                 page_stride=cache.data.stride(0), head_stride=cache.data.stride(1), tensor_scale=tensor_scale,
                 g_dec=g_dec, config=config, gluon=gluon, variant=variant)


def cache_scales(cache) -> tuple[float, float]:
    """(fp8 `tensor` scale, nvfp4 g_dec) of a cache, as `PagedCache.fp8_tensor_scale()` / `.outer_scale()` compute
    them (1 / 1 where the format has none), memoized on (format, tensor_amax): the torch helpers build small tensors
    on every call, host time an engine would pay on every store and gather."""
    return _cache_scales(cache.fmt, cache.tensor_amax)


@functools.lru_cache(maxsize=256)
def _cache_scales(fmt: Format, tensor_amax: float | None) -> tuple[float, float]:
    amax = None if tensor_amax is None else torch.tensor(tensor_amax, dtype=torch.float32)
    tensor_scale = 1.0
    if fmt.scale_element == "fp32-tensor" and amax is not None:
        tensor_scale = float(fp8_row_scale(amax, ds_floor=False, pow2=False))
    g_dec = nvfp4_outer_scale(fmt, torch.zeros(1), amax) if kd.kernel_desc(fmt).outer_scale else 1.0
    return tensor_scale, g_dec


def require_tensor_scale(cache) -> float:
    """The fp8 `tensor` scale of a cache that has been stored to (the torch path cannot decode without it either)."""
    if cache.tensor_amax is None:
        raise LayoutError("this fp8 tensor-scaled cache has no tensor_amax yet: store into it (or set it) first")
    return cache_scales(cache)[0]
