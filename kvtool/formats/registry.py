"""Format descriptors and the registry (SPEC section 2).

A `Format` is a frozen description: family, element codec, block, scale element, and the recipe options that apply
to its family. Every command, kernel, test and benchmark reads these fields; adding a format is adding one entry to
`FAMILIES`. `QTensor` is a quantized cache in memory: payload and scale planes, the outer scale, and the descriptor.

Names: a family name (`bf16`, `fp8`, `nvfp4`, alias `fp4`, `mxfp4`) plus options, or a compact label that spells the
options after dashes, e.g. `mxfp4-floor`, `nvfp4-div-auto`, `nvfp4-g0.25`, `fp8-token`, `fp8-ds-pow2`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

import kvtool.formats.codecs as codecs
import kvtool.formats.recipes as recipes
import kvtool.formats.rotation as _rot
from kvtool.errors import FormatError, InputError
from kvtool.formats.elements import E2M1, E4M3, ElementCodec
from kvtool.formats.rules import Fp8Scale, NvRecipe, ScaleRule, parse_enum

__all__ = [
    "ALIASES", "DEFAULTS", "FAMILIES", "Family", "Format", "QTensor", "RecipesReport", "SCALE_ELEMENT_BYTES",
    "SCALE_UNIT_BYTE", "all_formats", "engine_formats", "get_format", "list_recipes", "require_finite", "rule_variants"
]


@dataclass(frozen=True)
class Family:
    """What a family of formats is made of; one entry per family in FAMILIES."""

    name: str
    element: ElementCodec | None  # None: payload is bf16 itself
    payload_bits: int  # bits per element in the payload
    block: int  # elements per scale (0: no block scale)
    scale_element: str  # 'none' | 'fp32-tensor' | 'fp32-row' | 'e4m3' | 'e8m0' (bytes per scale derive from it)
    quantize: Callable
    dequantize: Callable
    options: tuple[str, ...]  # which Format option fields apply
    description: str

    @property
    def has_outer_scale(self) -> bool:
        """The family's QTensors carry a decode-direction fp32 outer scale (NVFP4's g_dec) beside the block scales."""
        return "outer_scale" in self.options


SCALE_ELEMENT_BYTES = {"none": 0, "fp32-tensor": 0, "fp32-row": 4, "e4m3": 1, "e8m0": 1}
# The byte of scale 1.0 for each one-byte block-scale element: E4M3 0b0_0111_000 (2**(7 - 7)), E8M0 127 (2**(127 -
# 127)); what a writer that never computed its scales leaves in the plane.
SCALE_UNIT_BYTE = {"e4m3": 0b0_0111_000, "e8m0": 127}

FAMILIES: dict[str, Family] = {
    "bf16": Family("bf16", None, 16, 0, "none", codecs.bf16_quantize, codecs.bf16_dequantize, (),
                   "bfloat16, no scale"),
    "fp8": Family("fp8", E4M3, 8, 0, "none", codecs.fp8_quantize, codecs.fp8_dequantize,
                  ("fp8_scale", "ds_floor", "pow2"), "E4M3FN with a unit, per-tensor or per-token fp32 scale"),
    "nvfp4": Family("nvfp4", E2M1, 4, 16, "e4m3", codecs.nvfp4_quantize, codecs.nvfp4_dequantize,
                    ("recipe", "outer_scale"), "E2M1, one E4M3 scale per 16 elements, optional fp32 outer scale"),
    "mxfp4": Family("mxfp4", E2M1, 4, 32, "e8m0", codecs.mxfp4_quantize, codecs.mxfp4_dequantize,
                    ("scale_rule",), "E2M1, one E8M0 scale per 32 elements"),
    # SGLang's FP4 KV pool (kvfp4_tensor.py FP4MXBlock16KVQuantizeUtil): MX element and scale, 16-element blocks.
    "kvfp4": Family("kvfp4", E2M1, 4, 16, "e8m0", codecs.mxfp4_quantize, codecs.mxfp4_dequantize,
                    ("scale_rule",), "E2M1, one E8M0 scale per 16 elements (SGLang FP4 KV)"),
}
ALIASES = {"fp4": "nvfp4", "bfloat16": "bf16", "e4m3": "fp8", "fp8_e4m3": "fp8"}

DEFAULTS = {"scale_rule": ScaleRule.RCEIL, "recipe": NvRecipe.RCP, "outer_scale": "1", "fp8_scale": Fp8Scale.UNIT,
            "ds_floor": False, "pow2": False}


@dataclass(frozen=True)
class Format:
    """One fully resolved cache format: a family and the values of the options that apply to it (others are None)."""

    family: str
    scale_rule: ScaleRule | None = None
    recipe: NvRecipe | None = None
    outer_scale: str | None = None  # nvfp4 decode-direction g_dec: "1", "auto" or a float's repr
    fp8_scale: Fp8Scale | None = None
    ds_floor: bool | None = None
    pow2: bool | None = None
    engine: str | None = None  # an engine recipe's name (kvtool.formats.recipes): its choices replace the options
    rotation: int | None = None  # Hadamard block before quantizing (kvtool.formats.rotation; 0 = whole dim)

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    @property
    def element(self) -> ElementCodec | None:
        return self.spec.element

    @property
    def block(self) -> int:
        return self.spec.block

    @property
    def scale_element(self) -> str:
        if self.fp8_scale is not None:  # the fp8 scale kind is an option; other families fix theirs
            return {Fp8Scale.UNIT: "none", Fp8Scale.TENSOR: "fp32-tensor", Fp8Scale.TOKEN: "fp32-row"}[self.fp8_scale]
        return self.spec.scale_element

    @property
    def unrotated(self) -> "Format":
        """The same format without its rotation (what a kernel reading the codes sees: the rotated domain)."""
        return dataclasses.replace(self, rotation=None) if self.rotation is not None else self

    @property
    def is_quantized(self) -> bool:
        """False when the payload is the values themselves (bf16): no element codec, no scales."""
        return self.spec.element is not None

    @property
    def has_local_scales(self) -> bool:
        """True when scales vary within a tensor (one per row or per block); False for a unit or whole-tensor scale,
        where every element of the tensor shares one scale (and for bf16)."""
        return SCALE_ELEMENT_BYTES[self.scale_element] > 0

    def same_codecs(self, other: "Format") -> bool:
        """Both formats' bytes are read with the same element and scale codecs at the same block (rule options may
        differ): with equal planes, their stored bytes compare directly."""
        return (self.element, self.scale_element, self.block) == (other.element, other.scale_element, other.block)

    @property
    def needs_tensor_amax(self) -> bool:
        """True when a scale depends on the whole tensor (streaming must take a first pass for the amax)."""
        return self.fp8_scale == Fp8Scale.TENSOR or self.outer_scale == "auto"

    @property
    def label(self) -> str:
        """Compact, parseable name: family plus every non-default option (`mxfp4-floor`, `nvfp4-div-auto`)."""
        parts = [self.family]
        if self.scale_rule is not None:
            parts.append(self.scale_rule.name.lower())
        if self.recipe is not None:
            parts.append(self.recipe.name.lower())
        if self.outer_scale not in (None, "1"):
            parts.append("auto" if self.outer_scale == "auto" else f"g{self.outer_scale}")
        if self.fp8_scale is not None:
            parts.append(self.fp8_scale.name.lower())
        if self.ds_floor:
            parts.append("ds")
        if self.pow2:
            parts.append("pow2")
        return "-".join(parts) + (f"@{self.engine}" if self.engine else "") + _rot.label_suffix(self.rotation)

    def payload_bytes(self, dim: int) -> int:
        return dim * self.spec.payload_bits // 8

    def scale_bytes(self, dim: int) -> int:
        """Scale bytes per row of `dim` elements (a per-tensor scale is amortised to 0)."""
        elem = self.scale_element
        if elem == "fp32-row":
            return 4
        return dim // self.block * SCALE_ELEMENT_BYTES[elem] if self.block else 0

    def bytes_per_token(self, dim: int = 128) -> int:
        """Bytes per token per head at head dim `dim` (SPEC section 2 table at dim 128)."""
        return self.payload_bytes(dim) + self.scale_bytes(dim)

    def check_dim(self, dim: int, name: str = "tensor") -> None:
        if self.block and dim % self.block:
            raise FormatError(f"{name}: last dimension {dim} is not divisible by the {self.family} block {self.block}")
        if self.rotation is not None:
            _rot.check_rotation(self.rotation, dim, name)
        if self.spec.payload_bits < 8 and dim % 2:
            raise FormatError(f"{name}: last dimension {dim} must be even to pack two FP4 codes per byte")

    def quantize(self, x: torch.Tensor, *, tensor_amax: torch.Tensor | None = None, name: str = "tensor",
                 check_finite: bool = True) -> "QTensor":
        """Quantize floating `x` [..., D] along its last dimension. `tensor_amax` supplies the whole-tensor amax when
        `x` is a chunk of a larger tensor (fp8 `tensor` scale, nvfp4 `auto` outer scale)."""
        if not x.is_floating_point():
            raise InputError(f"{name}: dtype {x.dtype} is not floating point")
        if x.dim() == 0:
            raise InputError(f"{name}: a scalar cannot be quantized along a last dimension")
        self.check_dim(x.shape[-1], name)
        if check_finite:
            require_finite(x, name)
        if self.rotation is not None:  # codes hold x R; dequantize undoes R
            x = _rot.rotate(x, self.rotation)
        if self.engine:
            payload, scales, outer = recipes.quantize(recipes.get_recipe(self.engine), self, x.float(), tensor_amax)
        else:
            payload, scales, outer = self.spec.quantize(self, x.float(), tensor_amax)
        return QTensor(self, payload, scales, outer, tuple(x.shape))

    def dequantize(self, q: "QTensor", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode `q` (planes [..., payload], [..., scales]) to values [..., D] in the floating `dtype` (computed in
        fp32, then cast). A non-floating dtype is a FormatError: decoded values are not integers."""
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise FormatError(f"dequantize needs a floating dtype (float32, bfloat16, float16), got {dtype}")
        if self.rotation is not None:
            return _rot.unrotate(self.unrotated.dequantize(q), self.rotation).to(dtype)
        if self.engine:
            out = recipes.dequantize(recipes.get_recipe(self.engine), self, q.payload, q.scales, q.outer_scale)
            return out.to(dtype)
        return self.spec.dequantize(self, q.payload, q.scales, q.outer_scale).to(dtype)

    def outer_scale_value(self, tensor_amax: torch.Tensor | None) -> float:
        """The nvfp4 outer scale a QTensor of this format stores for a tensor of amax `tensor_amax` (1 for other
        families): the SPEC's decode-direction g_dec, or an engine recipe's value in its own direction."""
        if not self.spec.has_outer_scale:
            return 1.0
        if self.engine:
            return recipes.outer_scales(recipes.get_recipe(self.engine), self, torch.zeros(1), tensor_amax)[0]
        return codecs.nvfp4_outer_scale(self, torch.zeros(1), tensor_amax)

    def require_kvtool_codec(self, what: str = "this kernel") -> None:
        """Raise FormatError when the format names an engine recipe: kernels implement the SPEC codecs only, so
        they refuse a recipe rather than write other bytes (the torch path runs every recipe)."""
        if self.engine:
            raise FormatError(f"{what} implements kvtool's SPEC codecs and cannot honour engine recipe "
                              f"{self.engine!r}; use the torch backend (--device cpu / backend torch)")

    def to_meta(self) -> dict:
        """Options as plain strings (for the cache file metadata and JSON reports)."""
        out = {"family": self.family, "label": self.label, "block": self.block, "scale_element": self.scale_element}
        for key in self.spec.options:
            value = getattr(self, key)
            out[key] = value.name.lower() if hasattr(value, "name") else value
        if self.engine:
            out["engine_recipe"] = self.engine
        out.update(_rot.to_meta(self.rotation))
        return out

    @classmethod
    def from_meta(cls, meta: dict) -> "Format":
        if meta.get("rotation") is not None:
            base = cls.from_meta({k: v for k, v in meta.items() if k != "rotation"})
            return dataclasses.replace(base, rotation=_rot.from_meta(meta))
        opts = {k: meta[k] for k in FAMILIES[_family(meta["family"])].options if k in meta}
        if meta.get("engine_recipe"):
            return get_format(meta["family"], engine=meta["engine_recipe"], strict=False,
                              **({"outer_scale": opts["outer_scale"]} if "outer_scale" in opts else {}))
        return get_format(meta["family"], **opts)


@dataclass
class QTensor:
    """A quantized cache tensor: `payload` [..., D * bits / 8] (uint8, or bf16 for bf16), `scales` (uint8 [..., D/block]
    for block formats, fp32 [..., 1] per row, an fp32 scalar per tensor, or None), `outer_scale` (nvfp4 g_dec, else 1)
    and the logical `shape` [..., D] of the original tensor."""

    fmt: Format
    payload: torch.Tensor
    scales: torch.Tensor | None
    outer_scale: float
    shape: tuple[int, ...]
    extra: dict = field(default_factory=dict)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The decoded values [..., D] in the floating `dtype` (`Format.dequantize`; int dtypes raise FormatError)."""
        return self.fmt.dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        n = self.payload.numel() * self.payload.element_size()
        return n + (self.scales.numel() * self.scales.element_size() if self.scales is not None else 0)

    def to(self, device) -> "QTensor":
        scales = self.scales.to(device) if self.scales is not None else None
        return dataclasses.replace(self, payload=self.payload.to(device), scales=scales)


def require_finite(x: torch.Tensor, name: str) -> None:
    """Raise InputError naming the tensor and the first non-finite index (SPEC: never guess a NaN code)."""
    if x.numel() == 0:
        return
    lo, hi = torch.aminmax(x.detach())
    # NaN propagates into aminmax and +-Inf shows at an end, so one cheap reduction answers "all finite?"; the
    # element-wise search for the first bad index runs only on failure.
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        flat = int(torch.nonzero(bad.reshape(-1))[0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape))
        value = float(x.reshape(-1)[flat])
        raise InputError(f"{name}: non-finite value {value} at index {list(index)}")


def _family(name: str) -> str:
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in FAMILIES:
        raise FormatError(f"unknown format {name!r} (choose {'|'.join(list(FAMILIES) + list(ALIASES)[:1])})")
    return key


def _outer_scale(value) -> str:
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        g = float(text)
    except ValueError:
        raise FormatError(f"unknown outer scale {value!r} (choose 1|auto|a positive number)") from None
    if not (math.isfinite(g) and g > 0):
        raise FormatError(f"outer scale must be a positive finite number, got {value!r}")
    return "1" if g == 1.0 else repr(g)


def get_format(name: str, *, scale_rule: "str | ScaleRule | None" = None, recipe: "str | NvRecipe | None" = None,
               outer_scale: "str | float | None" = None, fp8_scale: "str | Fp8Scale | None" = None,
               ds_floor: "bool | None" = None, pow2: "bool | None" = None, strict: bool = True,
               engine: "str | None" = None, rotation: "int | None" = None) -> Format:
    """Resolve a name or label plus explicit options into a Format. Options that do not apply to the family raise
    FormatError when `strict` (a user passing `--scale-rule` for nvfp4 made a mistake); otherwise they are ignored.
    Options (None = the family's default): `scale_rule` mxfp4 floor|even|ceil|rceil; `recipe` nvfp4 rcp|div|unrounded;
    `outer_scale` nvfp4 1|"auto"|a positive number (decode direction); `fp8_scale` unit|tensor|token; `ds_floor` /
    `pow2` the DeepSeek fp8 token options; strings or the rule enums of kvtool.formats.rules alike.
    `engine` (or a label suffix `@<recipe>`, e.g. `nvfp4@vllm.ref_nvfp4`) names an engine recipe
    (kvtool.formats.recipes), whose choices replace the family's rule options."""
    name, label_rotation = _rot.split_label(name)  # `+rot` / `+rotN` suffix, or `rotation` (kvtool.formats.rotation)
    if rotation is not None or label_rotation is not None:
        base = get_format(name, scale_rule=scale_rule, recipe=recipe, outer_scale=outer_scale, fp8_scale=fp8_scale,
                          ds_floor=ds_floor, pow2=pow2, strict=strict, engine=engine)
        return _rotated(base, label_rotation if rotation is None else rotation)
    name, _, at_engine = str(name).partition("@")
    if engine or at_engine:
        return _engine_format(name, engine or at_engine, outer_scale=outer_scale, strict=strict,
                              given=(scale_rule, recipe, fp8_scale, ds_floor, pow2))
    family_name, _, rest = str(name).strip().partition("-")
    family = _family(family_name)
    given = {"scale_rule": scale_rule, "recipe": recipe, "outer_scale": outer_scale, "fp8_scale": fp8_scale,
             "ds_floor": ds_floor, "pow2": pow2}
    labelled: dict = {}
    for token in filter(None, rest.lower().split("-")):
        for key, value in _label_token(family, token).items():
            _check_label_option(name, key, key in labelled, given[key], value)
            labelled[key] = value
    given.update(labelled)
    applicable = FAMILIES[family].options
    opts = {}
    for key, value in given.items():
        if key not in applicable:
            if value not in (None, False) and strict:
                raise FormatError(f"option {key.replace('_', '-')} does not apply to {family}")
            continue
        opts[key] = DEFAULTS[key] if value is None else value
    if "scale_rule" in opts:
        opts["scale_rule"] = parse_enum(ScaleRule, opts["scale_rule"], "scale rule")
    if "recipe" in opts:
        opts["recipe"] = parse_enum(NvRecipe, opts["recipe"], "nvfp4 recipe")
    if "outer_scale" in opts:
        opts["outer_scale"] = _outer_scale(opts["outer_scale"])
    if "fp8_scale" in opts:
        opts["fp8_scale"] = parse_enum(Fp8Scale, opts["fp8_scale"], "fp8 scale")
        if (opts["ds_floor"] or opts["pow2"]) and opts["fp8_scale"] != Fp8Scale.TOKEN:
            if given["fp8_scale"] is None:
                opts["fp8_scale"] = Fp8Scale.TOKEN  # the DeepSeek options imply per-token scales
            else:
                raise FormatError("the DeepSeek floor / pow2 options need --fp8-scale token")
        opts["ds_floor"], opts["pow2"] = bool(opts["ds_floor"]), bool(opts["pow2"])
    return Format(family, **opts)


def _rotated(base: Format, rotation: int) -> Format:
    """`base` with a Hadamard rotation. Whole-tensor scales are refused: their amax is taken before the rotation
    (streaming passes, the paged cache's frozen amax), so rotated values could clip."""
    if base.needs_tensor_amax:
        raise FormatError(f"rotation ({_rot.label_suffix(rotation)}) does not combine with a whole-tensor scale "
                          f"({base.label}); use a per-token / per-block scale")
    return dataclasses.replace(base, rotation=rotation)


def _engine_format(name: str, engine: str, *, outer_scale, strict: bool, given: tuple) -> Format:
    """The Format of an engine recipe: its family, the family's option fields fixed to what the recipe implies, and
    an outer scale where the recipe takes one. `name` must be empty or the recipe's family (`nvfp4@vllm.ref_nvfp4`)."""
    rec = recipes.get_recipe(engine)
    family, _, rest = str(name).strip().partition("-")
    if family and _family(family) != rec.family:
        raise FormatError(f"engine recipe {rec.name} writes {rec.family}, not {_family(family)}")
    for token in filter(None, rest.lower().split("-")):  # a label's own tokens: only its outer scale is free
        opt = _label_token(rec.family, token)
        if "outer_scale" in opt:
            outer_scale = opt["outer_scale"] if outer_scale is None else outer_scale
        elif rec.family != "fp8" or token not in ("token", "ds", "pow2", "unit"):
            given += (token,)
    if strict and any(v not in (None, False) for v in given):
        raise FormatError(f"engine recipe {rec.name} fixes every rule option; give only the family "
                          f"({rec.family}) and, for NVFP4 recipes, --outer-scale")
    if outer_scale not in (None, "1", 1, 1.0) and rec.outer == recipes.OuterDir.NONE:
        raise FormatError(f"engine recipe {rec.name} takes no outer scale")
    opts = {"nvfp4": lambda: {"outer_scale": _outer_scale(outer_scale if outer_scale is not None else "1")},
            "fp8": lambda: ({"fp8_scale": Fp8Scale.TOKEN, "ds_floor": True, "pow2": rec.pow2 != recipes.Pow2.NONE}
                            if rec.row_scale else {"fp8_scale": Fp8Scale.UNIT, "ds_floor": False, "pow2": False})}
    return Format(rec.family, **opts.get(rec.family, dict)(), engine=rec.name)


_OPTION_ENUMS = {"scale_rule": (ScaleRule, "scale rule"), "recipe": (NvRecipe, "nvfp4 recipe"),
                 "fp8_scale": (Fp8Scale, "fp8 scale")}


def _option_text(key: str, value) -> str:
    if key in _OPTION_ENUMS:
        return parse_enum(*_OPTION_ENUMS[key][:1], value, _OPTION_ENUMS[key][1]).name.lower()
    return _outer_scale(value) if key == "outer_scale" else str(bool(value)).lower()


def _check_label_option(label: str, key: str, repeated: bool, flag, value) -> None:
    """A label may set an option once (`mxfp4-floor-floor` is a typo, not a rule), and an explicit option (a flag)
    may repeat what the label says but never contradict it (`mxfp4-floor` with --scale-rule rceil): kvtool does not
    pick a winner silently."""
    option = key.replace("_", "-")
    if repeated:
        raise FormatError(f"format label {label!r} sets {option} twice")
    if flag not in (None, False) and _option_text(key, flag) != _option_text(key, value):
        raise FormatError(f"format label {label!r} says {option} {_option_text(key, value)}, but the {option} option "
                          f"says {_option_text(key, flag)}: give one of them")


def _label_token(family: str, token: str) -> dict:
    """One dash-separated label token -> the option it sets."""
    for key, enum_cls in (("scale_rule", ScaleRule), ("recipe", NvRecipe), ("fp8_scale", Fp8Scale)):
        if key in FAMILIES[family].options and token.upper() in enum_cls.__members__:
            return {key: enum_cls[token.upper()]}
    options = FAMILIES[family].options
    if "outer_scale" in options and token == "auto":
        return {"outer_scale": "auto"}
    if "outer_scale" in options and token.startswith("g"):
        return {"outer_scale": token[1:]}
    if "ds_floor" in options and token == "ds":
        return {"ds_floor": True}
    if "pow2" in options and token == "pow2":
        return {"pow2": True}
    raise FormatError(f"unknown option {token!r} in a {family} format label")


def all_formats() -> list[Format]:
    """Every family with every rule / recipe / scale option (outer scales 1 and auto): for sweeps in tests and tables."""
    out = [get_format("bf16")]
    out += [get_format("fp8", fp8_scale=s) for s in Fp8Scale]
    out += [get_format("fp8", fp8_scale="token", ds_floor=True, pow2=p) for p in (False, True)]
    out += [get_format("nvfp4", recipe=r, outer_scale=g) for r in NvRecipe for g in ("1", "auto")]
    out += [get_format("mxfp4", scale_rule=r) for r in ScaleRule]
    return out


def rule_variants(fmt: Format) -> list[Format]:
    """The SPEC formats (`all_formats`) that store `fmt`'s planes under other rule options: same family and scale
    element, `fmt` itself left out (every other MXFP4 scale rule; every NVFP4 recipe and outer scale; the fp8 token
    floor / pow2 variants). What a writer with another rule or recipe would have made of the same values."""
    return [v for v in all_formats() if v.family == fmt.family and v.scale_element == fmt.scale_element and v != fmt]


def engine_formats() -> list[Format]:
    """Every engine recipe as a Format (with outer scales 1 and auto where the recipe takes one), after the SPEC
    variants in diagnoses: which writer's bytes a file holds."""
    out = []
    for name, rec in recipes.RECIPES.items():
        outers = (None, "auto") if rec.outer != recipes.OuterDir.NONE else (None,)
        out += [get_format(f"@{name}", outer_scale=g) for g in outers]
    return out


# ------------------------------------------------------------------------------------------------- the listing
@dataclass(frozen=True)
class RecipesReport:
    """`kvtool recipes`: every engine recipe as engine, version, function, format label and its choices."""

    recipes: list


def list_recipes(engine: str | None = None) -> RecipesReport:
    """The recipe registry as a report, optionally only the recipes whose name or engine contains `engine`."""
    rows = []
    for rec in recipes.RECIPES.values():
        if engine and engine.lower() not in f"{rec.name} {rec.engine}".lower():
            continue
        rows.append({**rec.to_dict(), "label": get_format(f"@{rec.name}").label})
    if engine and not rows:
        raise FormatError(f"no engine recipe matches {engine!r} (choose from {', '.join(recipes.RECIPES)})")
    return RecipesReport(rows)
