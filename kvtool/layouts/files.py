"""Engine dumps on disk: `read_layout` / `write_layout` for raw `.bin`, `.pt` and `.safetensors` files.

- `.bin`: the preset's regions concatenated in preset order, nothing else. kvtool writes a sidecar `<file>.json`
  ({"layout", "geometry", "scalars", "prefix"}) next to it so that kvtool can read its own output without `--geometry`
  (and under the tensor's name); an engine's dump has none, and `--geometry` says what the bytes cannot.
- `.safetensors` / `.pt`: one tensor per region, named `<region>` or `<prefix>.<region>` (any dtype and shape: only
  the bytes count; several prefixes = several caches, e.g. one per layer, each with its own geometry). For
  single-region presets a tensor whose name does not end in the region name is that region, its whole name being the
  prefix. A `.pt` may also hold one bare tensor (read like a `.bin`). kvtool writes its metadata into the safetensors
  header / a `kvtool.meta` entry ({"layout", "geometry", "geometries": {prefix: geometry}, "scalars"}).
- `planes` is kvtool's own layout: a `.safetensors` in `planes` is a kvtool cache file (schema 2, see
  kvtool.container; its checksums are verified when it is read). Reading one takes every tensor's format, shape and
  scales from the file's own metadata (its passthrough plain tensors are not caches: they are listed as skipped);
  writing one writes a kvtool cache file that every kvtool command reads without `--layout`.
Returned keys: `k` / `v` (paired presets) or `x`, prefixed as `<prefix>.k` or just `<prefix>` (single-tensor presets).

A dump's bytes do not say its head count or head dim: without kvtool's metadata, `--geometry` must name them unless
exactly one (heads, dim) of HEAD_CHOICES x DIM_CHOICES fits the byte count; then that one is used and
`LayoutRead.assumed` says so (commands print it on stderr). Several fits are an error listing them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kvtool.container import (
    META_SCHEMA,
    CacheEntry,
    ChecksumError,
    SafetensorsWriter,
    create_temp,
    dtype_name,
    hash_stored,
    kvtool_metadata,
    parse_dtype,
    parse_kvtool,
    placeholder_checksum,
    plane_specs,
    read_header,
    read_rows,
    write_metadata,
)
from kvtool.errors import FileFormatError, KvtoolError, LayoutError, OutputError
from kvtool.formats import QTensor, get_format
from kvtool.layouts.engine import (
    Geometry,
    decode,
    encode,
    make_geometry,
    parse_geometry,
    qtensor_scalars,
    resolve_format,
)
from kvtool.layouts.presets import LayoutPreset, get_preset

__all__ = [
    "DIM_CHOICES", "Dump", "HEAD_CHOICES", "LayoutRead", "META_KEY", "PAGE_CHOICES", "encode_for_write",
    "load_dump", "plan_write", "read_layout", "read_layout_all", "read_layout_info", "write_layout",
]

META_KEY = "kvtool.meta"  # safetensors metadata key / .pt dict entry holding {"layout", "geometry", "scalars"}
PAGE_CHOICES = (1, 16, 32, 64, 128, 256)
HEAD_CHOICES = (1, 2, 4, 8, 16, 32, 64)
DIM_CHOICES = (64, 128, 256, 512)


@dataclass
class Dump:
    """A loaded file: `raw` (one uint8 byte stream) or `named` ({tensor name: uint8 bytes}); `meta` from kvtool."""

    path: Path
    raw: "torch.Tensor | None" = None
    named: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    kvtool: bool = False  # a kvtool cache file (schema 1): read through kvtool.container, not as buffers

    @property
    def nbytes(self) -> int:
        return int(self.raw.numel()) if self.raw is not None else sum(int(t.numel()) for t in self.named.values())


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _flatten(obj, prefix: str, out: dict, meta: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix or "tensor"] = _as_bytes(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if key == META_KEY and isinstance(value, str):
                meta.update(json.loads(value))
            else:
                _flatten(value, f"{prefix}.{key}" if prefix else str(key), out, meta)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}.{i}" if prefix else str(i), out, meta)
    else:
        raise FileFormatError(f"{prefix or 'file'}: a .pt entry of type {type(obj).__name__} is not a tensor")


def load_dump(path: "str | Path") -> Dump:
    """Read a dump's bytes (and kvtool metadata, if any) without interpreting them."""
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: no such file")
    suffix = path.suffix.lower()
    dump = Dump(path)
    try:
        if suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                dump.kvtool = META_SCHEMA in header
                if not dump.kvtool:
                    dump.named = {name: _as_bytes(f.get_tensor(name)) for name in f.keys()}
            if META_KEY in header:
                dump.meta = json.loads(header[META_KEY])
        elif suffix == ".pt":
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
            if isinstance(obj, torch.Tensor):
                dump.raw = _as_bytes(obj)
            else:
                _flatten(obj, "", dump.named, dump.meta)
        else:
            dump.raw = torch.from_numpy(np.fromfile(str(path), dtype=np.uint8))
            sidecar = Path(str(path) + ".json")
            if sidecar.is_file():
                dump.meta = json.loads(sidecar.read_text())
    except KvtoolError:
        raise
    except Exception as err:  # noqa: BLE001 - any parser failure is a bad file, said in one line
        raise FileFormatError(f"{path}: cannot read as {suffix or 'raw bytes'}: {type(err).__name__}: {err}") from None
    return dump


# ------------------------------------------------------------------------------------------------- names <-> regions
def _match_region(preset: LayoutPreset, name: str) -> tuple[str, str]:
    """(region name, prefix) of a tensor name in a dump."""
    for region in preset.regions:
        if name == region.name:
            return region.name, ""
        if name.endswith("." + region.name):
            return region.name, name[: -len(region.name) - 1]
    if len(preset.regions) == 1:
        return preset.regions[0].name, name
    raise LayoutError(f"tensor {name!r} is none of {preset.name}'s buffers "
                      f"({'|'.join(r.name for r in preset.regions)}, optionally as PREFIX.NAME)")


def _key(preset: LayoutPreset, prefix: str, logical: str) -> str:
    if preset.paired:
        return f"{prefix}.{logical}" if prefix else logical
    return prefix or logical


def _split_key(preset: LayoutPreset, key: str) -> tuple[str, str]:
    """(prefix, logical) of an input tensor name for write_layout."""
    if not preset.paired:
        return ("" if key == preset.tensors[0] else key), preset.tensors[0]
    for logical in preset.tensors:
        if key == logical:
            return "", logical
        if key.endswith("." + logical):
            return key[: -len(logical) - 1], logical
    raise LayoutError(f"{preset.name} pairs {'/'.join(preset.tensors)}: name tensors "
                      f"{' and '.join(preset.tensors)} or PREFIX.{preset.tensors[0]} and PREFIX.{preset.tensors[1]}, "
                      f"got {key!r} (leave it out: --exclude '{key}')")


# ------------------------------------------------------------------------------------------------ geometry + sizes
def _candidates(preset: LayoutPreset, given: dict):
    """Geometries one change away from `given` (raw keys): what the size hint tries."""
    labels = [get_format(f).label for f in preset.families] + (["fp8-token"] if "fp8" in preset.families else [])
    pages = (preset.page_size,) if preset.page_fixed else PAGE_CHOICES
    for key, values in (("heads", HEAD_CHOICES), ("dim", DIM_CHOICES), ("page", pages), ("format", labels)):
        for value in values:
            if given.get(key) != value:
                yield key, value, {**given, key: value}


def _geometry(preset: LayoutPreset, given: dict, tokens: int) -> Geometry:
    fmt = resolve_format(preset, given.get("format"))
    return make_geometry(preset, fmt, given.get("page"), given.get("heads", 1), given.get("dim", 128), tokens)


def _fit(preset: LayoutPreset, given: dict, sizes: list[int]) -> "Geometry | None":
    """The geometry `given` implies for region byte counts `sizes` (one per non-empty region, or one total for a
    raw stream), with tokens inferred as whole pages when not given; None when the sizes do not fit."""
    geo = _geometry(preset, given, given.get("tokens", 0))
    per_page = [geo.region_page_bytes(r) for r in preset.regions if geo.region_page_bytes(r)]
    if len(sizes) == 1 and len(per_page) > 1:
        per_page = [sum(per_page)]
    if len(per_page) != len(sizes) or any(s % p for s, p in zip(sizes, per_page)):
        return None
    pages = {s // p for s, p in zip(sizes, per_page)}
    if len(pages) != 1:
        return None
    n_pages = pages.pop()
    if "tokens" in given:
        return geo if geo.pages == n_pages else None
    return replace(geo, tokens=n_pages * geo.page) if n_pages else None


def _size_error(dump: Dump, preset: LayoutPreset, given: dict, sizes: list[int], what: str) -> LayoutError:
    hints = []
    try:
        geo = _geometry(preset, given, given.get("tokens", 0))
        need = sum(geo.region_bytes(r) for r in preset.regions) if "tokens" in given else None
        page_bytes = sum(geo.region_page_bytes(r) for r in preset.regions)
    except KvtoolError:
        geo, need, page_bytes = None, None, 0
    for key, value, cand in _candidates(preset, given):
        try:
            fitted = _fit(preset, cand, sizes)
        except KvtoolError:
            continue
        if fitted is not None:
            hints.append(f"{key}={value}" + ("" if "tokens" in given else f" ({fitted.tokens} tokens)"))
    if "tokens" in given and page_bytes and sum(sizes) % page_bytes == 0 and len(sizes) == 1:
        n_pages = sum(sizes) // page_bytes
        hints.insert(0, f"tokens<={n_pages * geo.page} ({n_pages} page{'s' if n_pages != 1 else ''})")
    shown = geo.text() if geo is not None else str(given)
    if need is not None:
        msg = f"{dump.path.name}: {preset.name} with {shown} needs {need} bytes ({geo.pages} pages x {page_bytes} B)"
    else:
        shown = shown.replace(",tokens=0", "")
        msg = f"{dump.path.name}: {preset.name} with {shown} has {page_bytes}-byte pages"
    msg += f", {what} {sum(sizes)} bytes"
    if need is not None and sum(sizes) < need:
        msg += " (truncated?)"
    return LayoutError(msg + ("; geometries that fit: " + ", ".join(hints[:4]) if hints else
                              "; no geometry one key away fits (check --from-layout and format)"))


def _pin_geometry(dump: Dump, preset: LayoutPreset, given: dict, regions, prefix: str) -> tuple[dict, "str | None"]:
    """`given` with heads / dim filled in when exactly one choice fits the dump's bytes (and a note saying so); a
    LayoutError when several fit; `given` unchanged when none does (the size error then names what is wrong)."""
    free = [k for k in ("heads", "dim") if k not in given]
    if not free:
        return given, None
    choices = {"heads": HEAD_CHOICES, "dim": DIM_CHOICES}
    fits = []
    for values in itertools.product(*(choices[k] for k in free)):
        cand = {**given, **dict(zip(free, values))}
        try:
            geo0 = _geometry(preset, cand, cand.get("tokens", 0))
            live = [r.name for r in preset.regions if geo0.region_page_bytes(r)]
            if regions is None:
                sizes = [int(dump.raw.numel())]
            elif all(r in regions for r in live) and len(live) == len(regions):
                sizes = [int(regions[r].numel()) for r in live]
            else:
                continue
            geo = _fit(preset, cand, sizes)
        except KvtoolError:
            continue
        if geo is not None:
            fits.append((cand, geo))
    where = f"{dump.path.name}{f' ({prefix})' if prefix else ''}"
    if len(fits) > 1:
        shown = "; ".join(f"{','.join(f'{k}={c[k]}' for k in free)} ({g.tokens} tokens)" for c, g in fits[:6])
        more = f"; ... ({len(fits)} in all)" if len(fits) > 6 else ""
        raise LayoutError(f"{where}: the bytes do not say the geometry: {len(fits)} fit its size as {preset.name} "
                          f"({shown}{more}); give --geometry {','.join(f'{k}=N' for k in free)} (keys format, page, "
                          "heads, dim, tokens)")
    if len(fits) == 1:
        cand, geo = fits[0]
        return cand, (f"{where}: no --geometry {'/'.join(free)} given: assumed {geo.text()}, the only "
                      f"{'/'.join(free)} of {preset.name} that fits its size")
    return given, None


def _scalars(meta: dict, given: dict, key: str, logical: str) -> dict:
    """Scalars of one tensor: kvtool metadata, then geometry `outer=` / `tensor_scale=`, then `outer.<logical>=`."""
    out = dict(meta.get("scalars", {}).get(key, {}))
    for name in ("tensor_scale", "outer"):
        for geo_key in (name, f"{name}.{logical}"):
            if geo_key in given:
                out[name] = given[geo_key]
    return out


# ------------------------------------------------------------------------------------------------ kvtool cache files
def _shape_geometry(preset: LayoutPreset, fmt, shape: tuple) -> Geometry:
    """The geometry a logical shape [..., H, D] means in `preset` (page: the preset's); leading axes count as tokens."""
    shape = tuple(int(s) for s in shape)
    tokens = math.prod(shape[:-2]) if len(shape) > 2 else (shape[0] if len(shape) == 2 else 1)
    heads = shape[-2] if len(shape) > 2 else 1
    return Geometry(fmt, preset.page_size, heads, shape[-1] if shape else 1, tokens)


def _verify_kvtool(f, path: Path, ce: CacheEntry, tensors: dict) -> None:
    """The digests of one kvtool entry (its metadata and every plane): ChecksumError on a mismatch or none."""
    where = f"{path}: kvtool entry {ce.name!r}"
    if not ce.checksum:
        raise ChecksumError(f"{where} has no checksum record, so its data cannot be verified")
    if ce.meta_ok is False:
        raise ChecksumError(f"{where}: metadata checksum mismatch (edited after writing)")
    for role, t in tensors.items():
        if ce.checksum.get(role) is None or hash_stored(f, t) != ce.checksum[role]:
            raise ChecksumError(f"{where}: checksum mismatch in the {t.name!r} bytes (the file changed after writing)")


def _read_kvtool(dump: Dump, given: dict, keep) -> "LayoutRead":
    """A kvtool cache file as planes: each entry's format, shape, scales and outer / tensor scale from its metadata.
    `given` (the --geometry keys) must agree with what the file says about every entry that `keep(name)` keeps."""
    planes = get_preset("planes")
    header = read_header(dump.path)
    entries = parse_kvtool(header) or {}
    used = {n for ce in entries.values() for n in (ce.payload, ce.scales) if n}
    read = LayoutRead({}, {}, sum(t.nbytes for t in header.tensors.values()), planes.name, kvtool=True,
                      skipped=[n for n in header.tensors if n not in used and keep(n)])
    with open(dump.path, "rb") as f:
        for name, ce in entries.items():
            if not keep(name):
                continue
            tensors = {"payload": header.tensors[ce.payload]}
            if ce.scales is not None:
                tensors["scales"] = header.tensors[ce.scales]
            _verify_kvtool(f, dump.path, ce, tensors)
            planes_of = {role: read_rows(f, t, 0, t.rows).reshape(t.shape) for role, t in tensors.items()}
            q = QTensor(ce.fmt, planes_of["payload"], planes_of.get("scales"), ce.outer_scale, tuple(ce.shape),
                        {"dtype": parse_dtype(ce.dtype)})
            geo = _shape_geometry(planes, ce.fmt, ce.shape)
            wrong = _disagree(geo, given)
            if wrong:
                raise LayoutError(f"{dump.path.name}: kvtool entry {name!r} is {ce.fmt.label} {list(ce.shape)}, "
                                  f"--geometry says {wrong} (a kvtool cache file's own metadata says it all: "
                                  "drop --geometry)")
            read.tensors[name], read.geometries[name] = q, geo
    return read


def _disagree(geo: Geometry, given: dict) -> str:
    """The --geometry keys (format, heads, dim, tokens) that contradict `geo`, as "key=value, ..." ('' when none)."""
    have = {"format": geo.fmt, "heads": geo.heads, "dim": geo.dim, "tokens": geo.tokens}
    said = {k: get_format(given[k]) if k == "format" else given[k] for k in have if k in given}
    return ", ".join(f"{k}={given[k]}" for k in said if said[k] != have[k])


def _write_kvtool(tensors: dict, path: Path) -> dict:
    """{name: QTensor} as a kvtool cache file (schema 2, layout planes) at `path`, atomically; returns geometries."""
    planes = get_preset("planes")
    jobs, plan = [], []
    for name, q in tensors.items():
        shape = tuple(int(s) for s in q.shape)
        (p_dtype, p_shape), scales = plane_specs(q.fmt, shape)
        scalar = scales is not None and scales[1] == ()
        ce = CacheEntry(name, q.fmt, shape, dtype_name(q.extra.get("dtype", torch.bfloat16)), f"{name}.payload",
                        f"{name}.scales" if scales else None, float(q.outer_scale),
                        float(q.scales.reshape(-1)[0]) if scalar else None,
                        checksum=placeholder_checksum(scales is not None))
        plan += [(ce.payload, p_dtype, p_shape)] + ([(ce.scales, scales[0], scales[1])] if scales else [])
        jobs.append((ce, q, p_dtype, scales))
    if not path.parent.is_dir():
        raise OutputError(f"output directory {path.parent} does not exist")
    entries = [job[0] for job in jobs]
    with SafetensorsWriter(path, plan, kvtool_metadata(entries)) as writer:
        for ce, q, p_dtype, scales in jobs:
            rows = math.prod(ce.shape[:-1])
            writer.write_rows(ce.payload, 0, q.payload.detach().cpu().contiguous().view(p_dtype).reshape(rows, -1))
            if scales is not None:
                s = q.scales.detach().cpu().contiguous().view(scales[0])
                writer.write_rows(ce.scales, 0, s.reshape(1, 1) if scales[1] == () else s.reshape(rows, -1))

        writer.commit(lambda: write_metadata(writer, entries, []))
    return {name: _shape_geometry(planes, q.fmt, q.shape) for name, q in tensors.items()}



# ------------------------------------------------------------------------------------------------------ public API
@dataclass
class LayoutRead:
    """What read_layout_all found: `tensors` {name: QTensor}, each one's `geometries` [name], `nbytes` (tensor data
    bytes in the file), the `layout` read, `kvtool` (a kvtool cache file, read from its own metadata) and `skipped`
    (its passthrough plain tensors: not caches)."""

    tensors: dict
    geometries: dict
    nbytes: int
    layout: str
    kvtool: bool = False
    skipped: list = field(default_factory=list)
    assumed: "str | None" = None  # the geometry assumed because it was the only one that fits (module docstring)


def read_layout_all(path: "str | Path", layout: "str | LayoutPreset", geometry: "str | dict | None" = None,
                    keep=None) -> LayoutRead:
    """read_layout plus each tensor's resolved Geometry, the file's tensor bytes and what was skipped. `keep(name) ->
    bool` (default: all) selects the tensors returned (and, in a kvtool cache file, the ones read and checked)."""
    keep = keep or (lambda name: True)
    preset = get_preset(layout)
    dump = load_dump(path)
    user = parse_geometry(geometry)
    if dump.kvtool:
        if preset.name != "planes":
            raise LayoutError(f"{dump.path.name} is a kvtool cache file (layout planes; its metadata names every "
                              f"tensor's format and shape), not a {preset.name} dump: read it as planes (convert "
                              "--from-layout planes) or without --layout")
        return _read_kvtool(dump, user, keep)
    if dump.meta.get("layout") not in (None, preset.name):
        raise LayoutError(f"{dump.path.name}: kvtool wrote it as layout {dump.meta['layout']}, not {preset.name}")
    per_prefix = dump.meta.get("geometries") or {}
    if dump.raw is not None:
        groups: dict = {str(dump.meta.get("prefix") or ""): None}  # kvtool's sidecar keeps the tensor's name
    else:
        groups = {}
        for name, data in dump.named.items():
            region, prefix = _match_region(preset, name)
            groups.setdefault(prefix, {})[region] = data
        if not groups:
            raise LayoutError(f"{dump.path.name}: no tensors in the file")
    read = LayoutRead({}, {}, dump.nbytes, preset.name)
    for prefix, regions in groups.items():
        given = {**parse_geometry(per_prefix.get(prefix, dump.meta.get("geometry"))), **user}
        if not per_prefix.get(prefix, dump.meta.get("geometry")):
            given, assumed = _pin_geometry(dump, preset, given, regions, prefix)
            if assumed:
                read.assumed = assumed
        geo0 = _geometry(preset, given, given.get("tokens", 0))
        live = [r.name for r in preset.regions if geo0.region_page_bytes(r)]
        if regions is not None:
            missing = [r for r in live if r not in regions]
            extra = [r for r in regions if r not in live]
            label = f"{prefix}." if prefix else ""
            if missing:
                raise LayoutError(f"{dump.path.name}: {preset.name} ({geo0.fmt.label}) needs buffer(s) "
                                  f"{', '.join(label + m for m in missing)}; the file lacks them")
            if extra:
                raise LayoutError(f"{dump.path.name}: buffer(s) {', '.join(label + e for e in extra)} hold no plane "
                                  f"of {geo0.fmt.label} in {preset.name} (wrong format?)")
            sizes = [int(regions[r].numel()) for r in live]
        else:
            sizes = [int(dump.raw.numel())]
        geo = _fit(preset, given, sizes)
        if geo is None:
            raise _size_error(dump, preset, given, sizes, "the file has" if regions is None else "its buffers hold")
        if regions is None:
            bounds = np.cumsum([0] + [geo.region_bytes(next(r for r in preset.regions if r.name == n)) for n in live])
            regions = {n: dump.raw[int(a):int(b)] for n, a, b in zip(live, bounds[:-1], bounds[1:])}
        scalars = {lg: _scalars(dump.meta, given, _key(preset, prefix, lg), lg) for lg in preset.tensors}
        decoded = decode(preset, regions, replace(geo, scalars=scalars))
        for lg, q in decoded.items():
            if not keep(_key(preset, prefix, lg)):
                continue
            if read.assumed:
                q.extra["assumed_geometry"] = read.assumed  # readers print it: the bytes did not say
            read.tensors[_key(preset, prefix, lg)] = q
            read.geometries[_key(preset, prefix, lg)] = geo
    return read


def read_layout_info(path: "str | Path", layout: "str | LayoutPreset",
                     geometry: "str | dict | None" = None) -> tuple[dict, Geometry, int]:
    """read_layout plus the resolved Geometry (of the last tensor read) and the file's tensor bytes (for reports)."""
    read = read_layout_all(path, layout, geometry)
    if not read.tensors:
        raise LayoutError(f"{Path(path).name}: holds no quantized tensor (plain: {', '.join(read.skipped[:5])})")
    return read.tensors, list(read.geometries.values())[-1], read.nbytes


def read_layout(path: "str | Path", layout: "str | LayoutPreset", geometry: "str | dict | None" = None) -> dict:
    """Read an engine dump in layout `layout` into {name: QTensor of logical shape [tokens, heads, D]}.

    `path`: a raw `.bin`, a `.pt` (torch.load weights_only=True) or a `.safetensors` holding the engine's buffer
    tensor(s). `geometry`: "KEY=VAL[,KEY=VAL...]" with keys format (a label such as mxfp4, nvfp4-auto, fp8-token),
    page, heads, dim, tokens, tensor_scale (fp8 `tensor`), outer (nvfp4 g_dec), the last two also per tensor as
    `outer.k=` / `tensor_scale.v=` (a {key: value} dict is accepted too); missing keys come from the file's kvtool
    metadata, then the preset (format, page), then heads=1, dim=128, tokens = every slot of every page.
    Names: `k` / `v` for paired presets, `x` otherwise, prefixed by the dump's tensor-name prefixes. Payloads are uint8
    (bf16 for bf16); scales uint8 [N, H, D/block], fp32 [N, H, 1] (fp8 token) or an fp32 scalar (fp8 tensor).
    A kvtool cache file read as `planes` gives its quantized entries under their names and logical shapes (its plain
    passthrough tensors are left out). Raises LayoutError when the byte count does not match the geometry, naming
    expected and actual bytes and the geometries one key away that would fit."""
    return read_layout_info(path, layout, geometry)[0]


def _logical_shape(name: str, q: QTensor) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in q.shape)
    if len(shape) == 2:
        return shape[0], 1, shape[1]
    if len(shape) != 3:
        raise LayoutError(f"{name}: a cache tensor is [tokens, heads, D] (or [tokens, D]), got {list(shape)}")
    return shape


def _group_geometry(preset: LayoutPreset, prefix: str, members: dict, given: dict) -> Geometry:
    """The geometry of one cache (one prefix: `x`, or its `k` and `v`): its tensors must share format and shape."""
    where = _key(preset, prefix, "x") if not preset.paired else (prefix or "k/v")
    fmts = {q.fmt for q in members.values()}
    if len(fmts) != 1:
        raise LayoutError(f"{where}: one cache holds one format, got {', '.join(sorted(f.label for f in fmts))}")
    fmt = fmts.pop()
    if "format" in given and get_format(given["format"]) != fmt:
        raise LayoutError(f"{where}: the tensors are {fmt.label}, the geometry says format={given['format']} "
                          "(layouts move bytes; use quantize to change the format)")
    resolve_format(preset, fmt.label)
    shapes = {_logical_shape(_key(preset, prefix, lg), q) for lg, q in members.items()}
    if len(shapes) != 1:
        raise LayoutError(f"{where}: {' and '.join(preset.tensors)} of one cache share one geometry, got shapes "
                          f"{sorted(shapes)}")
    n, h, d = shapes.pop()
    for key, value in (("tokens", n), ("heads", h), ("dim", d)):
        if key in given and given[key] != value:
            raise LayoutError(f"{where}: the tensors have {key}={value}, the geometry says {key}={given[key]}")
    return make_geometry(preset, fmt, given.get("page"), h, d, n)


def plan_write(tensors: dict, layout: "str | LayoutPreset",
               geometry: "str | dict | None" = None) -> tuple[dict, dict, dict]:
    """The bytes write_layout would write to a container: ({buffer name: uint8 [pages, region_page_bytes]},
    {prefix: Geometry}, metadata). Each prefix (one cache) has its own geometry; `geometry` may set page and must
    agree with every cache on format, tokens, heads and dim."""
    preset = get_preset(layout)
    given = parse_geometry(geometry)
    if not tensors:
        raise LayoutError("nothing to write: no tensors")
    groups: dict = {}
    for key, q in tensors.items():
        prefix, logical = _split_key(preset, key)
        if logical in groups.setdefault(prefix, {}):
            raise LayoutError(f"two tensors map to {_key(preset, prefix, logical)!r}")
        groups[prefix][logical] = q
    out, scalars, geos = {}, {}, {}
    for prefix, members in groups.items():
        missing = [lg for lg in preset.tensors if lg not in members]
        if missing:
            raise LayoutError(f"{preset.name} needs {'/'.join(preset.tensors)}; missing "
                              f"{', '.join(_key(preset, prefix, m) for m in missing)}")
        geo = geos[prefix] = _group_geometry(preset, prefix, members, given)
        for region, data in encode(preset, members, geo).items():
            out[f"{prefix}.{region}" if prefix else region] = data.reshape(max(geo.pages, 1), -1)
        for lg, q in members.items():
            if qtensor_scalars(q):
                scalars[_key(preset, prefix, lg)] = qtensor_scalars(q)
    meta = {"layout": preset.name, "geometry": next(iter(geos.values())).text(), "scalars": scalars}
    if len(geos) > 1:
        meta["geometries"] = {prefix: geo.text() for prefix, geo in geos.items()}
    return out, geos, meta


def encode_for_write(tensors: dict, layout: "str | LayoutPreset",
                     geometry: "str | dict | None" = None) -> tuple[dict, Geometry, dict]:
    """The bytes write_layout would write: ({tensor name: uint8 [pages, region_page_bytes]}, geometry of the first
    cache, metadata); see plan_write."""
    out, geos, meta = plan_write(tensors, layout, geometry)
    return out, next(iter(geos.values())), meta


def _atomic(path: Path, write) -> None:
    """Write through a temporary file in the target directory, then os.replace (never a half-written target)."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"output directory {parent} does not exist")
    fd, tmp = create_temp(path)  # `.NAME.kvtool-PID-RANDOM.tmp`: a dead writer's leftover is removed next time
    os.close(fd)
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_layout(tensors: dict, path: "str | Path", layout: "str | LayoutPreset",
                 geometry: "str | dict | None" = None) -> dict:
    """Write {name: QTensor [tokens, heads, D]} in layout `layout` (names as read_layout returns them: k/v or
    PREFIX.k/PREFIX.v for paired presets). The format is the tensors' own; `geometry` may set page (default: the
    preset's) and must agree with the tensors on format, tokens, heads and dim. `.safetensors` / `.pt`: one uint8
    [pages, page_bytes] tensor per engine buffer, named PREFIX.BUFFER (several caches, each with its own geometry),
    plus kvtool metadata; `planes` as `.safetensors` is a kvtool cache file (schema 1); anything else: the raw bytes
    of ONE cache plus a `<path>.json` sidecar. Atomic: a temporary file in the target directory, then os.replace.
    Returns {tensor name: Geometry written}."""
    path = Path(path)
    preset = get_preset(layout)
    suffix = path.suffix.lower()
    if preset.name == "planes" and suffix == ".safetensors":
        if not tensors:
            raise LayoutError("nothing to write: no tensors")
        given = parse_geometry(geometry)
        for key, q in tensors.items():
            wrong = _disagree(_shape_geometry(preset, q.fmt, q.shape), given)
            if wrong:
                raise LayoutError(f"{key}: the tensor is {q.fmt.label} {list(q.shape)}, the geometry says {wrong}")
        return _write_kvtool(tensors, path)
    if suffix not in (".safetensors", ".pt"):
        caches = sorted({_split_key(preset, key)[0] for key in tensors})
        if len(caches) > 1:
            raise LayoutError(f"{path.name}: a raw dump holds one cache, got {len(caches)} "
                              f"({', '.join(c or '(unnamed)' for c in caches[:6])}): pick one (convert --include "
                              "NAME) or write .safetensors (each cache's engine buffers named PREFIX.BUFFER)")
    buffers, geos, meta = plan_write(tensors, layout, geometry)
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        _atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in buffers.items()}, tmp,
                                            metadata={META_KEY: json.dumps(meta)}))
    elif suffix == ".pt":
        _atomic(path, lambda tmp: torch.save({**buffers, META_KEY: json.dumps(meta)}, tmp))
    else:
        prefix = next(iter(geos))
        if prefix:
            meta["prefix"] = prefix  # read back under the tensor's own name
        raw = torch.cat([b.reshape(-1) for b in buffers.values()]) if buffers else torch.zeros(0, dtype=torch.uint8)
        _atomic(path, lambda tmp: raw.numpy().tofile(tmp))
        sidecar = Path(str(path) + ".json")
        _atomic(sidecar, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1) + "\n"))
    return {key: geos[_split_key(preset, key)[0]] for key in tensors}
