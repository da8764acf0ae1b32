"""The kvtool cache file: a safetensors file that describes itself, read and written tensor by tensor, row block by
row block, so that files larger than memory pass through with bounded memory.

Schema 1
========
A kvtool cache file is a valid safetensors file (8-byte little-endian header length N, N bytes of UTF-8 JSON header,
padded with spaces so that the data starts 8-byte aligned, then the raw little-endian tensor bytes, contiguous, in
header order). `safetensors.safe_open` reads it. Its header `__metadata__` (string -> string) holds:

- `kvtool.schema`: `"1"`. A reader refuses a larger number ("written by a newer kvtool") and never guesses.
- `kvtool.version`: the kvtool version that wrote the file (informational).
- `kvtool.tensors`: a JSON object, one key per LOGICAL tensor (the tensor the user quantized), each value:
    - `format`: `Format.to_meta()`: `family` (bf16|fp8|nvfp4|mxfp4), `label` (e.g. `mxfp4-rceil`), `block`,
      `scale_element` (none|fp32-tensor|fp32-row|e4m3|e8m0) and the family's options: `scale_rule` (mxfp4:
      floor|even|ceil|rceil), `recipe` and `outer_scale` (nvfp4: rcp|div|unrounded; "1"|"auto"|a number), `fp8_scale`,
      `ds_floor`, `pow2` (fp8). The reader rebuilds the descriptor with `Format.from_meta`; an unknown name is an error.
    - `shape`: the logical shape `[..., D]`, quantized along the last dimension D.
    - `dtype`: the original floating dtype (bf16|fp16|fp32|fp64); `kvtool dequantize` restores it by default.
    - `layout`: `"planes"` (SPEC section 5): payload and scales as separate token-major tensors.
    - `outer_scale`: the decode-direction outer scale as a float (nvfp4 `g_dec`, the value used; 1.0 otherwise).
    - `tensor_scale`: the fp8 per-tensor scale `s` as a float (fp8 `tensor` only, else null; the stored tensor rules).
    - `payload`: name of the stored payload tensor, `"<name>.payload"`: U8 `[..., D * bits / 8]` (element codes; FP4
      packed two per byte, element 2i in the low nibble), or BF16 `[..., D]` for the bf16 format.
    - `scales`: name of the stored scale tensor `"<name>.scales"`, or null when the format has none: U8
      `[..., D / block]` (E4M3 for nvfp4, E8M0 for mxfp4), F32 `[..., 1]` (fp8 `token`), or an F32 scalar `[]` (fp8
      `tensor`).
    - `checksum`: `{"algorithm": "blake2b-256", "payload": HEX, "scales": HEX | null}`: hashlib.blake2b with a 32-byte
      digest over each stored tensor's raw bytes exactly as they lie in the file. `kvtool inspect --verify` recomputes.
- Stored tensors that no logical entry names are passthrough tensors (copied unchanged by `quantize --exclude`).

Plain safetensors (no `kvtool.schema`) are read as caches too: each floating tensor is one cache, quantized along its
last dimension. Headers are validated before any data is touched: truncation, offsets beyond the end of the file,
overlapping spans and `dtype x shape != byte span` are one-line `FileFormatError`s.

Writing: the writer plans every stored tensor up front (names, dtypes, shapes are known before any data), writes the
header with placeholder checksums into a temporary file in the target directory (`tempfile.mkstemp(dir=...)`), fills
each tensor row block by row block (hashing as it goes), rewrites the header with the digests (padded to the same
length), fsyncs and `os.replace`s it onto the target. On any error the temporary file is removed; a killed process
never leaves a partial file at the target path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from kvtool import __version__
from kvtool.errors import FileFormatError, FormatError, KvtoolError, OutputError
from kvtool.formats import Format, QTensor

SCHEMA_VERSION = 1
META_SCHEMA = "kvtool.schema"
META_VERSION = "kvtool.version"
META_TENSORS = "kvtool.tensors"
CHECKSUM_ALGORITHM = "blake2b-256"
LAYOUT_PLANES = "planes"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

# safetensors dtype strings <-> torch dtypes (little-endian on disk).
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}

# Short names of floating dtypes, as reports and the `dtype` metadata field spell them.
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def parse_dtype(name: str) -> torch.dtype:
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
           "float64": "fp64"}.get(str(name).lower(), str(name).lower())
    if key not in DTYPES_BY_NAME:
        raise FormatError(f"unknown dtype {name!r} (choose {'|'.join(DTYPES_BY_NAME)})")
    return DTYPES_BY_NAME[key]


# ------------------------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: dtype, shape and its absolute byte span [start, end) in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_len(self) -> int:
        """Elements per row of the [rows, last] view (a scalar is one row of one element)."""
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if self.shape else 1


@dataclass
class Header:
    path: Path
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    file_size: int


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header without reading tensor data. Raises FileFormatError naming what lies."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FileFormatError(f"{path}: truncated: {size} bytes, a safetensors file starts with an 8-byte "
                                      "header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise FileFormatError(f"{path}: truncated or not a safetensors file: header length {n} but the file "
                                      f"has {size} bytes")
            raw = f.read(n)
    except OSError as err:
        raise FileFormatError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FileFormatError(f"{path}: corrupt safetensors header (not JSON: {err})") from None
    if not isinstance(obj, dict):
        raise FileFormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FileFormatError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")
    base = 8 + n
    tensors = {name: _stored_tensor(path, name, info, base, size) for name, info in obj.items()}
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise FileFormatError(f"{path}: header lies: tensors {a!r} and {b!r} overlap in the file")
    return Header(path, tensors, metadata, size)


def _stored_tensor(path: Path, name: str, info, base: int, size: int) -> StoredTensor:
    where = f"{path}: header lies: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise FileFormatError(f"{path}: corrupt safetensors header: tensor {name!r} lacks dtype/shape/data_offsets")
    dtype = ST_DTYPES.get(info["dtype"])
    if dtype is None:
        raise FileFormatError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise FileFormatError(f"{where}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise FileFormatError(f"{where}: bad data_offsets {offsets!r}")
    need = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != need:
        raise FileFormatError(f"{where}: {info['dtype']} {shape} needs {need} bytes but its offsets span "
                              f"{offsets[1] - offsets[0]}")
    if base + offsets[1] > size:
        raise FileFormatError(f"{where}: data ends at byte {base + offsets[1]}, beyond the end of the file ({size} "
                              "bytes; truncated?)")
    return StoredTensor(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def read_rows(f: BinaryIO, t: StoredTensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of `t` viewed as [rows, last], read straight from the file: [stop - start, last] in t.dtype.
    Only those bytes are read, so memory is bounded by the row block, whatever the file size."""
    row_bytes = t.row_len * t.dtype.itemsize
    n = (stop - start) * row_bytes
    if n == 0:
        return torch.empty((stop - start, t.row_len), dtype=t.dtype)
    buf = bytearray(n)
    f.seek(t.start + start * row_bytes)
    got = f.readinto(buf)
    if got != n:
        raise FileFormatError(f"{getattr(f, 'name', 'file')}: truncated while reading tensor {t.name!r}")
    return torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).reshape(stop - start, t.row_len)


def hash_stored(f: BinaryIO, t: StoredTensor, chunk: int = 16 << 20) -> str:
    """blake2b-256 hex digest of the stored bytes of `t`, read in chunks."""
    h = hashlib.blake2b(digest_size=32)
    f.seek(t.start)
    left = t.nbytes
    while left:
        data = f.read(min(chunk, left))
        if not data:
            raise FileFormatError(f"{getattr(f, 'name', 'file')}: truncated while hashing tensor {t.name!r}")
        h.update(data)
        left -= len(data)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------------ schema
@dataclass
class CacheEntry:
    """The metadata of one logical tensor in a kvtool file (see the module docstring)."""

    name: str
    fmt: Format
    shape: tuple[int, ...]
    dtype: str
    payload: str
    scales: str | None
    outer_scale: float = 1.0
    tensor_scale: float | None = None
    layout: str = LAYOUT_PLANES
    checksum: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": self.fmt.to_meta(), "shape": list(self.shape), "dtype": self.dtype, "layout": self.layout,
                "outer_scale": self.outer_scale, "tensor_scale": self.tensor_scale, "payload": self.payload,
                "scales": self.scales, "checksum": self.checksum}

    @classmethod
    def from_json(cls, path: Path, name: str, d) -> "CacheEntry":
        where = f"{path}: kvtool entry {name!r}"
        if not isinstance(d, dict) or not {"format", "shape", "payload"} <= d.keys():
            raise FileFormatError(f"{where} lacks format/shape/payload")
        if not isinstance(d["format"], dict) or "family" not in d["format"]:
            raise FileFormatError(f"{where}: format metadata lacks 'family'")
        try:
            fmt = Format.from_meta(d["format"])
        except KvtoolError as err:
            raise FormatError(f"{where}: {err}") from None
        layout = d.get("layout", LAYOUT_PLANES)
        if layout != LAYOUT_PLANES:
            raise FileFormatError(f"{where}: unknown layout {layout!r} (schema 1 stores 'planes')")
        shape = d["shape"]
        if not (isinstance(shape, list) and shape and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise FileFormatError(f"{where}: bad shape {shape!r}")
        try:
            outer = float(d.get("outer_scale", 1.0))
            tscale = None if d.get("tensor_scale") is None else float(d["tensor_scale"])
        except (TypeError, ValueError):
            raise FileFormatError(f"{where}: outer_scale / tensor_scale must be numbers") from None
        checksum = d.get("checksum") or {}
        if not isinstance(checksum, dict) or not all(v is None or isinstance(v, str) for v in checksum.values()):
            raise FileFormatError(f"{where}: checksum must map plane names to hex digests")
        if checksum and checksum.get("algorithm", CHECKSUM_ALGORITHM) != CHECKSUM_ALGORITHM:
            raise FileFormatError(f"{where}: unknown checksum algorithm {checksum['algorithm']!r}")
        scales = d.get("scales")
        if scales is not None and not isinstance(scales, str):
            raise FileFormatError(f"{where}: 'scales' must be a tensor name or null")
        return cls(name, fmt, tuple(shape), str(d.get("dtype", "fp32")), str(d["payload"]), scales,
                   outer, tscale, layout, checksum)


def plane_specs(fmt: Format, shape: tuple[int, ...]) -> tuple[tuple, tuple | None]:
    """((payload dtype, shape), (scales dtype, shape) or None) that `fmt` stores for a logical tensor `shape`.
    Derived by quantizing one zero row, so the planes always match what the codecs produce."""
    probe = _probe(fmt, shape[-1])
    lead = tuple(shape[:-1])
    payload = (probe.payload.dtype, lead + tuple(probe.payload.shape[-1:]))
    if probe.scales is None:
        return payload, None
    if probe.scales.dim() == 0:  # one scale for the whole tensor
        return payload, (probe.scales.dtype, ())
    return payload, (probe.scales.dtype, lead + tuple(probe.scales.shape[-1:]))


_PROBES: dict = {}


def _probe(fmt: Format, dim: int) -> QTensor:
    key = (fmt, dim)
    if key not in _PROBES:
        _PROBES[key] = fmt.quantize(torch.zeros(1, dim), check_finite=False)
    return _PROBES[key]


def parse_kvtool(header: Header) -> dict[str, CacheEntry] | None:
    """The kvtool entries of a header, validated against the stored tensors; None for a plain safetensors file."""
    meta = header.metadata
    if META_SCHEMA not in meta:
        return None
    path = header.path
    try:
        version = int(meta[META_SCHEMA])
    except ValueError:
        raise FileFormatError(f"{path}: corrupt kvtool metadata: schema {meta[META_SCHEMA]!r} is not a number") from None
    if version > SCHEMA_VERSION:
        raise FileFormatError(f"{path}: written by a newer kvtool (schema {version}, kvtool "
                              f"{meta.get(META_VERSION, '?')}); this kvtool {__version__} reads schema "
                              f"{SCHEMA_VERSION}: upgrade kvtool")
    if version < 1:
        raise FileFormatError(f"{path}: corrupt kvtool metadata: schema {version}")
    try:
        table = json.loads(meta.get(META_TENSORS, "{}"))
    except json.JSONDecodeError as err:
        raise FileFormatError(f"{path}: corrupt kvtool metadata ({META_TENSORS} is not JSON: {err})") from None
    if not isinstance(table, dict):
        raise FileFormatError(f"{path}: corrupt kvtool metadata ({META_TENSORS} must be an object)")
    entries = {name: CacheEntry.from_json(path, name, d) for name, d in table.items()}
    for e in entries.values():
        _check_planes(header, e)
    return entries


def _check_planes(header: Header, e: CacheEntry) -> None:
    where = f"{header.path}: kvtool entry {e.name!r}"
    try:
        e.fmt.check_dim(e.shape[-1], e.name)
    except KvtoolError as err:
        raise FileFormatError(f"{where}: {err}") from None
    want_payload, want_scales = plane_specs(e.fmt, e.shape)
    for role, stored_name, want in (("payload", e.payload, want_payload), ("scales", e.scales, want_scales)):
        if want is None and stored_name is None:
            continue
        if (want is None) != (stored_name is None):
            raise FileFormatError(f"{where}: {e.fmt.label} {'has no' if want is None else 'needs a'} {role} tensor")
        t = header.tensors.get(stored_name)
        if t is None:
            raise FileFormatError(f"{where}: its {role} tensor {stored_name!r} is missing from the file")
        if (t.dtype, t.shape) != want:
            raise FileFormatError(f"{where}: {role} tensor {stored_name!r} is {ST_NAMES[t.dtype]} {list(t.shape)}, "
                                  f"{e.fmt.label} {list(e.shape)} needs {ST_NAMES[want[0]]} {list(want[1])}")


def kvtool_metadata(entries: list[CacheEntry]) -> dict[str, str]:
    return {META_SCHEMA: str(SCHEMA_VERSION), META_VERSION: __version__,
            META_TENSORS: json.dumps({e.name: e.to_json() for e in entries}, separators=(",", ":"))}


# ------------------------------------------------------------------------------------------------------ writing
def check_output(target: Path, inputs: list[Path]) -> Path:
    """Validate an output path before any work: its directory exists and is writable, it is not a directory, and it
    is none of the inputs (also through other spellings, symlinks or hard links). Returns the absolute target."""
    target = Path(os.path.abspath(os.path.expanduser(str(target))))
    parent = target.parent
    if not parent.is_dir():
        raise OutputError(f"output directory {parent} does not exist")
    if target.is_dir():
        raise OutputError(f"output path {target} is a directory")
    for src in inputs:
        src = Path(src)
        same = target.resolve() == src.resolve()
        if not same and target.exists() and src.exists():
            same = os.path.samefile(target, src)
        if same:
            raise OutputError(f"output path {target} is the input file {src}: choose another -o")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"output directory {parent} is not writable")
    return target


class AtomicFile:
    """A temporary file in the target's directory that becomes `target` on `commit()` (fsync, then os.replace) and is
    removed on `abort()` or when the `with` block exits without a commit."""

    def __init__(self, target: Path):
        self.target = Path(target)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.target.parent, prefix=f".{self.target.name}.", suffix=".tmp")
        except OSError as err:
            raise OutputError(f"cannot write in {self.target.parent}: {err.strerror or err}") from None
        self.fd, self.tmp = fd, Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the final file the user's usual permissions

    def commit(self) -> None:
        try:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.target)
        except OSError as err:
            self.abort()
            raise OutputError(f"cannot write {self.target}: {err.strerror or err}") from None
        try:  # make the rename durable; not every filesystem lets a directory be opened
            dfd = os.open(self.target.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0 or self.tmp.exists():
            self.abort()


class SafetensorsWriter:
    """Streams a safetensors file: `plan` lists every stored tensor (name, dtype, shape) up front; `write_rows` fills
    each tensor's [rows, last] view in row order (hashing as it goes); `commit(metadata_fn)` asks for the final
    `__metadata__` given the digests, rewrites the header in place and renames the file onto the target."""

    HEADER_SLACK = 256  # spare header bytes (plus 64 per tensor): the final metadata may outgrow the placeholder

    def __init__(self, target: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        names = [name for name, _, _ in plan]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise OutputError(f"output tensor names collide: {', '.join(dup)}")
        self._plan = plan
        self._spans: dict[str, StoredTensor] = {}
        offset = 0
        for name, dtype, shape in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            self._spans[name] = StoredTensor(name, dtype, tuple(shape), offset, offset + nbytes)
            offset += nbytes
        self._data_bytes = offset
        header = self._header_json(metadata or {})
        self._reserved = _align8(len(header) + self.HEADER_SLACK + 64 * len(plan) + 8) - 8
        self._written = {name: 0 for name in names}
        self._hash = {name: hashlib.blake2b(digest_size=32) for name in names}
        self._file = AtomicFile(target)
        try:
            os.ftruncate(self._file.fd, 8 + self._reserved + self._data_bytes)
            self._write_header(header)
        except OSError as err:
            self._file.abort()
            raise OutputError(f"cannot write {target}: {err.strerror or err}") from None

    def _header_json(self, metadata: dict[str, str]) -> bytes:
        obj: dict = {"__metadata__": metadata} if metadata else {}
        for name, t in self._spans.items():
            obj[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [t.start, t.end]}
        return json.dumps(obj, separators=(",", ":")).encode()

    def _write_header(self, header: bytes) -> None:
        if len(header) > self._reserved:
            raise KvtoolError("internal: the final safetensors header outgrew its reserved space")
        padded = header + b" " * (self._reserved - len(header))
        os.pwrite(self._file.fd, struct.pack("<Q", self._reserved) + padded, 0)

    def write_rows(self, name: str, start: int, data: torch.Tensor) -> None:
        """Write rows [start, start + n) of tensor `name` ([rows, last] view); rows must arrive in order."""
        t = self._spans[name]
        raw = data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        offset = start * t.row_len * t.dtype.itemsize
        if data.dtype != t.dtype or offset != self._written[name] or offset + raw.numel() > t.nbytes:
            raise KvtoolError(f"internal: out-of-order or mistyped write to {name!r}")
        if raw.numel() == 0:
            return
        view = memoryview(raw.numpy())
        self._hash[name].update(view)
        pos = 8 + self._reserved + t.start + offset
        while view:
            try:
                done = os.pwrite(self._file.fd, view, pos)
            except OSError as err:
                self.abort()
                raise OutputError(f"cannot write {self._file.target}: {err.strerror or err}") from None
            view, pos = view[done:], pos + done
        self._written[name] += raw.numel()

    def digest(self, name: str) -> str:
        return self._hash[name].hexdigest()

    def commit(self, metadata_fn: Callable[[], dict[str, str]] | None = None) -> None:
        missing = [n for n, t in self._spans.items() if self._written[n] != t.nbytes]
        if missing:
            self.abort()
            raise KvtoolError(f"internal: tensors not fully written: {', '.join(missing)}")
        if metadata_fn is not None:
            self._write_header(self._header_json(metadata_fn()))
        self._file.commit()

    def abort(self) -> None:
        self._file.abort()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._file.__exit__(*exc)


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def placeholder_checksum(has_scales: bool) -> dict:
    """A checksum record with zero digests of the final length (so the header does not grow at commit)."""
    return {"algorithm": CHECKSUM_ALGORITHM, "payload": "0" * 64, "scales": "0" * 64 if has_scales else None}
