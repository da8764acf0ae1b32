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

Verification (on by default, `verify=False` is the `--no-verify` escape): every stored plane of a kvtool file is
hashed as it is read (in order; an out-of-order read hashes the whole plane first; what was read only in part is
finished when the file is closed) and a mismatch is a `ChecksumError` naming the tensor and plane; schema-2 metadata
digests are checked when the file is opened; an entry without a checksum record is an error. Every row block a
quantized entry returns is checked for codes that decode to NaN / Inf (E8M0 0xFF, E4M3 0x7F / 0xFF scales, fp8
payload NaN codes, non-finite or negative fp32 scales, bf16 NaN / Inf) and non-finite or non-positive outer scales:
an `InputError` naming the tensor, the index and the byte offset in the file.

An entry is viewed as [rows, D] (D = last dimension). `read(a, b)` returns rows [a, b) as values ([b - a, D]; the
stored dtype for plain entries, decoded fp32 for quantized ones); `read_q(a, b)` returns a quantized entry's rows as a
QTensor. Safetensors and .npy inputs are read by byte range, so memory follows the row block, not the file size.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import torch

from kvtool.container import (
    SCALE_RANGE,
    CacheEntry,
    ChecksumError,
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
from kvtool.st_header import (  # noqa: F401 - re-exported; torch-free (kvtool.workflows.inspect_plain)
    NPY_MAGIC,
    SAFETENSORS_SUFFIXES,
    TORCH_SUFFIXES,
    ZIP_MAGIC,
    check_input_path,
    input_kind,
    read_npy_header,
    select,
)

__all__ = [
    "Entry", "InputFile", "NPY_MAGIC", "RowReader", "SAFETENSORS_SUFFIXES", "TORCH_SUFFIXES", "ZIP_MAGIC",
    "check_codes", "check_finite_rows", "check_outer", "open_input", "qtensor_entry", "row_chunks", "select",
]

RowReader = Callable[[int, int], torch.Tensor]


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
    checksum: dict | None = None  # kvtool files: the stored digests (role -> hex; passthrough tensors: "data")
    stored: dict[str, StoredTensor] = field(default_factory=dict)  # kvtool files: role -> stored tensor
    check_codes: bool = True  # check decoded codes of every row block read_q returns (module docstring)
    path: str = ""  # the file, for messages

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
        q = QTensor(self.fmt, self.payload_fn(start, stop), scales, self.outer_scale, (stop - start, self.dim))
        if self.check_codes:
            check_codes(q, self, start)
        return q

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

    verifiers: list = field(default_factory=list)  # _PlaneVerifier of every verified plane (finished at close)
    meta_ok: dict[str, bool] = field(default_factory=dict)  # entry name -> its metadata digest matched (schema 2)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def finish(self) -> None:
        """Verify what was read only in part (the rest of those planes is hashed now): ChecksumError on a mismatch."""
        for v in self.verifiers:
            v.finish()

    def __enter__(self) -> "InputFile":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None and self.handle is not None:
                self.finish()
        finally:
            self.close()

    def verify(self, entry: Entry) -> str | None:
        """Recompute an entry's digests now: 'ok', 'mismatch: <planes>' (payload, scales, data, meta), 'missing' (a
        kvtool entry without a checksum record: nothing can be verified), or None for a tensor of a plain file."""
        if self.kind != "kvtool" or self.handle is None:
            return None
        if not entry.checksum:
            return "missing" if entry.quantized or (self.schema or 0) >= 2 else None
        bad = [role for role, t in entry.stored.items()
               if entry.checksum.get(role) is None or hash_stored(self.handle, t) != entry.checksum[role]]
        if self.meta_ok.get(entry.name) is False:
            bad.append("meta")
        return "ok" if not bad else "mismatch: " + ", ".join(bad)


def open_input(path: Path, layout: str | None = None, geometry: str | None = None, *,
               verify: bool = True, report_checksums: bool = False) -> InputFile:
    """Open any input kvtool reads (see the module docstring). Raises InputError / FileFormatError / LayoutError.
    `verify` (default) checks checksums as data is read and decoded codes as they are used; False trusts the file
    (the `--no-verify` escape: faster, and the only way to look at a file whose scales decode to NaN).
    `report_checksums` (inspect): checksums are not checked as data is read but left to `InputFile.verify`, which
    reports them per tensor; the decoded codes are still checked when `verify`."""
    path = Path(path)
    check_input_path(path)
    if layout is not None:
        return _open_layout(path, layout, geometry, verify, report_checksums)
    kind = input_kind(path)
    if kind == "npy":
        return _open_npy(path)
    if kind == "torch":
        return _open_torch(path)
    if kind == "bin":
        raise InputError(f"{path}: a raw .bin engine dump needs --layout NAME (and --geometry) to be decoded")
    return _open_safetensors(path, verify, report_checksums)


# --------------------------------------------------------------------------------------------------- safetensors
def _open_safetensors(path: Path, verify: bool = True, report_checksums: bool = False) -> InputFile:
    header = read_header(path)
    codes, verify = verify, verify and not report_checksums
    kv = parse_kvtool(header)
    f = open(path, "rb")
    entries: dict[str, Entry] = {}
    used: set[str] = set()
    order: dict[str, int] = {}
    inp = InputFile(path, "kvtool" if kv is not None else "safetensors", entries, header.schema,
                    header.metadata.get("kvtool.version"), handle=f)
    try:
        if kv is not None and header.schema < 2 and codes:
            inp.notes.append(f"{path.name}: kvtool schema {header.schema} file: its metadata (scales, shapes, options) "
                             "is not covered by checksums; re-write it with this kvtool (quantize) to protect it")
        for ce in (kv or {}).values():
            if ce.meta_ok is not None:
                inp.meta_ok[ce.name] = ce.meta_ok
            if verify and ce.meta_ok is False:
                raise ChecksumError(f"{path}: kvtool entry {ce.name!r}: metadata checksum mismatch (its format, shape "
                                    "or scales were edited after writing; --no-verify reads it anyway)")
            if verify and not ce.checksum:
                raise ChecksumError(f"{path}: kvtool entry {ce.name!r} has no checksum record, so its data cannot be "
                                    "verified (--no-verify reads it unverified)")
            entries[ce.name] = _kvtool_entry(inp, header, ce, verify, codes)
            used.update(n for n in (ce.payload, ce.scales) if n)
            order[ce.name] = header.tensors[ce.payload].start
        for name, t in header.tensors.items():
            if name in used:
                continue
            if name in entries:
                raise FileFormatError(f"{path}: tensor {name!r} is both a stored tensor and a kvtool entry")
            rec = header.passthrough.get(name)
            if rec is not None:
                inp.meta_ok[name] = rec.meta_ok
                if verify and not rec.meta_ok:
                    raise ChecksumError(f"{path}: passthrough tensor {name!r}: metadata checksum mismatch (its dtype "
                                        "or shape was edited after writing; --no-verify reads it anyway)")
            checksum = {"data": rec.checksum["data"]} if rec is not None else None
            expect = checksum["data"] if (verify and checksum) else None
            entries[name] = Entry(name, t.shape, t.dtype, nbytes=t.nbytes, checksum=checksum, stored={"data": t},
                                  rows_fn=_stored_reader(inp, t, expect, f"passthrough tensor {name!r}"),
                                  path=str(path))
            order[name] = t.start
    except BaseException:
        f.close()
        raise
    inp.entries = dict(sorted(entries.items(), key=lambda kv_: order[kv_[0]]))
    return inp


class _PlaneVerifier:
    """Hashes one stored plane as its bytes are read: in order from byte 0 (the usual streaming pass); any other read
    hashes the whole plane at once. A mismatch, whenever it is known, is a ChecksumError."""

    def __init__(self, f: BinaryIO, t: StoredTensor, expected: str, what: str):
        self.f, self.t, self.expected, self.what = f, t, expected, what
        self.pos = 0
        self.hash = hashlib.blake2b(digest_size=32)
        self.done = t.nbytes == 0 and self._check(self.hash.hexdigest())

    def _check(self, digest: str) -> bool:
        if digest != self.expected:
            raise ChecksumError(f"{self.f.name}: {self.what}: checksum mismatch in the {self.t.name!r} bytes (the "
                                "file changed after writing; --no-verify reads it anyway)")
        return True

    def feed(self, offset: int, chunk: torch.Tensor) -> None:
        if self.done:
            return
        if offset != self.pos:  # not the next bytes: verify the whole plane now
            self.done = self._check(hash_stored(self.f, self.t))
            return
        data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy()
        self.hash.update(memoryview(data))
        self.pos += data.size
        if self.pos >= self.t.nbytes:
            self.done = self._check(self.hash.hexdigest())

    def finish(self) -> None:
        if not self.done:
            self.done = self._check(hash_stored(self.f, self.t))


def _stored_reader(inp: "InputFile | BinaryIO", t: StoredTensor, expected: str | None = None,
                   what: str = "") -> RowReader:
    f = inp.handle if isinstance(inp, InputFile) else inp
    if expected is None:
        return lambda a, b: read_rows(f, t, a, b)
    v = _PlaneVerifier(f, t, expected, what)
    inp.verifiers.append(v)
    row_bytes = t.row_len * t.dtype.itemsize

    def read(a: int, b: int) -> torch.Tensor:
        rows = read_rows(f, t, a, b)
        v.feed(a * row_bytes, rows)
        return rows

    return read


def _kvtool_entry(inp: InputFile, header: Header, ce: CacheEntry, verify: bool, codes: bool) -> Entry:
    dtype = parse_dtype(ce.dtype)  # validated by the schema
    payload = header.tensors[ce.payload]
    stored = {"payload": payload}
    what = f"kvtool entry {ce.name!r}"
    ck = ce.checksum or {}
    entry = Entry(ce.name, ce.shape, dtype, ce.fmt, ce.outer_scale, payload.nbytes,
                  payload_fn=_stored_reader(inp, payload, ck.get("payload") if verify else None, what),
                  checksum=ce.checksum or None, stored=stored, check_codes=codes, path=str(header.path))
    if ce.scales is not None:
        scales = header.tensors[ce.scales]
        stored["scales"] = scales
        entry.nbytes += scales.nbytes
        reader = _stored_reader(inp, scales, ck.get("scales") if verify else None, what)
        if scales.shape == ():
            entry.scalar_scale = reader(0, 1).reshape(())
            value = float(entry.scalar_scale)
            if ce.tensor_scale is not None and value != ce.tensor_scale:
                raise FileFormatError(f"{header.path}: {what}: field tensor_scale {ce.tensor_scale!r} differs from "
                                      f"the stored scale {value!r}")
        else:
            entry.scales_fn = reader
    if codes:
        check_outer(entry)
    return entry


# ------------------------------------------------------------------------------------------------- decode checks
def check_outer(e: Entry) -> None:
    """The outer (and whole-tensor) scale of a quantized entry must be finite, positive and a normal fp32 number."""
    lo, hi = SCALE_RANGE
    for what, value in (("outer scale", e.outer_scale),
                        ("tensor scale", None if e.scalar_scale is None else float(e.scalar_scale))):
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise InputError(f"{e.path + ': ' if e.path else ''}{e.name}: {what} {value!r} is not a finite positive "
                             "number in [2^-126, 2^126] (the values would decode to NaN, Inf, 0 or garbage)")


def _bad_codes(fmt: Format, payload: torch.Tensor, scales: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    """(plane, mask of bad elements) for codes that decode to NaN / Inf (or a negative fp32 scale)."""
    out = []
    if scales is not None and scales.dim() > 0:
        if fmt.scale_element == "e8m0":
            out.append(("scales", scales == 0xFF))
        elif fmt.scale_element == "e4m3":
            out.append(("scales", (scales & 0x7F) == 0x7F))
        elif scales.is_floating_point():
            out.append(("scales", ~torch.isfinite(scales) | (scales < 0)))
    nan_code = fmt.element.nan_code if fmt.element is not None else None  # E4M3FN: 0x7F / 0xFF
    if nan_code is not None and payload.dtype == torch.uint8:
        out.append(("payload", (payload & fmt.element.magnitude_mask) == nan_code))
    elif payload.is_floating_point():
        out.append(("payload", ~torch.isfinite(payload)))
    return out


def check_codes(q: QTensor, e: Entry, row_start: int) -> None:
    """InputError naming the tensor, the element index and the file byte offset of the first code in `q` (rows
    [row_start, ...) of `e`) that decodes to NaN / Inf."""
    if q.payload.numel() == 0:
        return
    for plane, mask in _bad_codes(q.fmt, q.payload, q.scales):
        if not bool(mask.any()):
            continue
        flat = int(torch.nonzero(mask.reshape(-1))[0])
        width = mask.shape[-1] if mask.dim() else 1
        row, col = row_start + flat // width, flat % width
        src = q.scales if plane == "scales" else q.payload
        code = src.reshape(-1)[flat]
        shown = f"0x{int(code):02X}" if src.dtype == torch.uint8 else repr(float(code))
        index = [int(i) for i in np.unravel_index(row * width + col, tuple(e.shape[:-1]) + (width,))]
        where = f"{e.name} {plane}{index}"
        t = e.stored.get(plane)
        if t is not None:
            where += f" (byte offset {t.start + (row * width + col) * t.dtype.itemsize} in {e.path or 'the file'})"
        raise InputError(f"{where}: code {shown} decodes to NaN / Inf or a negative scale ({q.fmt.label}); the file "
                         "is corrupt or was read with the wrong layout (--no-verify decodes it anyway)")


# --------------------------------------------------------------------------------------------------------- .npy
def _open_npy(path: Path) -> InputFile:
    h = read_npy_header(path)  # the one parse and its errors (kvtool.st_header; `kvtool inspect` reports from it)
    tdtype = getattr(torch, h.torch_name)
    if h.whole:
        # Not row-major little-endian: load it whole (no streaming) and convert once.
        arr = np.load(path, allow_pickle=False)
        native = np.ascontiguousarray(arr).astype(h.dtype.newbyteorder("="), copy=False)
        tensor = torch.from_numpy(native).reshape(h.shape)  # ascontiguousarray makes a 0-d array [1]: keep []
        notes = [f"{path.name}: Fortran-order, big-endian or 0-d .npy is loaded whole (not streamed)"]
        entry = _memory_entry("tensor", tensor)
        return InputFile(path, "npy", {"tensor": entry}, notes=notes)
    f = open(path, "rb")
    t = StoredTensor("tensor", tdtype, h.shape, h.offset, h.offset + h.nbytes)
    entry = Entry("tensor", t.shape, tdtype, nbytes=h.nbytes, rows_fn=_stored_reader(f, t))
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
def _open_layout(path: Path, layout: str, geometry: str | None, verify: bool = True,
                 report_checksums: bool = False) -> InputFile:
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
            return _open_safetensors(path, verify, report_checksums)
    tensors = read_layout(path, layout, geometry)
    assumed = next((q.extra["assumed_geometry"] for q in tensors.values() if "assumed_geometry" in q.extra), None)
    entries = {}
    for name, q in tensors.items():
        entries[name] = qtensor_entry(name, q)
        entries[name].check_codes = verify
        entries[name].path = str(path)
        if verify:
            check_outer(entries[name])
    if not entries:
        raise LayoutError(f"{path}: layout {layout} produced no tensors")
    warnings = {name: found for name, q in tensors.items() if (found := check_plausible({name: q}))}
    for name in entries:
        if assumed:
            warnings.setdefault(name, []).insert(0, assumed)
    return InputFile(path, f"layout:{layout}", entries, warnings=warnings, notes=[assumed] if assumed else [])


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
    if not x.is_floating_point() or x.numel() == 0:
        return
    if x.element_size() == 1:
        x = x.float()  # float8 tensors have no abs / amax kernels
    if bool(torch.isfinite(x.abs().amax())):
        return  # amax propagates NaN and Inf, and is much faster than isfinite on bf16
    if not bool(torch.isfinite(x).all()):
        flat_local = int(torch.nonzero(~torch.isfinite(x.reshape(-1)))[0])
        value = float(x.reshape(-1)[flat_local])
        flat = row_start * x.shape[-1] + flat_local
        index = [int(i) for i in np.unravel_index(flat, shape)] if shape else []
        raise InputError(f"{name}: non-finite value {value} at index {index} (kvtool never guesses a NaN code)")
