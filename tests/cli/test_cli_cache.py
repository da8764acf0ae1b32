"""`kvtool quantize | dequantize | inspect | diff` end to end: a few true subprocess runs of `python -m kvtool` (exit
codes, no traceback, no output file on failure, a killed run leaves nothing at the target) and CliRunner runs for the
many options and every bad input of issue 2 (one line, exit 2, no output file)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cli_helpers import kv, kv_json, one_line_error

from kvtool.container import read_header
from kvtool.formats import get_format

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures" / "synthetic_cache.safetensors"


def run_module(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvtool", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def mx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "mx.safetensors"
    assert kv("quantize", FIX, "-o", out, "--to", "mxfp4").exit_code == 0
    return out


# ------------------------------------------------------------------------------------------------ real processes
def test_end_to_end_in_a_real_process(tmp_path):
    out = tmp_path / "k.safetensors"
    r = run_module("quantize", FIX, "-o", out, "--to", "nvfp4", "--outer-scale", "auto", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "nvfp4-rcp-auto"
    r = run_module("inspect", out, "--verify", "--json")
    assert r.returncode == 0 and all(t["checksum"] == "ok" for t in json.loads(r.stdout)["tensors"])
    r = run_module("diff", out, FIX, "--min-sqnr", "60")
    assert r.returncode == 1 and "FAIL" in r.stdout and "Traceback" not in r.stderr


def test_bad_input_in_a_real_process(tmp_path):
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(FIX.read_bytes()[:3000])
    out = tmp_path / "o.safetensors"
    for args in (["quantize", bad, "-o", out, "--to", "mxfp4"],
                 ["quantize", FIX, "-o", out, "--to", "mxfp4", "--device", "cuda"] if not torch.cuda.is_available()
                 else ["quantize", FIX, "-o", out, "--to", "mxfp9"]):
        r = run_module(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.safetensors"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_killed_run_leaves_no_output(sig, tmp_path):
    src = tmp_path / "big.safetensors"
    save_file({"k": torch.randn(1 << 16, 128).bfloat16()}, str(src))
    out = tmp_path / "out.safetensors"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kvtool", "quantize", src, "-o", out, "--to", "nvfp4",
                             "--chunk-mb", "0.002"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not out.exists()
    if sig == signal.SIGTERM:  # a catchable signal also removes the temporary file
        assert proc.returncode == 130 and b"interrupted" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


# ------------------------------------------------------------------------------------------------ quantize
def test_quantize_calls_the_workflow_with_the_options(monkeypatch, tmp_path):
    import kvtool.workflows.cache_ops as ops

    got = {}

    def fake(src, out, to, **kwargs):
        got.update(src=src, out=out, to=to, **kwargs)
        return ops.CacheOpReport("quantize", str(src), str(out), to, "cpu", 64.0)

    monkeypatch.setattr(ops, "quantize_file", fake)
    r = kv("quantize", FIX, "-o", tmp_path / "o.safetensors", "--to", "nvfp4", "--recipe", "div", "--outer-scale",
           "auto", "--include", "*.k", "--include", "*.v", "--exclude", "layers.0.v", "--chunk-mb", "8",
           "--layout", "paged", "--geometry", "page=16,heads=2")
    assert r.exit_code == 0, r.output
    assert got["to"] == "nvfp4" and got["options"] == {"scale_rule": None, "recipe": "div", "outer_scale": "auto",
                                                       "fp8_scale": None}
    assert got["include"] == ["*.k", "*.v"] and got["exclude"] == ["layers.0.v"] and got["chunk_mb"] == 8.0
    assert got["layout"] == "paged" and got["geometry"] == "page=16,heads=2" and got["device"] == "cpu"


@pytest.mark.parametrize("args,label", [
    (["--to", "mxfp4", "--scale-rule", "floor"], "mxfp4-floor"),
    (["--to", "mxfp4-even"], "mxfp4-even"),
    (["--to", "fp4", "--recipe", "unrounded"], "nvfp4-unrounded"),
    (["--to", "fp8", "--fp8-scale", "token"], "fp8-token"),
    (["--to", "fp8-ds-pow2"], "fp8-token-ds-pow2"),
    (["--to", "nvfp4", "--outer-scale", "0.5"], "nvfp4-rcp-g0.5"),
])
def test_quantize_recipe_options(args, label, tmp_path):
    report = kv_json("quantize", FIX, "-o", tmp_path / "o.safetensors", *args)
    assert report["format"] == label and {t["format"] for t in report["tensors"]} == {label}
    with safe_open(str(tmp_path / "o.safetensors"), "pt") as f:
        table = json.loads(f.metadata()["kvtool.tensors"])
    assert {e["format"]["label"] for e in table.values()} == {label}


def test_quantize_include_exclude_and_report(tmp_path):
    report = kv_json("quantize", FIX, "-o", tmp_path / "o.safetensors", "--to", "mxfp4", "--include", "layers.0.*",
                     "--exclude", "*.v")
    assert list(report) == ["command", "input", "output", "format", "device", "chunk_mb", "tensors", "bytes_in",
                            "bytes_out", "hints"]
    actions = {t["name"]: (t["action"], t["bytes_per_token"], t["compression_vs_bf16"]) for t in report["tensors"]}
    assert actions == {"layers.0.index_k": ("quantized", 68, 3.7647), "layers.0.k": ("quantized", 68, 3.7647),
                       "layers.0.v": ("copied", 256, 1.0)}
    r = kv("quantize", FIX, "-o", tmp_path / "n.safetensors", "--to", "mxfp4", "--include", "nothing*")
    one_line_error(r, "no tensor matches")


def test_requantize_hint_goes_to_stderr(mx, tmp_path):
    r = kv("quantize", mx, "-o", tmp_path / "n.safetensors", "--to", "nvfp4", "--json")
    assert r.exit_code == 0 and "hint:" in r.stderr and "already mxfp4-rceil" in r.stderr
    assert json.loads(r.stdout)["hints"]  # stdout is pure JSON


# ------------------------------------------------------------------------------------------------ dequantize
def test_dequantize_restores_the_original_names_shapes_and_dtype(mx, tmp_path):
    report = kv_json("dequantize", mx, "-o", tmp_path / "d.safetensors")
    assert report["format"] is None
    back, orig = load_file(str(tmp_path / "d.safetensors")), load_file(str(FIX))
    assert {n: (t.shape, t.dtype) for n, t in back.items()} == {n: (t.shape, t.dtype) for n, t in orig.items()}
    fmt = get_format("mxfp4")
    assert torch.equal(back["layers.0.k"], fmt.dequantize(fmt.quantize(orig["layers.0.k"]), torch.bfloat16))
    kv_json("dequantize", mx, "-o", tmp_path / "f.safetensors", "--dtype", "fp32")
    assert load_file(str(tmp_path / "f.safetensors"))["layers.0.v"].dtype == torch.float32
    one_line_error(kv("dequantize", mx, "-o", tmp_path / "x.safetensors", "--dtype", "int4"), "unknown dtype")
    one_line_error(kv("dequantize", FIX, "-o", tmp_path / "x.safetensors"), "nothing to dequantize")
    assert not (tmp_path / "x.safetensors").exists()


# ------------------------------------------------------------------------------------------------ inspect
def test_inspect_plain_and_quantized(mx, tmp_path):
    plain = kv_json("inspect", FIX)
    assert plain["kind"] == "safetensors" and {t["format"] for t in plain["tensors"]} == {"bf16 plain"}
    assert {t["bytes_per_token"] for t in plain["tensors"]} == {256}
    report = kv_json("inspect", mx, "--verify")
    assert report["schema"] == 2 and report["ok"] and report["verified"]
    idx = next(t for t in report["tensors"] if t["name"] == "layers.0.index_k")
    assert idx["format"] == "mxfp4-rceil" and idx["options"] == {"scale_rule": "rceil"}
    assert idx["bytes_per_token"] == 68 and idx["compression_vs_bf16"] == pytest.approx(256 / 68, abs=1e-4)
    s = idx["scales"]
    assert s["blocks"] == 256 * 4 and s["zero_blocks"] == 1  # the planted all-zero block index_k[5, 32:64]
    assert 0 < s["saturated_blocks"] < s["blocks"] and sum(s["exponent_histogram"].values()) == s["scales"]
    assert s["exponent_histogram"]["-1"] >= 4  # the tie row: four blocks at scale 2^-1
    fp8 = kv_json("quantize", FIX, "-o", tmp_path / "t.safetensors", "--to", "fp8", "--fp8-scale", "tensor")
    t = kv_json("inspect", tmp_path / "t.safetensors")["tensors"][0]
    assert t["tensor_scale"] == pytest.approx(fp8["tensors"][0]["tensor_scale"]) and t["scales"]["scales"] == 1
    r = kv("inspect", mx)
    assert r.exit_code == 0 and "mxfp4-rceil" in r.stdout and "scale exponents" in r.stdout


def test_inspect_verify_fails_with_exit_1_on_a_corrupt_byte(mx, tmp_path):
    bad = tmp_path / "bad.safetensors"
    data = bytearray(mx.read_bytes())
    t = read_header(mx).tensors["layers.0.v.scales"]
    data[t.start + 3] ^= 0x40
    bad.write_bytes(bytes(data))
    r = kv("inspect", bad, "--verify", "--json")
    assert r.exit_code == 1
    status = {t["name"]: t["checksum"] for t in json.loads(r.stdout)["tensors"]}
    assert status["layers.0.v"] == "mismatch: scales" and status["layers.0.k"] == "ok"
    assert kv("inspect", bad).exit_code == 1  # verifying is the default
    assert kv("inspect", bad, "--no-verify").exit_code == 0  # without verifying the checksum is not recomputed


# ------------------------------------------------------------------------------------------------ diff
def test_diff_across_formats_and_thresholds(mx, tmp_path):
    report = kv_json("diff", mx, FIX)
    assert report["passed"] and list(report)[:3] == ["a", "b", "tensors"]
    k = next(t for t in report["tensors"] if t["name"] == "layers.0.k")
    assert 0 < k["metrics"]["rel_l2"] < 0.3 and k["codes"]["compared"] == "reencoded-b"
    assert k["codes"]["scale_mismatch_pct"] == 0 and next(iter(k["rule_fit"])) == "mxfp4-rceil"
    rel = max(t["metrics"]["rel_l2"] for t in report["tensors"])
    assert kv("diff", mx, FIX, "--max-rel-l2", str(rel * 1.01)).exit_code == 0
    assert kv("diff", mx, FIX, "--max-rel-l2", str(rel * 0.99)).exit_code == 1
    assert kv("diff", mx, FIX, "--max-abs", "1e-3").exit_code == 1
    assert kv("diff", mx, FIX, "--min-sqnr", "10").exit_code == 0
    assert kv("diff", mx, FIX, "--max-scale-mismatch", "0").exit_code == 0
    same = kv_json("diff", mx, mx, "--max-abs", "0", "--max-scale-mismatch", "0")
    assert same["passed"] and all(t["value_mismatch_pct"] == 0 for t in same["tensors"])


def test_diff_scale_rule_mismatch(mx, tmp_path):
    floor = tmp_path / "floor.safetensors"
    kv_json("quantize", FIX, "-o", floor, "--to", "mxfp4", "--scale-rule", "floor")
    r = kv("diff", floor, mx, "--max-scale-mismatch", "1", "--json")
    assert r.exit_code == 1
    report = json.loads(r.stdout)
    idx = next(t for t in report["tensors"] if t["name"] == "layers.0.index_k")
    c = idx["codes"]
    assert c["compared"] == "stored" and c["scale_mismatch_pct"] > 1 and c["rule_blocks"] == c["differing_blocks"] > 0
    assert any("scale-byte mismatch" in f for f in report["failures"])


def test_diff_names_the_rule_a_mislabelled_file_really_used(tmp_path):
    """A writer that used `floor` but declared `rceil` (the silent mismatch of SPEC section 2) is caught against the
    original: the declared format does not reproduce the bytes, and the rule fit names floor."""
    floor = tmp_path / "floor.safetensors"
    kv_json("quantize", FIX, "-o", floor, "--to", "mxfp4-floor")
    with safe_open(str(floor), "pt") as f:
        meta = dict(f.metadata())
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    table = json.loads(meta["kvtool.tensors"])
    for entry in table.values():
        entry["format"].update(scale_rule="rceil", label="mxfp4-rceil")
        entry["checksum"] = {}
    meta["kvtool.tensors"] = json.dumps(table)
    lying = tmp_path / "lying.safetensors"
    save_file(tensors, str(lying), metadata=meta)
    r = kv("diff", lying, FIX, "--max-scale-mismatch", "0", "--json", "--no-verify")  # the record was dropped
    assert r.exit_code == 1
    for t in json.loads(r.stdout)["tensors"]:
        assert t["format_a"] == "mxfp4-rceil" and t["codes"]["scale_mismatch_pct"] > 0
        assert next(iter(t["rule_fit"])) == "mxfp4-floor" and t["rule_fit"]["mxfp4-floor"] == 100.0


def test_diff_structure_and_plot(mx, tmp_path, monkeypatch):
    part = tmp_path / "part.safetensors"
    kv_json("quantize", FIX, "-o", part, "--to", "mxfp4", "--include", "*.k")  # others copied, names all present
    assert kv("diff", part, FIX).exit_code == 0
    only = tmp_path / "only.safetensors"
    save_file({"layers.0.k": load_file(str(FIX))["layers.0.k"]}, str(only))
    r = kv("diff", only, FIX, "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["only_in_b"] == ["layers.0.index_k", "layers.0.v"]
    reshaped = tmp_path / "reshaped.safetensors"
    save_file({"layers.0.k": torch.zeros(128, 2, 128)}, str(reshaped))
    assert kv("diff", reshaped, only).exit_code == 1
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(4, 32), "y": torch.zeros(4, 32)}, str(other))
    one_line_error(kv("diff", other, FIX), "share no tensor names")
    png = tmp_path / "err.png"
    r = kv("diff", mx, FIX, "--plot", png)
    assert r.exit_code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    one_line_error(kv("diff", mx, FIX, "--plot", tmp_path / "x.png"), "needs matplotlib")


def test_single_tensor_files_pair_whatever_their_names(tmp_path):
    import numpy as np

    x = torch.randn(8, 64)
    np.save(tmp_path / "x.npy", x.numpy())
    torch.save({"keys": x}, tmp_path / "k.pt")
    report = kv_json("diff", tmp_path / "x.npy", tmp_path / "k.pt", "--max-abs", "0")
    assert report["tensors"][0]["name"] == "tensor~keys" and report["tensors"][0]["metrics"]["max_abs"] == 0


# ------------------------------------------------------------------------------------------------ layouts
def test_layout_and_geometry_route_to_read_layout(monkeypatch, tmp_path):
    import kvtool.layouts as layouts

    fmt = get_format("mxfp4")
    seen = []

    def fake_read_layout(path, layout, geometry):
        seen.append((Path(path).name, layout, geometry))
        return {"k": fmt.quantize(torch.randn(16, 2, 64))}

    monkeypatch.setattr(layouts, "read_layout", fake_read_layout)
    dump = tmp_path / "dump.bin"
    dump.write_bytes(b"\0" * 64)
    geo = "page=16,heads=2,dim=64"
    for cmd in (["dequantize", dump, "-o", tmp_path / "d.safetensors"], ["inspect", dump],
                ["quantize", dump, "-o", tmp_path / "q.safetensors", "--to", "nvfp4"],
                ["diff", dump, dump, "--layout-b", "vllm-mxfp4-page", "--geometry-b", geo]):
        r = kv(*cmd, "--layout", "vllm-mxfp4-page", "--geometry", geo)
        assert r.exit_code == 0, r.output
    assert seen[0] == ("dump.bin", "vllm-mxfp4-page", geo) and len(seen) == 5
    one_line_error(kv("inspect", dump), "needs --layout")
    monkeypatch.setitem(sys.modules, "kvtool.layouts", None)  # a build without kvtool.layouts
    one_line_error(kv("inspect", dump, "--layout", "paged"), "not available")


# ------------------------------------------------------------------------------------------------ bad input
def _raw(path: Path, header: dict, nbytes: int) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(nbytes))
    return path


def _future(tmp_path: Path, mx: Path) -> Path:
    with safe_open(str(mx), "pt") as f:
        meta = {**f.metadata(), "kvtool.schema": "7"}
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    save_file(tensors, str(tmp_path / "future.safetensors"), metadata=meta)
    return tmp_path / "future.safetensors"


BAD_INPUTS = {
    "truncated": (lambda d, mx: (d / "t.safetensors").write_bytes(FIX.read_bytes()[:100]) and d / "t.safetensors",
                  "header length"),
    "offsets beyond end": (lambda d, mx: _raw(d / "o.safetensors", {"a": {"dtype": "BF16", "shape": [4, 32],
                                                                          "data_offsets": [0, 256]}}, 100),
                           "beyond the end of the file"),
    "overlap": (lambda d, mx: _raw(d / "v.safetensors", {"a": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]},
                                                         "b": {"dtype": "F32", "shape": [32],
                                                               "data_offsets": [64, 192]}}, 192), "overlap"),
    "dtype x shape != span": (lambda d, mx: _raw(d / "s.safetensors", {"a": {"dtype": "F32", "shape": [2, 32],
                                                                             "data_offsets": [0, 128]}}, 256),
                              "needs 256 bytes but its offsets span 128"),
    "future schema": (lambda d, mx: _future(d, mx), "newer kvtool (schema 7"),
    "last dim vs block": (lambda d, mx: save_file({"x": torch.randn(4, 48)}, str(d / "b.safetensors"))
                          or d / "b.safetensors", "48 is not divisible by the mxfp4 block 32"),
    "nan": (lambda d, mx: _nan_file(d, float("nan")), "x: non-finite value nan at index [9, 1, 3]"),
    "inf": (lambda d, mx: _nan_file(d, float("-inf")), "x: non-finite value -inf at index [9, 1, 3]"),
    "non-floating": (lambda d, mx: save_file({"x": torch.ones(4, 32, dtype=torch.int32)}, str(d / "i.safetensors"))
                     or d / "i.safetensors", "x: dtype int32 is not floating point"),
    "missing input": (lambda d, mx: d / "nope.safetensors", "no such file"),
    "not json": (lambda d, mx: (d / "j.safetensors").write_bytes(struct.pack("<Q", 6) + b"{oops}")
                 and d / "j.safetensors", "not JSON"),
}


def _nan_file(d: Path, value: float) -> Path:
    x = torch.randn(16, 2, 32)
    x[9, 1, 3] = value
    save_file({"x": x.bfloat16()}, str(d / "nan.safetensors"))
    return d / "nan.safetensors"


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=str)
def test_bad_inputs_are_one_line_exit_2_and_write_nothing(case, mx, tmp_path):
    make, words = BAD_INPUTS[case]
    src = make(tmp_path, mx)
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    one_line_error(kv("quantize", src, "-o", out, "--to", "mxfp4", "--chunk-mb", "0.0005"), words)
    assert list(out.parent.iterdir()) == []  # no output and no temporary file


@pytest.mark.parametrize("args,words", [
    (["--to", "mxfp5"], "unknown format 'mxfp5'"),
    (["--to", "nvfp4", "--recipe", "fast"], "unknown nvfp4 recipe 'fast'"),
    (["--to", "mxfp4", "--scale-rule", "round"], "unknown scale rule 'round'"),
    (["--to", "mxfp4", "--recipe", "div"], "does not apply to mxfp4"),
    (["--to", "nvfp4", "--outer-scale", "-1"], "outer scale must be a positive"),
    (["--to", "mxfp4", "--chunk-mb", "0"], "--chunk-mb must be positive"),
])
def test_bad_options(args, words, tmp_path):
    one_line_error(kv("quantize", FIX, "-o", tmp_path / "o.safetensors", *args), words)
    assert not (tmp_path / "o.safetensors").exists()


def test_bad_output_paths(mx, tmp_path, monkeypatch):
    link = tmp_path / "link.safetensors"
    link.symlink_to(mx)
    for out in (mx, mx.parent / ".." / mx.parent.name / mx.name, link):
        one_line_error(kv("dequantize", mx, "-o", out), "is the input file")
    one_line_error(kv("quantize", link, "-o", mx, "--to", "nvfp4"), "is the input file")
    one_line_error(kv("quantize", FIX, "-o", tmp_path / "missing" / "o.safetensors", "--to", "mxfp4"),
                   "does not exist")
    ro = tmp_path / "ro"
    ro.mkdir()
    import kvtool.container

    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(kvtool.container, "_open_new", refuse)  # where the temporary file is created
    one_line_error(kv("quantize", FIX, "-o", ro / "o.safetensors", "--to", "mxfp4"), "Read-only file system")
    assert list(ro.iterdir()) == []


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    one_line_error(kv("quantize", FIX, "-o", tmp_path / "o.safetensors", "--to", "mxfp4", "--device", "cuda"),
                   "no CUDA device")


@pytest.mark.parametrize("cmd", ["quantize", "dequantize", "inspect", "diff"])
def test_help_has_examples(cmd):
    r = kv(cmd, "--help")
    assert r.exit_code == 0 and "Examples" in r.output and f"kvtool {cmd}" in r.output
