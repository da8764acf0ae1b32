"""kvtool.st_header.NPY_TORCH_DTYPES, the numpy dtypes kvtool reads from an .npy file, is the set torch.from_numpy
takes, each with the torch dtype torch gives it: the torch-free header parse names the dtype the torch reader uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool.st_header import NPY_TORCH_DTYPES

# Every numpy scalar type, as an .npy header's descr spells it (np.lib.format round-trips the dtype through its descr).
# numpy's own types only: packages imported earlier in the process (ml_dtypes, through torchao) register theirs in
# np.sctypeDict too, and their descrs ('<f1', '<c4') do not round-trip.
DTYPES = sorted({np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(np.dtype(t)))
                 for t in set(np.sctypeDict.values()) if t.__module__ == "numpy"}, key=str)


def _torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    try:
        return torch.from_numpy(np.zeros(0, dtype=dtype.newbyteorder("="))).dtype
    except TypeError:
        return None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_matches_torch_from_numpy(dtype):
    name = NPY_TORCH_DTYPES.get((dtype.kind, dtype.itemsize))
    expected = _torch_dtype(dtype)
    assert (getattr(torch, name) if name else None) == expected


def test_every_entry_is_reached():
    reached = {(d.kind, d.itemsize) for d in DTYPES if _torch_dtype(d) is not None}
    assert reached == set(NPY_TORCH_DTYPES)
