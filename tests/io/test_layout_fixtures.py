"""The engine-layout user path (issue 7 follow-up) on the committed engine dumps (fixtures/make_layout_dumps.py) and on
kvtool cache files: every README layout command as a CLI run with its exit code, convert reading a kvtool file's own
metadata (format, shape, heads, scales), one cache per raw output, passthrough tensors, diff pairing, and inspect's
plausibility warnings on a wrong geometry."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_helpers import kv, kv_json, one_line_error

from kvtool.formats import get_format
from kvtool.layouts import read_layout, write_layout

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
SYNTH = FIXTURES / "synthetic_cache.safetensors"
VLLM = FIXTURES / "vllm_mxfp4_k.bin"
TRT = FIXTURES / "trtllm_nvfp4_kv.bin"
VLLM_GEO = "format=mxfp4,page=128,heads=2,dim=128,tokens=256"
TRT_GEO = "format=nvfp4,page=32,heads=2,dim=128,tokens=256"


def same_bytes(a, b) -> bool:
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def assert_same(a, b) -> None:
    assert a.fmt == b.fmt and tuple(a.shape) == tuple(b.shape) and float(a.outer_scale) == float(b.outer_scale)
    assert same_bytes(a.payload, b.payload)
    assert (a.scales is None) == (b.scales is None)
    if a.scales is not None:
        assert same_bytes(a.scales, b.scales)


@pytest.fixture(scope="module")
def cache_files(tmp_path_factory) -> dict:
    """kvtool cache files made from the synthetic cache by `kvtool quantize` (the README tour's first line)."""
    d = tmp_path_factory.mktemp("caches")
    out = {"mx": d / "k_mxfp4.safetensors", "nv": d / "kv_nvfp4.safetensors", "k0": d / "k0_mxfp4.safetensors"}
    for key, extra in (("mx", ["--to", "mxfp4"]), ("nv", ["--to", "nvfp4"]),
                       ("k0", ["--to", "mxfp4", "--include", "layers.0.k"])):
        assert kv("quantize", SYNTH, "-o", out[key], *extra).exit_code == 0
    return out


# ------------------------------------------------------------------------------------------------------ fixtures
def test_committed_dumps_are_what_the_script_makes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_layout_dumps", FIXTURES / "make_layout_dumps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = module.make(tmp_path)
    assert [p.name for p in made] == [VLLM.name, TRT.name]
    for path in made:
        assert path.read_bytes() == (FIXTURES / path.name).read_bytes(), path.name
        assert not Path(str(FIXTURES / path.name) + ".json").exists()  # engine dumps: no kvtool sidecar
    assert VLLM.stat().st_size == 2 * 2 * 8704 and TRT.stat().st_size == 8 * 2 * 2 * 32 * 72


def test_dumps_decode_to_the_quantized_source():
    source = load_file(str(SYNTH))
    x = read_layout(VLLM, "vllm-mxfp4-page", VLLM_GEO)["x"]
    assert_same(x, get_format("mxfp4").quantize(source["layers.0.k"]))
    kvs = read_layout(TRT, "trtllm-nvfp4-kv", TRT_GEO)
    for name in "kv":
        assert_same(kvs[name], get_format("nvfp4").quantize(source[f"layers.0.{name}"]))


# --------------------------------------------------------------------------------------------- README commands
def test_readme_inspect_dump_in_a_real_process():
    """kvtool inspect fixtures/vllm_mxfp4_k.bin --layout vllm-mxfp4-page --geometry ..."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "kvtool", "inspect", "fixtures/vllm_mxfp4_k.bin", "--layout",
                           "vllm-mxfp4-page", "--geometry", VLLM_GEO, "--json"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["kind"] == "layout:vllm-mxfp4-page" and report["warnings"] == [] and "warning" not in proc.stderr
    (t,) = report["tensors"]
    assert (t["name"], t["format"], t["shape"], t["bytes_per_token"]) == ("x", "mxfp4-rceil", [256, 2, 128], 68)


@pytest.mark.parametrize("dump,layout,good,wrong", [
    (VLLM, "vllm-mxfp4-page", VLLM_GEO, VLLM_GEO.replace("page=128", "page=32")),
    (TRT, "trtllm-nvfp4-kv", TRT_GEO, TRT_GEO.replace("page=32", "page=16")),
])
def test_inspect_warns_on_a_wrong_geometry_of_the_same_size(dump, layout, good, wrong):
    right = kv("inspect", dump, "--layout", layout, "--geometry", good)
    assert right.exit_code == 0 and "warning" not in right.stderr, right.output
    assert kv_json("inspect", dump, "--layout", layout, "--geometry", good)["warnings"] == []
    # Same byte count: no size error; --no-verify, since a wrong geometry may read payload bytes as NaN scale codes
    # (an error by default: tests/io/test_integrity_decode.py)
    bad = kv("inspect", dump, "--layout", layout, "--geometry", wrong, "--no-verify")
    assert bad.exit_code == 0, bad.output
    assert "warning: " in bad.stderr and "wrong layout or geometry?" in bad.stderr
    assert "x " in bad.stdout or "k " in bad.stdout  # the table still goes to stdout
    warnings = kv_json("inspect", dump, "--layout", layout, "--geometry", wrong, "--no-verify")["warnings"]
    assert warnings and all("wrong layout or geometry?" in w for w in warnings)


def test_readme_convert_dump_to_planes_is_a_kvtool_file(tmp_path):
    """kvtool convert fixtures/vllm_mxfp4_k.bin -o /tmp/k.planes.safetensors --from-layout vllm-mxfp4-page
    --to-layout planes --geometry ..."""
    out = tmp_path / "k.planes.safetensors"
    report = kv_json("convert", VLLM, "-o", out, "--from-layout", "vllm-mxfp4-page", "--to-layout", "planes",
                     "--geometry", VLLM_GEO)
    assert report["tensors"] == ["x"] and report["warnings"] == [] and report["input_bytes"] == 34816
    assert report["items"][0]["geometry_out"] == {"format": "mxfp4-rceil", "page": 1, "heads": 2, "dim": 128,
                                                  "tokens": 256, "pages": 256}
    # a kvtool cache file: every command reads it without --layout, checksums included
    info = kv_json("inspect", out, "--verify")
    assert info["kind"] == "kvtool" and info["tensors"][0]["shape"] == [256, 2, 128]
    assert info["tensors"][0]["checksum"] == "ok"
    assert_same(read_layout(out, "planes")["x"], read_layout(VLLM, "vllm-mxfp4-page", VLLM_GEO)["x"])


def test_readme_diff_dump_against_kvtool_quantized_k(cache_files):
    """kvtool diff fixtures/vllm_mxfp4_k.bin /tmp/k_mxfp4.safetensors --layout ... --geometry ... --pair x=layers.0.k:
    the dump holds exactly the bytes kvtool writes (0% scale and payload disagreement)."""
    args = [VLLM, cache_files["mx"], "--layout", "vllm-mxfp4-page", "--geometry", VLLM_GEO]
    report = kv_json("diff", *args, "--pair", "x=layers.0.k", "--max-scale-mismatch", "0")
    (t,) = report["tensors"]
    assert t["name"] == "x~layers.0.k" and report["passed"] and report["warnings"] == []
    assert t["metrics"]["max_abs"] == 0 and t["codes"]["scale_mismatch_pct"] == 0
    assert t["codes"]["payload_mismatch_pct"] == 0 and t["codes"]["compared"] == "stored"
    table = kv("diff", *args, "--pair", "x=layers.0.k")
    assert table.exit_code == 0 and "REPORT" in table.stdout, table.output  # no threshold given: no PASS
    one_line_error(kv("diff", *args), "--pair A_NAME=B_NAME", empty_stdout=True)  # one tensor vs three: no silent guess
    one_line_error(kv("diff", *args, "--pair", "x=layers.9.k"), "B has no tensor 'layers.9.k'", empty_stdout=True)
    one_line_error(kv("diff", *args, "--pair", "x"), "not A_NAME=B_NAME", empty_stdout=True)


def test_diff_trtllm_dump_against_the_bf16_original_names_its_rule():
    report = kv_json("diff", TRT, SYNTH, "--layout", "trtllm-nvfp4-kv", "--geometry", TRT_GEO,
                     "--pair", "k=layers.0.k", "--pair", "v=layers.0.v", "--max-scale-mismatch", "0")
    assert [t["name"] for t in report["tensors"]] == ["k~layers.0.k", "v~layers.0.v"] and report["passed"]
    for t in report["tensors"]:
        assert next(iter(t["rule_fit"])) == "nvfp4-rcp" and t["rule_fit"]["nvfp4-rcp"] == 100
        assert t["codes"]["scale_mismatch_pct"] == 0 and t["codes"]["compared"] == "reencoded-b"
    assert report["only_in_b"] == []  # explicit pairs: index_k is not "only in B"


# ---------------------------------------------------------------------------------------- convert kvtool files
def test_convert_reads_a_kvtool_files_own_metadata(cache_files, tmp_path):
    """Issue 1: planes input = the kvtool file's format, shape (heads kept) and scales; one cache per raw output."""
    mx = cache_files["mx"]
    raw = tmp_path / "k.vllm.bin"
    base = ["convert", mx, "-o", raw, "--from-layout", "planes", "--to-layout", "vllm-mxfp4-page"]
    result = kv(*base)
    one_line_error(result, "a raw dump holds one cache, got 3", empty_stdout=True)
    assert "--include" in result.stderr and not raw.exists()
    report = kv_json(*base, "--include", "layers.0.k")
    assert report["tensors"] == ["layers.0.k"] and report["format"] == "mxfp4-rceil"
    assert report["geometry_out"] == {"format": "mxfp4-rceil", "page": 128, "heads": 2, "dim": 128, "tokens": 256,
                                      "pages": 2}
    assert raw.read_bytes() == VLLM.read_bytes()  # the engine fixture, byte for byte
    # kvtool's sidecar keeps the name; the README inspect line reads the file too
    info = kv_json("inspect", raw, "--layout", "vllm-mxfp4-page", "--geometry", VLLM_GEO)
    assert [(t["name"], t["shape"]) for t in info["tensors"]] == [("layers.0.k", [256, 2, 128])]
    # --geometry agreeing with the file is fine, contradicting it is an error naming both
    assert kv(*base, "--include", "layers.0.k", "--geometry", "format=mxfp4,heads=2").exit_code == 0
    one_line_error(kv(*base, "--include", "layers.0.k", "--geometry", "heads=1"), "--geometry says heads=1",
                   empty_stdout=True)


def test_convert_every_tensor_into_one_container(cache_files, tmp_path):
    out = tmp_path / "all.vllm.safetensors"
    report = kv_json("convert", cache_files["mx"], "-o", out, "--from-layout", "planes",
                     "--to-layout", "vllm-mxfp4-page")
    shapes = {i["name"]: (i["shape"], i["geometry_out"]["heads"]) for i in report["items"]}
    assert shapes == {"layers.0.index_k": ([256, 128], 1), "layers.0.k": ([256, 2, 128], 2),
                      "layers.0.v": ([256, 2, 128], 2)}
    back = read_layout(out, "vllm-mxfp4-page")  # each cache under PREFIX.cache with its own geometry
    planes = read_layout(cache_files["mx"], "planes")
    assert sorted(back) == sorted(planes)
    for name, q in planes.items():
        assert same_bytes(back[name].payload, q.payload) and same_bytes(back[name].scales, q.scales)
        assert back[name].shape[-2] == (q.shape[-2] if len(q.shape) == 3 else 1)


def test_convert_skips_passthrough_tensors_with_a_note(cache_files, tmp_path):
    k0 = cache_files["k0"]  # layers.0.k quantized; v and index_k passed through as bf16
    out = tmp_path / "k0.bin"
    result = kv("convert", k0, "-o", out, "--from-layout", "planes", "--to-layout", "vllm-mxfp4-page", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tensors"] == ["layers.0.k"] and sorted(report["skipped"]) == ["layers.0.index_k", "layers.0.v"]
    assert result.stderr.count("note: ") == 2 and "passthrough" in result.stderr
    assert out.read_bytes() == VLLM.read_bytes()
    one_line_error(kv("convert", k0, "-o", tmp_path / "v.bin", "--from-layout", "planes", "--to-layout",
                      "vllm-mxfp4-page", "--include", "layers.0.v"), "plain tensor", empty_stdout=True)
    one_line_error(kv("convert", k0, "-o", tmp_path / "n.bin", "--from-layout", "planes", "--to-layout",
                      "vllm-mxfp4-page", "--include", "nothing*"), "no tensor matches", empty_stdout=True)


def test_convert_kv_pairs_from_a_kvtool_file(cache_files, tmp_path):
    out = tmp_path / "kv.trt.bin"
    base = ["convert", cache_files["nv"], "-o", out, "--from-layout", "planes", "--to-layout", "trtllm-nvfp4-kv"]
    one_line_error(kv(*base), "--exclude 'layers.0.index_k'", empty_stdout=True)
    assert kv(*base, "--exclude", "*.index_k").exit_code == 0
    assert out.read_bytes() == TRT.read_bytes()
    assert sorted(read_layout(out, "trtllm-nvfp4-kv")) == ["layers.0.k", "layers.0.v"]  # names from the sidecar
    one_line_error(kv("convert", cache_files["mx"], "-o", tmp_path / "x.bin", "--from-layout", "vllm-mxfp4-page",
                      "--to-layout", "planes"), "is a kvtool cache file", empty_stdout=True)


def test_raw_sidecar_keeps_a_prefixed_names_scalars(tmp_path):
    """A raw dump of `layers.0.k` (nvfp4 with a whole-tensor outer scale) reads back under that name with it."""
    q = get_format("nvfp4-div-auto").quantize(torch.randn(40, 2, 128))
    path = tmp_path / "k.bin"
    geos = write_layout({"layers.0.k": q}, path, "paged", "page=16")
    assert geos["layers.0.k"].pages == 3
    back = read_layout(path, "paged")
    assert list(back) == ["layers.0.k"]
    assert_same(back["layers.0.k"], q)
