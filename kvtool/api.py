"""The library API for cache files: `load`, `save`, `verify`, `convert` (also as `kvtool.load` and so on).

    import kvtool
    caches = kvtool.load("k_mxfp4.safetensors")          # {name: QTensor | torch.Tensor}, logical shapes
    q = caches["layers.0.k"]                              # QTensor: q.shape (256, 2, 128), q.payload [256, 2, 64] u8
    x = q.dequantize(torch.bfloat16)                      # [256, 2, 128]
    kvtool.save("k_nvfp4.safetensors", {"k": x}, fmt="nvfp4", outer_scale="auto")
    assert all(s == "ok" for s in kvtool.verify("k_nvfp4.safetensors").values())

Shapes are LOGICAL: a quantized tensor of shape [..., D] (quantized along its last dimension D) is a `QTensor` whose
`payload` is [..., D * bits / 8] (uint8; bf16 [..., D] for bf16), whose `scales` are [..., D / block] (uint8 E4M3 or
E8M0), [..., 1] (fp32, fp8 `token`), a 0-d fp32 tensor (fp8 `tensor`) or None, and whose `shape` is [..., D]. A plain
(unquantized) tensor is a `torch.Tensor` with its stored shape and dtype. Files are read and written with the same
code as `kvtool quantize / inspect` (the cache file format is in the README); errors are `kvtool.errors.KvtoolError`
subclasses with a one-line message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Union

import torch

from kvtool.formats import Format, QTensor
from kvtool.readers import Entry, InputFile, open_input, qtensor_entry, select

__all__ = ["convert", "load", "save", "verify"]

Tensors = Mapping[str, Union[torch.Tensor, QTensor]]


def load(path: str | Path, *, include: list[str] | None = None, exclude: list[str] | None = None,
         dequantize: bool | torch.dtype = False, layout: str | None = None,
         geometry: str | None = None) -> dict[str, torch.Tensor | QTensor]:
    """Read every (selected) tensor of a cache file into memory, in file order.

    `path`: a kvtool cache file, plain safetensors, `.pt` (weights_only) or `.npy`, or an engine dump with `layout`
    (a preset name, see `kvtool layouts`) and `geometry` ("format=mxfp4,page=128,heads=2,..."). `include` /
    `exclude`: fnmatch globs on the tensor names. Returns {name: QTensor} for quantized tensors (logical shapes, see
    the module docstring; `q.extra["dtype"]` is the original dtype) and {name: torch.Tensor} for plain ones; with
    `dequantize` (True = fp32, or a floating dtype) quantized tensors come back decoded, [..., D] in that dtype."""
    dtype = torch.float32 if dequantize is True else (dequantize or None)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        from kvtool.errors import InputError

        raise InputError(f"dequantize takes True or a floating torch dtype, got {dequantize!r}")
    out: dict[str, torch.Tensor | QTensor] = {}
    with open_input(Path(path), layout, geometry) as inp:
        for name in select(list(inp.entries), include, exclude):
            e = inp.entries[name]
            if not e.quantized:
                out[name] = e.read(0, e.rows).reshape(e.shape).clone()
            elif dtype is not None:
                out[name] = e.read_q(0, e.rows).dequantize(dtype).reshape(e.shape)
            else:
                out[name] = _logical(e, e.read_q(0, e.rows))
    return out


def _logical(e: Entry, q: QTensor) -> QTensor:
    """A [rows, ...] QTensor of entry `e` with its planes reshaped to the logical leading dimensions."""
    lead = tuple(e.shape[:-1])
    scales = q.scales
    if scales is not None and scales.dim() > 0:
        scales = scales.reshape(*lead, -1).clone()
    return QTensor(q.fmt, q.payload.reshape(*lead, -1).clone(), scales, q.outer_scale, tuple(e.shape),
                   {"dtype": e.dtype})


def save(path: str | Path, tensors: Tensors, fmt: str | Format | None = None, **options) -> Path:
    """Write `tensors` as a kvtool cache file at `path` (atomically: a temporary file, renamed when complete).

    Each `QTensor` is stored as it is (its planes, format and scales). Each floating `torch.Tensor` [..., D] is
    quantized along D to `fmt` (a name or label such as "nvfp4", "mxfp4-floor", or a `Format`) with the recipe
    `options` of `kvtool.formats.get_format` (scale_rule, recipe, outer_scale, fp8_scale); without `fmt`, and for
    non-floating tensors, tensors are stored unchanged (passthrough). Returns the absolute path written."""
    from kvtool.workflows.cache_ops import quantize_file

    if not tensors:
        from kvtool.errors import InputError

        raise InputError("save: no tensors given")
    entries = {name: (qtensor_entry(name, t) if isinstance(t, QTensor) else _memory_entry(name, t))
               for name, t in tensors.items()}
    chosen = [n for n, e in entries.items() if fmt is not None and not e.quantized and e.floating and e.shape]
    label = fmt.label if isinstance(fmt, Format) else (fmt or "bf16")
    report = quantize_file(InputFile(Path("<memory>"), "memory", entries), Path(path), label, options=options,
                           include=chosen or ["\0"])  # no glob matches "\0": an empty selection copies every tensor
    return Path(report.output)


def _memory_entry(name: str, t: torch.Tensor) -> Entry:
    if not isinstance(t, torch.Tensor):
        from kvtool.errors import InputError

        raise InputError(f"save: {name} is a {type(t).__name__}, not a torch.Tensor or QTensor")
    t = t.detach().to("cpu").contiguous()
    view = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return Entry(name, tuple(t.shape), t.dtype, nbytes=t.numel() * t.element_size(),
                 rows_fn=lambda a, b: view[a:b])


def verify(path: str | Path) -> dict[str, str]:
    """Recompute the checksums of a kvtool cache file: {name: "ok" | "mismatch: payload|scales" | "none"} ("none":
    a tensor without a recorded digest, e.g. a plain input file's)."""
    with open_input(Path(path)) as inp:
        return {name: (inp.verify(e) or "none") for name, e in inp.entries.items()}


def convert(src: str | Path, dst: str | Path, *, from_layout: str, to_layout: str, geometry: str | None = None,
            to_geometry: str | None = None, include: list[str] | None = None, exclude: list[str] | None = None):
    """Move a quantized cache's bytes from one engine layout to another (`kvtool convert`; the format is unchanged).
    Returns the `kvtool.layouts.workflows.ConvertReport` (its notes and warnings included)."""
    from kvtool.layouts.workflows import convert_layout

    return convert_layout(Path(src), Path(dst), from_layout, to_layout, geometry, to_geometry, include, exclude)

