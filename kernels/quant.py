"""Whole-tensor quantize / dequantize on the GPU (what `kvtool quantize/dequantize --device cuda` runs): the store and
dequantize kernels in their planes mode. `triton_quantize(fmt, x)` returns the same QTensor as `fmt.quantize(x)`
(payload, scales and outer scale, byte for byte); `triton_dequantize(q)` the same values as `q.dequantize()`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvtool.errors import InputError, KernelArgumentError
from kvtool.formats import Format, QTensor, require_finite
from kvtool.formats.codecs import fp8_row_scale, nvfp4_outer_scale
from kvtool.formats.kernel_desc import qtensor_of_bytes
from kvtool.kernels.dequant import OUTPUT_DTYPES, check_output_dtype, launch_dequant
from kvtool.kernels.store import check_floating, launch_store

__all__ = ["triton_dequantize", "triton_quantize"]


def triton_quantize(fmt: Format, x: torch.Tensor, tensor_amax: torch.Tensor | None = None, *,
                    check_finite: bool = True, config: tuple[int, int] | None = None,
                    variant: Mapping[str, object] | None = None) -> QTensor:
    """Quantize x [..., D] (bf16 / fp16 / fp32, on CUDA or under the interpreter) along its last dimension.

    Returns QTensor(fmt, payload, scales, outer_scale, x.shape) with the torch path's types: payload uint8
    [..., D * bits / 8] (bf16 [..., D] for bf16), scales uint8 [..., D / block] (nvfp4 / mxfp4), fp32 [..., 1] (fp8
    token), a 0-dim fp32 tensor (fp8 tensor) or None. `tensor_amax` (fp32 scalar tensor) stands in for the whole
    tensor's amax when x is a chunk (fp8 tensor scale, nvfp4 `auto`). Non-finite input raises InputError unless
    `check_finite` is False (that check is an extra pass over x). `config` / `variant`: the store's launch overrides
    (`store.launch_store`; tests and sweeps)."""
    if not x.is_floating_point():
        raise InputError(f"quantize: dtype {x.dtype} is not floating point")
    if x.dim() == 0:
        raise InputError("quantize: a scalar cannot be quantized along a last dimension")
    D = x.shape[-1]
    fmt.check_dim(D, "quantize")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.float()
    x2 = x.reshape(-1, D)
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    check_floating(x2, "quantize: x")
    if check_finite:
        require_finite(x, "quantize")
    rows, lead = x2.shape[0], tuple(x.shape[:-1])
    g_dec, tensor_scale, scales_out = 1.0, 1.0, None  # scales_out: the fp8 `tensor` scale, 0-dim
    if fmt.outer_scale is not None:  # nvfp4: fp32 outer scale from the tensor (or the given) amax
        g_dec = nvfp4_outer_scale(fmt, x2, tensor_amax)
    payload = torch.empty(rows, fmt.payload_bytes(D), dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, fmt.scale_bytes(D), dtype=torch.uint8, device=x.device)
    if fmt.scale_element == "fp32-tensor":
        amax = x2.abs().amax() if tensor_amax is None else tensor_amax.float()
        scales_out = fp8_row_scale(amax.reshape(()), ds_floor=False, pow2=False).to(x.device)
        tensor_scale = float(scales_out)
    launch_store(x2.unsqueeze(1), None, payload, scales if scales.numel() else None, fmt, tensor_scale=tensor_scale,
                 g_dec=g_dec, config=config, variant=variant)
    return qtensor_of_bytes(fmt, payload, scales, tuple(x.shape), lead=lead, tensor_scale=scales_out, outer_scale=g_dec)


def triton_dequantize(q: QTensor, dtype: torch.dtype = torch.float32, *,
                      config: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode a QTensor (payload [..., PB] on CUDA or under the interpreter) to a floating `dtype` [..., D]: the same
    values, bit for bit, as `q.dequantize(dtype)`. fp32 / bf16 / fp16 come out of the kernel; any other floating dtype
    is the kernel's fp32 cast by torch, as the torch path casts its fp32 result."""
    fmt = q.fmt
    if dtype.is_floating_point and dtype not in OUTPUT_DTYPES:
        return triton_dequantize(q, torch.float32, config=config).to(dtype)
    check_output_dtype(dtype)
    payload = q.payload
    if payload.dtype == torch.bfloat16:
        payload = payload.view(torch.uint8)
    if payload.dtype != torch.uint8:
        raise KernelArgumentError(f"dequantize: payload dtype {q.payload.dtype} is not uint8 (or bf16 for bf16)")
    D = q.shape[-1] if q.shape else 0
    if payload.dim() == 0 or payload.shape[-1] != fmt.payload_bytes(D):
        raise KernelArgumentError(f"dequantize: payload {list(q.payload.shape)} does not hold rows of {D} elements "
                                  f"in {fmt.label} ({fmt.payload_bytes(D)} bytes each)")
    lead = tuple(payload.shape[:-1])
    payload = payload.reshape(-1, payload.shape[-1]).contiguous()
    rows = payload.shape[0]
    scales, tensor_scale = None, 1.0
    if fmt.scale_element in ("e4m3", "e8m0", "fp32-row"):
        if q.scales is None or q.scales.numel() != rows * (fmt.scale_bytes(D) // q.scales.element_size()):
            raise KernelArgumentError(f"dequantize: scales {None if q.scales is None else list(q.scales.shape)} do "
                                      f"not match {rows} rows of {fmt.label}")
        scales = q.scales.contiguous().view(torch.uint8).reshape(rows, fmt.scale_bytes(D))
        if scales.device != payload.device:
            raise KernelArgumentError(f"dequantize: scales on {scales.device}, payload on {payload.device}")
    elif fmt.scale_element == "fp32-tensor":
        tensor_scale = float(q.scales)
    out = torch.empty(rows, 1, D, dtype=dtype, device=payload.device)
    launch_dequant(payload, scales, None, out, fmt, tensor_scale=tensor_scale, g_dec=q.outer_scale, config=config)
    return out.reshape(*lead, D)
