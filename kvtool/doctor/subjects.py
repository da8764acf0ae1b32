"""What the doctor examines: every tensor of an input as a `Subject` (its declared reading: quantized planes, plain
values or integer ids), loaded through kvtool's own readers (kvtool files, plain safetensors, .pt, .npy) and
layouts (raw engine dumps with --layout / --geometry).

A plain fp8 tensor (torch float8_e4m3fn / float8_e4m3fnuz, safetensors F8_E4M3) is a unit-scale fp8 cache whose
declared element is the dtype's; `fp8_element` overrides what a reader of raw fp8 bytes takes them for.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtool.errors import InputError
from kvtool.formats import QTensor, get_format
from kvtool.readers import open_input

__all__ = ["FP8_DTYPES", "HALF_DTYPES", "LAYER_RE", "Subject", "load_subjects", "page_of", "subject_from_tensor"]

LAYER_RE = re.compile(r"(?:^|\.)(?:layers?|blocks?|h)\.(\d+)(?:\.|$)")
FP8_DTYPES = {torch.float8_e4m3fn: "fn", torch.float8_e4m3fnuz: "fnuz"}
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Subject:
    """One tensor as declared. Exactly one of `q` (quantized planes, logical shape [..., D]) and `values` (a plain
    tensor as stored: float or integer) is set. `fp8_element`: fn | fnuz, how the declared reader decodes fp8 bytes.
    `geometry` (layouts.Geometry) when read from an engine dump; `kind` the input kind (kvtool, safetensors, pt, npy,
    layout:NAME)."""

    name: str
    kind: str
    q: QTensor | None = None
    values: torch.Tensor | None = None
    fp8_element: str = "fn"
    geometry: object = None
    extra: dict = field(default_factory=dict)

    @property
    def layer(self) -> int | None:
        m = LAYER_RE.search(self.name)
        return int(m.group(1)) if m else None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape) if self.q is not None else tuple(self.values.shape)

    @property
    def heads(self) -> int:
        """Heads of a [..., H, D] tensor (token-major); 1 for [N, D]."""
        return self.shape[-2] if len(self.shape) >= 3 else 1

    @property
    def dim(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if self.shape else 1

    @property
    def family(self) -> str | None:
        return self.q.fmt.family if self.q is not None else None

    @property
    def is_ids(self) -> bool:
        return self.values is not None and not self.values.is_floating_point() and self.values.dtype != torch.bool \
            and self.values.dtype != torch.uint8

    @property
    def is_half(self) -> bool:
        if self.q is not None:
            return not self.q.fmt.is_quantized  # a bf16 cache: the payload is the half values
        return self.values is not None and self.values.dtype in HALF_DTYPES

    def half_bits(self) -> tuple[torch.Tensor, torch.dtype]:
        """(int16 bits [rows, D], declared half dtype) of a bf16 cache or a plain half tensor."""
        t = self.q.payload if self.q is not None else self.values
        return t.contiguous().view(torch.int16).reshape(self.rows, self.dim), t.dtype

    def payload_rows(self) -> torch.Tensor:
        """Payload bytes [rows, bytes per row] (uint8)."""
        return self.q.payload.contiguous().view(torch.uint8).reshape(self.rows, -1)

    def scale_rows(self) -> torch.Tensor | None:
        """Per-row scales [rows, S] (uint8 block scales or fp32 row scales); None for unit / tensor / bf16."""
        s = self.q.scales
        if s is None or s.dim() == 0 or s.numel() == 1 and self.rows != 1:
            return None
        return s.contiguous().reshape(self.rows, -1)

    def head_of_rows(self) -> torch.Tensor:
        return torch.arange(self.rows) % self.heads


def _logical(q: QTensor, shape: tuple[int, ...]) -> QTensor:
    """A QTensor read as [rows, D] reshaped to its logical shape (payload and per-row scales alike)."""
    lead = tuple(shape[:-1])
    payload = q.payload.reshape(*lead, -1)
    scales = q.scales
    if scales is not None and scales.dim() > 0 and not (scales.numel() == 1 and math.prod(lead) != 1):
        scales = scales.reshape(*lead, -1)
    return QTensor(q.fmt, payload, scales, q.outer_scale, tuple(shape), dict(q.extra))


def subject_from_tensor(name: str, t: torch.Tensor, kind: str = "tensor", fp8_element: str | None = None) -> Subject:
    """A plain tensor as a Subject (fp8 dtypes become unit-scale fp8 caches with their element)."""
    t = t.detach().cpu()
    if t.dtype in FP8_DTYPES:
        codes = t.contiguous().view(torch.uint8)
        q = QTensor(get_format("fp8"), codes, None, 1.0, tuple(t.shape))
        return Subject(name, kind, q=q, fp8_element=fp8_element or FP8_DTYPES[t.dtype])
    if t.dim() == 0:
        t = t.reshape(1)
    return Subject(name, kind, values=t.contiguous())


def load_subjects(source, layout: str | None = None, geometry: str | None = None,
                  fp8_element: str | None = None) -> tuple[str, str, list[Subject], dict]:
    """(path text, kind, subjects, layout info) of `source`: a path (any input kvtool reads), a {name: tensor or
    QTensor} mapping, or one tensor / QTensor. Layout info: {'warnings': {name: [...]}} from the layout reader."""
    if isinstance(source, (torch.Tensor, QTensor)):
        source = {"tensor": source}
    if isinstance(source, dict):
        subjects = []
        for name, t in source.items():
            if isinstance(t, QTensor):
                subjects.append(Subject(name, "memory", q=t, fp8_element=fp8_element or "fn"))
            elif isinstance(t, torch.Tensor):
                subjects.append(subject_from_tensor(name, t, "memory", fp8_element))
            else:
                raise InputError(f"{name}: a {type(t).__name__} is neither a tensor nor a QTensor")
        return "<memory>", "memory", subjects, {}
    path = Path(source)
    subjects = []
    # verify=False: the doctor must see a broken file's NaN scales and odd codes, not stop at them (the checksum
    # check is `kvtool inspect --verify`'s job)
    with open_input(path, layout, geometry, verify=False) as inp:
        for name, e in inp.entries.items():
            if e.quantized:
                q = _logical(e.read_q(0, e.rows), e.shape)
                subjects.append(Subject(name, inp.kind, q=q, fp8_element=fp8_element or "fn"))
            else:
                values = e.read(0, e.rows).reshape(e.shape)
                subjects.append(subject_from_tensor(name, values, inp.kind, fp8_element))
        info = {"warnings": dict(inp.warnings)}
    return str(path), inp.kind, subjects, info


def page_of(s: Subject, default: int) -> int:
    """Tokens per page: the dump's geometry's (when paged), else `default` (slot-per-token layouts and files)."""
    page = getattr(s.geometry, "page", 1) if s.geometry is not None else 1
    return page if page > 1 else default
