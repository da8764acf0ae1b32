"""Backend choice in one place (STYLE 17): `backend="auto" | "torch" | "triton"`.

`auto` picks Triton for CUDA tensors and the torch reference for CPU tensors. `triton` on CPU tensors only works under
the Triton interpreter (TRITON_INTERPRET=1, as in the tests). Both paths return the same types and, where the SPEC says
so, the same bytes.
"""

from __future__ import annotations

import torch

from kvtool.errors import KvtoolError
from kvtool.formats import rotation as _rotation
from kvtool.kernels import platform as _platform  # plain torch: no Triton import

__all__ = [
    "BACKENDS", "dequantize", "gather_dequantize", "interpreting", "quantize", "resolve_backend",
    "resolve_check_backend", "resolve_device", "store"
]

BACKENDS = ("auto", "torch", "triton")


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1: CPU tensors, as in the tests): the flag
    `kvtool.kernels.platform` read once at import, the one the kernels were specialized on."""
    return _platform.INTERPRET


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Return "torch" or "triton" for work on `device`."""
    if backend not in BACKENDS:
        raise KvtoolError(f"unknown backend {backend!r} (choose {'|'.join(BACKENDS)})")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        return "triton" if on_cuda else "torch"
    if backend == "triton" and not on_cuda and not interpreting():
        raise KvtoolError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for the interpreter)")
    return backend


def resolve_check_backend(backend: str, device: torch.device) -> tuple[str, str]:
    """The backend of a kernel check (verify-topk, verify-attn) and its report label: as resolve_backend, except that
    under the interpreter on CPU `auto` checks the kernel ("triton-interpreter"), since checking it is the point."""
    if backend == "auto" and device.type == "cpu" and interpreting():
        backend = "triton"
    resolved = resolve_backend(backend, device)
    return resolved, ("triton-interpreter" if resolved == "triton" and device.type == "cpu" else resolved)


def resolve_device(device: str) -> torch.device:
    """Validate a --device value; `cuda` without a GPU is a one-line error, not a traceback."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):  # torch's message for `tpu` is a multi-line list of every device type
        raise KvtoolError(f"unsupported device {device!r} (choose cpu|cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvtoolError("--device cuda was asked for, but torch sees no CUDA device on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise KvtoolError(f"unsupported device {device!r} (choose cpu|cuda)")
    return dev


# ------------------------------------------------------------------------------------------ store / (de)quantize
# Each pair below returns the same types and, per the SPEC, the same bytes / values on both backends. The Triton
# modules are imported lazily: importing kvtool must not pay for (or need) Triton's compiler.
def store(cache, x: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "auto", *, validate: bool = True) -> None:
    """Quantize x [N, H, D] (bf16 / fp16 / fp32) into `cache` (a PagedCache) at `slot_mapping` [N] (int32 / int64,
    -1 skips the token). torch: `cache.store`; triton: `kernels.store.store` (`validate=False` skips its finite and
    slot-range checks, which cost a pass and a host sync)."""
    if resolve_backend(backend, x.device) == "torch":
        return cache.store(x, slot_mapping)
    cache.fmt.require_kvtool_codec("the Triton store kernel")
    from kvtool.kernels.store import store as triton_store

    if cache.fmt.rotation is not None:  # the kernels know no rotation: they quantize the rotated values (codes = x R)
        x = _rotation.rotate(x, cache.fmt.rotation)
    return triton_store(cache, x, slot_mapping, validate=validate)


def gather_dequantize(cache, slots: torch.Tensor, dtype: torch.dtype = torch.float32, backend: str = "auto"
                      ) -> torch.Tensor:
    """Decoded values [N, H, D] in `dtype` (fp32 / bf16; fp16 on triton) of the cache tokens at `slots` [N]."""
    if resolve_backend(backend, cache.data.device) == "torch":
        return cache.dequantize(slots, dtype)
    cache.fmt.require_kvtool_codec("the Triton dequantize kernel")
    from kvtool.kernels.dequant import gather_dequantize as triton_gather

    if cache.fmt.rotation is not None:  # the kernel decodes the rotated domain; R^T brings it back
        return _rotation.unrotate(triton_gather(cache, slots, torch.float32), cache.fmt.rotation).to(dtype)
    return triton_gather(cache, slots, dtype)


def _triton(module: str, what: str):
    """`kvtool.kernels.<module>`, or a one-line error saying why the Triton path cannot run here."""
    import importlib

    try:
        return importlib.import_module(f"kvtool.kernels.{module}")
    except ImportError as err:
        raise KvtoolError(f"the Triton {what} kernel is not available ({err}); use --device cpu") from None


def quantize(fmt, x: torch.Tensor, tensor_amax: torch.Tensor | None = None, backend: str = "auto", *,
             name: str = "tensor", check_finite: bool = True):
    """`fmt.quantize(x, tensor_amax=...)` -> QTensor, on either backend (x [..., D], rows along the last dim).
    `check_finite` rejects NaN / Inf input with a message naming `name` and the first bad index."""
    if resolve_backend(backend, x.device) == "torch":
        return fmt.quantize(x, tensor_amax=tensor_amax, name=name, check_finite=check_finite)
    fmt.require_kvtool_codec("the Triton quantize kernel")
    if check_finite:
        from kvtool.formats import require_finite

        require_finite(x, name)  # here, so that the message names the tensor
    quant = _triton("quant", "quantize")
    if fmt.rotation is not None:
        x = _rotation.rotate(x, fmt.rotation)
    return quant.triton_quantize(fmt, x, tensor_amax, check_finite=False)


def dequantize(q, dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """`q.dequantize(dtype)` -> [..., D] values, on either backend."""
    if resolve_backend(backend, q.payload.device) == "torch":
        return q.dequantize(dtype)
    q.fmt.require_kvtool_codec("the Triton dequantize kernel")
    triton_dequantize = _triton("quant", "dequantize").triton_dequantize
    if q.fmt.rotation is not None:
        return _rotation.unrotate(triton_dequantize(q, torch.float32), q.fmt.rotation).to(dtype)
    return triton_dequantize(q, dtype)
