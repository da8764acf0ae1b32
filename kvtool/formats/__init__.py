"""The SPEC as code: element codecs, rules, format descriptors and the registry (layer 1 of DESIGN.md)."""

from kvtool.formats.elements import (
    E2M1,
    E2M1_MAX,
    E4M3,
    E4M3_MAX,
    E8M0_BIAS,
    ElementCodec,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    pack_nibbles,
    unpack_nibbles,
)
from kvtool.formats.registry import (
    ALIASES,
    FAMILIES,
    SCALE_UNIT_BYTE,
    Family,
    Format,
    QTensor,
    all_formats,
    engine_formats,
    get_format,
    require_finite,
    rule_variants,
)
from kvtool.formats.rules import Fp8Scale, NvRecipe, ScaleRule

__all__ = [
    "ALIASES", "E2M1", "E2M1_MAX", "E4M3", "E4M3_MAX", "E8M0_BIAS", "ElementCodec", "FAMILIES", "Family", "Format",
    "Fp8Scale", "NvRecipe", "QTensor", "SCALE_UNIT_BYTE", "ScaleRule", "all_formats", "e2m1_decode", "e2m1_encode",
    "e4m3_decode", "e4m3_encode", "e8m0_decode", "engine_formats", "get_format", "pack_nibbles", "require_finite",
    "rule_variants", "unpack_nibbles",
]
