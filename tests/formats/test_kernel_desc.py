"""The kernel-facing format descriptor (kvtool.formats.kernel_desc) agrees with the registry it is derived from."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.formats import get_format
from kvtool.formats import kernel_desc as kd
from kvtool.formats.registry import FAMILIES

LABELS = ["bf16", "fp8", "fp8-tensor", "fp8-token", "nvfp4", "nvfp4-auto", "mxfp4", "mxfp4-floor", *FAMILIES]


@pytest.mark.parametrize("label", sorted(set(LABELS)))
def test_descriptor_bytes_and_codes_match_the_format(label):
    fmt = get_format(label)
    d = kd.kernel_desc(fmt)
    for dim in (32, 64, 128):
        assert d.payload_bytes(dim) == fmt.payload_bytes(dim)
        assert d.scale_bytes(dim) == fmt.scale_bytes(dim)
    assert kd.SCALES[d.scale] == fmt.scale_element
    assert d.element == (fmt.element.name if fmt.element else "bf16")
    assert d.token_scale == (kd.SCALE_NONE if fmt.scale_element == "fp32-tensor" else d.scale)


def test_codes_are_numbered_once_and_distinct():
    assert sorted({kd.SCALE_NONE, kd.SCALE_ROW, kd.SCALE_E4M3, kd.SCALE_E8M0, kd.SCALE_TENSOR}) == list(range(5))
    assert sorted({kd.ELEM_BF16, kd.ELEM_E4M3, kd.ELEM_E2M1}) == list(range(3))
    # the index tiles read `>= E4M3` as "a block scale" of a token_scale code
    assert kd.SCALE_NONE < kd.SCALE_ROW < kd.SCALE_E4M3 < kd.SCALE_E8M0


@pytest.mark.parametrize("label", ["bf16", "fp8-tensor", "fp8-token", "nvfp4-auto", "mxfp4"])
@pytest.mark.parametrize("rows", [0, 3])
def test_qtensor_of_bytes_rebuilds_the_torch_codecs_qtensor(label, rows):
    fmt = get_format(label)
    x = torch.randn(rows, 2, 64, generator=torch.Generator().manual_seed(rows)) * 3
    q = fmt.quantize(x, tensor_amax=torch.tensor(3.0) if fmt.needs_tensor_amax else None)
    n = rows * 2
    payload = q.payload.contiguous().view(torch.uint8).reshape(n, fmt.payload_bytes(64))
    scales = None
    if fmt.scale_bytes(64):
        scales = q.scales.contiguous().view(torch.uint8).reshape(n, fmt.scale_bytes(64))
    tensor_scale = q.scales if fmt.scale_element == "fp32-tensor" else None
    got = kd.qtensor_of_bytes(fmt, payload, scales, tuple(x.shape), lead=(rows, 2), tensor_scale=tensor_scale,
                              outer_scale=q.outer_scale)
    assert got.payload.dtype == q.payload.dtype and torch.equal(got.payload, q.payload)
    assert (got.scales is None) == (q.scales is None)
    if q.scales is not None:
        assert got.scales.dtype == q.scales.dtype and got.scales.shape == q.scales.shape
        assert torch.equal(got.scales.reshape(-1).view(torch.uint8), q.scales.reshape(-1).view(torch.uint8))
    assert got.outer_scale == q.outer_scale and got.shape == q.shape
    assert torch.equal(got.dequantize(), q.dequantize())


def test_kernel_index_geometry_defaults_are_the_indexer_configs():
    pytest.importorskip("triton")
    from kvtool.indexer import IndexerConfig
    from kvtool.kernels.index_score import IndexGeometry

    cfg = IndexerConfig()
    for f in dataclasses.fields(IndexGeometry):
        assert getattr(IndexGeometry(), f.name) == getattr(cfg, f.name), f.name


def test_slot_range_check():
    from kvtool.errors import LayoutError

    kd.check_slots(torch.tensor([-1, 0, 7]), 8, allow_skip=True)
    with pytest.raises(LayoutError):
        kd.check_slots(torch.tensor([-1, 0]), 8, allow_skip=False)
    with pytest.raises(LayoutError):
        kd.check_slots(torch.tensor([8]), 8, allow_skip=True)
