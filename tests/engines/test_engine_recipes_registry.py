"""Engine recipes as registry entries: labels, metadata round trips, kernel refusal, the CLI (`kvtool recipes`,
`--recipe-of`). No engine package is needed here; tests/engines/test_engine_recipes.py holds the oracle comparisons.

Hand-worked cases pin what each recipe choice means, on inputs small enough to check by eye.
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import kv, kv_json, one_line_error

from kvtool import backend
from kvtool.errors import FormatError
from kvtool.formats import Format, get_format
from kvtool.formats.recipes import RECIPES, OuterDir, Sign, Tie, e2m1_codes

NAMES = sorted(RECIPES)


@pytest.mark.parametrize("name", NAMES)
def test_label_and_metadata_round_trip(name):
    fmt = get_format(f"@{name}")
    assert fmt.engine == name and fmt.family == RECIPES[name].family
    assert get_format(fmt.label) == fmt
    assert Format.from_meta(fmt.to_meta()) == fmt
    assert fmt.bytes_per_token(128) == get_format(fmt.family).bytes_per_token(128) or fmt.family == "fp8"


@pytest.mark.parametrize("name", [n for n in NAMES if RECIPES[n].outer != OuterDir.NONE])
def test_outer_scale_auto_follows_the_recipe_direction(name):
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 7
    amax = x.abs().amax()
    q = get_format(f"@{name}", outer_scale="auto").quantize(x)
    want = amax / 2688.0 if RECIPES[name].outer == OuterDir.DEC else torch.tensor(2688.0) / amax
    assert q.outer_scale == float(want)
    fmt = get_format(f"@{name}", outer_scale="auto")
    assert Format.from_meta(fmt.to_meta()) == fmt


def test_recipe_fixes_the_rule_options():
    with pytest.raises(FormatError, match="fixes every rule option"):
        get_format("mxfp4-floor@torchao.to_mx_floor")
    with pytest.raises(FormatError, match="fixes every rule option"):
        get_format("nvfp4@vllm.ref_nvfp4", recipe="div")
    with pytest.raises(FormatError, match="writes kvfp4, not nvfp4"):
        get_format("nvfp4@sglang.kvfp4")
    with pytest.raises(FormatError, match="takes no outer scale"):
        get_format("@atom.index_store", outer_scale="auto")
    with pytest.raises(FormatError, match="unknown engine recipe"):
        get_format("@vllm.nope")


def test_spec_stays_the_default():
    assert get_format("nvfp4").engine is None and get_format("mxfp4").label == "mxfp4-rceil"
    assert "engine_recipe" not in get_format("nvfp4").to_meta()


# E2M1 tie and sign rules, by hand: y = [0.25, 0.75, 2.5, 3.5, 5, -0.0, -0.1, 7, 2**28]
Y = torch.tensor([0.25, 0.75, 2.5, 3.5, 5.0, -0.0, -0.1, 7.0, 2.0**28])


@pytest.mark.parametrize("tie,sign,codes", [
    (Tie.EVEN, Sign.BIT, [0, 2, 4, 6, 6, 8, 8, 7, 7]),  # SPEC: half to even; -0 and -0.1 keep the sign
    (Tie.AWAY, Sign.BIT, [1, 2, 5, 6, 7, 8, 8, 7, 7]),  # triton_kernels / AITER: ties up
    (Tie.AWAY, Sign.NEGATIVE, [1, 2, 5, 6, 7, 0, 8, 7, 7]),  # SGLang: -0.0 is not < 0
    (Tie.EVEN, Sign.NONZERO, [0, 2, 4, 6, 6, 0, 0, 7, 7]),  # DeepGEMM: never code 8
    (Tie.NEAREST_FIRST, Sign.NEGATIVE, [0, 1, 4, 5, 6, 0, 8, 7, 0]),  # FlashInfer: ties down; 2**28 -> 0 (fp32 distances all tie)
])
def test_e2m1_rules_by_hand(tie, sign, codes):
    assert e2m1_codes(Y, tie, sign).tolist() == codes


def test_small_blocks_by_hand():
    """Block 0 has amax 0.03 (0.03 / 6 = 0.005 -> E4M3 subnormal 3 * 2**-9, byte 0x03), block 1 amax 1e-5 (1e-5 / 6
    is below 2**-10: the scale rounds to 0)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 0.03, 1e-5
    spec = get_format("nvfp4").quantize(x)
    deepgemm = get_format("@deepgemm.per_token_cast_to_nvfp4").quantize(x)
    torchao = get_format("@torchao.nvfp4_quantize").quantize(x)
    assert spec.scales.tolist() == [[0x03, 0x00]] and spec.payload[0, 8] == 0  # SPEC: scale 0, codes 0
    assert deepgemm.scales.tolist() == [[0x03, 0x01]]  # DeepGEMM: clamped up to 2**-9 (byte 0x01)
    assert deepgemm.payload[0, 8] == 0  # 1e-5 / 2**-9 = 0.005 -> code 0
    assert torchao.scales.tolist() == [[0x08, 0x08]]  # torchao: at least 2**-6 (byte 0x08)
    assert torchao.payload[0, 0] == 0x04  # 0.03 * 2**6 = 1.92 -> 2.0 (code 4), low nibble = element 0
    mx_zero = torch.zeros(1, 32)
    assert get_format("@flashinfer.mxfp4_ref").quantize(mx_zero).scales.item() == 127  # scale 1 for a zero block
    assert get_format("@sglang.kvfp4").quantize(torch.zeros(1, 16)).scales.item() == 94  # 2**-33
    assert get_format("@triton_kernels.round_up").quantize(-mx_zero).payload[0, 0] == 0x88  # -0 keeps its sign


def test_aiter_top_binade_by_hand():
    """amax 3e38 (mantissa >= 1.75 at 2**127) rounds up to 2**128: the SPEC's EVEN takes its exponent (e = 126, byte
    253), AITER takes log2(inf) = inf and clamps (e = 127, byte 254)."""
    x = torch.full((1, 32), 3e38)
    assert get_format("mxfp4-even").quantize(x).scales.item() == 253
    assert get_format("@aiter.mxfp4_quant_op").quantize(x).scales.item() == 254
    zero = -torch.zeros(1, 32)
    assert get_format("@aiter.mxfp4_quant_op").quantize(zero).payload[0, 0] == 0x88  # -0 keeps its sign bit


def test_triton_kernels_refuse_a_recipe():
    fmt = get_format("@vllm.ref_nvfp4")
    with pytest.raises(FormatError, match="cannot honour engine recipe 'vllm.ref_nvfp4'"):
        backend.quantize(fmt, torch.randn(2, 128), backend="triton")


# ------------------------------------------------------------------------------------------------------ files, CLI
def test_recipe_round_trips_through_a_cache_file(tmp_path):
    from safetensors.torch import save_file

    from kvtool.workflows.cache_ops import dequantize_file, quantize_file

    x = torch.randn(8, 2, 128, generator=torch.Generator().manual_seed(3))
    src, out, back = tmp_path / "x.safetensors", tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    save_file({"k": x}, str(src))
    quantize_file(src, out, "nvfp4", options={"engine": "vllm.ref_nvfp4", "outer_scale": "auto"})
    dequantize_file(out, back, dtype="fp32")
    from safetensors.torch import load_file

    fmt = get_format("nvfp4-auto@vllm.ref_nvfp4")
    assert torch.equal(load_file(str(back))["k"].view(torch.int32), fmt.quantize(x).dequantize().view(torch.int32))
    report = kv_json("inspect", out)
    assert {t["format"] for t in report["tensors"]} == {fmt.label}


def test_cli_recipes_lists_every_recipe():
    report = kv_json("recipes")
    assert [r["name"] for r in report["recipes"]] == list(RECIPES)
    row = next(r for r in report["recipes"] if r["name"] == "sglang.kvfp4")
    assert row["label"] == "kvfp4@sglang.kvfp4" and row["choices"]["tie"] == "away" and row["version"]
    only = kv_json("recipes", "--engine", "torchao")
    assert {r["name"] for r in only["recipes"]} == {n for n in RECIPES if n.startswith("torchao.")}
    one_line_error(kv("recipes", "--engine", "nope"), "no engine recipe matches")


def test_cli_recipe_of_needs_a_layout_for_reading(tmp_path):
    one_line_error(kv("dequantize", tmp_path / "x.safetensors", "-o", tmp_path / "y.safetensors", "--recipe-of",
                      "sglang.kvfp4"), "--recipe-of reads an engine dump")


def test_cli_quantize_with_recipe_of_then_read_an_engine_dump(tmp_path):
    """`quantize --recipe-of` writes the recipe's bytes and records it; an engine dump read with `--layout ...
    --recipe-of` decodes as the engine does: DeepGEMM's v * (S * g) differs from the SPEC's (v * S) * g in the last
    bit of some values, so reading the same dump without the recipe gives other values."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from kvtool.layouts import write_layout

    x = torch.randn(20, 2, 128, generator=torch.Generator().manual_seed(4)) * 50
    src = tmp_path / "x.safetensors"
    save_file({"k": x}, str(src))
    report = kv_json("quantize", src, "-o", tmp_path / "q.safetensors", "--to", "nvfp4", "--recipe-of",
                     "deepgemm.per_token_cast_to_nvfp4", "--outer-scale", "auto")
    assert [t["format"] for t in report["tensors"]] == ["nvfp4-auto@deepgemm.per_token_cast_to_nvfp4"]
    q = get_format("nvfp4-auto@deepgemm.per_token_cast_to_nvfp4").quantize(x)
    dump = tmp_path / "kv.bin"
    write_layout({"k": q, "v": q}, dump, "vllm-nvfp4-kv", "page=16")
    Path(str(dump) + ".json").unlink()  # a bare engine dump: format, outer scale and recipe from the command line
    geometry = f"heads=2,dim=128,tokens=20,page=16,format=nvfp4,outer={q.outer_scale!r}"
    decoded = {}
    for name, extra in (("recipe", ["--recipe-of", "deepgemm.per_token_cast_to_nvfp4"]), ("spec", [])):
        out = tmp_path / f"{name}.safetensors"
        kv_json("dequantize", dump, "-o", out, "--layout", "vllm-nvfp4-kv", "--geometry", geometry, "--dtype", "fp32",
                *extra)
        decoded[name] = load_file(str(out))["k"].view(torch.int32)
    assert torch.equal(decoded["recipe"], q.dequantize().view(torch.int32))
    assert not torch.equal(decoded["spec"], decoded["recipe"])


@pytest.mark.parametrize("label", ["nvfp4-auto@vllm.ref_nvfp4", "nvfp4-auto@flashinfer.nvfp4_kv_ref",
                                   "nvfp4-auto@torchao.nvfp4_quantize", "kvfp4@sglang.kvfp4", "nvfp4-auto"])
def test_paged_cache_keeps_the_recipe_and_its_outer_scale_direction(label):
    """The paged cache (decode, verify-topk) stores and decodes a recipe's bytes as the recipe does, an
    encode-direction outer scale included (its `auto` is 2688 / amax, not amax / 2688)."""
    from kvtool.paged import PagedCache

    fmt = get_format(label)
    x = torch.randn(20, 2, 128, generator=torch.Generator().manual_seed(6)) * 3
    cache = PagedCache.allocate(fmt, 2, 16, 2, 128)
    cache.store(x, torch.arange(20))
    want = fmt.quantize(x, tensor_amax=x.abs().amax()).dequantize()
    assert torch.equal(cache.dequantize(torch.arange(20), torch.float32).view(torch.int32), want.view(torch.int32))


def test_diff_names_the_engine_recipe_that_wrote_the_bytes(tmp_path):
    """An engine's bytes declared as the SPEC format (a dump read as plain `mxfp4`): diff's rule fit ranks the engine
    recipe that reproduces them first, at 100 %, above the declared SPEC rule."""
    from safetensors.torch import save_file

    from kvtool.layouts import write_layout

    x = torch.randn(64, 1, 128, generator=torch.Generator().manual_seed(7))
    x[:4, 0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # E2M1 ties: ROUND_UP goes away
    plain = tmp_path / "x.safetensors"
    save_file({"x": x}, str(plain))
    engine = get_format("@triton_kernels.round_up").quantize(x)
    dump = tmp_path / "dump.bin"
    spec_view = type(engine)(get_format("mxfp4"), engine.payload, engine.scales, 1.0, engine.shape)
    write_layout({"x": spec_view}, dump, "planes", None)
    report = kv_json("diff", dump, plain, "--layout", "planes")
    fit = report["tensors"][0]["rule_fit"]
    best = next(iter(fit))
    assert best == "mxfp4@triton_kernels.round_up" and fit[best] == 100.0, fit
    assert fit["mxfp4-rceil"] < 100.0
