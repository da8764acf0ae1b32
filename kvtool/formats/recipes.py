"""Engine recipes: each engine quantizer's byte-level choices as one registry entry (data), run by one generic codec.

kvtool's SPEC conventions are one set of choices; an engine function makes others (a different tie rule, a scale
floor, a reciprocal taken in another order, a sign dropped from zero codes). An `EngineRecipe` names every choice that
changes a byte or a value; `quantize` / `dequantize` below run any recipe through the same pipeline:

    amax = max |x| per block (fp32), floored at `amax_min`
    NVFP4-like: t = scale_value(amax, g) -> clamp(t, scale_min, 448) -> E4M3 byte, S = its value
                y = elem(x, S, g)       (S == 0: `zero_scale`)
    MX-like:    e = exp_rule(amax) -> E8M0 byte e + 127; y = x * 2**-e (byte 0: `byte0`)
    FP8 rows:   s = max(amax, amax_min) / 448, optional power of two (`pow2`); payload e4m3(x / s)
    codes = E2M1(y) with `tie` and `sign`; decode per `decode` / `byte0_decode`.

Every enum member's docstring line is its formula; the functions that evaluate them sit in tables keyed by member,
so adding a recipe is adding data. Where an engine's own function is the oracle, tests/engines compares it with the
recipe byte for byte (`oracle` says which function and whether that check runs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

from kvtool.errors import FormatError
from kvtool.formats.base import FormatParams
from kvtool.formats.codecs import _block_amax, _blocks, _quantize_blocks, div_by_const, mx_exponent
from kvtool.formats.elements import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E8M0_BIAS,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    exp2_int,
    f32_bits,
    pack_nibbles,
    unpack_nibbles,
)
from kvtool.formats.rules import ScaleRule

__all__ = [
    "BYTE0_DECODE", "BYTE0_ENCODE", "Byte0", "DECODE", "DEQUANTIZE", "Decode", "ELEM", "EXP_RULE", "Elem",
    "EngineRecipe", "ExpRule", "NV_ENC", "OuterDir", "POW2", "Pow2", "QUANTIZE", "RECIPES",
    "SCALE_VALUE", "SIGN_BIT", "ScaleValue", "Sign", "TIE_MAGNITUDE", "Tie", "ZeroScale", "dequantize", "e2m1_codes",
    "get_recipe", "outer_scales", "quantize"
]

NV_ENC = E2M1_MAX * E4M3_MAX  # 2688 = 6 * 448: the outer scale that maps a tensor amax to the top block scale


# ------------------------------------------------------------------------------------------------------ the choices
class Tie(enum.IntEnum):
    """E2M1 rounding of |y| between two neighbours (the SPEC's thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5).

    EVEN:          round half to even (SPEC; PTX cvt.rn.satfinite.e2m1x2, torchao, DeepGEMM, vLLM cast_to_fp4).
    AWAY:          ties go to the larger magnitude (`|y| >= threshold` counts; triton_kernels, AITER, SGLang).
    NEAREST_FIRST: argmin over the fp32 distances |m - v| to the 8 magnitudes, the lower one on equal distance:
                   ties go down; above |y| = 2**27 every distance rounds to |y|, so the first, 0, wins (FlashInfer).
    All saturate at 6 (NEAREST_FIRST only up to 2**27).
    """

    EVEN = 0
    AWAY = 1
    NEAREST_FIRST = 2


class Sign(enum.IntEnum):
    """Which codes get the sign bit (bit 3) of y.

    BIT:      the IEEE sign bit of y (SPEC: -0.0 and -0.1 both give 8).
    NEGATIVE: y < 0 (-0.0 gives 0, -0.1 gives 8; FlashInfer, SGLang, vLLM's `torch.sign`).
    NONZERO:  y < 0 and the magnitude code is not 0 (never writes 8; DeepGEMM).
    """

    BIT = 0
    NEGATIVE = 1
    NONZERO = 2


class OuterDir(enum.IntEnum):
    """Which direction of the NVFP4 outer (per-tensor) scale the function takes, and what `auto` computes.

    NONE: no outer scale (1).
    DEC:  decode direction g_dec (x ~ code * S * g_dec); auto: g_dec = fp32(amax_tensor / 2688);
          g_enc = fp32(1 / g_dec).
    ENC:  encode direction g_enc (TRT-LLM / vLLM / FlashInfer global_scale); auto: g_enc = fp32(2688 / amax_tensor).
    The QTensor's `outer_scale` holds the value in the recipe's own direction.
    """

    NONE = 0
    DEC = 1
    ENC = 2


class ScaleValue(enum.IntEnum):
    """The fp32 value an NVFP4 block scale is rounded from (each op one fp32 rounding, left to right).

    DIV6_MUL_G:    (amax / 6) * g_enc          (kvtool, FlashInfer)
    RCP6_MUL_G:    (amax * fp32(1/6)) * g_enc  (vLLM ref_nvfp4_quant, DeepGEMM math.per_token_cast_to_nvfp4)
    DIV_6G:        amax / fp32(6 * g_dec)      (DeepGEMM nvfp4.per_token_cast_to_nvfp4)
    DIV6_DIV_G:    (amax / 6) / g_dec          (torchao nvfp4_quantize with a per-tensor scale)
    """

    DIV6_MUL_G = 0
    RCP6_MUL_G = 1
    DIV_6G = 2
    DIV6_DIV_G = 3


class Elem(enum.IntEnum):
    """The fp32 y that NVFP4 codes are rounded from (S = the stored E4M3 scale's value).

    RCP:         x * fp32(1 / (S * g_dec))                    (kvtool rcp; torchao without a per-tensor scale)
    DIV:         x / (S * g_dec)                              (kvtool div, DeepGEMM)
    RCP_RCP:     x * 1 / (S * r(g_enc)), r(a) = 1 / (a + [a == 0] * 1e8)   (vLLM get_reciprocal)
    MUL_G_DIV_S: (x * g_enc) / S                              (FlashInfer)
    RCP_G_DIV_S: x * ((1 / g_dec) / S)                        (torchao)
    """

    RCP = 0
    DIV = 1
    RCP_RCP = 2
    MUL_G_DIV_S = 3
    RCP_G_DIV_S = 4


class ZeroScale(enum.IntEnum):
    """An NVFP4 block whose stored scale byte is 0 (all-zero block, or amax / 6 * g_enc <= 2**-10).

    FLUSH:   codes 0 (SPEC).
    ONE:     S is taken as 1 in the element formula (FlashInfer).
    FORMULA: the element formula as written (vLLM's 1e8 guard; a scale floor keeps S > 0 for DeepGEMM / torchao).
    """

    FLUSH = 0
    ONE = 1
    FORMULA = 2


class Decode(enum.IntEnum):
    """NVFP4 decoded value from the code value v, S and the outer scale (each op one fp32 rounding).

    CODE_S_G:        (v * S) * g_dec   (SPEC; v * S is exact)
    CODE_SG:         v * (S * g_dec)   (DeepGEMM cast_back_from_nvfp4)
    CODE_S_DIV_GENC: v * (S / g_enc)   (vLLM ref_nvfp4_quant_dequant)
    """

    CODE_S_G = 0
    CODE_SG = 1
    CODE_S_DIV_GENC = 2


class ExpRule(enum.IntEnum):
    """The unbiased E8M0 exponent e of an MX block from its fp32 amax (t = fp32(amax / 6)).

    FLOOR, EVEN, CEIL, RCEIL: kvtool's ScaleRule, exact fp32 bit arithmetic, e clamped to [-127, 127].
    RCEIL_LOG2:     ceil(fp32 log2(t)), clamped to [-127, 127] (torchao RCEIL: an amax just above 6 * 2**k gives k
                    where log2 rounds down to an integer).
    RCEIL_LOG2_MIN: ceil(fp32 log2(max(t, 1e-10))) (SGLang KVFP4: an all-zero block stores 2**-33, byte 94).
    FLOOR_LOG2:     floor(fp32 log2(t)) (t = 0, also an underflowed quotient, taken as 1), clamped to [-127, 128]
                    (FlashInfer MXFP4 reference).
    UP_BITS:        exponent field of (bits(t) + 0x7FFFFF) & 0x7F800000 (triton_kernels ROUND_UP; t = 0 -> byte 0).
    DOWN_BITS:      exponent field of bits(t) & 0x7F800000 (triton_kernels ROUND_DOWN; a subnormal t -> byte 0).
    EVEN_LOG2:      floor(fp32 log2(r)) - 2 with r = (bits(amax) + 0x200000) & 0xFF800000, clamped to [-127, 127]
                    (AITER: as EVEN, except that an amax rounding up to 2**128 gives log2 = inf -> e = 127, not 126).
    """

    FLOOR = 0
    EVEN = 1
    CEIL = 2
    RCEIL = 3
    RCEIL_LOG2 = 4
    RCEIL_LOG2_MIN = 5
    FLOOR_LOG2 = 6
    UP_BITS = 7
    DOWN_BITS = 8
    EVEN_LOG2 = 9


class Byte0(enum.IntEnum):
    """What an MX block with scale byte 0 multiplies its elements by (encode), and what byte 0 decodes to.

    EXACT:      2**127 (encode) / 2**-127 (decode): the byte's own value (SPEC, except its all-zero flush).
    ONE:        1 (torchao RCEIL); decodes 2**-127.
    MIN_NORMAL: 2**126, the reciprocal of fp32's smallest normal (torchao FLOOR / CEIL / EVEN); decodes 2**-127.
    ZERO:       0, codes +-0 (triton_kernels); byte 0 decodes to 0.
    """

    EXACT = 0
    ONE = 1
    MIN_NORMAL = 2
    ZERO = 3


class Pow2(enum.IntEnum):
    """FP8 row scale rounded up to a power of two (ue8m0).

    NONE: no rounding.
    BITS: 2**(E(s) + [mantissa != 0]) (kvtool fp8-ds-pow2, DeepGEMM ceil_to_ue8m0).
    LOG2: exp2(ceil(fp32 log2 s)) (vLLM ROCm indexer writer: one binade lower where log2 rounds to an integer).
    """

    NONE = 0
    BITS = 1
    LOG2 = 2


# ------------------------------------------------------------------------------------------------------ the records
@dataclass(frozen=True)
class EngineRecipe:
    """One engine function's byte-level choices. `family` is the kvtool format family it writes; fields that do not
    apply to the family are None. `oracle` names the engine function a test compares with (and whether that test
    runs, or the recipe was written from reading the code); `note` says what still differs and when."""

    name: str
    engine: str
    version: str
    function: str
    family: str
    tie: Tie | None = Tie.EVEN
    sign: Sign | None = Sign.BIT
    amax_min: float = 0.0
    outer: OuterDir = OuterDir.NONE
    scale_value: ScaleValue | None = None
    scale_min: float = 0.0
    elem: Elem | None = None
    zero_scale: ZeroScale | None = None
    decode: Decode | None = None
    exp_rule: ExpRule | None = None
    byte0: Byte0 | None = None
    pow2: Pow2 | None = None
    row_scale: bool | None = None  # fp8: a per-row fp32 scale (the DeepSeek indexer writers), else a plain cast
    nan: str = "reject"  # kvtool refuses non-finite input before any recipe runs; engine NaN codes are not reproduced
    oracle: str = ""
    note: str = ""

    def choices(self) -> dict:
        """The byte-level choices that apply (name -> lower-case member name or number), for tables and JSON."""
        skip = {"name", "engine", "version", "function", "family", "oracle", "note"}
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in skip or value is None:
                continue
            out[f.name] = value.name.lower() if isinstance(value, enum.Enum) else value
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "engine": self.engine, "version": self.version, "function": self.function,
                "format": self.family, "choices": self.choices(), "oracle": self.oracle, "note": self.note}


VLLM_V, SGLANG_V = "vllm 0.33.0", "sglang 0.5.23"
FLASHINFER_V, TORCHAO_V = "flashinfer-python 0.7.2.post1", "torchao 0.18.0"
_NV = dict(family="nvfp4")
_MX = dict(family="mxfp4")

RECIPES: dict[str, EngineRecipe] = {r.name: r for r in (
    EngineRecipe(
        "vllm.ref_nvfp4", "vLLM", VLLM_V,
        "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py: ref_nvfp4_quant (+ _dequant)",
        **_NV, sign=Sign.NEGATIVE, outer=OuterDir.ENC, scale_value=ScaleValue.RCP6_MUL_G, elem=Elem.RCP_RCP,
        zero_scale=ZeroScale.FORMULA, decode=Decode.CODE_S_DIV_GENC,
        oracle="tests/engines: ref_nvfp4_quant values, scales and ref_nvfp4_quant_dequant, from the wheel",
        note="returns fp32 values, not codes: compared as codes of those values (-0.0 values are code 8)"),
    EngineRecipe(
        "deepgemm.per_token_cast_to_nvfp4", "DeepGEMM (vendored in vLLM)", VLLM_V,
        "vllm/third_party/deep_gemm/utils/math.py: per_token_cast_to_nvfp4 (global_scale = decode direction)",
        **_NV, sign=Sign.NONZERO, outer=OuterDir.DEC, scale_value=ScaleValue.RCP6_MUL_G, scale_min=2.0**-9,
        elem=Elem.DIV, zero_scale=ZeroScale.FORMULA, decode=Decode.CODE_SG,
        oracle="tests/engines: per_token_cast_to_nvfp4 from the wheel",
        note="a scale that would round to 0 is clamped to byte 0x01 (2**-9) and the codes are kept"),
    EngineRecipe(
        "deepgemm.megamoe_cast_to_nvfp4", "DeepGEMM (vendored in vLLM)", VLLM_V,
        "vllm/third_party/deep_gemm/utils/nvfp4.py: per_token_cast_to_nvfp4 + cast_back_from_nvfp4",
        **_NV, sign=Sign.NONZERO, outer=OuterDir.DEC, scale_value=ScaleValue.DIV_6G, scale_min=2.0**-9,
        elem=Elem.DIV, zero_scale=ZeroScale.FORMULA, decode=Decode.CODE_SG,
        oracle="tests/engines: nvfp4.per_token_cast_to_nvfp4 and cast_back_from_nvfp4 from the wheel"),
    EngineRecipe(
        "deepgemm.per_token_cast_to_fp4", "DeepGEMM (vendored in vLLM)", VLLM_V,
        "vllm/third_party/deep_gemm/utils/math.py: per_token_cast_to_fp4(use_ue8m0=True, gran_k=32)",
        **_MX, sign=Sign.NONZERO, amax_min=1e-4, exp_rule=ExpRule.RCEIL, byte0=Byte0.EXACT,
        oracle="tests/engines: per_token_cast_to_fp4 + cast_back_from_fp4 from the wheel",
        note="the recipe is the ue8m0, 32-element form (MXFP4); use_ue8m0=False stores fp32 scales (no kvtool "
             "format); amax is floored at 1e-4, so a block never stores byte 0"),
    EngineRecipe(
        "torchao.nvfp4_quantize", "torchao", TORCHAO_V,
        "torchao/prototype/mx_formats/nvfp4_tensor.py: nvfp4_quantize (per_tensor_scale = decode direction)",
        **_NV, outer=OuterDir.DEC, scale_value=ScaleValue.DIV6_DIV_G, scale_min=2.0**-6, elem=Elem.RCP_G_DIV_S,
        zero_scale=ZeroScale.FORMULA, decode=Decode.CODE_S_G,
        oracle="tests/engines: nvfp4_quantize (installed torchao)",
        note="every block scale is clamped to at least 2**-6 (E4M3's smallest normal): blocks with amax < 0.09375 "
             "differ from the SPEC"),
    EngineRecipe(
        "torchao.to_mx_floor", "torchao", TORCHAO_V,
        "torchao/prototype/mx_formats/mx_tensor.py: to_mx(float4_e2m1fn_x2, 32, FLOOR)",
        **_MX, exp_rule=ExpRule.FLOOR, byte0=Byte0.MIN_NORMAL, oracle="tests/engines: to_mx (installed torchao)"),
    EngineRecipe(
        "torchao.to_mx_ceil", "torchao", TORCHAO_V, "torchao/prototype/mx_formats/mx_tensor.py: to_mx(..., CEIL)",
        **_MX, exp_rule=ExpRule.CEIL, byte0=Byte0.MIN_NORMAL, oracle="tests/engines: to_mx (installed torchao)"),
    EngineRecipe(
        "torchao.to_mx_even", "torchao", TORCHAO_V, "torchao/prototype/mx_formats/mx_tensor.py: to_mx(..., EVEN)",
        **_MX, exp_rule=ExpRule.EVEN, byte0=Byte0.MIN_NORMAL, oracle="tests/engines: to_mx (installed torchao)"),
    EngineRecipe(
        "torchao.to_mx_rceil", "torchao", TORCHAO_V,
        "torchao/prototype/mx_formats/mx_tensor.py: to_mx(..., RCEIL) eager path (_to_mx_rceil)",
        **_MX, exp_rule=ExpRule.RCEIL_LOG2, byte0=Byte0.ONE, oracle="tests/engines: to_mx (installed torchao)",
        note="eager torch path; the compiled sm100 path uses cvt.rp.satfinite.ue8m0x2 (exact RCEIL) instead"),
    EngineRecipe(
        "triton_kernels.round_up", "triton_kernels (vendored in vLLM)", VLLM_V,
        "vllm/third_party/triton_kernels/numerics_details/mxfp.py: downcast_to_mxfp_torch(ROUND_UP)",
        **_MX, tie=Tie.AWAY, exp_rule=ExpRule.UP_BITS, byte0=Byte0.ZERO,
        oracle="tests/engines: downcast_to_mxfp_torch + upcast_from_mxfp_torch, and the Triton kernel "
               "_downcast_to_mxfp in the interpreter, from the wheel"),
    EngineRecipe(
        "triton_kernels.round_down", "triton_kernels (vendored in vLLM)", VLLM_V,
        "vllm/third_party/triton_kernels/numerics_details/mxfp.py: downcast_to_mxfp_torch(ROUND_DOWN)",
        **_MX, tie=Tie.AWAY, exp_rule=ExpRule.DOWN_BITS, byte0=Byte0.ZERO,
        oracle="tests/engines: downcast_to_mxfp_torch + upcast_from_mxfp_torch, and the Triton kernel "
               "_downcast_to_mxfp in the interpreter, from the wheel",
        note="2**floor(log2(amax / 6)): block maxima in (6, 8) * 2**k clip to 6"),
    EngineRecipe(
        "flashinfer.mxfp4_ref", "FlashInfer", FLASHINFER_V,
        "flashinfer/trace/templates/quantize.py: _mxfp4_quantize_reference",
        **_MX, tie=Tie.NEAREST_FIRST, sign=Sign.NEGATIVE, exp_rule=ExpRule.FLOOR_LOG2, byte0=Byte0.EXACT,
        oracle="tests/engines: _mxfp4_quantize_reference from the wheel",
        note="an all-zero block stores byte 127 (scale 1); maxima in (6, 8) * 2**k clip to 6"),
    EngineRecipe(
        "flashinfer.nvfp4_kv_ref", "FlashInfer", FLASHINFER_V,
        "flashinfer/trace/templates/quantize.py: _nvfp4_kv_quantize_reference (= _nvfp4_quantize_reference)",
        **_NV, tie=Tie.NEAREST_FIRST, sign=Sign.NEGATIVE, outer=OuterDir.ENC, scale_value=ScaleValue.DIV6_MUL_G,
        elem=Elem.MUL_G_DIV_S, zero_scale=ZeroScale.ONE, decode=Decode.CODE_S_DIV_GENC,
        oracle="tests/engines: _nvfp4_kv_quantize_reference from the wheel",
        note="ties round down; where the scale caps at 448 (an outer scale that overflows it), |y| > 2**27 gives "
             "code 0, not 6"),
    EngineRecipe(
        "sglang.kvfp4", "SGLang", SGLANG_V,
        "python/sglang/srt/layers/quantization/kvfp4_tensor.py: FP4MXBlock16KVQuantizeUtil.batched_(de)quantize",
        family="kvfp4", tie=Tie.AWAY, sign=Sign.NEGATIVE, exp_rule=ExpRule.RCEIL_LOG2_MIN, byte0=Byte0.EXACT,
        oracle="tests/engines: batched_quantize / batched_dequantize from the wheel, run eagerly on fp32 input",
        note="SGLang runs it under torch.compile (fp32 arithmetic, as here); eager on bf16 input it rounds "
             "amax / 6 and log2 to bf16 and can store a scale one binade low (minimal input: a block max of 96.5 "
             "stores byte 131 eager, 132 here; 96.5 / 16 then saturates to 6)"),
    EngineRecipe(
        "vllm.indexer_k_cache", "vLLM (ROCm)", VLLM_V,
        "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py: _indexer_k_quant_and_cache_kernel (scale_fmt != ue8m0)",
        family="fp8", tie=None, sign=None, amax_min=1e-4, pow2=Pow2.NONE, row_scale=True,
        oracle="tests/engines: the Triton kernel under the interpreter, fp32 output buffer (the interpreter's "
               "fp32 -> e4m3 cast is wrong; the GPU's cvt.rn.satfinite is the SPEC's e4m3 encode)",
        note="pages of P > 1 tokens are stored shuffled: layout ds32-indexer-shuffled"),
    EngineRecipe(
        "vllm.indexer_k_cache_ue8m0", "vLLM (ROCm)", VLLM_V,
        "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py: _indexer_k_quant_and_cache_kernel (scale_fmt = ue8m0)",
        family="fp8", tie=None, sign=None, amax_min=1e-4, pow2=Pow2.LOG2, row_scale=True,
        oracle="tests/engines: the Triton kernel under the interpreter (scales exact; fp32 output buffer)",
        note="fp32 log2: a row max just above 448 * 2**k gives scale 2**k and saturating codes (kvtool's "
             "fp8-ds-pow2 gives 2**(k+1)); the GPU's approximate lg2 is not checked here"),
    EngineRecipe(
        "aiter.mxfp4_quant_op", "AITER", "ROCm/aiter main (quant.py at 6920962)",
        "aiter/ops/triton/_triton_kernels/quant/quant.py: _mxfp4_quant_op",
        **_MX, exp_rule=ExpRule.EVEN_LOG2, byte0=Byte0.EXACT,
        oracle="not oracle-checked in the engines tier (AITER is not on PyPI): checked once by hand under the "
               "Triton interpreter "
               "on the tier's edge classes, with two interpreter-only rewrites (`tl.floor(x)` for `x.floor()`, `~m` "
               "for `not m`): equal except 4 codes of fp32-subnormal inputs, where numpy's float32 exp2(127) is "
               "inexact",
        note="amax bits + 0x200000 masked to the exponent, e = floor(log2) - 2; codes by bit arithmetic, half to "
             "even; the sign bit is kept (an all-zero block of -0 writes 8); its float -> uint8 byte cast of a "
             "negative e is target-defined"),
    EngineRecipe(
        "atom.index_store", "ATOM", "ROCm/ATOM main (sparse_attn.py at b06c966, read)",
        "atom/model_ops/minimax_m3/sparse_attn.py: _fused_qknorm_rope_kv_insert_shuffle_kernel, step (5): the "
        "normed, roped index key cast to the index cache dtype (index_cache + slot * idx_head_dim)",
        family="fp8", tie=None, sign=None, row_scale=False,
        oracle="not oracle-checked: read from the public source (ATOM is not on PyPI; its kernel needs ROCm)",
        note="a plain cast, no scale (layout atom-index); kvtool clamps to +-448 first, the kernel's cast of an "
             "out-of-range value is target-defined (RMS-normed index keys stay far below 448)"),
    EngineRecipe(
        "atom.fp4_index_store", "ATOM", "ROCm/ATOM MiniMax-M3 FP4 index, as described (not read)",
        "the FP4 index key store: 'scale = e4m3(amax/6), codes rounded half to even', unit outer scale",
        **_NV, scale_value=ScaleValue.DIV6_MUL_G, elem=Elem.RCP, zero_scale=ZeroScale.FLUSH, decode=Decode.CODE_S_G,
        oracle="not oracle-checked: written from the description quoted in the SPEC (no public source found here)",
        note="equal to kvtool's nvfp4 (rcp, outer 1) by construction"),
)}


def get_recipe(name: "str | EngineRecipe") -> EngineRecipe:
    """The recipe named `name` (case-insensitive), or FormatError listing the names."""
    if isinstance(name, EngineRecipe):
        return name
    key = str(name).strip().lower()
    if key not in RECIPES:
        raise FormatError(f"unknown engine recipe {name!r} (choose {'|'.join(RECIPES)}; `kvtool recipes` lists them)")
    return RECIPES[key]


# ------------------------------------------------------------------------------------------------- the formulas
def _e2m1_away(m: torch.Tensor) -> torch.Tensor:
    code = torch.zeros(m.shape, dtype=torch.uint8, device=m.device)
    for boundary in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        code += (m >= boundary).to(torch.uint8)
    return code


def _e2m1_nearest_first(m: torch.Tensor) -> torch.Tensor:
    values = E2M1_VALUES[:8].to(m.device)
    return (m.unsqueeze(-1) - values).abs().argmin(dim=-1).to(torch.uint8)  # argmin: the first of equal minima


TIE_MAGNITUDE = {
    Tie.EVEN: lambda m: e2m1_encode(m) & 7,
    Tie.AWAY: _e2m1_away,
    Tie.NEAREST_FIRST: _e2m1_nearest_first,
}

SIGN_BIT = {
    Sign.BIT: lambda y, mag: torch.signbit(y),
    Sign.NEGATIVE: lambda y, mag: y < 0,
    Sign.NONZERO: lambda y, mag: (y < 0) & (mag != 0),
}


def e2m1_codes(y: torch.Tensor, tie: Tie, sign: Sign) -> torch.Tensor:
    """fp32 y -> E2M1 codes (uint8 0..15) under a tie and a sign rule."""
    mag = TIE_MAGNITUDE[tie](y.abs())
    return mag | (SIGN_BIT[sign](y, mag).to(torch.uint8) << 3)


def _rcp_guard(a: torch.Tensor) -> torch.Tensor:
    return 1.0 / (a + (a == 0) * 1e8)


SCALE_VALUE = {
    ScaleValue.DIV6_MUL_G: lambda amax, ge, gd, gd_f: div_by_const(amax, E2M1_MAX) * ge,
    ScaleValue.RCP6_MUL_G: lambda amax, ge, gd, gd_f: (amax * (1.0 / E2M1_MAX)) * ge,
    ScaleValue.DIV_6G: lambda amax, ge, gd, gd_f: div_by_const(amax, E2M1_MAX * gd_f),
    ScaleValue.DIV6_DIV_G: lambda amax, ge, gd, gd_f: div_by_const(amax, E2M1_MAX) / gd,
}

ELEM = {
    Elem.RCP: lambda x, s, ge, gd: x * (1.0 / (s * gd)),
    Elem.DIV: lambda x, s, ge, gd: x / (s * gd),
    Elem.RCP_RCP: lambda x, s, ge, gd: x * _rcp_guard(s * _rcp_guard(ge)),
    Elem.MUL_G_DIV_S: lambda x, s, ge, gd: (x * ge) / s,
    Elem.RCP_G_DIV_S: lambda x, s, ge, gd: x * ((1.0 / gd) / s),
}

DECODE = {
    Decode.CODE_S_G: lambda v, s, ge, gd: (v * s) * gd,
    Decode.CODE_SG: lambda v, s, ge, gd: v * (s * gd),
    Decode.CODE_S_DIV_GENC: lambda v, s, ge, gd: v * (s / ge),
}


def _log2_t(amax: torch.Tensor) -> torch.Tensor:
    return torch.log2(div_by_const(amax, E2M1_MAX))


def _floor_log2_t(amax: torch.Tensor) -> torch.Tensor:
    t = div_by_const(amax, E2M1_MAX)
    t = torch.where(t > 0, t, 1.0)  # a quotient that is 0 (amax 0, or amax / 6 underflowing) counts as 1
    return torch.floor(torch.log2(t)).clamp(-E8M0_BIAS, E8M0_BIAS + 1).to(torch.int32)


def _bits_exp(amax: torch.Tensor, add: int) -> torch.Tensor:
    field = ((f32_bits(div_by_const(amax, E2M1_MAX)) + add) & 0x7F800000) >> 23
    return field.to(torch.int32) - E8M0_BIAS


EXP_RULE = {
    ExpRule.FLOOR: lambda a: mx_exponent(a, ScaleRule.FLOOR),
    ExpRule.EVEN: lambda a: mx_exponent(a, ScaleRule.EVEN),
    ExpRule.CEIL: lambda a: mx_exponent(a, ScaleRule.CEIL),
    ExpRule.RCEIL: lambda a: mx_exponent(a, ScaleRule.RCEIL),
    ExpRule.RCEIL_LOG2: lambda a: torch.ceil(_log2_t(a)).clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32),
    ExpRule.RCEIL_LOG2_MIN: lambda a: torch.ceil(torch.log2(div_by_const(a, E2M1_MAX).clamp(min=1e-10)))
    .to(torch.int32),
    ExpRule.FLOOR_LOG2: lambda a: _floor_log2_t(a),
    ExpRule.UP_BITS: lambda a: _bits_exp(a, 0x7FFFFF),
    ExpRule.DOWN_BITS: lambda a: _bits_exp(a, 0),
    ExpRule.EVEN_LOG2: lambda a: (torch.floor(torch.log2(((f32_bits(a) + 0x200000) & 0x7F800000).view(torch.float32)))
                                  - 2).clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32),
}

BYTE0_ENCODE = {Byte0.EXACT: 2.0**127, Byte0.ONE: 1.0, Byte0.MIN_NORMAL: 2.0**126, Byte0.ZERO: 0.0}
BYTE0_DECODE = {Byte0.EXACT: 2.0**-127, Byte0.ONE: 2.0**-127, Byte0.MIN_NORMAL: 2.0**-127, Byte0.ZERO: 0.0}

POW2 = {
    Pow2.NONE: lambda s: s,
    Pow2.BITS: lambda s: exp2_int(((f32_bits(s) >> 23) & 0xFF) - 127 + ((f32_bits(s) & 0x7FFFFF) != 0).to(torch.int32)),
    Pow2.LOG2: lambda s: torch.exp2(torch.ceil(torch.log2(s))),
}


# ------------------------------------------------------------------------------------------------- outer scale
def outer_scales(recipe: EngineRecipe, fmt: FormatParams, x: torch.Tensor, tensor_amax: torch.Tensor | None
                 ) -> tuple[float, float, float]:
    """(stored, g_enc, g_dec): the outer scale in the recipe's direction (what QTensor.outer_scale keeps) and both
    directions as fp32-representable floats. `auto` follows the recipe's direction (OuterDir)."""
    if recipe.outer == OuterDir.NONE or fmt.outer_scale in (None, "1"):
        return 1.0, 1.0, 1.0
    if fmt.outer_scale == "auto":
        amax = (x.abs().amax() if tensor_amax is None else tensor_amax).float().cpu().reshape(())
        if float(amax) == 0:
            return 1.0, 1.0, 1.0
        g = amax / NV_ENC if recipe.outer == OuterDir.DEC else torch.tensor(NV_ENC) / amax
        stored = float(g.float())
    else:
        stored = float(torch.tensor(float(fmt.outer_scale), dtype=torch.float32))
    return (stored,) + _both(recipe, stored)


def _both(recipe: EngineRecipe, stored: float) -> tuple[float, float]:
    """(g_enc, g_dec) from the stored value: the other direction is the fp32 reciprocal of the stored one."""
    other = float(torch.tensor(1.0 / stored, dtype=torch.float32))
    return (other, stored) if recipe.outer == OuterDir.DEC else (stored, other)


# ------------------------------------------------------------------------------------------------- quantize
def quantize(recipe: EngineRecipe, fmt: FormatParams, x: torch.Tensor, tensor_amax: torch.Tensor | None):
    """x fp32 [..., D] -> (payload, scales, outer_scale) under `recipe` (the family codecs' return convention)."""
    return QUANTIZE[recipe.family](recipe, fmt, x, tensor_amax)


def dequantize(recipe: EngineRecipe, fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    return DEQUANTIZE[recipe.family](recipe, fmt, payload, scales, outer_scale)


def _nv_quantize(r: EngineRecipe, fmt: FormatParams, x: torch.Tensor, tensor_amax):
    stored, g_enc, g_dec = outer_scales(r, fmt, x, tensor_amax)
    ge = torch.tensor(g_enc, dtype=torch.float32, device=x.device)
    gd = torch.tensor(g_dec, dtype=torch.float32, device=x.device)

    def chunk(xb):  # [r, D/16, 16]
        amax = _block_amax(xb).clamp(min=r.amax_min)
        t = SCALE_VALUE[r.scale_value](amax, ge, gd, g_dec).clamp(min=r.scale_min)
        scale_bytes = e4m3_encode(t)
        s = e4m3_decode(scale_bytes)
        zero = scale_bytes == 0
        if r.zero_scale == ZeroScale.ONE:
            s = torch.where(zero, 1.0, s)
        y = ELEM[r.elem](xb, s, ge, gd)
        if r.zero_scale == ZeroScale.FLUSH:
            y = torch.where(zero, 0.0, y)
        return pack_nibbles(e2m1_codes(y, r.tie, r.sign)), scale_bytes.squeeze(-1)

    payload, scales = _quantize_blocks(x, fmt.block, chunk)
    return payload, scales, stored


def _nv_dequantize(r: EngineRecipe, fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    g_enc, g_dec = _both(r, float(outer_scale)) if r.outer != OuterDir.NONE else (1.0, 1.0)
    values = _blocks(_code_values(unpack_nibbles(payload)), fmt.block)
    s = e4m3_decode(scales).unsqueeze(-1)
    out = DECODE[r.decode](values, s, torch.tensor(g_enc), torch.tensor(g_dec))
    return out.reshape(*payload.shape[:-1], payload.shape[-1] * 2)


def _code_values(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES.to(codes.device)[(codes & 0xF).long()]


def _mx_quantize(r: EngineRecipe, fmt: FormatParams, x: torch.Tensor, tensor_amax):
    def chunk(xb):  # [r, D/block, block]
        amax = _block_amax(xb).clamp(min=r.amax_min)
        e = EXP_RULE[r.exp_rule](amax)
        scale_bytes = (e + E8M0_BIAS).to(torch.uint8)
        mult = torch.where(scale_bytes == 0, BYTE0_ENCODE[r.byte0], exp2_int(-e.clamp(-E8M0_BIAS, E8M0_BIAS)))
        mult = torch.where(e > E8M0_BIAS, 0.0, mult)  # FlashInfer's e = 128 (byte 255): x / inf
        y = xb * mult
        return pack_nibbles(e2m1_codes(y, r.tie, r.sign)), scale_bytes.squeeze(-1)

    payload, scales = _quantize_blocks(x, fmt.block, chunk)
    return payload, scales, 1.0


def _mx_dequantize(r: EngineRecipe, fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    values = _blocks(_code_values(unpack_nibbles(payload)), fmt.block)
    s = exp2_int(scales.to(torch.int32) - E8M0_BIAS)
    s = torch.where(scales == 0, BYTE0_DECODE[r.byte0], s)
    s = torch.where(scales == 255, float("nan"), s)
    out = values * s.unsqueeze(-1)
    return out.reshape(*payload.shape[:-1], payload.shape[-1] * 2)


def _fp8_quantize(r: EngineRecipe, fmt: FormatParams, x: torch.Tensor, tensor_amax):
    if not r.row_scale:
        return e4m3_encode(x), None, 1.0
    amax = x.abs().amax(-1, keepdim=True).clamp(min=r.amax_min)
    s = POW2[r.pow2](div_by_const(amax, E4M3_MAX))
    return e4m3_encode(x / s), s, 1.0


def _fp8_dequantize(r: EngineRecipe, fmt: FormatParams, payload, scales, outer_scale) -> torch.Tensor:
    values = e4m3_decode(payload)
    return values if scales is None else values * scales.to(payload.device)


QUANTIZE = {"nvfp4": _nv_quantize, "mxfp4": _mx_quantize, "kvfp4": _mx_quantize, "fp8": _fp8_quantize}
DEQUANTIZE = {"nvfp4": _nv_dequantize, "mxfp4": _mx_dequantize, "kvfp4": _mx_dequantize, "fp8": _fp8_dequantize}
