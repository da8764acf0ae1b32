"""Workflows behind `kvtool convert` and `kvtool layouts`: each returns a plain report dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtool.errors import InputError, KvtoolError, OutputError
from kvtool.formats import Format, get_format
from kvtool.layouts.engine import make_geometry, parse_geometry
from kvtool.layouts.files import read_layout_all, write_layout
from kvtool.layouts.plausible import check_plausible
from kvtool.layouts.presets import PRESETS, RULES, LayoutPreset, Region, get_preset
from kvtool.readers import check_outer, qtensor_entry, select

__all__ = [
    "ConvertItem", "ConvertReport", "LayoutsReport", "PresetRow", "convert_layout", "list_layouts",
    "region_byte_map",
]

_SYMBOL = {"head": "H", "token": "P"}


def region_byte_map(region: Region, fmt: Format, dim: int) -> str:
    """One region's bytes per page, e.g. "H x ([x payload P x 64 B][x scale P x 4 B])" or
    "[k payload H x P x 64 B][k scale H x P x 8 B]..." (axes outside the planes multiply the bracket)."""
    pos = region.order.index("plane")
    outer = [_SYMBOL[a] for a in region.order[1:pos]]
    inner = [_SYMBOL[a] for a in region.order[pos + 1:]]
    parts = []
    for plane in region.planes:
        nb = fmt.payload_bytes(dim) if plane.part == "payload" else fmt.scale_bytes(dim)
        if nb == 0:
            continue
        rule = "" if plane.rule == "linear" else f", {plane.rule}"
        parts.append(f"[{plane.tensor} {plane.part} {' x '.join(inner + [f'{nb} B'])}{rule}]")
    if not parts:
        return ""
    body = "".join(parts)
    return f"{' x '.join(outer)} x ({body})" if outer else body


@dataclass
class PresetRow:
    name: str
    families: list[str]
    tensors: list[str]
    page_size: int
    page_fixed: bool
    format: str  # the format the byte map below is drawn for
    byte_map: dict  # region name -> bytes per page
    page_bytes: int  # all regions, one page, at `heads` and `dim`
    rules: dict  # rule name -> formula, for the rules this preset uses
    source: str
    note: str


@dataclass
class LayoutsReport:
    dim: int
    heads: int
    presets: list[PresetRow] = field(default_factory=list)


def _example_format(preset: LayoutPreset, label: "str | None") -> Format:
    if label is not None:
        fmt = get_format(label)
        if fmt.family in preset.families:
            return fmt
    return get_format(preset.default_format or ("mxfp4" if "mxfp4" in preset.families else preset.families[0]))


def list_layouts(dim: int = 128, heads: int = 1, fmt_label: "str | None" = None) -> LayoutsReport:
    """Every preset with its byte map per page at head dim `dim` (drawn for `fmt_label` where the preset holds it,
    else its default format) and its page bytes at `heads` heads."""
    report = LayoutsReport(dim, heads)
    for preset in PRESETS.values():
        fmt = _example_format(preset, fmt_label)
        geo = make_geometry(preset, fmt, None, heads, dim, preset.page_size)
        maps = {r.name: region_byte_map(r, fmt, dim) for r in preset.regions}
        used = {p.rule for r in preset.regions for p in r.planes if p.rule != "linear"}
        report.presets.append(PresetRow(
            preset.name, list(preset.families), list(preset.tensors), preset.page_size, preset.page_fixed, fmt.label,
            {k: v for k, v in maps.items() if v}, sum(geo.region_page_bytes(r) for r in preset.regions),
            {u: RULES[u].formula for u in sorted(used)}, preset.source, preset.note))
    return report


@dataclass
class ConvertItem:
    """One logical tensor converted: its name, logical shape, format and geometry on each side."""

    name: str
    shape: list[int]
    format: str
    geometry_in: dict
    geometry_out: dict


@dataclass
class ConvertReport:
    input: str
    output: str
    from_layout: str
    to_layout: str
    format: str  # the tensors' format label (labels joined with ',' when they differ)
    geometry_in: dict  # of the first tensor (every tensor's: items)
    geometry_out: dict
    tensors: list[str]
    input_bytes: int  # tensor data bytes in the input file
    output_bytes: int
    warnings: list[str]
    items: list[ConvertItem] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # plain (passthrough) tensors of a kvtool file: not caches
    notes: list[str] = field(default_factory=list)


def convert_layout(src: Path, dst: Path, from_layout: str, to_layout: str, geometry: "str | None" = None,
                   to_geometry: "str | None" = None, include: "list[str] | None" = None,
                   exclude: "list[str] | None" = None) -> ConvertReport:
    """Read `src` in `from_layout` (geometry from `geometry`, the file, or the preset; a kvtool cache file read as
    `planes` brings each tensor's own format, shape and scales) and write the same quantized bytes of every selected
    tensor (`include` / `exclude`: fnmatch globs on the names read) to `dst` in `to_layout` (page size from
    `to_geometry`, else the target preset's default). The format is unchanged. A raw output holds one cache (select
    one with `include`); a `.safetensors` / `.pt` output holds each cache's engine buffers as PREFIX.BUFFER, each with
    its own geometry. Plain passthrough tensors are skipped with a note. Plausibility warnings on what was read are
    part of the report; codes that decode to NaN / Inf are an error (kvtool.readers.check_codes), and a kvtool cache
    file read as planes is verified against its checksums."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise OutputError(f"output {dst} is the input file")
    target = get_preset(to_layout)
    out_geo = parse_geometry(to_geometry)
    page = out_geo.pop("page", None)
    if out_geo:
        raise OutputError(f"--to-geometry sets only page= (format, heads, dim and tokens come from the input), "
                          f"got {', '.join(out_geo)}")
    read = read_layout_all(src, from_layout, geometry, keep=lambda name: bool(select([name], include, exclude)))
    plain, names = list(read.skipped), list(read.tensors)
    if not names:
        if plain:
            raise InputError(f"{src.name}: {', '.join(plain)}: plain tensor(s) (passthrough, not quantized): nothing "
                             "to convert (kvtool quantize them first)")
        try:
            every = ", ".join(list(read_layout_all(src, from_layout, geometry).tensors)[:8])
        except KvtoolError as err:
            every = f"unreadable as a whole: {err}"
        raise InputError(f"{src.name}: no tensor matches --include/--exclude (it holds: {every})")
    tensors = {n: read.tensors[n] for n in names}
    for n, q in tensors.items():  # NaN / Inf codes and bad outer scales are refused before anything is written
        entry = qtensor_entry(n, q)
        entry.path = str(src)
        check_outer(entry)
        entry.read_q(0, entry.rows)
    written = write_layout(tensors, dst, target, None if page is None else f"page={page}")
    items = [ConvertItem(n, [int(s) for s in q.shape], q.fmt.label, read.geometries[n].as_dict(),
                         written[n].as_dict()) for n, q in tensors.items()]
    labels = sorted({q.fmt.label for q in tensors.values()})
    return ConvertReport(
        str(src), str(dst), read.layout, target.name, ",".join(labels), items[0].geometry_in, items[0].geometry_out,
        sorted(tensors), read.nbytes, dst.stat().st_size, check_plausible(tensors), items, plain,
        [f"{n}: a plain tensor (passthrough, not a quantized cache): skipped" for n in plain]
        + ([read.assumed] if read.assumed else []))
