"""`kvtool inspect` of a plain safetensors file or an .npy file imports no torch (kvtool.workflows.inspect_plain), and
says exactly what the torch path (kvtool.workflows.inspect.inspect_file) says: the same text, the same --json, the
same one-line errors for files whose header lies. Files with NaN, +-inf, -0, all-zero and subnormal values make sure
the header path reads no values that would matter; a kvtool cache file still goes the torch path and reports the
same as before.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cli_helpers import kv
from kvtool.errors import KvtoolError
from kvtool.readers import open_input
from kvtool.workflows.inspect import inspect_file
from kvtool.workflows.inspect_plain import plain_report

ROOT = Path(__file__).resolve().parents[2]
EDGE = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 2.0 ** -140, 65504.0, -3.5, 1.0]


def _edge(dtype: torch.dtype, rows: int = 3, dim: int = 32) -> torch.Tensor:
    x = torch.tensor(EDGE * (rows * dim // len(EDGE) + 1))[: rows * dim].reshape(rows, dim)
    return x.to(dtype)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("torch_free")
    out = {}
    plain = {
        "layers.0.k": _edge(torch.bfloat16).reshape(1, 3, 32), "layers.0.v": _edge(torch.float16),
        "layers.1.k": _edge(torch.float32), "zeros": torch.zeros(2, 64, dtype=torch.bfloat16),
        "neg_zeros": torch.full((2, 16), -0.0), "sub": torch.full((4, 8), 1e-45), "ids": torch.arange(6),
        "flags": torch.tensor([True, False]), "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 8),
        "f8": torch.zeros(2, 32, dtype=torch.float8_e4m3fn), "u16": torch.zeros(4, 4, dtype=torch.uint16),
        "f64": torch.ones(1, 2, dtype=torch.float64),
    }
    out["mixed"] = d / "mixed.safetensors"
    save_file(plain, str(out["mixed"]), metadata={"kvtool.version": "0.0.9", "note": "not a kvtool file"})
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        out[name] = d / f"{name}.st"
        save_file({"x": _edge(dtype, 4, 64)}, str(out[name]))
    finite = {"k": torch.randn(2, 4, 64), "z": torch.zeros(3, 32)}
    src = d / "finite.safetensors"
    save_file(finite, str(src))
    out["kvtool"] = d / "cache.safetensors"
    result = kv("quantize", src, "--to", "mxfp4", "-o", out["kvtool"])
    assert result.exit_code == 0, result.output
    return out


PLAIN = ["mixed", "bf16", "fp16", "fp32"]
OPTIONS = [[], ["--json"], ["--no-verify"], ["--include", "layers.*", "--exclude", "*.v"], ["--json", "--include", "x"]]


def _torch_path(monkeypatch):
    monkeypatch.setattr("kvtool.workflows.inspect_plain.plain_report", lambda *a, **k: None)


def assert_same_as_torch_path(path, opts, monkeypatch):
    """`kvtool inspect path *opts` prints the same (stdout, stderr, exit 0) on the torch-free route and the torch one."""
    light = kv("inspect", path, *opts)
    _torch_path(monkeypatch)
    heavy = kv("inspect", path, *opts)
    assert light.exit_code == heavy.exit_code == 0, light.output + heavy.output
    assert (light.stdout, light.stderr) == (heavy.stdout, heavy.stderr)


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: " ".join(o) or "default")
@pytest.mark.parametrize("name", PLAIN)
def test_cli_output_equals_the_torch_path(files, name, opts, monkeypatch):
    assert_same_as_torch_path(files[name], opts, monkeypatch)


@pytest.mark.parametrize("name", PLAIN)
def test_report_equals_inspect_file(files, name):
    for kw in ({}, {"verify": False}, {"include": ["layers.*", "x"], "exclude": ["*.k"]}):
        ticks_light, ticks_heavy = [], []
        light = plain_report(files[name], progress=lambda *a: ticks_light.append(a), **kw)
        heavy = inspect_file(files[name], progress=lambda *a: ticks_heavy.append(a), **kw)
        assert light == heavy and ticks_light == ticks_heavy
        assert json.dumps(light.__dict__, default=str) == json.dumps(heavy.__dict__, default=str)


def test_other_inputs_go_the_torch_path(files, tmp_path):
    assert plain_report(files["kvtool"]) is None
    torch.save({"k": torch.zeros(2, 4)}, tmp_path / "a.pt")
    (tmp_path / "dump.bin").write_bytes(b"\0" * 64)
    assert plain_report(tmp_path / "a.pt") is None and plain_report(tmp_path / "dump.bin") is None


@pytest.mark.parametrize("name", ["missing.safetensors", "missing.npy", "missing.pt", "."])
def test_missing_file_or_directory_same_error(tmp_path, name):
    with pytest.raises(KvtoolError) as light:
        plain_report(tmp_path / name)
    with pytest.raises(KvtoolError) as heavy:
        open_input(tmp_path / name)
    assert (type(light.value), str(light.value)) == (type(heavy.value), str(heavy.value))


# ------------------------------------------------------------------------------------------------------ .npy
NPY = {  # name -> array: every dtype torch takes, the layouts the reader loads whole, and edge values
    "f32": np.array(EDGE * 13, dtype=np.float32)[:128].reshape(2, 2, 32),
    "f16": np.zeros((3, 16), dtype=np.float16), "f64": np.full((1, 8), -0.0),
    "i8": np.arange(-4, 4, dtype=np.int8).reshape(2, 4), "u16": np.zeros((4, 4), dtype=np.uint16),
    "u64": np.ones(5, dtype=np.uint64), "i64": np.arange(6), "bool": np.array([[True, False]]),
    "c64": np.zeros((2, 2), dtype=np.complex64), "scalar": np.array(3.0, dtype=np.float32),
    "empty": np.zeros((0, 8), dtype=np.float32), "fortran": np.asfortranarray(np.ones((4, 6), dtype=np.float32)),
    "big_endian": np.arange(12, dtype=">f4").reshape(3, 4),
}


@pytest.fixture(scope="module")
def npy_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("npy")
    out = {}
    for name, arr in NPY.items():
        out[name] = d / f"{name}.npy"
        np.save(out[name], arr)
    return out


@pytest.mark.parametrize("name", NPY)
def test_npy_report_equals_inspect_file(npy_files, name):
    for kw in ({}, {"verify": False}, {"include": ["tensor"]}, {"exclude": ["t*"]}):
        ticks_light, ticks_heavy = [], []
        light = plain_report(npy_files[name], progress=lambda *a: ticks_light.append(a), **kw)
        heavy = inspect_file(npy_files[name], progress=lambda *a: ticks_heavy.append(a), **kw)
        assert light == heavy and ticks_light == ticks_heavy
        assert json.dumps(light.__dict__, default=str) == json.dumps(heavy.__dict__, default=str)


@pytest.mark.parametrize("opts", [[], ["--json"], ["--exclude", "tensor"]], ids=lambda o: " ".join(o) or "default")
@pytest.mark.parametrize("name", ["f32", "scalar", "fortran", "big_endian"])
def test_npy_cli_output_equals_the_torch_path(npy_files, name, opts, monkeypatch):
    assert_same_as_torch_path(npy_files[name], opts, monkeypatch)


def _npy_bytes(arr: np.ndarray, **kw) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, **kw)
    return buf.getvalue()


NPY_BAD = {  # name -> file bytes that the .npy reader refuses
    "magic_only": b"\x93NUMPY",
    "bad_version": b"\x93NUMPY\x09\x00" + b"\0" * 8,
    "bad_dict": b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4',}\n",
    "objects": _npy_bytes(np.array([{"a": 1}], dtype=object), allow_pickle=True),
    "unicode": _npy_bytes(np.array(["ab", "c"])),
    "datetime": _npy_bytes(np.array(["2026-01-01"], dtype="datetime64[D]")),
    "structured": _npy_bytes(np.zeros(2, dtype=[("a", "<f4"), ("b", "<i2")])),
    "subarray_field": _npy_bytes(np.zeros(3, dtype=[("a", "<f4", (2,))])),
    "longdouble": _npy_bytes(np.zeros(2, dtype=np.longdouble)),
    "truncated": _npy_bytes(np.zeros((4, 8), dtype=np.float32))[:-4],
}


@pytest.mark.parametrize("case", NPY_BAD)
def test_npy_same_error(tmp_path, case):
    path = tmp_path / f"{case}.npy"
    path.write_bytes(NPY_BAD[case])
    with pytest.raises(KvtoolError) as light:
        plain_report(path)
    with pytest.raises(KvtoolError) as heavy:
        open_input(path).close()
    assert (type(light.value), str(light.value)) == (type(heavy.value), str(heavy.value))
    assert "\n" not in str(light.value)


def test_npy_inspect_imports_no_torch(npy_files, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "120")
    for name in ("f32", "fortran", "scalar"):
        for opts in ([], ["--json"]):
            run = _run("inspect", npy_files[name], *opts)
            assert run.stderr.splitlines()[-1] == "NO-TORCH 0", run.stderr
            assert run.stdout == kv("inspect", npy_files[name], *opts).stdout
    bad = tmp_path / "bad.npy"
    bad.write_bytes(NPY_BAD["unicode"])
    run = _run("inspect", bad)
    assert run.stderr.splitlines()[-1] == "NO-TORCH 2" and run.stderr.startswith("error: "), run.stderr


def _corrupt(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


CORRUPT = {
    "short": b"",
    "not_json": b"{nope",
    "list": b"[]",
    "dup": b'{"a": 1, "a": 2}',
    "nan": b'{"a": NaN}',
    "dtype": b'{"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}',
    "lacks": b'{"a": {"dtype": "F32", "shape": [1]}}',
    "shape": b'{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',
    "span": b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}',
    "beyond": b'{"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}',
    "overlap": b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
               b'"b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}',
    "meta": b'{"__metadata__": {"a": 1}}',
    "deep": b"[" * 80 + b"]" * 80,
}


@pytest.mark.parametrize("case", CORRUPT)
def test_same_error_for_a_lying_header(tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    if case == "short":
        path.write_bytes(b"\x01\x02")
    else:
        _corrupt(path, CORRUPT[case], b"\0" * 8)
    with pytest.raises(KvtoolError) as light:
        plain_report(path)
    with pytest.raises(KvtoolError) as heavy:
        open_input(path).close()
    assert (type(light.value), str(light.value)) == (type(heavy.value), str(heavy.value))


def test_kvtool_cache_report_is_unchanged(files, monkeypatch):
    """A kvtool cache file needs the codecs (scale statistics) and the format registry: the torch path, as before."""
    light = kv("inspect", files["kvtool"], "--json")
    _torch_path(monkeypatch)
    heavy = kv("inspect", files["kvtool"], "--json")
    assert light.exit_code == heavy.exit_code == 0 and light.stdout == heavy.stdout
    assert json.loads(light.stdout)["kind"] == "kvtool"


CHECK = """
import sys
from kvtool.cli import main
sys.argv = ["kvtool", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    code = e.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code, file=sys.stderr)
"""


def _run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}  # the width the in-process runner renders at (monkeypatched below)
    return subprocess.run([sys.executable, "-c", CHECK, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env=env)


@pytest.mark.parametrize("opts", [[], ["--json"]], ids=["text", "json"])
def test_plain_inspect_imports_no_torch(files, opts, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    for name in PLAIN:
        run = _run("inspect", files[name], *opts)
        assert run.stderr.splitlines()[-1] == "NO-TORCH 0", run.stderr
        assert run.stdout == kv("inspect", files[name], *opts).stdout


def test_help_and_bad_file_import_no_torch(tmp_path):
    assert _run("-h").stderr.splitlines()[-1] == "NO-TORCH 0"
    bad = _corrupt(tmp_path / "bad.safetensors", b"{nope")
    for path in (bad, tmp_path / "missing.pt", tmp_path):
        run = _run("inspect", path)
        assert run.stderr.splitlines()[-1] == "NO-TORCH 2" and run.stderr.startswith("error: "), run.stderr


def test_kvtool_cache_inspect_imports_torch(files):
    """The fallback, measured by the same probe: a quantized cache file needs the codecs."""
    assert _run("inspect", files["kvtool"]).stderr.splitlines()[-1] == "TORCH 0"
