"""Backend choice in one place (STYLE 17): `backend="auto" | "torch" | "triton"`.

`auto` picks Triton for CUDA tensors and the torch reference for CPU tensors. `triton` on CPU tensors only works under
the Triton interpreter (TRITON_INTERPRET=1, as in the tests). Both paths return the same types and, where the SPEC says
so, the same bytes.
"""

from __future__ import annotations

import os

import torch

from kvtool.errors import KvtoolError

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Return "torch" or "triton" for work on `device`."""
    if backend not in BACKENDS:
        raise KvtoolError(f"unknown backend {backend!r} (choose {'|'.join(BACKENDS)})")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        return "triton" if on_cuda else "torch"
    if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise KvtoolError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for the interpreter)")
    return backend


def resolve_device(device: str) -> torch.device:
    """Validate a --device value; `cuda` without a GPU is a one-line error, not a traceback."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvtoolError("--device cuda was asked for, but torch sees no CUDA device on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise KvtoolError(f"unsupported device {device!r} (choose cpu|cuda)")
    return dev
