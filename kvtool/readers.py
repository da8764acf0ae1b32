"""Readers: every input kvtool accepts, opened as one `InputFile` of named `Entry`s that stream row blocks.

Inputs:
- kvtool cache files (safetensors with `kvtool.schema`, see `kvtool.container`): quantized entries, plus any
  passthrough tensors as plain entries;
- plain safetensors: each tensor is a plain entry (a floating one is a cache quantized along its last dimension);
- `.pt` / `.pth` (and zip-format `.bin`): `torch.load(weights_only=True)`, never unpickled otherwise; a tensor (named
  `tensor`) or a (nested) dict / list of tensors (names joined with dots);
- `.npy`: one array named `tensor` (`allow_pickle` is never used);
- engine dumps with `--layout NAME --geometry K=V,...`: routed to `kvtool.layouts.read_layout(path, layout,
  geometry) -> dict[str, QTensor]`, each QTensor a quantized entry; `kvtool.layouts.check_plausible` looks at what was
  read, and its warnings (a wrong geometry or layout reads payload bytes as scales) are kept per entry in
  `InputFile.warnings`. A kvtool cache file with `--layout planes` is opened as the kvtool file it is.

An entry is viewed as [rows, D] (D = last dimension). `read(a, b)` returns rows [a, b) as values ([b - a, D]; the
stored dtype for plain entries, decoded fp32 for quantized ones); `read_q(a, b)` returns a quantized entry's rows as a
QTensor. Safetensors and .npy inputs are read by byte range, so memory follows the row block, not the file size.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import torch

from kvtool.container import (
    CacheEntry,
    Header,
    StoredTensor,
    dtype_name,
    hash_stored,
    parse_dtype,
    parse_kvtool,
    read_header,
    read_rows,
)
from kvtool.errors import FileFormatError, InputError, LayoutError
from kvtool.formats import Format, QTensor

RowReader = Callable[[int, int], torch.Tensor]

SAFETENSORS_SUFFIXES = (".safetensors", ".st")
TORCH_SUFFIXES = (".pt", ".pth")
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"


@dataclass
class Entry:
    """One logical tensor of an input: `shape` [..., D]; `dtype` the original dtype (for quantized entries the dtype
    the values had before quantization, when known); `fmt` None for plain tensors."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: Format | None = None
    outer_scale: float = 1.0
    nbytes: int = 0  # bytes stored in the input
    rows_fn: RowReader | None = None  # plain: rows as stored
    payload_fn: RowReader | None = None  # quantized: payload rows [n, Dp]
    scales_fn: RowReader | None = None  # quantized: scale rows [n, S]
    scalar_scale: torch.Tensor | None = None  # quantized with one scale for the whole tensor (fp8 `tensor`)
    checksum: dict | None = None  # kvtool files: the stored digests
    stored: dict[str, StoredTensor] = field(default_factory=dict)  # kvtool files: role -> stored tensor

    @property
    def quantized(self) -> bool:
        return self.fmt is not None

    @property
    def dim(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if self.shape else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def floating(self) -> bool:
        return self.quantized or self.dtype.is_floating_point

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as values: [stop - start, D]; plain entries in their stored dtype, quantized ones
        decoded to fp32."""
        if self.quantized:
            return self.read_q(start, stop).dequantize(torch.float32)
        return self.rows_fn(start, stop)

    def read_q(self, start: int, stop: int) -> QTensor:
        """Rows [start, stop) of a quantized entry as a QTensor of logical shape [stop - start, D]."""
        if not self.quantized:
            raise InputError(f"{self.name}: not a quantized tensor")
        scales = self.scalar_scale if self.scalar_scale is not None else (
            self.scales_fn(start, stop) if self.scales_fn is not None else None)
        return QTensor(self.fmt, self.payload_fn(start, stop), scales, self.outer_scale, (stop - start, self.dim))

    def describe(self) -> str:
        kind = self.fmt.label if self.quantized else dtype_name(self.dtype)
        return f"{self.name} ({kind} {list(self.shape)})"


@dataclass
class InputFile:
    """An opened input: `kind` is kvtool | safetensors | pt | npy | layout:NAME; `entries` in file order."""

    path: Path
    kind: str
    entries: dict[str, Entry]
    schema: int | None = None
    writer_version: str | None = None
    notes: list[str] = field(default_factory=list)
    handle: BinaryIO | None = None
    warnings: dict[str, list[str]] = field(default_factory=dict)  # entry name -> plausibility warnings (layouts)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def __enter__(self) -> "InputFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def verify(self, entry: Entry) -> str | None:
        """Recompute a kvtool entry's digests: 'ok', 'mismatch' (naming the plane), or None when it has none."""
        if not entry.checksum or self.handle is None:
            return None
        bad = [role for role, t in entry.stored.items()
               if entry.checksum.get(role) is not None and hash_stored(self.handle, t) != entry.checksum[role]]
        if not any(entry.checksum.get(role) for role in entry.stored):
            return None  # a record without digests: nothing to verify
        return "ok" if not bad else "mismatch: " + ", ".join(bad)


def open_input(path: Path, layout: str | None = None, geometry: str | None = None) -> InputFile:
    """Open any input kvtool reads (see the module docstring). Raises InputError / FileFormatError / LayoutError."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a file")
    if layout is not None:
        return _open_layout(path, layout, geometry)
    try:
        with open(path, "rb") as f:
            magic = f.read(8)
    except OSError as err:
        raise InputError(f"{path}: cannot read: {err.strerror or err}") from None
    suffix = path.suffix.lower()
    if magic.startswith(NPY_MAGIC) or suffix == ".npy":
        return _open_npy(path)
    if magic.startswith(ZIP_MAGIC) or suffix in TORCH_SUFFIXES:
        return _open_torch(path)
    if suffix == ".bin":
        raise InputError(f"{path}: a raw .bin engine dump needs --layout NAME (and --geometry) to be decoded")
    return _open_safetensors(path)


# --------------------------------------------------------------------------------------------------- safetensors
def _open_safetensors(path: Path) -> InputFile:
    header = read_header(path)
    kv = parse_kvtool(header)
    f = open(path, "rb")
    entries: dict[str, Entry] = {}
    used: set[str] = set()
    order: dict[str, int] = {}
    try:
        for ce in (kv or {}).values():
            entries[ce.name] = _kvtool_entry(f, header, ce)
            used.update(n for n in (ce.payload, ce.scales) if n)
            order[ce.name] = header.tensors[ce.payload].start
        for name, t in header.tensors.items():
            if name in used:
                continue
            if name in entries:
                raise FileFormatError(f"{path}: tensor {name!r} is both a stored tensor and a kvtool entry")
            entries[name] = Entry(name, t.shape, t.dtype, nbytes=t.nbytes, rows_fn=_stored_reader(f, t))
            order[name] = t.start
    except BaseException:
        f.close()
        raise
    entries = dict(sorted(entries.items(), key=lambda kv_: order[kv_[0]]))
    schema = None if kv is None else int(header.metadata["kvtool.schema"])
    return InputFile(path, "kvtool" if kv is not None else "safetensors", entries, schema,
                     header.metadata.get("kvtool.version"), handle=f)


def _stored_reader(f: BinaryIO, t: StoredTensor) -> RowReader:
    return lambda a, b: read_rows(f, t, a, b)


def _kvtool_entry(f: BinaryIO, header: Header, ce: CacheEntry) -> Entry:
    try:
        dtype = parse_dtype(ce.dtype)
    except Exception:  # noqa: BLE001 - any unknown dtype name is a corrupt entry
        raise FileFormatError(f"{header.path}: kvtool entry {ce.name!r}: unknown original dtype {ce.dtype!r}") from None
    payload = header.tensors[ce.payload]
    stored = {"payload": payload}
    entry = Entry(ce.name, ce.shape, dtype, ce.fmt, ce.outer_scale, payload.nbytes,
                  payload_fn=_stored_reader(f, payload), checksum=ce.checksum or None, stored=stored)
    if ce.scales is not None:
        scales = header.tensors[ce.scales]
        stored["scales"] = scales
        entry.nbytes += scales.nbytes
        if scales.shape == ():
            entry.scalar_scale = read_rows(f, scales, 0, 1).reshape(())
        else:
            entry.scales_fn = _stored_reader(f, scales)
    return entry


# --------------------------------------------------------------------------------------------------------- .npy
def _open_npy(path: Path) -> InputFile:
    f = open(path, "rb")
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)  # version 3.0 differs from 2.0 only in the header's text encoding
        offset = f.tell()
    except (ValueError, OSError, SyntaxError) as err:
        f.close()
        raise FileFormatError(f"{path}: corrupt .npy file ({err})") from None
    if dtype.hasobject:
        f.close()
        raise FileFormatError(f"{path}: the .npy array holds Python objects; kvtool never unpickles")
    try:
        tdtype = torch.from_numpy(np.zeros(0, dtype=dtype.newbyteorder("="))).dtype
    except TypeError:
        f.close()
        raise InputError(f"{path}: unsupported .npy dtype {dtype}") from None
    need = math.prod(shape) * dtype.itemsize
    if offset + need > path.stat().st_size:
        f.close()
        raise FileFormatError(f"{path}: truncated .npy: {list(shape)} {dtype} needs {need} data bytes")
    notes = []
    if fortran or len(shape) == 0 or not dtype.isnative:
        # Not row-major little-endian: load it whole (no streaming) and convert once.
        f.close()
        arr = np.load(path, allow_pickle=False)
        tensor = torch.from_numpy(np.ascontiguousarray(arr).astype(dtype.newbyteorder("="), copy=False))
        notes.append(f"{path.name}: Fortran-order, big-endian or 0-d .npy is loaded whole (not streamed)")
        entry = _memory_entry("tensor", tensor)
        return InputFile(path, "npy", {"tensor": entry}, notes=notes)
    t = StoredTensor("tensor", tdtype, tuple(shape), offset, offset + need)
    entry = Entry("tensor", t.shape, tdtype, nbytes=need, rows_fn=_stored_reader(f, t))
    return InputFile(path, "npy", {"tensor": entry}, handle=f)


# ------------------------------------------------------------------------------------------------------ .pt files
def _open_torch(path: Path) -> InputFile:
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileFormatError(f"{path}: not loadable with torch.load(weights_only=True) (kvtool never unpickles "
                              f"arbitrary objects): {first}") from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for a corrupt file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileFormatError(f"{path}: corrupt or unreadable torch file: {first}") from None
    notes: list[str] = []
    entries = {name: _memory_entry(name, t) for name, t in _flatten(obj, "", notes)}
    if not entries:
        raise InputError(f"{path}: holds no tensors")
    return InputFile(path, "pt", entries, notes=notes)


def _flatten(obj, prefix: str, notes: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield (prefix or "tensor"), obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key), notes)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flatten(value, f"{prefix}.{i}" if prefix else str(i), notes)
    else:
        notes.append(f"skipped {prefix or 'the top-level object'}: a {type(obj).__name__}, not a tensor")


def _memory_entry(name: str, t: torch.Tensor) -> Entry:
    t = t.detach().to("cpu")
    if t.dim() == 0:
        view = t.reshape(1, 1)
    else:
        view = t.contiguous().reshape(-1, t.shape[-1]) if t.numel() else t.reshape(0, t.shape[-1])
    return Entry(name, tuple(t.shape), t.dtype, nbytes=t.numel() * t.element_size(),
                 rows_fn=lambda a, b: view[a:b])


# ------------------------------------------------------------------------------------------------------- layouts
def _open_layout(path: Path, layout: str, geometry: str | None) -> InputFile:
    """Route an engine dump to kvtool.layouts (imported only here); `geometry` is passed on as "KEY=VAL,..." text."""
    try:
        from kvtool.layouts import check_plausible, read_layout
    except ImportError:
        raise LayoutError(f"--layout {layout}: engine layouts are not available in this kvtool build "
                          "(kvtool.layouts is missing)") from None
    if str(layout).strip().lower() == "planes" and path.suffix.lower() in SAFETENSORS_SUFFIXES:
        header = read_header(path)
        if parse_kvtool(header) is not None:  # kvtool's own planes: its metadata says format, shape and scales
            if geometry:
                read_layout(path, layout, geometry)  # only checks that --geometry agrees with the file
            return _open_safetensors(path)
    tensors = read_layout(path, layout, geometry)
    entries = {}
    for name, q in tensors.items():
        entries[name] = qtensor_entry(name, q)
    if not entries:
        raise LayoutError(f"{path}: layout {layout} produced no tensors")
    warnings = {name: found for name, q in tensors.items() if (found := check_plausible({name: q}))}
    return InputFile(path, f"layout:{layout}", entries, warnings=warnings)


def qtensor_entry(name: str, q: QTensor) -> Entry:
    """An in-memory QTensor (planes: payload [..., Dp], scales [..., S] / scalar / None) as a quantized entry."""
    shape = tuple(q.shape)
    rows = math.prod(shape[:-1])
    if q.payload.numel() % max(rows, 1) or (rows and q.payload.reshape(rows, -1).shape[0] != rows):
        raise LayoutError(f"{name}: payload {list(q.payload.shape)} does not match logical shape {list(shape)}")
    payload = q.payload.detach().to("cpu").contiguous().reshape(rows, -1)
    entry = Entry(name, shape, q.extra.get("dtype", torch.bfloat16), q.fmt, float(q.outer_scale), q.nbytes,
                  payload_fn=lambda a, b: payload[a:b])
    if q.scales is not None:
        scales = q.scales.detach().to("cpu").contiguous()
        if scales.dim() == 0 or scales.numel() == 1 and rows != 1:
            entry.scalar_scale = scales.reshape(())
        else:
            if scales.numel() % max(rows, 1):
                raise LayoutError(f"{name}: scales {list(scales.shape)} do not match logical shape {list(shape)}")
            scales = scales.reshape(rows, -1)
            entry.scales_fn = lambda a, b: scales[a:b]
    return entry


# ------------------------------------------------------------------------------------------------------ helpers
def row_chunks(rows: int, dim: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Row blocks [a, b) covering `rows` rows of `dim` elements, each at most `chunk_bytes` of fp32 (>= 1 row)."""
    step = max(1, chunk_bytes // max(1, dim * 4))
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


def check_finite_rows(x: torch.Tensor, name: str, shape: tuple[int, ...], row_start: int) -> None:
    """Raise InputError naming the tensor and the first non-finite element by its GLOBAL index in `shape`, for a
    chunk `x` [n, D] that starts at row `row_start` of the [rows, D] view."""
    if not x.is_floating_point() or x.numel() == 0 or bool(torch.isfinite(x.abs().amax())):
        return  # amax propagates NaN and Inf, and is much faster than isfinite on bf16
    if not bool(torch.isfinite(x).all()):
        flat_local = int(torch.nonzero(~torch.isfinite(x.reshape(-1)))[0])
        value = float(x.reshape(-1)[flat_local])
        flat = row_start * x.shape[-1] + flat_local
        index = [int(i) for i in np.unravel_index(flat, shape)] if shape else []
        raise InputError(f"{name}: non-finite value {value} at index {index} (kvtool never guesses a NaN code)")


def select(names: list[str], include: list[str] | None, exclude: list[str] | None) -> list[str]:
    """Names matching any --include glob (all when none) and no --exclude glob (fnmatch, case-sensitive)."""
    from fnmatch import fnmatchcase

    inc = list(include or [])
    exc = list(exclude or [])
    return [n for n in names if (not inc or any(fnmatchcase(n, g) for g in inc))
            and not any(fnmatchcase(n, g) for g in exc)]
