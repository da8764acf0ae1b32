"""Named rules (SPEC section 2). Each enum value is also the integer that Triton kernels take as a constexpr."""

from __future__ import annotations

import enum

__all__ = ["Fp8Scale", "NvRecipe", "ScaleRule", "parse_enum"]


class ScaleRule(enum.IntEnum):
    """How an MXFP4 block's E8M0 exponent `e` is chosen from the block amax (fp32 bit arithmetic, E = unbiased exponent).

    FLOOR: `e = floor(log2 amax) - 2` (OCP MX v1.0; maxima in (6, 8) * 2**k clip to 6).
    EVEN:  `e = E((bits(amax) + 0x200000) & 0xFF800000) - 2` (AMD Quark / AITER Triton: rounds amax up a binade when
           its mantissa is >= 1.75).
    CEIL:  `e = floor(log2 amax) + [mantissa != 0] - 2` (torchao option).
    RCEIL: `e = ceil(log2(amax / 6))` (NVIDIA hardware, FlashInfer, DeepGEMM, ModelOpt, AITER default; never clips).
    `e` is clamped to [-127, 127]; the byte is `e + 127`; an all-zero block stores byte 0 and codes 0.
    """

    FLOOR = 0
    EVEN = 1
    CEIL = 2
    RCEIL = 3


class NvRecipe(enum.IntEnum):
    """How NVFP4 element codes are computed from the block scale `S` (the stored E4M3 scale's value) and outer `g_dec`.

    RCP:       `y = x * fp32(1 / (S * g_dec))` (TE reference, torchao, FlashInfer exact mode, ATOM).
    DIV:       `y = x / (S * g_dec)` (ModelOpt).
    UNROUNDED: `y = x / (amax / 6)`: codes from the unrounded fp32 scale; the stored byte is still rounded (AITER Triton).
    """

    RCP = 0
    DIV = 1
    UNROUNDED = 2


class Fp8Scale(enum.IntEnum):
    """FP8 E4M3 scaling granularity.

    UNIT:   plain cast after clamping, no scale (M3 index cache, SGLang main KV).
    TENSOR: one fp32 `s = amax_tensor / 448` (1 if amax is 0); payload `e4m3(x / s)`.
    TOKEN:  one fp32 `s = amax_row / 448` per (token, head) row (1 if 0) (ATOM main KV); DeepSeek V3.2 indexer variant
            `s = max(amax, 1e-4) / 448` (`ds_floor`), optionally rounded up to a power of two (`pow2`, ue8m0).
    """

    UNIT = 0
    TENSOR = 1
    TOKEN = 2


def parse_enum(enum_cls: type[enum.IntEnum], value: "str | enum.IntEnum", what: str) -> enum.IntEnum:
    """Resolve a case-insensitive name to an enum member, or raise FormatError naming the choices."""
    from kvtool.errors import FormatError

    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls[str(value).strip().upper()]
    except KeyError:
        choices = "|".join(m.name.lower() for m in enum_cls)
        raise FormatError(f"unknown {what} {value!r} (choose {choices})") from None
