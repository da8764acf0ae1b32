"""The kernel-facing view of a Format, as data: the numbers a Triton kernel is specialized on, and the one function
that turns a format's row bytes (what the kernels write and the paged pages hold) into its QTensor.

Kernels take raw tensors plus this descriptor and know nothing of caches, indexer configs or format families: the
element is named by its code (not guessed from the payload bit width, which an E5M2 or an int8 element would share
with E4M3), and the scale kinds are numbered here once for every kernel. Pure Python: importing it costs no Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvtool.errors import LayoutError

__all__ = [
    "BLOCK_SCALES", "ELEMENTS", "ELEMENT_BITS", "KernelDesc", "SCALES", "check_slots", "kernel_desc", "qtensor_of_bytes"
]

# Element codes: the payload's element (bf16 is the payload itself).
ELEMENTS = ("bf16", "e4m3", "e2m1")
ELEM_BF16, ELEM_E4M3, ELEM_E2M1 = range(len(ELEMENTS))
ELEMENT_BITS = {"bf16": 16, "e4m3": 8, "e2m1": 4}

# Scale kind codes, one numbering for every kernel. Readers that take a whole-tensor scale as a runtime scalar see
# `token_scale`, where fp32-tensor reads as none; only the store and dequantize kernels tell the two apart (`scale`).
SCALES = ("none", "fp32-row", "e4m3", "e8m0", "fp32-tensor")
SCALE_NONE, SCALE_ROW, SCALE_E4M3, SCALE_E8M0, SCALE_TENSOR = range(len(SCALES))
BLOCK_SCALES = (SCALE_E4M3, SCALE_E8M0)  # one byte per `block` elements


@dataclass(frozen=True)
class KernelDesc:
    """What a kernel needs of a format: element and scale codes, the block, the bytes per row of `dim` elements
    (`payload_bytes(dim)`, `scale_bytes(dim)`), and the codec options as integers (rounding rule, NVFP4 recipe,
    fp8 scale options). `outer_scale`: the format carries a decode-direction fp32 outer scale (NVFP4's g_dec)."""

    label: str
    elem: int
    payload_bits: int
    scale: int
    token_scale: int
    block: int
    outer_scale: bool
    rule: int
    recipe: int
    ds_floor: bool
    pow2: bool
    scale_unit_bytes: int  # bytes of one per-row or per-block scale (0: none kept per row)

    def payload_bytes(self, dim: int) -> int:
        return dim * self.payload_bits // 8

    def scale_bytes(self, dim: int) -> int:
        if self.scale == SCALE_ROW:
            return self.scale_unit_bytes
        return dim // self.block * self.scale_unit_bytes if self.block else 0

    @property
    def element(self) -> str:
        return ELEMENTS[self.elem]


@functools.lru_cache(maxsize=256)
def kernel_desc(fmt) -> KernelDesc:
    """The descriptor of a `kvtool.formats.Format` (memoized: formats are frozen)."""
    from kvtool.formats.registry import SCALE_ELEMENT_BYTES

    elem = fmt.element.name if fmt.element is not None else "bf16"
    if elem not in ELEMENTS or ELEMENT_BITS[elem] != fmt.spec.payload_bits:
        raise ValueError(f"{fmt.label}: element {elem!r} at {fmt.spec.payload_bits} bits has no kernel code")
    scale = SCALES.index(fmt.scale_element)
    return KernelDesc(
        label=fmt.label, elem=ELEMENTS.index(elem), payload_bits=fmt.spec.payload_bits, scale=scale,
        token_scale=SCALE_NONE if scale == SCALE_TENSOR else scale, block=fmt.block,
        outer_scale=fmt.spec.has_outer_scale, rule=int(fmt.scale_rule or 0), recipe=int(fmt.recipe or 0),
        ds_floor=bool(fmt.ds_floor), pow2=bool(fmt.pow2), scale_unit_bytes=SCALE_ELEMENT_BYTES[fmt.scale_element])


def check_slots(slots: torch.Tensor, num_slots: int, allow_skip: bool) -> None:
    """Slot ids of a paged buffer (`page * P + offset`) must lie in [0, num_slots), or be -1 (skip the token) where
    `allow_skip`: the torch store / gather and the kernels' `validate` check the same range (a host sync)."""
    if slots.numel() == 0:
        return
    low = -1 if allow_skip else 0
    lo, hi = int(slots.min()), int(slots.max())
    if lo < low or hi >= num_slots:
        raise LayoutError(f"slot ids must lie in [{low}, {num_slots}), got [{lo}, {hi}]")


def qtensor_of_bytes(fmt, payload: torch.Tensor, scales: torch.Tensor | None, shape: tuple[int, ...], *,
                     lead: tuple[int, ...], tensor_scale: torch.Tensor | None = None, outer_scale: float = 1.0):
    """The QTensor of rows in `fmt`'s byte layout, with the torch codec's types: `payload` uint8 [rows, PB] (viewed
    as bf16 for a bf16 payload), `scales` uint8 [rows, SB] (block scales stay bytes; a per-row fp32 scale is viewed
    as fp32 [..., 1]), `tensor_scale` the 0-dim fp32 scale of a whole-tensor-scaled format. `lead` is the shape of
    the rows (`shape` without its last dim for a plain tensor; [N, H] for paged tokens)."""
    from kvtool.formats.registry import QTensor

    d = kernel_desc(fmt)
    payload = payload.reshape(*lead, payload.shape[-1])
    if d.elem == ELEM_BF16:
        payload = payload.view(torch.bfloat16)
    out_scales = None
    if d.scale in BLOCK_SCALES:
        out_scales = scales.reshape(*lead, scales.shape[-1])
    elif d.scale == SCALE_ROW:
        out_scales = scales.contiguous().view(torch.float32).reshape(*lead, 1)
    elif d.scale == SCALE_TENSOR:
        out_scales = tensor_scale
    return QTensor(fmt, payload, out_scales, outer_scale, tuple(shape))
