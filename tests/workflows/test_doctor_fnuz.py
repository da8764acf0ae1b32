"""The E4M3FNUZ element codec of kvtool.doctor, swept whole against ml_dtypes.float8_e4m3fnuz (the third opinion),
and the FN / FNUZ facts the fp8 detectors rest on."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from kvtool.doctor.fnuz import E4M3FNUZ, E4M3FNUZ_MAX, E4M3FNUZ_TABLE, e4m3fnuz_decode, e4m3fnuz_encode
from kvtool.formats import e4m3_decode


def test_decode_every_code_equals_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(codes.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32))
    mine = e4m3fnuz_decode(torch.from_numpy(codes))
    assert torch.equal(torch.isnan(mine), torch.isnan(ref))
    assert torch.isnan(mine).sum() == 1 and torch.isnan(mine[0x80])  # the one NaN is 0x80
    ok = ~torch.isnan(ref)
    assert torch.equal(mine[ok].view(torch.int32), ref[ok].view(torch.int32))  # bit for bit (no -0 anywhere)


def test_derived_constants():
    assert E4M3FNUZ_MAX == 240.0 == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fnuz).max)
    assert E4M3FNUZ.min_subnormal == 2.0**-10 == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fnuz).smallest_subnormal)
    assert E4M3FNUZ_TABLE[0x7F] == 240.0 and E4M3FNUZ_TABLE[0xFF] == -240.0


def test_every_finite_code_is_half_its_fn_value():
    """Why FNUZ bytes read as FN are off by exactly 2x: bias 8 vs 7 (except 0x7F/0xFF, FN's NaN, and 0x80)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    fn, fnuz = e4m3_decode(codes), e4m3fnuz_decode(codes)
    same = ~torch.isnan(fn) & ~torch.isnan(fnuz) & (codes != 0x80)
    assert torch.equal(fnuz[same] * 2, fn[same])


def _ml_encode(x: torch.Tensor) -> torch.Tensor:
    a = np.clip(x.numpy(), -240.0, 240.0).astype(ml_dtypes.float8_e4m3fnuz)
    return torch.from_numpy(a.view(np.uint8).copy())


def test_encode_random_ties_and_edges_equal_ml_dtypes():
    g = torch.Generator().manual_seed(0)
    values = E4M3FNUZ_TABLE[:0x80].double()
    mids = ((values[1:] + values[:-1]) / 2).float()  # every rounding midpoint: ties to the even code
    x = torch.cat([torch.randn(20000, generator=g) * 20, torch.randn(2000, generator=g) * 1e-3, mids, -mids,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 240.0, 241.0, 1e6, -1e6, 2.0**-11, -(2.0**-11)])])
    assert torch.equal(e4m3fnuz_encode(x), _ml_encode(x))
    assert int((e4m3fnuz_encode(x) == 0x80).sum()) == 0  # an FNUZ writer never writes 0x80 (its NaN)
