"""Issue 30, decoding checks: codes that decode to NaN / Inf (E8M0 0xFF, E4M3 0x7F / 0xFF scales, fp8 payload NaN
codes, non-finite fp32 scales) and outer scales that are NaN, Inf, 0, negative or absurd are an error by default,
naming the tensor, the index and the byte offset, even when the checksums are valid (a writer that stored them)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cli_helpers import kv, one_line_error
from integrity_helpers import quantized, set_byte

from kvtool.container import read_header
from kvtool.errors import InputError
from kvtool.readers import open_input, qtensor_entry
from kvtool.workflows.cache_ops import dequantize_file
from kvtool.workflows.diff import diff_files

VLLM = "fixtures/vllm_mxfp4_k.bin"
VLLM_GEO = "format=mxfp4,page=128,heads=2,dim=128,tokens=256"


@pytest.mark.parametrize("label,tensor,offset,code", [
    ("mxfp4", "k.scales", 7, 0xFF),  # E8M0 NaN
    ("nvfp4", "k.scales", 9, 0x7F),  # E4M3 NaN
    ("nvfp4", "k.scales", 9, 0xFF),  # E4M3 -NaN
    ("fp8", "k.payload", 300, 0x7F),  # an fp8 element that decodes to NaN
])
def test_nan_codes_with_valid_checksums_are_errors(label, tensor, offset, code, tmp_path):
    good = quantized(tmp_path, label)
    bad = set_byte(good, tmp_path / "bad.safetensors", tensor, offset, code)  # digests recomputed: they pass
    t = read_header(bad).tensors[tensor]
    index = [int(i) for i in np.unravel_index(offset, t.shape)]  # the plane's own index of the byte
    words = f"k {tensor.split('.')[1]}{index} (byte offset {t.start + offset} in {bad})"
    with pytest.raises(InputError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        dequantize_file(bad, tmp_path / "d.safetensors")
    assert not (tmp_path / "d.safetensors").exists()
    with pytest.raises(InputError, match=f"code 0x{code:02X} decodes to NaN"):
        diff_files(bad, good)  # the issue's `diff` said max_abs 0 on NaN output
    one_line_error(kv("dequantize", bad, "-o", tmp_path / "d.safetensors"), "decodes to NaN")
    one_line_error(kv("inspect", bad), "decodes to NaN")
    dequantize_file(bad, tmp_path / "d.safetensors", verify=False)  # the escape decodes it as it is
    with open_input(tmp_path / "d.safetensors") as inp:
        assert torch.isnan(inp.entries["k"].read(0, inp.entries["k"].rows).float()).any()


def test_fp32_row_scales_must_be_finite(tmp_path):
    good = quantized(tmp_path, "fp8-token")
    t = read_header(good).tensors["k.scales"]
    bad = good
    for i, byte in enumerate(torch.tensor([math.inf]).view(torch.uint8).tolist()):  # scale [3, 1, 0] = +Inf
        bad = set_byte(bad, tmp_path / f"bad{i}.safetensors", "k.scales", (3 * 2) * 4 + i, byte)
    assert t.shape == (32, 2, 1)
    with pytest.raises(InputError, match=r"k scales\[3, 0, 0\].*decodes to NaN / Inf"):
        dequantize_file(bad, tmp_path / "d.safetensors")


@pytest.mark.parametrize("outer", [math.nan, math.inf, 0.0, -1.0, 1e-40, 1e39])
def test_bad_outer_scales_of_in_memory_and_layout_entries(outer):
    from kvtool.formats import get_format
    from kvtool.readers import check_outer

    q = get_format("nvfp4").quantize(torch.randn(4, 64))
    q.outer_scale = outer
    e = qtensor_entry("x", q)
    with pytest.raises(InputError, match="outer scale"):
        check_outer(e)


def test_layout_dump_read_with_a_wrong_geometry_that_yields_nan_codes(tmp_path):
    """trtllm-nvfp4-kv at page 16 instead of 32 has the same size but reads payload bytes as E4M3 scales, some of
    them NaN: an error by default (it used to be decoded to NaN with only a warning); --no-verify shows the
    plausibility warnings."""
    args = ["fixtures/trtllm_nvfp4_kv.bin", "--layout", "trtllm-nvfp4-kv", "--geometry",
            "format=nvfp4,page=16,heads=2,dim=128,tokens=256"]
    r = kv("inspect", *args)
    assert r.exit_code == 2 and "decodes to NaN" in r.stderr and "wrong layout" in r.stderr, r.output
    r = kv("inspect", *args, "--no-verify")
    assert r.exit_code == 0 and "wrong layout or geometry?" in r.stderr, r.output
    r = kv("inspect", "fixtures/trtllm_nvfp4_kv.bin", "--layout", "trtllm-nvfp4-kv", "--geometry",
           "format=nvfp4,page=32,heads=2,dim=128,tokens=256")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output


def test_convert_refuses_nan_codes(tmp_path):
    r = kv("convert", "fixtures/trtllm_nvfp4_kv.bin", "-o", tmp_path / "o.safetensors", "--from-layout",
           "trtllm-nvfp4-kv", "--to-layout", "planes", "--geometry", "format=nvfp4,page=16,heads=2,dim=128,tokens=256")
    assert r.exit_code == 2 and "decodes to NaN" in r.stderr, r.output
    assert not (tmp_path / "o.safetensors").exists()


def test_good_files_pass_every_check(tmp_path):
    for label in ("mxfp4", "nvfp4", "nvfp4-auto", "fp8", "fp8-tensor", "fp8-token", "bf16"):
        good = quantized(tmp_path, label, name=f"{label}.safetensors")
        dequantize_file(good, tmp_path / "d.safetensors")
        assert diff_files(good, tmp_path / "d.safetensors").passed
