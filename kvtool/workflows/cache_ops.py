"""`quantize` and `dequantize` workflows: stream an input file tensor by tensor and row block by row block into a
kvtool cache file (or back into plain safetensors), with memory bounded by the chunk size, not the file size.

Re-quantizing an already-quantized input: each such tensor is DECODED to fp32 first and then quantized to the target
format, with a hint on stderr (the two rounding errors compound; quantize the original when you have it). Tensors that
`--include/--exclude` leave out are copied unchanged (plain tensors as they are, quantized ones with their planes).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvtool import backend as dispatch
from kvtool.backend import resolve_backend, resolve_device
from kvtool.container import (
    CacheEntry,
    SafetensorsWriter,
    check_output,
    DTYPE_NAMES,
    dtype_name,
    kvtool_metadata,
    parse_dtype,
    passthrough_record,
    placeholder_checksum,
    plane_specs,
    write_metadata,
)
from kvtool.errors import InputError, KvtoolError
from kvtool.formats import Format, QTensor, get_format
from kvtool.readers import Entry, InputFile, check_finite_rows, open_input, row_chunks, select

__all__ = ["CacheOpReport", "Hint", "Progress", "TensorResult", "chunk_bytes", "dequantize_file", "dequantize_tensor",
           "quantize_file", "quantize_tensor", "tensor_amax"]

Progress = Callable[[int, int, str], None]  # (units done, units total, what) -> None
Hint = Callable[[str], None]


@dataclass
class TensorResult:
    name: str
    action: str  # quantized | requantized | copied | dequantized
    format: str  # the format label, or the dtype name of a plain tensor
    shape: list[int]
    dtype_in: str
    bytes_in: int
    bytes_out: int
    bytes_per_token: int  # per token per head, i.e. per row of D elements
    compression_vs_bf16: float
    outer_scale: float | None = None
    tensor_scale: float | None = None


@dataclass
class CacheOpReport:
    command: str  # quantize | dequantize
    input: str
    output: str
    format: str | None  # target format label (quantize) or output dtype (dequantize; None = each original dtype)
    device: str
    chunk_mb: float
    tensors: list[TensorResult] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    hints: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ one tensor
def quantize_tensor(fmt: Format, x: torch.Tensor, tensor_amax: torch.Tensor | None, backend: str, *,
                    name: str = "tensor", check_finite: bool = True) -> QTensor:
    """Quantize floating `x` [..., D] (on the backend's device) to `fmt` along its last dimension, through the one
    dispatch (`kvtool.backend.quantize`: "torch" is the bit-exact reference, "triton" the kernel). `tensor_amax`
    (fp32 scalar) is the whole tensor's amax when `x` is a chunk of it."""
    return dispatch.quantize(fmt, x, tensor_amax, backend, name=name, check_finite=check_finite)


def dequantize_tensor(q: QTensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """Decode `q` to `dtype` [..., D] through the one dispatch (`kvtool.backend.dequantize`)."""
    return dispatch.dequantize(q, dtype, backend)


def tensor_amax(entry: Entry, chunk_bytes: int, tick: Callable[[int, str], None] | None = None) -> torch.Tensor:
    """First streaming pass: fp32 max |x| over the whole entry (also rejects NaN/Inf, naming the global index).
    `tick(rows, what)` reports progress."""
    amax = torch.zeros((), dtype=torch.float32)
    for a, b in row_chunks(entry.rows, entry.dim, chunk_bytes):
        x = entry.read(a, b)
        check_finite_rows(x, entry.name, entry.shape, a)
        if x.numel():
            amax = torch.maximum(amax, x.abs().amax().float())
        if tick:
            tick(b - a, f"{entry.name} (amax pass)")
    return amax


# ------------------------------------------------------------------------------------------------ quantize
def quantize_file(src: Path | InputFile, out: Path, to: str, *, options: dict | None = None,
                  include: list[str] | None = None, exclude: list[str] | None = None, device: str = "cpu",
                  chunk_mb: float = 64.0, layout: str | None = None, geometry: str | None = None,
                  progress: Progress | None = None,
                  hint: Hint | None = None, backend: str = "auto", verify: bool = True) -> CacheOpReport:
    """Quantize the selected floating tensors of `src` to format `to` (+ recipe `options`, see get_format) and write
    a kvtool cache file at `out` (atomically). `src` is a path, or an opened `InputFile` (in-memory tensors, as
    `kvtool.save` passes them; there an empty selection copies every tensor). Memory is bounded by `chunk_mb` of
    fp32 per row block. `backend` (auto|torch|triton, see kvtool.backend) picks the codec path; auto = Triton on
    cuda, torch on cpu."""
    fmt = get_format(to, **{k: v for k, v in (options or {}).items() if v is not None})
    dev = resolve_device(device)
    backend = resolve_backend(backend, dev)
    chunk = chunk_bytes(chunk_mb)
    memory = isinstance(src, InputFile)  # kvtool.api.save: tensors in memory, opened as an input
    target = check_output(out, [] if memory else [src])
    report = CacheOpReport("quantize", "<memory>" if memory else str(src), str(target), fmt.label, str(dev),
                           chunk_mb)
    say = _hinter(report, hint)
    with (contextlib.nullcontext(src) if memory else open_input(src, layout, geometry, verify=verify)) as inp:
        for note in inp.notes:
            say(note)
        chosen = set(select(list(inp.entries), include, exclude))
        if not chosen and not memory:
            raise InputError(f"{src}: no tensor matches --include/--exclude (it holds: {_names(inp.entries)})")
        for name, e in inp.entries.items():
            if name in chosen:
                _check_quantizable(e, fmt)
                if e.quantized:
                    say(f"{name} is already {e.fmt.label}: decoding it to fp32 and quantizing that to {fmt.label} "
                        "(the errors compound; quantize the original when you have it)")
        total = sum(e.rows * (2 if e.name in chosen and fmt.needs_tensor_amax else 1) for e in inp.entries.values())
        tick = _ticker(progress, total)
        # Whole-tensor amaxes first, so NaN/Inf are found before anything is written.
        amaxes = {n: tensor_amax(inp.entries[n], chunk, tick) for n in inp.entries
                  if n in chosen and fmt.needs_tensor_amax}
        jobs = [_plan_entry(e, fmt if name in chosen else None) for name, e in inp.entries.items()]
        plan = [p for job in jobs for p in job["planes"]]
        cache_entries = [job["entry"] for job in jobs if job["entry"] is not None]
        copied = [job["source"] for job in jobs if job["entry"] is None]  # passthrough: checksummed too (schema 2)
        placeholders = {e.name: passthrough_record(e.name, e.dtype, e.shape) for e in copied}
        with SafetensorsWriter(target, plan, kvtool_metadata(cache_entries, placeholders)) as writer:
            for job in jobs:
                e, ce = job["source"], job["entry"]
                if ce is None:
                    _copy_plain(writer, e, chunk, tick)
                    action, label = "copied", dtype_name(e.dtype)
                elif job["requantize"]:
                    _quantize_stream(writer, e, ce, amaxes.get(e.name), backend, dev, chunk, tick)
                    action, label = ("requantized" if e.quantized else "quantized"), ce.fmt.label
                else:
                    _copy_quantized(writer, e, ce, chunk, tick)
                    action, label = "copied", ce.fmt.label
                report.tensors.append(_result(e, ce, action, label))

            writer.commit(lambda: write_metadata(writer, cache_entries, [e.name for e in copied]))
    report.bytes_in = sum(t.bytes_in for t in report.tensors)
    report.bytes_out = target.stat().st_size
    return report


def _check_quantizable(e: Entry, fmt: Format) -> None:
    if not e.floating:
        raise InputError(f"{e.name}: dtype {dtype_name(e.dtype)} is not floating point (--exclude it to copy it "
                         "unchanged)")
    if not e.shape:
        raise InputError(f"{e.name}: a scalar cannot be quantized along a last dimension (--exclude it)")
    if e.dim == 0:
        raise InputError(f"{e.name}: shape {list(e.shape)} has a last dimension of 0: no block to quantize along it "
                         "(--exclude it to copy it unchanged; zero rows, e.g. [0, 128], quantize to empty planes)")
    if not e.quantized and e.dtype not in DTYPE_NAMES:
        raise InputError(f"{e.name}: dtype {dtype_name(e.dtype)} is already a low-precision format; kvtool quantizes "
                         f"{'|'.join(DTYPE_NAMES.values())} tensors (--exclude it to copy it unchanged)")
    fmt.check_dim(e.dim, e.name)


def _plan_entry(e: Entry, fmt: Format | None) -> dict:
    """Stored planes and kvtool metadata for one input entry: quantized to `fmt`, or copied as it is (fmt None)."""
    if fmt is None and not e.quantized:
        return {"source": e, "entry": None, "requantize": False, "planes": [(e.name, e.dtype, e.shape)]}
    target = fmt or e.fmt
    (p_dtype, p_shape), scales = plane_specs(target, e.shape)
    ce = CacheEntry(e.name, target, e.shape, dtype_name(e.dtype), f"{e.name}.payload",
                    f"{e.name}.scales" if scales else None, checksum=placeholder_checksum(scales is not None))
    planes = [(ce.payload, p_dtype, p_shape)] + ([(ce.scales, scales[0], scales[1])] if scales else [])
    if fmt is None:  # copied quantized entry keeps its scales
        ce.outer_scale = e.outer_scale
        ce.tensor_scale = float(e.scalar_scale) if e.scalar_scale is not None else None
    return {"source": e, "entry": ce, "requantize": fmt is not None, "planes": planes}


def _quantize_stream(writer, e: Entry, ce: CacheEntry, amax, backend: str, dev, chunk: int, tick) -> None:
    first: QTensor | None = None
    for a, b in row_chunks(e.rows, e.dim, chunk):
        x = e.read(a, b)
        check_finite_rows(x, e.name, e.shape, a)
        q = quantize_tensor(ce.fmt, x.to(dev), None if amax is None else amax.to(dev), backend, name=e.name,
                            check_finite=False)
        first = _write_q(writer, ce, q.to("cpu"), a, first)
        tick(b - a, e.name)
    if first is None:  # an empty tensor: the scales of a zero row stand in
        empty = torch.zeros(1, e.dim)
        _write_q(writer, ce, ce.fmt.quantize(empty, tensor_amax=amax, check_finite=False), 0, None, rows=0)


def _copy_quantized(writer, e: Entry, ce: CacheEntry, chunk: int, tick) -> None:
    first = None
    for a, b in row_chunks(e.rows, e.dim, chunk):
        first = _write_q(writer, ce, e.read_q(a, b), a, first)
        tick(b - a, e.name)
    if first is None:
        _write_q(writer, ce, e.read_q(0, 0), 0, None)


def _write_q(writer, ce: CacheEntry, q: QTensor, row: int, first: QTensor | None, rows: int | None = None):
    """Write one QTensor row block; the first block also fixes the tensor-wide scales in the metadata."""
    n = q.payload.shape[0] if rows is None else rows
    if first is None:
        ce.outer_scale = float(q.outer_scale)
        if q.scales is not None and q.scales.dim() == 0:
            ce.tensor_scale = float(q.scales)
            writer.write_rows(ce.scales, 0, q.scales.reshape(1, 1).float())
    elif float(q.outer_scale) != ce.outer_scale:
        raise KvtoolError(f"internal: {ce.name}: the outer scale changed between row blocks")
    if n:
        writer.write_rows(ce.payload, row, q.payload.reshape(n, -1))
        if q.scales is not None and q.scales.dim() > 0:
            writer.write_rows(ce.scales, row, q.scales.reshape(n, -1))
    return first or q


def _copy_plain(writer, e: Entry, chunk: int, tick) -> None:
    for a, b in row_chunks(e.rows, e.dim, chunk):
        writer.write_rows(e.name, a, e.read(a, b))
        tick(b - a, e.name)


# ------------------------------------------------------------------------------------------------ dequantize
def dequantize_file(src: Path, out: Path, *, dtype: str | None = None, device: str = "cpu", chunk_mb: float = 64.0,
                    layout: str | None = None, geometry: str | None = None, progress: Progress | None = None,
                    hint: Hint | None = None, backend: str = "auto", verify: bool = True) -> CacheOpReport:
    """Decode every quantized tensor of `src` into a plain safetensors file at `out` with the same tensor names and
    shapes as the original input; `dtype` (bf16|fp16|fp32) overrides each tensor's recorded original dtype.
    Plain (passthrough) tensors are copied unchanged. `verify` checks checksums and codes as they are read."""
    out_dtype = parse_dtype(dtype) if dtype else None
    dev = resolve_device(device)
    backend = resolve_backend(backend, dev)
    chunk = chunk_bytes(chunk_mb)
    target = check_output(out, [src])
    report = CacheOpReport("dequantize", str(src), str(target), dtype_name(out_dtype) if out_dtype else None,
                           str(dev), chunk_mb)
    say = _hinter(report, hint)
    with open_input(src, layout, geometry, verify=verify) as inp:
        for note in inp.notes:
            say(note)
        if not any(e.quantized for e in inp.entries.values()):
            raise InputError(f"{src}: holds no quantized tensors (a plain {inp.kind} file); nothing to dequantize")
        dtypes = {n: (out_dtype or e.dtype) if e.quantized else e.dtype for n, e in inp.entries.items()}
        plan = [(n, dtypes[n], e.shape) for n, e in inp.entries.items()]
        tick = _ticker(progress, sum(e.rows for e in inp.entries.values()))
        with SafetensorsWriter(target, plan) as writer:
            for name, e in inp.entries.items():
                for a, b in row_chunks(e.rows, e.dim, chunk):
                    if e.quantized:
                        x = dequantize_tensor(e.read_q(a, b).to(dev), dtypes[name], backend).to("cpu")
                    else:
                        x = e.read(a, b)
                    writer.write_rows(name, a, x)
                    tick(b - a, name)
                d = e.dim * dtypes[name].itemsize
                report.tensors.append(TensorResult(
                    name, "dequantized" if e.quantized else "copied", dtype_name(dtypes[name]), list(e.shape),
                    e.fmt.label if e.quantized else dtype_name(e.dtype), e.nbytes, e.numel * dtypes[name].itemsize,
                    d, round(2 * e.dim / max(d, 1), 4), e.outer_scale if e.quantized else None))
            writer.commit()
    report.bytes_in = sum(t.bytes_in for t in report.tensors)
    report.bytes_out = target.stat().st_size
    return report


# ------------------------------------------------------------------------------------------------ helpers
def chunk_bytes(chunk_mb: float) -> int:
    if not chunk_mb > 0:
        raise KvtoolError(f"--chunk-mb must be positive, got {chunk_mb}")
    return max(1, int(chunk_mb * (1 << 20)))


def _result(e: Entry, ce: CacheEntry | None, action: str, label: str) -> TensorResult:
    if ce is None:
        bpt = e.dim * e.dtype.itemsize
        return TensorResult(e.name, action, label, list(e.shape), dtype_name(e.dtype), e.nbytes, e.nbytes, bpt,
                            round(2 * e.dim / max(bpt, 1), 4))
    bpt = ce.fmt.bytes_per_token(e.dim)
    out_bytes = sum(math.prod(s) * d.itemsize for d, s in filter(None, plane_specs(ce.fmt, e.shape)))
    dtype_in = e.fmt.label if e.quantized else dtype_name(e.dtype)
    return TensorResult(e.name, action, label, list(e.shape), dtype_in, e.nbytes, out_bytes, bpt,
                        round(2 * e.dim / max(bpt, 1), 4), ce.outer_scale, ce.tensor_scale)


def _names(entries: dict, limit: int = 8) -> str:
    names = list(entries)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _hinter(report: CacheOpReport, hint: Hint | None) -> Hint:
    def say(text: str) -> None:
        report.hints.append(text)
        if hint:
            hint(text)

    return say


def _ticker(progress: Progress | None, total: int):
    """Adapt a Progress callback to `tick(rows_done, what)` (amax passes count their rows too)."""
    done = [0]

    def tick(n: int, what: str = "") -> None:
        done[0] += n
        if progress:
            progress(done[0], total, what)

    return tick
