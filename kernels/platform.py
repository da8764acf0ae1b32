"""Where the kernels run, decided once: whether Triton interprets them (TRITON_INTERPRET=1, read here at import, like
every jit constant: CPU tensors, as in the tests) and the CUDA device rules that pick launch paths (capability, SM
count, programmatic dependent launch). Plain torch: importing it costs no Triton compiler, so the dispatch module
(`kvtool.backend`) and the CLI read the same flag the kernels were specialized on."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["INTERPRET", "LAUNCH_PDL", "cuda_at_least", "num_sms", "pdl_ok"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

@functools.lru_cache(maxsize=None)
def cuda_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """The device rule of the Gluon fast paths: Gluon is importable and `device` is a CUDA (not ROCm) device of at
    least `capability` (memoized per device)."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    try:  # imported here: this module must not import Triton
        from triton.experimental import gluon  # noqa: F401
    except ImportError:  # pragma: no cover - the pinned Triton has Gluon
        return False
    return torch.cuda.get_device_capability(device) >= capability


# Programmatic dependent launch (PDL), as engines launch their step kernels: a launch's programs are scheduled as the
# kernel before retires (its tail and the launch gap overlap) and wait in `griddepcontrol.wait` before their first
# global access: every input may come from the kernel before (the store of this step's token, the indexer's
# selection), so nothing is read earlier. A launch without the attribute makes both instructions no-ops. Used by the
# Gluon sparse decode and by the portable sparse-attention kernel and its merge (its rule: `sparse_attn.PDL_MODES`;
# measurements: docs/kernels/sparse_attn.md). All call Triton's `gdc_wait` (triton.language.extra.cuda) first thing;
# `gdc_launch_dependents` comes first too, or, in the portable kernel's large decode grids, after the loop.
# LAUNCH_PDL = False turns it off everywhere.
LAUNCH_PDL = True


def pdl_ok(device: torch.device) -> bool:
    """Launch with PDL on `device`: LAUNCH_PDL and a CUDA (not ROCm) device of capability >= 9.0 (griddepcontrol)."""
    return LAUNCH_PDL and cuda_at_least(device, (9, 0))


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent Gluon kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
