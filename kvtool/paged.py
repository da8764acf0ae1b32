"""The paged cache (SPEC section 5), as engines hold it, with the plain-torch store and gather that kernels must equal.

One layer's cache of one kind (K, V, or the index keys) is a single uint8 buffer `data` [num_pages, H, page_bytes].
Per page and head the bytes are `[P x payload][P x scale]`: P tokens' payloads (D * bits / 8 bytes each), then their
scales (D / block bytes for nvfp4 / mxfp4, 4 bytes of fp32 for fp8 `token`, none otherwise). A token's slot is
`page * P + offset`; slot -1 means "skip this token". With P = 128 and mxfp4 at D = 128 this is vLLM's 8704-byte page.

Whole-tensor scales (fp8 `tensor`, nvfp4 `auto`) come from `tensor_amax`, fixed when the cache is created (engines
calibrate it; if none is given, the first store's amax is taken and frozen), so every store uses the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.errors import InputError
from kvtool.formats import Format, QTensor
from kvtool.formats.codecs import fp8_row_scale
from kvtool.formats.kernel_desc import check_slots, kernel_desc, qtensor_of_bytes

__all__ = ["PagedCache", "contiguous_slots"]


@dataclass
class PagedCache:
    fmt: Format
    page_size: int
    num_heads: int
    head_dim: int
    data: torch.Tensor  # uint8 [num_pages, num_heads, page_bytes]
    tensor_amax: float | None = None

    @classmethod
    def allocate(cls, fmt: Format, num_pages: int, page_size: int, num_heads: int, head_dim: int,
                 device: str | torch.device = "cpu", tensor_amax: float | None = None) -> "PagedCache":
        fmt.check_dim(head_dim, "cache")
        page_bytes = page_size * (fmt.payload_bytes(head_dim) + fmt.scale_bytes(head_dim))
        data = torch.zeros(num_pages, num_heads, page_bytes, dtype=torch.uint8, device=device)
        return cls(fmt, page_size, num_heads, head_dim, data, tensor_amax)

    # ------------------------------------------------------------------------------------------------ geometry
    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def payload_bytes(self) -> int:
        """Payload bytes per token and head."""
        return self.fmt.payload_bytes(self.head_dim)

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per token and head (0 when the format has no per-token scale)."""
        return self.fmt.scale_bytes(self.head_dim)

    @property
    def page_bytes(self) -> int:
        return self.data.shape[-1]

    def payload_plane(self) -> torch.Tensor:
        """View [num_pages, H, P, payload_bytes] of the payload bytes."""
        n = self.page_size * self.payload_bytes
        return self.data[..., :n].unflatten(-1, (self.page_size, self.payload_bytes))

    def scale_plane(self) -> torch.Tensor:
        """View [num_pages, H, P, scale_bytes] of the scale bytes (empty last dim when there are none)."""
        n = self.page_size * self.payload_bytes
        return self.data[..., n:].unflatten(-1, (self.page_size, self.scale_bytes))

    # ------------------------------------------------------------------------------------------- whole-tensor scales
    def tensor_amax_tensor(self) -> torch.Tensor | None:
        return None if self.tensor_amax is None else torch.tensor(self.tensor_amax, dtype=torch.float32)

    def fp8_tensor_scale(self) -> float:
        """fp8 `tensor` scale `s` (fp32 value) implied by `tensor_amax`."""
        return float(fp8_row_scale(self.tensor_amax_tensor(), ds_floor=False, pow2=False))

    def outer_scale(self) -> float:
        """nvfp4 decode-direction outer scale g_dec implied by the format and `tensor_amax` (1 for other formats)."""
        if not kernel_desc(self.fmt).outer_scale:
            return 1.0
        return self.fmt.outer_scale_value(self.tensor_amax_tensor())  # an engine recipe's value in its direction

    def freeze_tensor_amax(self, x: torch.Tensor) -> None:
        if self.fmt.needs_tensor_amax and self.tensor_amax is None:
            self.tensor_amax = float(x.detach().abs().amax().float().cpu()) if x.numel() else 0.0

    # ---------------------------------------------------------------------------------------------------- checks
    def check_store_args(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if x.dim() != 3 or tuple(x.shape[1:]) != (self.num_heads, self.head_dim):
            raise InputError(f"store: x must be [N, {self.num_heads}, {self.head_dim}], got {list(x.shape)}")
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] != x.shape[0]:
            raise InputError(f"store: slot_mapping must be [{x.shape[0]}], got {list(slot_mapping.shape)}")
        if slot_mapping.dtype not in (torch.int64, torch.int32):
            raise InputError(f"store: slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
        check_slots(slot_mapping, self.num_slots, allow_skip=True)

    # ------------------------------------------------------------------------------------- torch reference paths
    def store(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize x [N, H, D] (bf16/fp16/fp32) and write token i to slot `slot_mapping[i]` (-1: skip)."""
        self.check_store_args(x, slot_mapping)
        self.freeze_tensor_amax(x)
        keep = slot_mapping >= 0
        x, slots = x[keep], slot_mapping[keep].long()
        if x.shape[0] == 0:
            return
        q = self.fmt.quantize(x, tensor_amax=self.tensor_amax_tensor(), name="store")
        page, off = slots // self.page_size, slots % self.page_size
        payload = q.payload.contiguous().view(torch.uint8).to(self.data.device)
        self.payload_plane()[page, :, off] = payload.reshape(x.shape[0], self.num_heads, self.payload_bytes)
        if self.scale_bytes:
            scales = q.scales.contiguous().view(torch.uint8).to(self.data.device)
            self.scale_plane()[page, :, off] = scales.reshape(x.shape[0], self.num_heads, self.scale_bytes)

    def gather(self, slots: torch.Tensor) -> QTensor:
        """The quantized tokens at `slots` [N] (all valid) as a QTensor of logical shape [N, H, D]."""
        check_slots(slots, self.num_slots, allow_skip=False)
        slots = slots.long().to(self.data.device)
        page, off = slots // self.page_size, slots % self.page_size
        payload = self.payload_plane()[page, :, off].contiguous()  # [N, H, PB]
        scales = self.scale_plane()[page, :, off].contiguous() if self.scale_bytes else None  # [N, H, SB]
        tensor_scale = None
        if self.fmt.scale_element == "fp32-tensor":
            tensor_scale = torch.tensor(self.fp8_tensor_scale(), dtype=torch.float32, device=self.data.device)
        shape = (slots.shape[0], self.num_heads, self.head_dim)
        return qtensor_of_bytes(self.fmt, payload, scales, shape, lead=shape[:2], tensor_scale=tensor_scale,
                                outer_scale=self.outer_scale())

    def dequantize(self, slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded values [N, H, D] of the tokens at `slots`."""
        return self.gather(slots).dequantize(dtype)

    # --------------------------------------------------------------------------- backend choice (torch or Triton)
    def store_(self, x: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "auto") -> None:
        """`store` on either backend (`kvtool.backend.store`): Triton on CUDA under `auto`, the same bytes."""
        from kvtool.backend import store

        store(self, x, slot_mapping, backend)

    def dequantize_(self, slots: torch.Tensor, dtype: torch.dtype = torch.float32, backend: str = "auto"
                    ) -> torch.Tensor:
        """`dequantize` on either backend (`kvtool.backend.gather_dequantize`): the same values."""
        from kvtool.backend import gather_dequantize

        return gather_dequantize(self, slots, dtype, backend)


def contiguous_slots(context_lens: list[int], page_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A block table that gives each request its own run of pages: returns (block_table [B, max_pages] int32, padded
    with -1, and per request the slot ids [len] of its tokens in order). Handy for tests and synthetic runs."""
    pages = [(n + page_size - 1) // page_size for n in context_lens]
    width = max(pages + [1])
    table = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    slots, start = [], 0
    for b, (n, p) in enumerate(zip(context_lens, pages)):
        table[b, :p] = torch.arange(start, start + p, dtype=torch.int32)
        slots.append(start * page_size + torch.arange(n, dtype=torch.int64))
        start += p
    return table, slots
