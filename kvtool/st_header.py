"""The safetensors header, read and validated without torch: what `kvtool inspect` needs for a plain safetensors file,
and the first half of `kvtool.container.read_header` (which maps the dtype names onto torch dtypes).

A header is 8 bytes of little-endian length N, then N bytes of UTF-8 JSON: one object per tensor (`dtype` a
safetensors dtype string, `shape`, `data_offsets` relative to the end of the header) and an optional `__metadata__`
(string -> string). The limits of `kvtool.container` are checked here, before anything is parsed or allocated: at most
MAX_HEADER_BYTES of header, JSON at most MAX_JSON_DEPTH deep, no duplicate keys and no NaN / Infinity literals
(`load_json`), at most MAX_DIMS dimensions of at most MAX_DIM each, `dtype x shape == byte span`, spans inside the
file and not overlapping. Every failure is a one-line `FileFormatError` naming the file and the tensor.

The `.npy` header (`read_npy_header`) is read here too, with numpy's own header parser and the table of the numpy
dtypes torch takes (`NPY_TORCH_DTYPES`): kvtool.readers opens an .npy file through it, and `kvtool inspect` reports one
from it alone.

This module imports json, re and struct (and numpy for `json_depth` of a header with many brackets, and for an .npy
header) only; `import torch` takes about a second, so a command that only reads headers stays fast.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import FileFormatError, InputError

__all__ = [
    "MAX_DIM", "MAX_DIMS", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH", "META_SCHEMA", "META_VERSION", "NPY_MAGIC",
    "NPY_TORCH_DTYPES", "NpyHeader", "RawHeader", "RawTensor", "SAFETENSORS_SUFFIXES", "SHORT_DTYPE_NAMES",
    "ST_DTYPE_NAMES", "ST_ITEMSIZES", "TORCH_SUFFIXES", "ZIP_MAGIC", "check_input_path", "check_shape", "input_kind",
    "json_depth", "load_json", "read_npy_header", "read_raw_header", "select", "short_dtype_name",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
MAX_JSON_DEPTH = 64  # kvtool's headers nest 4 deep; the json module recurses per level (RecursionError near 1000)
MAX_DIMS = 16
MAX_DIM = 1 << 48  # a bound on every dimension, so that products and torch allocations never overflow

META_SCHEMA = "kvtool.schema"  # a safetensors file with this metadata key is a kvtool cache file (kvtool.container)
META_VERSION = "kvtool.version"
SAFETENSORS_SUFFIXES = (".safetensors", ".st")
TORCH_SUFFIXES = (".pt", ".pth")
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"

# safetensors dtype string -> (torch attribute name, bytes per element); little-endian on disk.
# kvtool.container builds its ST_DTYPES (string -> torch.dtype) from this one table.
_ST = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2), "U16": ("uint16", 2),
    "I32": ("int32", 4), "U32": ("uint32", 4), "I64": ("int64", 8), "U64": ("uint64", 8), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "F32": ("float32", 4), "F64": ("float64", 8), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
ST_DTYPE_NAMES = {k: name for k, (name, _) in _ST.items()}
ST_ITEMSIZES = {k: size for k, (_, size) in _ST.items()}
# Short names of floating dtypes (by torch attribute name), as reports and the `dtype` metadata field spell them.
SHORT_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def short_dtype_name(torch_name: str) -> str:
    """The name a report gives a dtype: bf16 / fp16 / fp32 / fp64, else torch's own (`int32`, `float8_e4m3fn`)."""
    return SHORT_DTYPE_NAMES.get(torch_name, torch_name)


# ------------------------------------------------------------------------------------------------------ JSON
class _JsonSchemaError(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _JsonSchemaError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise _JsonSchemaError(f"non-standard JSON constant {name}")


def json_depth(text: bytes) -> int:
    """The deepest nesting of [] / {} in JSON `text`, brackets inside strings not counted (vectorized: a 100 MiB
    header takes well under a second)."""
    import numpy as np

    # Escapes first (a backslash and the byte after it become two neutral bytes), so every quote left delimits.
    flat = re.sub(rb"\\.", b"__", text, flags=re.S)
    arr = np.frombuffer(flat, dtype=np.uint8)
    if arr.size == 0:
        return 0
    inside = (np.cumsum(arr == ord('"')) & 1).astype(bool)
    step = (np.isin(arr, (ord("["), ord("{"))).astype(np.int64) - np.isin(arr, (ord("]"), ord("}"))))
    step[inside] = 0
    return int(np.cumsum(step).max(initial=0))


def load_json(text: bytes | str, what: str):
    """Parse JSON strictly: at most MAX_JSON_DEPTH deep (checked before parsing), no duplicate keys, no NaN /
    Infinity literals. Raises FileFormatError("<what>: ...")."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    # At most MAX_JSON_DEPTH opening brackets cannot nest deeper: a small header is parsed without numpy (~0.1 s).
    depth = json_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH else 0
    if depth > MAX_JSON_DEPTH:
        raise FileFormatError(f"{what}: JSON nested {depth} deep (at most {MAX_JSON_DEPTH})")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _JsonSchemaError as err:
        raise FileFormatError(f"{what}: {err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise FileFormatError(f"{what}: not JSON ({err})") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_shape(shape, where: str, *, allow_scalar: bool = True) -> tuple[int, ...]:
    """A shape from a file: a list of at most MAX_DIMS ints (not bools) in [0, MAX_DIM]."""
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and (shape or allow_scalar)
            and all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape)):
        raise FileFormatError(f"{where}: bad shape {_short(shape)} (a list of at most {MAX_DIMS} ints in "
                              f"[0, 2^48]{'' if allow_scalar else ', not empty'})")
    return tuple(shape)


# ------------------------------------------------------------------------------------------------------ header
@dataclass(frozen=True)
class RawTensor:
    """One tensor of a safetensors header: its dtype string (`BF16`, `U8`, ...), shape and absolute byte span
    [start, end) in the file."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class RawHeader:
    path: Path
    tensors: dict[str, RawTensor]  # in header order
    metadata: dict[str, str]
    file_size: int


def read_raw_header(path: Path) -> RawHeader:
    """Parse and validate a safetensors header without reading tensor data (module docstring). Raises
    FileFormatError naming what lies."""
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
    obj = load_json(raw, f"{path}: corrupt safetensors header")
    if not isinstance(obj, dict):
        raise FileFormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FileFormatError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")
    base = 8 + n
    tensors = {name: _raw_tensor(path, name, info, base, size) for name, info in obj.items()}
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise FileFormatError(f"{path}: header lies: tensors {a!r} and {b!r} overlap in the file")
    return RawHeader(path, tensors, metadata, size)


def _raw_tensor(path: Path, name: str, info, base: int, size: int) -> RawTensor:
    where = f"{path}: header lies: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise FileFormatError(f"{path}: corrupt safetensors header: tensor {name!r} lacks dtype/shape/data_offsets")
    st = info["dtype"] if isinstance(info["dtype"], str) and info["dtype"] in _ST else None
    if st is None:
        raise FileFormatError(f"{path}: tensor {name!r} has unsupported dtype {_short(info['dtype'])}")
    shape, offsets = check_shape(info["shape"], f"{where}: field shape"), info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise FileFormatError(f"{where}: bad data_offsets {_short(offsets)}")
    need = math.prod(shape) * ST_ITEMSIZES[st]
    if offsets[1] - offsets[0] != need:
        raise FileFormatError(f"{where}: {st} {shape} needs {need} bytes but its offsets span "
                              f"{offsets[1] - offsets[0]}")
    if base + offsets[1] > size:
        raise FileFormatError(f"{where}: data ends at byte {base + offsets[1]}, beyond the end of the file ({size} "
                              "bytes; truncated?)")
    return RawTensor(name, st, shape, base + offsets[0], base + offsets[1])


# ------------------------------------------------------------------------------------------------------ .npy
# numpy dtype (kind, bytes per element) -> the torch attribute name of the dtype torch.from_numpy gives it: the numpy
# dtypes kvtool reads (tests/io/test_npy_header.py checks the table against torch.from_numpy for every numpy type).
NPY_TORCH_DTYPES = {
    ("b", 1): "bool", ("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32", ("u", 8): "uint64",
    ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32", ("i", 8): "int64", ("f", 2): "float16",
    ("f", 4): "float32", ("f", 8): "float64", ("c", 8): "complex64", ("c", 16): "complex128",
}


@dataclass(frozen=True)
class NpyHeader:
    """An .npy file's array: `dtype` the numpy dtype as stored, `torch_name` its torch dtype's attribute name (from
    NPY_TORCH_DTYPES), data at byte `offset`, `nbytes` of it; `whole`: Fortran order, big-endian or 0-d (a reader
    cannot stream it row by row)."""

    shape: tuple[int, ...]
    dtype: object  # numpy.dtype
    torch_name: str
    itemsize: int
    offset: int
    nbytes: int
    whole: bool


def read_npy_header(path: Path) -> NpyHeader:
    """Parse and validate an .npy header (numpy's parser, `allow_pickle` never used) without reading the array.
    Raises FileFormatError for a corrupt or truncated file or an array of Python objects, InputError for a dtype
    torch has no type for."""
    import numpy as np

    path = Path(path)
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)  # version 3.0 differs from 2.0 only in the header's text encoding
            offset = f.tell()
        except Exception as err:  # noqa: BLE001 - numpy's header parser raises ValueError, SyntaxError, TokenError...
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise FileFormatError(f"{path}: corrupt .npy file ({first})") from None
    if dtype.hasobject:
        raise FileFormatError(f"{path}: the .npy array holds Python objects; kvtool never unpickles")
    torch_name = NPY_TORCH_DTYPES.get((dtype.kind, dtype.itemsize))  # structured dtypes are kind "V": refused
    if torch_name is None:
        raise InputError(f"{path}: unsupported .npy dtype {dtype}")
    need = math.prod(shape) * dtype.itemsize
    if offset + need > path.stat().st_size:
        raise FileFormatError(f"{path}: truncated .npy: {list(shape)} {dtype} needs {need} data bytes")
    return NpyHeader(tuple(shape), dtype, torch_name, dtype.itemsize, offset, need,
                     bool(fortran or len(shape) == 0 or not dtype.isnative))


def check_input_path(path: Path) -> None:
    """InputError unless `path` exists and is not a directory (the first check of every reader)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a file")


def input_kind(path: Path) -> str:
    """Which reader a file (not an engine dump) goes to, by its first bytes, then its suffix: `npy`, `torch` (a zip
    or a .pt / .pth file), `bin` (a raw engine dump: it needs --layout) or `safetensors`. InputError if unreadable."""
    try:
        with open(path, "rb") as f:
            magic = f.read(8)
    except OSError as err:
        raise InputError(f"{path}: cannot read: {err.strerror or err}") from None
    suffix = Path(path).suffix.lower()
    if magic.startswith(NPY_MAGIC) or suffix == ".npy":
        return "npy"
    if magic.startswith(ZIP_MAGIC) or suffix in TORCH_SUFFIXES:
        return "torch"
    return "bin" if suffix == ".bin" else "safetensors"


def select(names: list[str], include: list[str] | None, exclude: list[str] | None) -> list[str]:
    """Names matching any --include glob (all when none) and no --exclude glob (fnmatch, case-sensitive)."""
    from fnmatch import fnmatchcase

    inc = list(include or [])
    exc = list(exclude or [])
    return [n for n in names if (not inc or any(fnmatchcase(n, g) for g in inc))
            and not any(fnmatchcase(n, g) for g in exc)]
