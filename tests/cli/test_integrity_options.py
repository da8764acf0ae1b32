"""Issue 30, options validated in one place (kvtool/options.py through handle_errors): ranges, label-vs-flag
conflicts, absurd outer scales, --device, and raw dumps whose geometry the bytes do not pin; each bad input is one
line on stderr and exit 2, before any work (no output file)."""

from __future__ import annotations

import pytest
from cli_helpers import kv, one_line_error

from kvtool.errors import FormatError
from kvtool.formats import get_format
from kvtool.options import RULES, OptionError, check_options

FIX = "fixtures/synthetic_cache.safetensors"
VLLM = "fixtures/vllm_mxfp4_k.bin"


@pytest.mark.parametrize("args,words", [
    (["verify-topk", "--synthetic", "--topk", "0"], "--topk must be an integer >= 1, got 0"),
    (["verify-topk", "--synthetic", "--block-size", "0"], "--block-size must be an integer >= 1, got 0"),
    (["verify-attn", "--synthetic", "--topk", "0"], "--topk must be"),
    (["decode", "--block-size", "0"], "--block-size must be"),
    (["decode", "--local", "-1"], "--local must be an integer >= 0"),
    (["verify-attn", "--synthetic", "--tolerance", "-1"], "--tolerance must be a number >= 0"),
    (["verify-attn", "--synthetic", "--tolerance", "nan"], "--tolerance must be a number >= 0"),
    (["diff", FIX, FIX, "--max-rel-l2", "-1"], "--max-rel-l2 must be a number >= 0"),
    (["diff", FIX, FIX, "--max-abs", "-0.5"], "--max-abs must be"),
    (["diff", FIX, FIX, "--min-sqnr", "nan"], "--min-sqnr must be a finite number"),
    (["quantize", FIX, "-o", "OUT", "--to", "mxfp4", "--chunk-mb", "0"], "--chunk-mb must be positive"),
    (["quantize", FIX, "-o", "OUT", "--to", "mxfp4", "--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["quantize", FIX, "-o", "OUT", "--to", "mxfp4-floor", "--scale-rule", "rceil"],
     "label 'mxfp4-floor' says scale-rule floor, but the scale-rule option says rceil"),
    (["quantize", FIX, "-o", "OUT", "--to", "fp8-token", "--fp8-scale", "tensor"],
     "label 'fp8-token' says fp8-scale token, but the fp8-scale option says tensor"),
    (["quantize", FIX, "-o", "OUT", "--to", "mxfp4-floor-floor"], "sets scale-rule twice"),
    (["quantize", FIX, "-o", "OUT", "--to", "nvfp4", "--outer-scale", "1e-30"], "outer scale must be a positive"),
    (["quantize", FIX, "-o", "OUT", "--to", "nvfp4-g1e30"], "outer scale must be a positive number in"),
    (["quantize", FIX, "-o", "OUT", "--to", "nvfp4", "--outer-scale", "1e30"], "[2^-64, 2^64]"),
    (["verify-topk", "--synthetic", "--formats", "nvfp4-g1e30"], "outer scale must be"),
    (["capacity", "--model", "minimax-m3", "--kv", "nvfp4", "--index", "fp4", "--tp", "0"], "--tp must be"),
])
def test_bad_options_exit_2_before_any_work(args, words, tmp_path):
    out = tmp_path / "o.safetensors"
    one_line_error(kv(*[str(out) if a == "OUT" else a for a in args]), words)
    assert not out.exists()


def test_agreeing_flags_and_labels_pass():
    assert get_format("mxfp4-floor", scale_rule="floor").label == "mxfp4-floor"
    assert get_format("nvfp4-g0.5", outer_scale="0.5").outer_scale == "0.5"
    with pytest.raises(FormatError, match="says outer-scale 0.5"):
        get_format("nvfp4-g0.5", outer_scale="0.25")
    with pytest.raises(FormatError, match="sets recipe twice"):
        get_format("nvfp4-div-rcp")


def test_every_rule_refuses_its_edge():
    for name, rule in RULES.items():
        for bad in (-1, float("nan"), True):
            assert not rule.ok(bad) or name == "min_sqnr" and bad == -1, (name, bad)
        with pytest.raises(OptionError, match=f"--{name.replace('_', '-')} must be"):
            check_options("x", {name: float("nan")})
    check_options("x", {"topk": 1, "block_size": 16, "tolerance": 0.0, "min_sqnr": -3.0, "device": "cuda:1",
                        "outer_scale": "auto", "layers": "0-3"})


def test_unknown_device_through_the_library(tmp_path):
    from kvtool.errors import KvtoolError
    from kvtool.workflows.cache_ops import quantize_file

    with pytest.raises(KvtoolError, match="unsupported device 'tpu'"):
        quantize_file(FIX, tmp_path / "o.safetensors", "mxfp4", device="tpu")
    assert not (tmp_path / "o.safetensors").exists()


def test_raw_dump_needs_its_geometry_unless_one_fits(tmp_path):
    """The vLLM dump is [256 tokens, 2 heads, 128]; read without heads / dim it used to be [512, 1, 128]."""
    r = kv("inspect", VLLM, "--layout", "vllm-mxfp4-page")
    one_line_error(r, "the bytes do not say the geometry: 10 fit its size as vllm-mxfp4-page")
    assert "heads=1,dim=128 (512 tokens)" in r.stderr and "heads=2,dim=128 (256 tokens)" in r.stderr
    r = kv("inspect", VLLM, "--layout", "vllm-mxfp4-page", "--geometry", "heads=2,tokens=256")
    assert r.exit_code == 0 and "assumed format=mxfp4-rceil,page=128,heads=2,dim=128,tokens=256" in r.stderr, r.output
    r = kv("dequantize", VLLM, "-o", tmp_path / "d.safetensors", "--layout", "vllm-mxfp4-page", "--geometry",
           "heads=2,tokens=256")
    assert r.exit_code == 0 and "assumed" in r.stderr, r.output
    r = kv("inspect", VLLM, "--layout", "vllm-mxfp4-page", "--geometry", "heads=2,dim=128")  # pinned: no note
    assert r.exit_code == 0 and "assumed" not in r.stderr, r.output
