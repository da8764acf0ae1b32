"""The one generic engine: QTensor planes <-> the bytes of a preset's regions, for a given geometry.

Canonical plane: uint8 [pages, H, P, nbytes] (tokens past the last one are zero padding of the partial last page).
A region's bytes are its planes nested in the region's axis order (see kvtool.layouts.presets); planes with a byte rule
are permuted inside each (page, head) block first. Reading is the exact inverse, so every preset round-trips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvtool.errors import FormatError, LayoutError
from kvtool.formats import Format, QTensor, get_format
from kvtool.formats.kernel_desc import kernel_desc, qtensor_of_bytes
from kvtool.layouts.presets import PAYLOAD, RULES, SCALE, LayoutPreset, Region

__all__ = [
    "GEOMETRY_KEYS", "Geometry", "build_qtensor", "decode", "encode", "from_canonical", "make_geometry",
    "parse_geometry", "qtensor_scalars", "region_from_bytes", "region_to_bytes", "resolve_format", "to_canonical"
]

GEOMETRY_KEYS = ("format", "page", "heads", "dim", "tokens", "tensor_scale", "outer", "recipe_of")
_INT_KEYS = ("page", "heads", "dim", "tokens")
_FLOAT_KEYS = ("tensor_scale", "outer")
_AXIS = {"page": 0, "head": 1, "token": 2}


@dataclass(frozen=True)
class Geometry:
    """What the bytes cannot say: format, page size P, heads H, head dim D, number of tokens N. Scalars that live
    outside engine buffers are per logical tensor in `scalars` ({name: {'tensor_scale': s, 'outer': g}}): the fp8
    `tensor` scale and the nvfp4 decode-direction outer scale g_dec."""

    fmt: Format
    page: int
    heads: int
    dim: int
    tokens: int
    scalars: dict = field(default_factory=dict, compare=False)

    @property
    def pages(self) -> int:
        return math.ceil(self.tokens / self.page) if self.tokens else 0

    def plane_bytes(self, part: str) -> int:
        """Bytes per token and head of a plane (0: the format has no such plane)."""
        return self.fmt.payload_bytes(self.dim) if part == PAYLOAD else self.fmt.scale_bytes(self.dim)

    def region_page_bytes(self, region: Region) -> int:
        return self.heads * self.page * sum(self.plane_bytes(p.part) for p in region.planes)

    def region_bytes(self, region: Region) -> int:
        return self.pages * self.region_page_bytes(region)

    def text(self) -> str:
        """The `--geometry` string that reproduces this geometry (format, page, heads, dim, tokens)."""
        return f"format={self.fmt.label},page={self.page},heads={self.heads},dim={self.dim},tokens={self.tokens}"

    def as_dict(self) -> dict:
        return {"format": self.fmt.label, "page": self.page, "heads": self.heads, "dim": self.dim,
                "tokens": self.tokens, "pages": self.pages}


def parse_geometry(text: "str | dict | None") -> dict:
    """Parse "KEY=VAL[,KEY=VAL...]" (keys: format, page, heads, dim, tokens, tensor_scale, outer, recipe_of (an engine
    recipe, folded into the format label as FORMAT@RECIPE); the two scalars
    also per logical tensor as tensor_scale.k=, outer.v=) into typed values. Raises LayoutError on an unknown key, a
    repeated key or a bad number."""
    out: dict = {}
    if isinstance(text, dict):  # an already split {key: value} mapping is accepted too
        text = ",".join(f"{key}={value}" for key, value in text.items())
    if text is None or not str(text).strip():
        return out
    for item in str(text).split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower().replace("-", "_"), value.strip()
        base, _, tensor = key.partition(".")  # tensor_scale.k / outer.v: a scalar for one logical tensor
        if not sep or not value:
            raise LayoutError(f"geometry item {item.strip()!r} is not KEY=VALUE (keys: {', '.join(GEOMETRY_KEYS)})")
        if base not in GEOMETRY_KEYS or (tensor and base not in _FLOAT_KEYS):
            raise LayoutError(f"unknown geometry key {key!r} (keys: {', '.join(GEOMETRY_KEYS)})")
        if key in out:
            raise LayoutError(f"geometry key {key!r} given twice")
        try:
            out[key] = int(value) if base in _INT_KEYS else float(value) if base in _FLOAT_KEYS else value
        except ValueError:
            raise LayoutError(f"geometry {key}={value!r} is not a number") from None
        if key in _INT_KEYS and (out[key] < 1 or (key != "tokens" and out[key] > 1 << 20)):
            raise LayoutError(f"geometry {key}={value} is out of range")
        if base in _FLOAT_KEYS and not (math.isfinite(out[key]) and out[key] > 0):
            raise LayoutError(f"geometry {key}={value} must be a positive finite number")
    if "recipe_of" in out:  # an engine recipe is part of the format label: FAMILY@RECIPE (or @RECIPE alone)
        out["format"] = f"{out.get('format', '').partition('@')[0]}@{out.pop('recipe_of')}"
    return out


def resolve_format(preset: LayoutPreset, label: "str | None") -> Format:
    """The format a preset holds: `label` (from geometry or file) or the preset's default; LayoutError if the preset
    cannot hold that family or no format is known."""
    label = label or preset.default_format
    if label is None:
        raise LayoutError(f"{preset.name}: no format given (add format=LABEL to --geometry, e.g. format=mxfp4)")
    fmt = get_format(label)
    if fmt.family not in preset.families:
        raise LayoutError(f"{preset.name} holds {'/'.join(preset.families)}, not {fmt.label}")
    held = {(p.tensor, p.part) for r in preset.regions for p in r.planes}
    if fmt.scale_bytes(fmt.block or 32) and any((t, SCALE) not in held for t in preset.tensors):
        raise LayoutError(f"{preset.name} has no place for the per-token scales of {fmt.label}")
    return fmt


def make_geometry(preset: LayoutPreset, fmt: Format, page: "int | None", heads: int, dim: int, tokens: int,
                  scalars: "dict | None" = None) -> Geometry:
    """A checked Geometry: page defaults to the preset's (and must equal it when the page is fixed); D must fit the
    format's block; every plane's byte rule must apply at this P and plane width."""
    page = page or preset.page_size
    if preset.page_fixed and page != preset.page_size:
        raise LayoutError(f"{preset.name} has a fixed page size of {preset.page_size}, got page={page}")
    try:
        fmt.check_dim(dim, f"{preset.name} head dim")
    except FormatError as err:
        raise LayoutError(str(err)) from None
    geo = Geometry(fmt, page, heads, dim, tokens, dict(scalars or {}))
    for region in preset.regions:
        for plane in region.planes:
            nb = geo.plane_bytes(plane.part)
            problem = RULES[plane.rule].check(page, nb) if nb else None
            if problem:
                raise LayoutError(f"{preset.name} {plane.tensor} {plane.part}: {problem} (page={page}, {nb} B)")
    return geo


# ------------------------------------------------------------------------------------------- QTensor <-> planes
def _rows(q: QTensor, part: str, geo: Geometry) -> "torch.Tensor | None":
    """The plane's bytes per (token, head): uint8 [N, H, nbytes], or None when the format has no such plane."""
    if part == PAYLOAD:
        t = q.payload
    else:
        if geo.plane_bytes(SCALE) == 0:
            return None
        t = q.scales
    t = t.detach().cpu().contiguous().view(torch.uint8)
    return t.reshape(geo.tokens, geo.heads, geo.plane_bytes(part))


def to_canonical(rows: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """[N, H, nb] -> zero-padded [pages, H, P, nb]."""
    n, h, nb = rows.shape
    padded = torch.zeros(geo.pages * geo.page, h, nb, dtype=torch.uint8)
    padded[:n] = rows
    return padded.reshape(geo.pages, geo.page, h, nb).permute(0, 2, 1, 3).contiguous()


def from_canonical(canon: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """[pages, H, P, nb] -> [N, H, nb] (padding dropped)."""
    pages, h, p, nb = canon.shape
    return canon.permute(0, 2, 1, 3).reshape(pages * p, h, nb)[: geo.tokens].contiguous()


def qtensor_scalars(q: QTensor) -> dict:
    """The scalars a cache buffer does not hold: fp8 `tensor` scale value, nvfp4 outer scale g_dec."""
    out = {}
    if q.fmt.scale_element == "fp32-tensor" and q.scales is not None:
        out["tensor_scale"] = float(q.scales.reshape(-1)[0])
    if kernel_desc(q.fmt).outer_scale:
        out["outer"] = float(q.outer_scale)
    return out


def build_qtensor(name: str, rows: dict, geo: Geometry) -> QTensor:
    """A QTensor of logical shape [N, H, D] from plane rows {part: uint8 [N, H, nb]} and the geometry's scalars
    (the bytes -> QTensor step is `kernel_desc.qtensor_of_bytes`, shared with the paged cache and the kernels)."""
    fmt, scalars = geo.fmt, geo.scalars.get(name, {})
    tensor_scale = None
    if fmt.scale_element == "fp32-tensor":
        if "tensor_scale" not in scalars:
            raise LayoutError(f"{name}: {fmt.label} needs its fp32 tensor scale (add tensor_scale=VALUE to --geometry)")
        tensor_scale = torch.tensor(scalars["tensor_scale"], dtype=torch.float32)
    outer = 1.0
    if kernel_desc(fmt).outer_scale:
        if "outer" in scalars:
            outer = float(scalars["outer"])
        elif fmt.outer_scale == "auto":
            raise LayoutError(f"{name}: {fmt.label} needs its outer scale g_dec (add outer=VALUE to --geometry)")
        else:
            outer = float(torch.tensor(float(fmt.outer_scale), dtype=torch.float32))
    shape = (geo.tokens, geo.heads, geo.dim)
    return qtensor_of_bytes(fmt, rows[PAYLOAD], rows.get(SCALE), shape, lead=shape[:2], tensor_scale=tensor_scale,
                            outer_scale=outer)


# ------------------------------------------------------------------------------------------ planes <-> region bytes
def _split_axes(region: Region) -> tuple[list[str], list[str]]:
    pos = region.order.index("plane")
    return list(region.order[:pos]), list(region.order[pos + 1:])


def region_to_bytes(region: Region, canon: dict, geo: Geometry) -> torch.Tensor:
    """Lay out the region's planes (canon {(tensor, part): [pages, H, P, nb]}) as uint8 [region_bytes]."""
    outer, inner = _split_axes(region)
    perm = [_AXIS[a] for a in outer] + [_AXIS[a] for a in inner] + [3]
    n_outer = math.prod({"page": geo.pages, "head": geo.heads, "token": geo.page}[a] for a in outer)
    rows = []
    for plane in region.planes:
        if geo.plane_bytes(plane.part) == 0:
            continue
        block = RULES[plane.rule].forward(canon[(plane.tensor, plane.part)])
        rows.append(block.permute(perm).reshape(n_outer, -1))
    if not rows:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(rows, dim=1).reshape(-1)


def region_from_bytes(region: Region, buf: torch.Tensor, geo: Geometry) -> dict:
    """Inverse of region_to_bytes: uint8 [region_bytes] -> {(tensor, part): [pages, H, P, nb]}."""
    outer, inner = _split_axes(region)
    sizes = {"page": geo.pages, "head": geo.heads, "token": geo.page}
    perm = [_AXIS[a] for a in outer] + [_AXIS[a] for a in inner] + [3]
    inv = [perm.index(i) for i in range(4)]
    planes = [p for p in region.planes if geo.plane_bytes(p.part)]
    widths = [math.prod(sizes[a] for a in inner) * geo.plane_bytes(p.part) for p in planes]
    out = {}
    if not planes:
        return out
    view = buf.reshape(math.prod(sizes[a] for a in outer), sum(widths))
    for plane, chunk in zip(planes, view.split(widths, dim=1)):
        shaped = chunk.reshape(*[sizes[a] for a in outer], *[sizes[a] for a in inner], geo.plane_bytes(plane.part))
        block = shaped.permute(inv).contiguous()
        out[(plane.tensor, plane.part)] = RULES[plane.rule].inverse(block).contiguous()
    return out


def encode(preset: LayoutPreset, tensors: dict, geo: Geometry) -> dict:
    """{logical name: QTensor [N, H, D]} -> {region name: uint8 bytes} (regions with no bytes in this format left
    out), in the preset's region order."""
    canon = {}
    for name in preset.tensors:
        for part in (PAYLOAD, SCALE):
            rows = _rows(tensors[name], part, geo)
            if rows is not None:
                canon[(name, part)] = to_canonical(rows, geo)
    out = {}
    for region in preset.regions:
        if geo.region_page_bytes(region):
            out[region.name] = region_to_bytes(region, canon, geo)
    return out


def decode(preset: LayoutPreset, regions: dict, geo: Geometry) -> dict:
    """{region name: uint8 bytes} -> {logical name: QTensor [N, H, D]} (inverse of encode)."""
    canon = {}
    for region in preset.regions:
        if geo.region_page_bytes(region):
            canon.update(region_from_bytes(region, regions[region.name], geo))
    out = {}
    for name in preset.tensors:
        rows = {part: from_canonical(canon[(name, part)], geo) for part in (PAYLOAD, SCALE) if (name, part) in canon}
        out[name] = build_qtensor(name, rows, geo)
    return out
