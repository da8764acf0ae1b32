"""The `inspect` report, and the torch-free way to it for files that need no decoding.

`kvtool inspect` of a plain safetensors file (no `kvtool.schema`) or of an .npy file reports per tensor what its
header says: dtype, shape, bytes per token, compression against bf16; nothing is decoded and there are no checksums.
Such a report is built here from the header alone (kvtool.st_header: json and struct for safetensors, numpy's header
parser for .npy; no torch), so the command starts in a fraction of the second `import torch` takes. Every other input
(kvtool cache files, whose scale statistics decode scale bytes with the format registry's torch codecs; .pt files and
engine dumps) goes to `kvtool.workflows.inspect.inspect_file`, which imports torch (the CLI's `inspect` tries
`plain_report` first). Both build the plain rows with the one `plain_info`, and the torch path reads headers through
the same `read_raw_header` / `read_npy_header`, so the report (text and --json) and every error message are the same
either way (tests/cli/test_inspect_torch_free.py compares them).

The report dataclasses live here, torch-free; kvtool.workflows.inspect re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvtool.st_header import (
    META_SCHEMA,
    META_VERSION,
    ST_DTYPE_NAMES,
    ST_ITEMSIZES,
    check_input_path,
    input_kind,
    read_npy_header,
    read_raw_header,
    select,
    short_dtype_name,
)

__all__ = ["InspectReport", "ScaleStats", "TensorInfo", "plain_info", "plain_report"]

Progress = Callable[[int, int, str], None]  # (units done, units total, what) -> None, as kvtool.workflows.cache_ops


@dataclass
class ScaleStats:
    element: str  # e8m0 | e4m3 | fp32-row | fp32-tensor | none
    scales: int  # scales counted (all-zero blocks' scales left out)
    min_nonzero: float | None
    max: float | None
    zero_scales: int  # scale value 0 outside all-zero blocks (e.g. nvfp4 scales that rounded to 0)
    nan_scales: int  # E8M0 byte 255
    exponent_histogram: dict[int, int]  # floor(log2 scale) -> count
    blocks: int
    saturated_blocks: int
    zero_blocks: int
    saturated_pct: float | None  # None where nothing clips (saturation "none")
    zero_pct: float
    saturation: str = "element"  # element (top code) | scale (scale at its max) | none: what saturated_blocks counts


@dataclass
class TensorInfo:
    name: str
    format: str  # label (quantized) or "<dtype> plain"
    options: dict  # recipe options of the format (scale_rule, recipe, outer_scale, fp8_scale, ...)
    shape: list[int]
    dtype: str  # original dtype (quantized) or stored dtype (plain)
    bytes_per_token: int
    compression_vs_bf16: float
    stored_bytes: int
    outer_scale: float | None
    tensor_scale: float | None
    checksum: str  # ok | mismatch: ... | unverified | none
    scales: ScaleStats | None


@dataclass
class InspectReport:
    path: str
    kind: str  # kvtool | safetensors | pt | npy | layout:NAME
    schema: int | None
    kvtool_version: str | None
    file_bytes: int
    tensors: list[TensorInfo] = field(default_factory=list)
    verified: bool = False
    ok: bool = True  # False when a verified checksum mismatched
    warnings: list[str] = field(default_factory=list)  # engine dumps: the layout or geometry looks wrong


def plain_info(name: str, shape: tuple[int, ...], dtype: str, itemsize: int, nbytes: int) -> TensorInfo:
    """The row of a plain (unquantized) tensor: `dtype` its report name (bf16, int32, ...), `itemsize` its bytes
    per element; bytes per token are those of one row of D = shape[-1] elements (1 for a scalar)."""
    dim = shape[-1] if shape else 1
    bpt = dim * itemsize
    return TensorInfo(name, f"{dtype} plain", {}, list(shape), dtype, bpt, round(2 * dim / max(bpt, 1), 4), nbytes,
                      None, None, "none", None)


def plain_report(path: Path, *, verify: bool = True, include: list[str] | None = None,
                 exclude: list[str] | None = None, progress: Progress | None = None) -> InspectReport | None:
    """The inspect report of a plain safetensors file or an .npy file from its header alone (the report
    `inspect_file` gives for it), or None when `path` is anything else (then `inspect_file` reads it). Raises the
    FileFormatError / InputError the torch path raises for the file (also for a missing file or a directory).
    Call it without a --layout only (an engine dump with --layout goes to `inspect_file` directly)."""
    path = Path(path)
    check_input_path(path)  # the torch path's first errors: no such file, a directory
    kind = input_kind(path)
    if kind == "npy":
        h = read_npy_header(path)
        report = InspectReport(str(path), "npy", None, None, path.stat().st_size, verified=verify)
        rows = [("tensor", h.shape, h.torch_name, h.itemsize, h.nbytes)]  # one array, named as kvtool.readers names it
    elif kind == "safetensors":
        header = read_raw_header(path)
        if META_SCHEMA in header.metadata:
            return None
        report = InspectReport(str(path), "safetensors", None, header.metadata.get(META_VERSION), header.file_size,
                               verified=verify)
        tensors = sorted(header.tensors.values(), key=lambda t: t.start)  # file order, as kvtool.readers
        rows = [(t.name, t.shape, ST_DTYPE_NAMES[t.st_dtype], ST_ITEMSIZES[t.st_dtype], t.nbytes) for t in tensors]
    else:
        return None
    by_name = {row[0]: row for row in rows}
    names = select(list(by_name), include, exclude)
    count = {n: math.prod(by_name[n][1][:-1]) for n in names}  # rows of D; a scalar is one row
    total, done = sum(count.values()), 0
    for name in names:
        _, shape, torch_name, itemsize, nbytes = by_name[name]
        report.tensors.append(plain_info(name, shape, short_dtype_name(torch_name), itemsize, nbytes))
        done += count[name]
        if progress:
            progress(done, total, name)
    return report
