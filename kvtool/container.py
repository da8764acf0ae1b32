"""The kvtool cache file: a safetensors file that describes itself, read and written tensor by tensor, row block by
row block, so that files larger than memory pass through with bounded memory.

Schema 2
========
A kvtool cache file is a valid safetensors file (8-byte little-endian header length N, N bytes of UTF-8 JSON header,
padded with spaces so that the data starts 8-byte aligned, then the raw little-endian tensor bytes, contiguous, in
header order). `safetensors.safe_open` reads it. Its header `__metadata__` (string -> string) holds:

- `kvtool.schema`: `"2"`. A reader refuses a larger number ("written by a newer kvtool") and never guesses; schema 1
  files (no metadata digests, no passthrough records) stay readable, with a warning.
- `kvtool.version`: the kvtool version that wrote the file (informational).
- `kvtool.tensors`: a JSON object, one key per LOGICAL tensor (the tensor the user quantized), each value exactly:
    - `format`: `Format.to_meta()`: `family` (bf16|fp8|nvfp4|mxfp4), `label` (e.g. `mxfp4-rceil`), `block`,
      `scale_element` (none|fp32-tensor|fp32-row|e4m3|e8m0) and the family's options: `scale_rule` (mxfp4:
      floor|even|ceil|rceil), `recipe` and `outer_scale` (nvfp4: rcp|div|unrounded; "1"|"auto"|a number), `fp8_scale`,
      `ds_floor`, `pow2` (fp8). The reader rebuilds the descriptor with `Format.from_meta`; an unknown name is an error.
    - `shape`: the logical shape `[..., D]`, quantized along the last dimension D (ints, not bools; each < 2^48).
    - `dtype`: the original floating dtype (bf16|fp16|fp32|fp64); `kvtool dequantize` restores it by default.
    - `layout`: `"planes"` (SPEC section 5): payload and scales as separate token-major tensors.
    - `outer_scale`: the decode-direction outer scale as a finite positive float (nvfp4 `g_dec`, the value used; it
      equals the format's numeric outer scale where the label names one; exactly 1.0 for other families).
    - `tensor_scale`: the fp8 per-tensor scale `s` as a finite positive float (fp8 `tensor` only, else null); it equals
      the stored scalar.
    - `payload`: name of the stored payload tensor, `"<name>.payload"`: U8 `[..., D * bits / 8]` (element codes; FP4
      packed two per byte, element 2i in the low nibble), or BF16 `[..., D]` for the bf16 format.
    - `scales`: name of the stored scale tensor `"<name>.scales"`, or null when the format has none: U8
      `[..., D / block]` (E4M3 for nvfp4, E8M0 for mxfp4), F32 `[..., 1]` (fp8 `token`), or an F32 scalar `[]` (fp8
      `tensor`).
    - `checksum`: `{"algorithm": "blake2b-256", "meta": HEX, "payload": HEX, "scales": HEX | null}`:
      hashlib.blake2b with a 32-byte digest over each stored tensor's raw bytes exactly as they lie in the file, and
      `meta` over the entry itself (`meta_digest`: the canonical JSON of the name, every field but `checksum`, and the
      dtype and shape of its stored planes), so that an edited scale, shape or option is caught like a flipped byte.
- `kvtool.passthrough`: a JSON object, one key per stored tensor that no entry names (copied unchanged by `quantize
  --exclude`): `{"dtype": ST_DTYPE, "shape": [...], "checksum": {"algorithm", "meta", "data"}}`. A stored tensor that
  is in neither table is an error (schema 2).

Limits checked before anything is parsed or allocated: the header is at most 100 MiB, JSON nests at most 64 deep
(`MAX_JSON_DEPTH`, so no RecursionError), no duplicate keys and no NaN / Infinity literals (`load_json`), at most 16
dimensions of at most 2^48 each. Every failure is a `FileFormatError` naming the file, the entry and the field.
Reading verifies by default (`kvtool.readers`): digests as the bytes are read, decoded scale codes as they are used.

Plain safetensors (no `kvtool.schema`) are read as caches too: each floating tensor is one cache, quantized along its
last dimension. Headers are validated before any data is touched: truncation, offsets beyond the end of the file,
overlapping spans and `dtype x shape != byte span` are one-line `FileFormatError`s.

Writing: the writer plans every stored tensor up front (names, dtypes, shapes are known before any data), writes the
header with placeholder checksums into a temporary file in the target directory, `.NAME.kvtool-PID-RANDOM.tmp`, fills
each tensor row block by row block (hashing as it goes), rewrites the header with the digests (padded to the same
length), fsyncs and `os.replace`s it onto the target. On any error the temporary file is removed; a killed process
never leaves a partial file at the target path, and the next write to the same target removes the temporary files of
writers whose process is gone (`remove_stale_temps`). Two live writers to one target both finish: the last rename
wins, and the target is always one complete file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from kvtool import __version__
from kvtool.errors import FileFormatError, FormatError, KvtoolError, OutputError
from kvtool.formats import Format, QTensor
from kvtool.st_header import (  # noqa: F401 - re-exported: the limits and JSON rules are the container's too
    MAX_DIM,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    META_SCHEMA,
    META_VERSION,
    SHORT_DTYPE_NAMES,
    ST_DTYPE_NAMES,
    _is_int,
    _short,
    check_shape,
    json_depth,
    load_json,
    read_raw_header,
    short_dtype_name,
)

__all__ = [
    "AtomicFile", "CHECKSUM_ALGORITHM", "CacheEntry", "ChecksumError", "DTYPES_BY_NAME", "DTYPE_NAMES",
    "ENTRY_FIELDS", "Header", "LAYOUT_PLANES", "MAX_DIM", "MAX_DIMS", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH",
    "META_PASSTHROUGH", "META_SCHEMA", "META_TENSORS", "META_VERSION", "PassthroughRecord", "READABLE_SCHEMAS",
    "SCALE_RANGE", "SCHEMA_VERSION", "ST_DTYPES", "ST_NAMES", "SafetensorsWriter", "StoredTensor",
    "TEMP_PATTERN", "canonical_json", "check_output", "check_shape", "create_temp", "dtype_name",
    "final_checksums", "hash_stored", "json_depth", "kvtool_metadata", "load_json", "meta_digest",
    "parse_dtype", "parse_kvtool", "passthrough_digest", "passthrough_record", "placeholder_checksum",
    "plane_specs", "read_header", "read_rows", "remove_stale_temps", "temp_path", "write_metadata",
]


class ChecksumError(FileFormatError):
    """Stored bytes or metadata that do not match the file's checksums (or a record that is missing)."""


SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # 1: no metadata digests and no passthrough records (read with a warning)
META_TENSORS = "kvtool.tensors"
META_PASSTHROUGH = "kvtool.passthrough"
CHECKSUM_ALGORITHM = "blake2b-256"
LAYOUT_PLANES = "planes"
# Outer / tensor scales a file may carry: normal fp32 numbers (kvtool's own `auto` outer scale is >= 2^-118).
SCALE_RANGE = (2.0 ** -126, 2.0 ** 126)
ENTRY_FIELDS = ("format", "shape", "dtype", "layout", "outer_scale", "tensor_scale", "payload", "scales", "checksum")
_HEX64 = re.compile(r"[0-9a-f]{64}")

# safetensors dtype strings <-> torch dtypes (little-endian on disk), from kvtool.st_header's one table.
ST_DTYPES: dict[str, torch.dtype] = {k: getattr(torch, name) for k, name in ST_DTYPE_NAMES.items()}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}

# Short names of floating dtypes, as reports and the `dtype` metadata field spell them.
DTYPE_NAMES = {getattr(torch, name): short for name, short in SHORT_DTYPE_NAMES.items()}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return short_dtype_name(str(dtype).replace("torch.", ""))


def parse_dtype(name: str) -> torch.dtype:
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
           "float64": "fp64"}.get(str(name).lower(), str(name).lower())
    if key not in DTYPES_BY_NAME:
        raise FormatError(f"unknown dtype {name!r} (choose {'|'.join(DTYPES_BY_NAME)})")
    return DTYPES_BY_NAME[key]


# ------------------------------------------------------------------------------------------------------ JSON
def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    schema: int | None = None  # set by parse_kvtool
    passthrough: dict = field(default_factory=dict)  # name -> PassthroughRecord (schema 2), set by parse_kvtool


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header without reading tensor data (kvtool.st_header.read_raw_header, the
    dtypes mapped onto torch's). Raises FileFormatError naming what lies."""
    raw = read_raw_header(path)
    tensors = {n: StoredTensor(n, ST_DTYPES[t.st_dtype], t.shape, t.start, t.end) for n, t in raw.tensors.items()}
    return Header(raw.path, tensors, raw.metadata, raw.file_size)


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
    checksum: dict | None = field(default_factory=dict)
    meta_ok: bool | None = None  # the metadata digest matched (schema 2), None when the file has none (schema 1)

    def fields(self) -> dict:
        """The entry's JSON fields except `checksum` (what `meta_digest` covers)."""
        return {"format": self.fmt.to_meta(), "shape": list(self.shape), "dtype": self.dtype, "layout": self.layout,
                "outer_scale": self.outer_scale, "tensor_scale": self.tensor_scale, "payload": self.payload,
                "scales": self.scales}

    def to_json(self) -> dict:
        return {**self.fields(), "checksum": self.checksum}

    @classmethod
    def from_json(cls, path: Path, name: str, d, schema: int = SCHEMA_VERSION) -> "CacheEntry":
        """Validate one `kvtool.tensors` value against the schema (module docstring); FileFormatError naming the
        entry and the field otherwise."""
        where = f"{path}: kvtool entry {name!r}"
        if not isinstance(d, dict):
            raise FileFormatError(f"{where}: must be a JSON object, got {type(d).__name__}")
        required = ENTRY_FIELDS if schema >= 2 else ("format", "shape", "payload")
        missing = [k for k in required if k not in d]
        if missing:
            raise FileFormatError(f"{where}: lacks field(s) {', '.join(missing)}")
        unknown = [k for k in d if k not in ENTRY_FIELDS]
        if unknown and schema >= 2:
            raise FileFormatError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
        fmt = _entry_format(where, d["format"], schema)
        shape = check_shape(d["shape"], f"{where}: field shape", allow_scalar=False)
        if shape[-1] == 0:
            raise FileFormatError(f"{where}: field shape {list(shape)}: the quantized last dimension must be >= 1")
        dtype = d.get("dtype", "fp32")
        if not isinstance(dtype, str) or dtype not in DTYPES_BY_NAME:
            raise FileFormatError(f"{where}: field dtype must be one of {'|'.join(DTYPES_BY_NAME)}, got "
                                  f"{_short(dtype)}")
        layout = d.get("layout", LAYOUT_PLANES)
        if layout != LAYOUT_PLANES:
            raise FileFormatError(f"{where}: field layout must be 'planes', got {_short(layout)}")
        outer = _entry_scale(where, "outer_scale", d.get("outer_scale", 1.0))
        expected = _expected_outer(fmt)
        if expected is not None and outer != expected:
            raise FileFormatError(f"{where}: field outer_scale is {outer!r} but the format {fmt.label} says "
                                  f"{expected!r}")
        tscale = d.get("tensor_scale")
        if tscale is not None:
            tscale = _entry_scale(where, "tensor_scale", tscale)
        if (tscale is not None) != (fmt.scale_element == "fp32-tensor") and (tscale is not None or schema >= 2):
            raise FileFormatError(f"{where}: field tensor_scale must be a number for fp8 tensor scaling and null "
                                  f"otherwise ({fmt.label}), got {_short(tscale)}")
        payload, scales = d["payload"], d.get("scales")
        if not isinstance(payload, str) or not payload:
            raise FileFormatError(f"{where}: field payload must be a tensor name, got {_short(payload)}")
        if scales is not None and (not isinstance(scales, str) or not scales or scales == payload):
            raise FileFormatError(f"{where}: field scales must be a tensor name other than the payload's, or null, "
                                  f"got {_short(scales)}")
        checksum = _entry_checksum(where, d.get("checksum"), scales is not None, schema)
        return cls(name, fmt, shape, dtype, payload, scales, outer, tscale, layout, checksum)


def _entry_format(where: str, meta, schema: int) -> Format:
    if not isinstance(meta, dict) or not isinstance(meta.get("family"), str):
        raise FileFormatError(f"{where}: field format must be an object with a string 'family'")
    bad = [k for k, v in meta.items() if not (v is None or isinstance(v, (str, bool)) or _is_number(v))]
    if bad:
        raise FileFormatError(f"{where}: field format.{bad[0]} must be a string, number, bool or null, got "
                              f"{_short(meta[bad[0]])}")
    try:
        fmt = Format.from_meta(meta)
    except KvtoolError as err:
        raise FormatError(f"{where}: field format: {err}") from None
    except Exception as err:  # noqa: BLE001 - option values of the wrong kind (e.g. a number for a rule)
        raise FileFormatError(f"{where}: field format: invalid options ({type(err).__name__}: {err})") from None
    if schema >= 2:
        rebuilt = fmt.to_meta()
        for key in ("block", "scale_element"):
            if key in meta and meta[key] != rebuilt[key]:
                raise FileFormatError(f"{where}: field format.{key} is {_short(meta[key])} but {fmt.label} has "
                                      f"{rebuilt[key]!r}")
    return fmt


def _entry_scale(where: str, key: str, value) -> float:
    lo, hi = SCALE_RANGE
    if not _is_number(value) or not (math.isfinite(value) and lo <= value <= hi):
        raise FileFormatError(f"{where}: field {key} must be a finite positive number in [2^-126, 2^126], got "
                              f"{_short(value)}")
    return float(value)


def _expected_outer(fmt: Format) -> float | None:
    """The outer scale a format's options fix (None when free: nvfp4 `auto`)."""
    value = getattr(fmt, "outer_scale", None)
    if value == "auto":
        return None
    return 1.0 if value in (None, "1") else float(value)


def _entry_checksum(where: str, record, has_scales: bool, schema: int) -> dict | None:
    if record is None or record == {}:
        return None  # no record: reading it verified is an error (kvtool.readers); --no-verify reads it
    roles = ("meta", "payload", "scales") if schema >= 2 else ("payload", "scales")
    if not isinstance(record, dict):
        raise FileFormatError(f"{where}: field checksum must be an object {{algorithm, {', '.join(roles)}}}, got "
                              f"{_short(record)}")
    if record.get("algorithm", CHECKSUM_ALGORITHM if schema < 2 else None) != CHECKSUM_ALGORITHM:
        raise FileFormatError(f"{where}: field checksum.algorithm must be {CHECKSUM_ALGORITHM!r}, got "
                              f"{_short(record.get('algorithm'))}")
    extra = [k for k in record if k not in ("algorithm", "meta", "payload", "scales")]
    if extra:
        raise FileFormatError(f"{where}: field checksum has unknown key(s) {', '.join(map(repr, extra))}")
    for role in roles:
        value = record.get(role)
        need = role != "scales" or has_scales
        if value is None and (schema < 2 or not need):
            continue
        if not need:
            raise FileFormatError(f"{where}: field checksum.scales must be null (the entry has no scales)")
        if not (isinstance(value, str) and _HEX64.fullmatch(value)):
            raise FileFormatError(f"{where}: field checksum.{role} must be 64 lowercase hex digits, got "
                                  f"{_short(value)}")
    return dict(record)


def meta_digest(name: str, fields: dict, planes: dict[str, StoredTensor]) -> str:
    """blake2b-256 over the canonical JSON of an entry's name, its fields (all but `checksum`) and the dtype and shape
    of its stored planes {role: StoredTensor}: what the `meta` digest of schema 2 covers."""
    obj = {"name": name, "fields": fields,
           "planes": {role: [ST_NAMES[t.dtype], list(t.shape)] for role, t in planes.items()}}
    return hashlib.blake2b(canonical_json(obj), digest_size=32).hexdigest()


def passthrough_digest(name: str, t: StoredTensor) -> str:
    obj = {"name": name, "dtype": ST_NAMES[t.dtype], "shape": list(t.shape)}
    return hashlib.blake2b(canonical_json(obj), digest_size=32).hexdigest()


@dataclass
class PassthroughRecord:
    """A stored tensor no entry names (schema 2): its digests {"meta", "data"} and whether the meta digest matched."""

    name: str
    checksum: dict
    meta_ok: bool


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
    """The kvtool entries of a header, validated against the schema and the stored tensors; None for a plain
    safetensors file. `header.schema` and `header.passthrough` are set as a side effect (schema 2 files record their
    passthrough tensors; see the module docstring)."""
    meta = header.metadata
    if META_SCHEMA not in meta:
        return None
    path = header.path
    text = meta[META_SCHEMA]
    if not re.fullmatch(r"[0-9]{1,6}", text):
        raise FileFormatError(f"{path}: corrupt kvtool metadata: field {META_SCHEMA} {_short(text)} is not a number")
    version = int(text)
    if version > SCHEMA_VERSION:
        raise FileFormatError(f"{path}: written by a newer kvtool (schema {version}, kvtool "
                              f"{meta.get(META_VERSION, '?')}); this kvtool {__version__} reads schema "
                              f"{SCHEMA_VERSION}: upgrade kvtool")
    if version not in READABLE_SCHEMAS:
        raise FileFormatError(f"{path}: corrupt kvtool metadata: schema {version}")
    header.schema = version
    table = load_json(meta.get(META_TENSORS, "{}"), f"{path}: corrupt kvtool metadata: field {META_TENSORS}")
    if not isinstance(table, dict):
        raise FileFormatError(f"{path}: corrupt kvtool metadata: field {META_TENSORS} must be an object")
    entries = {name: CacheEntry.from_json(path, name, d, version) for name, d in table.items()}
    owner: dict[str, str] = {}
    for e in entries.values():
        for stored in filter(None, (e.payload, e.scales)):
            if stored in owner:
                raise FileFormatError(f"{path}: kvtool entries {owner[stored]!r} and {e.name!r} both name stored "
                                      f"tensor {stored!r}")
            owner[stored] = e.name
        _check_planes(header, e)
        if version >= 2 and e.checksum is not None:
            planes = {role: header.tensors[n] for role, n in (("payload", e.payload), ("scales", e.scales)) if n}
            fields = {k: v for k, v in table[e.name].items() if k != "checksum"}
            e.meta_ok = meta_digest(e.name, fields, planes) == e.checksum["meta"]
    header.passthrough = _passthrough(header, owner, version)
    return entries


def _passthrough(header: Header, owner: dict[str, str], version: int) -> dict[str, PassthroughRecord]:
    path = header.path
    names = [n for n in header.tensors if n not in owner]
    if version < 2:
        return {}
    table = load_json(header.metadata.get(META_PASSTHROUGH, "{}"),
                      f"{path}: corrupt kvtool metadata: field {META_PASSTHROUGH}")
    if not isinstance(table, dict):
        raise FileFormatError(f"{path}: corrupt kvtool metadata: field {META_PASSTHROUGH} must be an object")
    out = {}
    for name in names:
        where = f"{path}: passthrough tensor {name!r}"
        rec = table.get(name)
        if rec is None:
            raise FileFormatError(f"{where} is neither a kvtool entry's plane nor listed in {META_PASSTHROUGH} "
                                  "(added after writing?)")
        if not isinstance(rec, dict) or set(rec) != {"dtype", "shape", "checksum"}:
            raise FileFormatError(f"{where}: its record must be an object {{dtype, shape, checksum}}")
        t = header.tensors[name]
        if rec["dtype"] != ST_NAMES[t.dtype] or rec["shape"] != list(t.shape):
            raise FileFormatError(f"{where}: recorded as {_short(rec['dtype'])} {_short(rec['shape'])}, stored as "
                                  f"{ST_NAMES[t.dtype]} {list(t.shape)}")
        ck = rec["checksum"]
        if not (isinstance(ck, dict) and ck.get("algorithm") == CHECKSUM_ALGORITHM and set(ck) ==
                {"algorithm", "meta", "data"} and all(isinstance(ck[k], str) and _HEX64.fullmatch(ck[k])
                                                      for k in ("meta", "data"))):
            raise FileFormatError(f"{where}: field checksum must be {{algorithm: {CHECKSUM_ALGORITHM}, meta: HEX, "
                                  "data: HEX}")
        out[name] = PassthroughRecord(name, dict(ck), passthrough_digest(name, t) == ck["meta"])
    stray = [n for n in table if n not in names]
    if stray:
        raise FileFormatError(f"{path}: {META_PASSTHROUGH} lists {stray[0]!r}, which is not a stored passthrough "
                              "tensor")
    return out


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


def kvtool_metadata(entries: list[CacheEntry], passthrough: dict[str, dict] | None = None) -> dict[str, str]:
    """The `__metadata__` of a schema-2 file: `entries` and the passthrough records {name: record} (see
    `passthrough_record`; placeholders first, the final digests at commit)."""
    return {META_SCHEMA: str(SCHEMA_VERSION), META_VERSION: __version__,
            META_TENSORS: json.dumps({e.name: e.to_json() for e in entries}, separators=(",", ":"), allow_nan=False),
            META_PASSTHROUGH: json.dumps(passthrough or {}, separators=(",", ":"))}


def passthrough_record(name: str, dtype: torch.dtype, shape: tuple[int, ...], data_digest: str = "0" * 64) -> dict:
    t = StoredTensor(name, dtype, tuple(shape), 0, 0)
    return {"dtype": ST_NAMES[dtype], "shape": list(shape),
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "meta": passthrough_digest(name, t), "data": data_digest}}


def final_checksums(writer: "SafetensorsWriter", entries: list[CacheEntry]) -> None:
    """Fill every entry's checksum record from the writer's digests (payload, scales, and the metadata digest)."""
    for ce in entries:
        planes = {role: writer.planned(n) for role, n in (("payload", ce.payload), ("scales", ce.scales)) if n}
        ce.checksum = {"algorithm": CHECKSUM_ALGORITHM, "meta": meta_digest(ce.name, _roundtrip(ce.fields()), planes),
                       "payload": writer.digest(ce.payload),
                       "scales": writer.digest(ce.scales) if ce.scales else None}


def write_metadata(writer: "SafetensorsWriter", entries: list[CacheEntry], passthrough: list[str]) -> dict[str, str]:
    """The final `__metadata__` of a kvtool file written by `writer`: entries' and passthrough tensors' digests."""
    final_checksums(writer, entries)
    records = {n: passthrough_record(n, writer.planned(n).dtype, writer.planned(n).shape, writer.digest(n))
               for n in passthrough}
    return kvtool_metadata(entries, records)


def _roundtrip(obj):
    """`obj` as the reader will see it after JSON (tuples become lists): the digests are computed on that."""
    return json.loads(json.dumps(obj, allow_nan=False))


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


TEMP_PATTERN = re.compile(r"\.(?P<name>.+)\.kvtool-(?P<pid>[0-9]+)-[0-9a-f]{8}\.tmp")


def temp_path(target: Path) -> Path:
    """The temporary file a write to `target` goes through: `.NAME.kvtool-PID-RANDOM.tmp` beside it (the PID lets a
    later run tell a dead writer's leftover from a live writer's file; the random part separates writers of one
    process)."""
    return target.parent / f".{target.name}.kvtool-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or not ours to judge: keep its file
    return True


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove the temporary files of earlier writes to `target` whose writer process is gone (killed with -9, a
    power cut); a live writer's file is left alone. Returns the paths removed."""
    target = Path(target)
    removed = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return removed
    for name in names:
        m = TEMP_PATTERN.fullmatch(name)
        if m is None or m.group("name") != target.name or _alive(int(m.group("pid"))):
            continue
        try:
            (target.parent / name).unlink()
            removed.append(target.parent / name)
        except OSError:
            pass
    return removed


def _open_new(path: Path, mode: int) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)


def create_temp(target: Path) -> tuple[int, Path]:
    """(fd, path) of a new temporary file for `target` (mode 0666 & ~umask, as the target would get), after
    removing stale ones (remove_stale_temps). OutputError when the directory cannot be written."""
    target = Path(target)
    remove_stale_temps(target)
    umask = os.umask(0)
    os.umask(umask)
    for _ in range(16):
        tmp = temp_path(target)
        try:
            return _open_new(tmp, 0o666 & ~umask), tmp
        except FileExistsError:
            continue
        except OSError as err:
            raise OutputError(f"cannot write in {target.parent}: {err.strerror or err}") from None
    raise OutputError(f"cannot create a temporary file beside {target}")


class AtomicFile:
    """A temporary file in the target's directory (`temp_path`) that becomes `target` on `commit()` (fsync, then
    os.replace) and is removed on `abort()` or when the `with` block exits without a commit."""

    def __init__(self, target: Path):
        self.target = Path(target)
        self.fd, self.tmp = create_temp(self.target)

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

    def planned(self, name: str) -> StoredTensor:
        """The planned stored tensor `name` (dtype, shape; offsets relative to the data section)."""
        return self._spans[name]

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
    return {"algorithm": CHECKSUM_ALGORITHM, "meta": "0" * 64, "payload": "0" * 64,
            "scales": "0" * 64 if has_scales else None}
