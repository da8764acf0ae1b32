"""Block codecs (SPEC section 2) in plain, vectorized torch: the reference every kernel must equal byte for byte.

Each function takes fp32 `x` of shape [..., D] (quantized along the last dimension) plus the format descriptor, and
returns (payload, scales, outer_scale). All arithmetic is fp32 with IEEE rounding, in the order the SPEC writes it; the
order is part of the contract because the Triton kernels repeat it.
"""

from __future__ import annotations

import torch

from kvtool.formats.base import FormatParams
from kvtool.formats.elements import (
    E2M1_MAX,
    E4M3_MAX,
    E8M0_BIAS,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    exp2_int,
    f32_bits,
    f32_mantissa_nonzero,
    f32_unbiased_exponent,
    pack_nibbles,
    unpack_nibbles,
)
from kvtool.formats.rules import Fp8Scale, NvRecipe, ScaleRule

__all__ = [
    "CPU_CHUNK_ELEMENTS", "DS_AMAX_FLOOR", "NV_AUTO_MIN_OUTER", "bf16_dequantize", "bf16_quantize", "div_by_const",
    "fp8_dequantize", "fp8_quantize", "fp8_row_scale", "mx_exponent", "mxfp4_dequantize", "mxfp4_quantize",
    "nvfp4_dequantize", "nvfp4_outer_scale", "nvfp4_quantize"
]

# DeepSeek V3.2 indexer floor on the per-token amax (fp32 of 1e-4).
DS_AMAX_FLOOR = 1e-4


# On CPU, rows are quantized in chunks of about this many elements, so that a chunk's fp32 temporaries (1 MB each)
# stay in cache across the ~12 elementwise passes instead of streaming through DRAM; 2**18 was the best of
# 2**14 .. 2**20 on a 2-core EPYC (bench/RESULTS.md). CUDA tensors go in one piece.
CPU_CHUNK_ELEMENTS = 1 << 18


def div_by_const(a: torch.Tensor, c: float) -> torch.Tensor:
    """IEEE fp32 `a / c` on every device. PyTorch's CUDA division by a Python scalar multiplies by the rounded
    reciprocal instead (one ulp off on some inputs; seen on the H200), so the divisor is a tensor on `a`'s device."""
    return a / torch.full_like(a, c)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dimension (keepdim): fp32 [..., NB, 1]. A block of 16 reduces by halving with
    `torch.maximum` (same values, NaN propagates alike): torch's amax over an inner dimension of 16 is a slow path on
    CPU (2.3x slower than the halving, 6x slower per element than an inner dimension of 32)."""
    a = xb.abs()
    if a.shape[-1] != 16:
        return a.amax(-1, keepdim=True)
    while a.shape[-1] > 1:
        half = a.shape[-1] // 2
        a = torch.maximum(a[..., :half], a[..., half:])
    return a


def _quantize_blocks(x: torch.Tensor, block: int, quantize_chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `quantize_chunk(xb)` (fp32 [r, D/block, block] -> packed uint8 [r, D/block, block/2], scale bytes uint8
    [r, D/block]) over the rows of `x` [..., D] (any float dtype: each chunk is made fp32 while it is in cache), in
    CPU_CHUNK_ELEMENTS chunks on CPU. Returns (payload uint8 [..., D/2], scales uint8 [..., D/block])."""
    d = x.shape[-1]
    nb = d // block
    x2 = x.reshape(-1, d)
    rows = x2.shape[0]
    step = max(1, CPU_CHUNK_ELEMENTS // d) if x.device.type == "cpu" else max(rows, 1)
    if step >= rows:
        payload, scales = quantize_chunk(x2.reshape(rows, nb, block).float())
    else:
        payload = torch.empty(rows, nb, block // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
        for start in range(0, rows, step):
            p, sc = quantize_chunk(x2[start:start + step].reshape(-1, nb, block).float())  # bf16 -> fp32 in cache
            payload[start:start + step] = p
            scales[start:start + step] = sc
    return payload.reshape(*x.shape[:-1], d // 2), scales.reshape(*x.shape[:-1], nb)


# ----------------------------------------------------------------------------------------------------------- bf16
def bf16_quantize(fmt: FormatParams, x: torch.Tensor, tensor_amax: torch.Tensor | None):
    return x.to(torch.bfloat16), None, 1.0


def bf16_dequantize(fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    return payload.float()


# ------------------------------------------------------------------------------------------------------------ fp8
def fp8_row_scale(amax: torch.Tensor, ds_floor: bool, pow2: bool) -> torch.Tensor:
    """fp32 scale `s` from an fp32 amax: `amax / 448` (1 where amax is 0), or DeepSeek's `max(amax, 1e-4) / 448`,
    optionally rounded up to a power of two (`2**ceil(log2 s)` by exponent bits: the ue8m0 variant)."""
    amax = amax.float()
    if ds_floor:
        s = div_by_const(torch.clamp(amax, min=DS_AMAX_FLOOR), E4M3_MAX)
    else:
        # 1 where the QUOTIENT is 0: amax = 0, and also 0 < amax < 448 * 2**-150 (fp32 subnormal), whose quotient
        # underflows to 0 and would turn x / s into inf / NaN codes (SPEC: finite input never gives NaN).
        s = div_by_const(amax, E4M3_MAX)
        s = torch.where(s > 0, s, torch.ones_like(s))
    if pow2:
        e = f32_unbiased_exponent(s) + f32_mantissa_nonzero(s).to(torch.int32)
        s = exp2_int(e)
    return s


def fp8_quantize(fmt: FormatParams, x: torch.Tensor, tensor_amax: torch.Tensor | None):
    if fmt.fp8_scale == Fp8Scale.UNIT:
        return e4m3_encode(x), None, 1.0
    if fmt.fp8_scale == Fp8Scale.TENSOR:
        amax = x.abs().amax() if tensor_amax is None else tensor_amax.float()
        s = fp8_row_scale(amax.reshape(()), ds_floor=False, pow2=False).to(x.device)
    else:  # TOKEN: one scale per (token, head) row
        s = fp8_row_scale(x.abs().amax(-1, keepdim=True), fmt.ds_floor, fmt.pow2)
    return e4m3_encode(x / s), s, 1.0


def fp8_dequantize(fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    values = e4m3_decode(payload)
    return values if scales is None else values * scales.to(values.device)


# ---------------------------------------------------------------------------------------------------------- nvfp4
# Smallest `auto` outer scale: with g_dec >= 2**-118 every non-zero block scale S >= 2**-9 keeps S * g_dec >= 2**-127,
# so fp32(1 / (S * g_dec)) (the rcp recipe) and g_enc = 1 / g_dec stay finite. A smaller amax_tensor / 2688 (a tensor
# whose amax is below 2688 * 2**-118 ~ 8e-33, all-zero included) uses g_dec = 1: its blocks then store scale 0, codes 0.
NV_AUTO_MIN_OUTER = 2.0**-118


def nvfp4_outer_scale(fmt: FormatParams, x: torch.Tensor, tensor_amax: torch.Tensor | None) -> float:
    """The decode-direction outer scale `g_dec` as an fp32-representable float: 1, `amax_tensor / (6 * 448)` for
    `auto` (1 when that is below NV_AUTO_MIN_OUTER, the all-zero tensor included), or the value the format names."""
    if fmt.outer_scale != "auto":
        return float(torch.tensor(float(fmt.outer_scale), dtype=torch.float32))
    amax = x.abs().amax() if tensor_amax is None else tensor_amax.float()
    g = (amax.float().cpu() / (E2M1_MAX * E4M3_MAX)).reshape(())
    return float(g) if float(g) >= NV_AUTO_MIN_OUTER else 1.0


def nvfp4_quantize(fmt: FormatParams, x: torch.Tensor, tensor_amax: torch.Tensor | None):
    g_dec = nvfp4_outer_scale(fmt, x, tensor_amax)
    g_dec_t = torch.tensor(g_dec, dtype=torch.float32, device=x.device)
    g_enc_t = 1.0 / g_dec_t  # fp32 reciprocal; exactly 1 for the default unit outer scale

    def chunk(xb):  # [r, D/16, 16]
        amax = _block_amax(xb)  # [r, D/16, 1]
        scale_bytes = e4m3_encode(div_by_const(amax, E2M1_MAX) * g_enc_t)
        s = e4m3_decode(scale_bytes)
        # A stored scale of 0 (all-zero block, or amax / 6 * g_enc <= 2**-10) decodes every code to 0: write codes 0.
        # Done on the per-block factors (cheap) instead of the payload: such a block is scaled to +-0 (multiplier 0
        # or divisor inf), then `+ 0.0` makes every -0 a +0 (code 0); other blocks add -0.0, which changes nothing.
        zero = scale_bytes == 0
        if fmt.recipe == NvRecipe.RCP:
            y = xb * (1.0 / (s * g_dec_t)).masked_fill_(zero, 0.0)
        elif fmt.recipe == NvRecipe.DIV:
            y = xb / (s * g_dec_t).masked_fill_(zero, float("inf"))
        else:  # UNROUNDED: codes from the fp32 scale before E4M3 rounding
            y = xb / div_by_const(amax, E2M1_MAX).masked_fill_(zero, float("inf"))
        y += torch.where(zero, 0.0, -0.0)
        return pack_nibbles(e2m1_encode(y)), scale_bytes.squeeze(-1)  # [r, D/16, 8], [r, D/16]

    payload, scales = _quantize_blocks(x, fmt.block, chunk)
    return payload, scales, g_dec


def nvfp4_dequantize(fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    values = _blocks(e2m1_decode(unpack_nibbles(payload)), fmt.block)
    # (code * S) is exact in fp32; the outer scale then rounds once.
    out = values * e4m3_decode(scales).unsqueeze(-1) * float(outer_scale)
    return out.reshape(*payload.shape[:-1], payload.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------------------- mxfp4
def mx_exponent(amax: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """Unbiased E8M0 exponent `e` (int32, clamped to [-127, 127]) of fp32 block maxima under `rule` (see ScaleRule)."""
    amax = amax.float()
    if rule == ScaleRule.FLOOR:
        e = f32_unbiased_exponent(amax) - 2
    elif rule == ScaleRule.EVEN:
        rounded = ((f32_bits(amax) + 0x200000) & 0x7F800000).view(torch.float32)
        e = f32_unbiased_exponent(rounded) - 2
    elif rule == ScaleRule.CEIL:
        e = f32_unbiased_exponent(amax) + f32_mantissa_nonzero(amax).to(torch.int32) - 2
    else:  # RCEIL: ceil(log2(amax / 6)) exactly, from the bits of the fp32 quotient
        t = div_by_const(amax, E2M1_MAX)
        bits = f32_bits(t)
        normal_e = f32_unbiased_exponent(t) + f32_mantissa_nonzero(t).to(torch.int32)
        # A subnormal t = m * 2**-149 has ceil(log2 t) = -149 + ceil(log2 m): -126 when m > 2**22, else <= -127.
        subnormal_e = torch.where((bits & 0x7FFFFF) > 0x400000, -126, -127).to(torch.int32)
        e = torch.where((bits & 0x7F800000) == 0, subnormal_e, normal_e)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def mxfp4_quantize(fmt: FormatParams, x: torch.Tensor, tensor_amax: torch.Tensor | None):
    def chunk(xb):  # [r, D/32, 32]
        amax = _block_amax(xb)  # [r, D/32, 1]
        e = mx_exponent(amax, fmt.scale_rule)
        zero = amax == 0  # all-zero block: byte 0, codes 0 (also for -0: `+ 0.0` turns -0 into +0; -0.0 elsewhere
        # changes nothing; cheaper than masking the payload)
        y = (xb * exp2_int(-e)).add_(torch.where(zero, 0.0, -0.0))  # exact: a power-of-two scaling
        scale_bytes = (e + E8M0_BIAS).masked_fill_(zero, 0).to(torch.uint8)
        return pack_nibbles(e2m1_encode(y)), scale_bytes.squeeze(-1)  # [r, D/32, 16], [r, D/32]

    payload, scales = _quantize_blocks(x, fmt.block, chunk)
    return payload, scales, 1.0


def mxfp4_dequantize(fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    values = _blocks(e2m1_decode(unpack_nibbles(payload)), fmt.block)
    out = values * e8m0_decode(scales).unsqueeze(-1)
    return out.reshape(*payload.shape[:-1], payload.shape[-1] * 2)
