"""The cache file (kvtool.container) and the readers (kvtool.readers): schema round trips for every format, checksums,
streaming == one-shot bytes, headers that lie, future schemas, foreign inputs (.pt, .npy, plain safetensors), the
global index of a NaN found in a row block, atomic output, and peak memory while streaming.

Run by hand for the big-file memory figure: `python tests/io/test_container.py --rss-gib 4` (writes, quantizes and
deletes a 4 GiB bf16 file next to /tmp; prints the peak RSS growth).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvtool.container import SafetensorsWriter, check_output, read_header
from kvtool.errors import FileFormatError, FormatError, InputError, KvtoolError, OutputError
from kvtool.formats import all_formats, get_format
from kvtool.readers import open_input
from kvtool.workflows.cache_ops import dequantize_file, quantize_file
from kvtool.workflows.inspect import inspect_file

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures" / "synthetic_cache.safetensors"
ALL = all_formats()
TINY_CHUNK_MB = 1e-4  # 104 bytes: one row per row block at D = 64


def _cache(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two small caches with an outlier channel, an outlier token, an all-zero block and a tie row."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(24, 2, 64, generator=g)
    k[..., 5] *= 30
    k[3] *= 10
    k[4, 1, :32] = 0
    k[6, 0] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8)
    idx = torch.randn(24, 64, generator=g).float()
    return {"k": k.bfloat16(), "index_k": idx}


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "cache.safetensors"
    save_file(_cache(), str(path))
    return path


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ------------------------------------------------------------------------------------------------ schema
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.label)
def test_schema_round_trip(fmt, src, tmp_path):
    out = tmp_path / "q.safetensors"
    quantize_file(src, out, fmt.label)
    with safe_open(str(out), "pt") as f:  # the reference reader accepts our streamed file
        meta = f.metadata()
        stored = {name: f.get_tensor(name) for name in f.keys()}
    assert meta["kvtool.schema"] == "2" and meta["kvtool.version"]
    table = json.loads(meta["kvtool.tensors"])
    assert set(table) == {"k", "index_k"}
    originals = _cache()
    with open_input(out) as inp:
        assert inp.kind == "kvtool" and inp.schema == 2
        for name, x in originals.items():
            e = inp.entries[name]
            assert e.fmt == fmt and table[name]["format"] == fmt.to_meta()
            assert e.shape == tuple(x.shape) and e.dtype == x.dtype and table[name]["layout"] == "planes"
            ref = fmt.quantize(x)
            q = e.read_q(0, e.rows)
            assert torch.equal(q.payload.view(torch.uint8).reshape(-1), ref.payload.view(torch.uint8).reshape(-1))
            assert torch.equal(stored[f"{name}.payload"].view(torch.uint8).reshape(-1),
                               ref.payload.view(torch.uint8).reshape(-1))
            if ref.scales is None:
                assert q.scales is None and table[name]["scales"] is None
            else:
                assert torch.equal(q.scales.reshape(-1).view(torch.uint8), ref.scales.reshape(-1).view(torch.uint8))
            assert e.outer_scale == ref.outer_scale == table[name]["outer_scale"]
            assert inp.verify(e) == "ok"


def test_dequantize_restores_names_shapes_and_dtypes(src, tmp_path):
    fmt = get_format("nvfp4-auto")
    quantize_file(src, tmp_path / "q.safetensors", fmt.label)
    dequantize_file(tmp_path / "q.safetensors", tmp_path / "d.safetensors")
    back, orig = load_file(str(tmp_path / "d.safetensors")), _cache()
    assert set(back) == set(orig)
    for name, x in orig.items():
        assert back[name].shape == x.shape and back[name].dtype == x.dtype
        assert torch.equal(back[name], fmt.dequantize(fmt.quantize(x), x.dtype))
    dequantize_file(tmp_path / "q.safetensors", tmp_path / "f.safetensors", dtype="fp32")
    assert all(t.dtype == torch.float32 for t in load_file(str(tmp_path / "f.safetensors")).values())


@pytest.mark.parametrize("label", ["mxfp4-floor", "nvfp4-div-auto", "fp8-tensor", "fp8-token-ds-pow2", "bf16"])
def test_streaming_equals_one_shot_bytes(label, src, tmp_path):
    quantize_file(src, tmp_path / "one.safetensors", label, chunk_mb=64)
    quantize_file(src, tmp_path / "rows.safetensors", label, chunk_mb=TINY_CHUNK_MB)
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "rows.safetensors").read_bytes()
    dequantize_file(tmp_path / "one.safetensors", tmp_path / "d1.safetensors", chunk_mb=64)
    dequantize_file(tmp_path / "one.safetensors", tmp_path / "d2.safetensors", chunk_mb=TINY_CHUNK_MB)
    assert (tmp_path / "d1.safetensors").read_bytes() == (tmp_path / "d2.safetensors").read_bytes()


def test_empty_and_copied_tensors(tmp_path):
    path = tmp_path / "in.safetensors"
    save_file({"empty": torch.zeros(0, 64), "pos": torch.arange(10), "k": torch.randn(4, 64)}, str(path))
    for label in ("fp8-tensor", "mxfp4"):
        out = tmp_path / f"{label}.safetensors"
        quantize_file(path, out, label, exclude=["pos"])
        with open_input(out) as inp:
            assert inp.entries["empty"].shape == (0, 64) and inp.entries["empty"].quantized
            assert torch.equal(inp.entries["pos"].read(0, 1).reshape(-1), torch.arange(10))
            assert all(inp.verify(e) in ("ok", None) for e in inp.entries.values())
        dequantize_file(out, tmp_path / "d.safetensors")
        back = load_file(str(tmp_path / "d.safetensors"))
        assert back["empty"].shape == (0, 64) and torch.equal(back["pos"], torch.arange(10))


def test_requantizing_decodes_and_copies_unselected_quantized(src, tmp_path):
    quantize_file(src, tmp_path / "a.safetensors", "mxfp4")
    hints = []
    quantize_file(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "nvfp4", include=["k"], hint=hints.append)
    assert len(hints) == 1 and "already mxfp4-rceil" in hints[0]
    with open_input(tmp_path / "a.safetensors") as a, open_input(tmp_path / "b.safetensors") as b:
        assert b.entries["k"].fmt.label == "nvfp4-rcp" and b.entries["index_k"].fmt.label == "mxfp4-rceil"
        ref = get_format("nvfp4").quantize(a.entries["k"].read(0, 48))
        assert torch.equal(b.entries["k"].read_q(0, 48).payload, ref.payload)
        qa, qb = a.entries["index_k"].read_q(0, 24), b.entries["index_k"].read_q(0, 24)
        assert torch.equal(qa.payload, qb.payload) and torch.equal(qa.scales, qb.scales)
        assert b.verify(b.entries["index_k"]) == "ok"


# ------------------------------------------------------------------------------------------------ checksums
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("role", ["payload", "scales"])
def test_checksum_detects_a_flipped_byte(role, src, tmp_path):
    out = tmp_path / "q.safetensors"
    quantize_file(src, out, "mxfp4")
    assert inspect_file(out, verify=True).ok
    t = read_header(out).tensors[f"k.{role}"]
    _flip(out, t.start + t.nbytes // 2)
    report = inspect_file(out, verify=True)
    status = {i.name: i.checksum for i in report.tensors}
    assert not report.ok and status == {"k": f"mismatch: {role}", "index_k": "ok"}
    assert inspect_file(out, verify=False).tensors[0].checksum == "unverified"


# ------------------------------------------------------------------------------------------------ lying headers
def _raw(path: Path, header: dict, data: bytes, pad_to: int | None = None) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


GOOD = {"a": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]}}
LIES = {
    "offsets beyond the end": ({"a": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]}}, 16, "beyond the end"),
    "overlap": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                 "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, 32, "overlap"),
    "dtype x shape != span": ({"a": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 16]}}, 32, "needs 32 bytes"),
    "bad offsets": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, 32, "bad data_offsets"),
    "unknown dtype": ({"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, 32, "unsupported dtype"),
    "missing field": ({"a": {"dtype": "F32", "shape": [1]}}, 32, "lacks"),
    "bad metadata": ({"__metadata__": {"x": 1}, **GOOD}, 32, "__metadata__"),
}


@pytest.mark.parametrize("case", list(LIES), ids=str)
def test_header_lies_are_one_line_errors(case, tmp_path):
    header, nbytes, words = LIES[case]
    path = _raw(tmp_path / "x.safetensors", header, bytes(nbytes))
    with pytest.raises(FileFormatError, match=words):
        open_input(path)


def test_truncated_and_garbage_files(tmp_path):
    full = tmp_path / "full.safetensors"
    save_file({"a": torch.ones(4, 8)}, str(full))
    data = full.read_bytes()
    cases = {"short": data[:5], "header cut": data[:20], "data cut": data[:-4], "garbage": b"\x10\x00" + b"x" * 30,
             "not json": struct.pack("<Q", 4) + b"{{{{"}
    for name, blob in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(blob)
        with pytest.raises(FileFormatError):
            open_input(path)


def _kvtool_with_meta(src: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "q.safetensors"
    quantize_file(src, out, "mxfp4")
    with safe_open(str(out), "pt") as f:
        meta = dict(f.metadata())
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    edit(meta)
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata=meta)
    return edited


def test_future_schema_is_refused(src, tmp_path):
    path = _kvtool_with_meta(src, tmp_path, lambda m: m.update({"kvtool.schema": "3"}))
    with pytest.raises(FileFormatError, match="newer kvtool"):
        open_input(path)


@pytest.mark.parametrize("field,value,error", [
    ("family", "mxfp5", FormatError), ("scale_rule", "round", FormatError), ("block", None, FileFormatError)])
def test_unknown_names_in_metadata(field, value, error, src, tmp_path):
    def edit(meta):
        table = json.loads(meta["kvtool.tensors"])
        table["k"]["format"][field] = value
        meta["kvtool.tensors"] = json.dumps(table)

    path = _kvtool_with_meta(src, tmp_path, edit)
    if error is None:  # (schema 2 checks every field: block and scale_element must match the format)
        open_input(path).close()
    else:
        with pytest.raises(error, match=str(value)):
            open_input(path)


def test_planes_that_do_not_match_the_format(src, tmp_path):
    def edit(meta):
        table = json.loads(meta["kvtool.tensors"])
        table["k"]["shape"] = [24, 2, 32]
        meta["kvtool.tensors"] = json.dumps(table)

    with pytest.raises(FileFormatError, match="needs U8"):
        open_input(_kvtool_with_meta(src, tmp_path, edit))


# ------------------------------------------------------------------------------------------------ readers
class NotATensor:
    """An arbitrary picklable object: torch.load(weights_only=True) must refuse it (and kvtool with it)."""


def test_pt_reader_flattens_and_never_unpickles(tmp_path):
    k = torch.randn(6, 2, 32)
    torch.save({"layer": {"k": k, "v": [k * 2]}, "step": 3}, tmp_path / "c.pt")
    with open_input(tmp_path / "c.pt") as inp:
        assert inp.kind == "pt" and list(inp.entries) == ["layer.k", "layer.v.0"]
        assert torch.equal(inp.entries["layer.v.0"].read(0, 12), (k * 2).reshape(12, 32))
        assert any("step" in n for n in inp.notes)
    torch.save(k, tmp_path / "t.pt")
    quantize_file(tmp_path / "t.pt", tmp_path / "t.safetensors", "mxfp4")
    with open_input(tmp_path / "t.safetensors") as q:
        assert torch.equal(q.entries["tensor"].read_q(0, 12).payload,
                           get_format("mxfp4").quantize(k).payload.reshape(12, -1))
    torch.save({"obj": NotATensor()}, tmp_path / "evil.pt")
    with pytest.raises(FileFormatError, match="weights_only"):
        open_input(tmp_path / "evil.pt")
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(FileFormatError):
        open_input(tmp_path / "bad.pt")


@pytest.mark.parametrize("variant", ["c", "fortran", "big-endian", "fp16"])
def test_npy_reader(variant, tmp_path):
    x = np.random.default_rng(0).standard_normal((5, 3, 32)).astype(np.float32)
    arr = {"c": x, "fortran": np.asfortranarray(x), "big-endian": x.astype(">f4"), "fp16": x.astype(np.float16)}
    np.save(tmp_path / "x.npy", arr[variant])
    with open_input(tmp_path / "x.npy") as inp:
        e = inp.entries["tensor"]
        assert e.shape == (5, 3, 32)
        got = torch.cat([e.read(a, a + 1) for a in range(e.rows)]).float()
        assert torch.equal(got, torch.from_numpy(arr[variant].astype(np.float32)).reshape(15, 32))
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(FileFormatError, match="Python objects"):
        open_input(tmp_path / "o.npy")


def test_npy_scalar_keeps_its_shape(tmp_path):
    """A 0-d array is a scalar entry, as a safetensors scalar is (shape [], one row of one element)."""
    np.save(tmp_path / "s.npy", np.array(2.5, dtype=np.float32))
    with open_input(tmp_path / "s.npy") as inp:
        e = inp.entries["tensor"]
        assert (e.shape, e.rows, e.dim) == ((), 1, 1)
        assert torch.equal(e.read(0, 1), torch.tensor([[2.5]]))


def test_plain_safetensors_and_fixture():
    with open_input(FIX) as inp:
        assert inp.kind == "safetensors"
        assert {n: e.shape for n, e in inp.entries.items()} == {
            "layers.0.index_k": (256, 128), "layers.0.k": (256, 2, 128), "layers.0.v": (256, 2, 128)}
        assert all(not e.quantized and e.dtype == torch.bfloat16 for e in inp.entries.values())
        tie = inp.entries["layers.0.index_k"].read(7, 8).float()
    assert torch.equal(tie[0, :8], torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 0.5)


@pytest.mark.parametrize("label", ["mxfp4", "fp8-tensor"])  # the stream pass, and the amax pass
def test_chunked_nan_reports_the_global_index(label, tmp_path):
    x = torch.randn(50, 3, 32)
    x[37, 2, 5] = float("nan")
    path = tmp_path / "in.safetensors"
    save_file({"layers.x": x}, str(path))
    before = _listing(tmp_path)
    with pytest.raises(InputError, match=r"layers\.x: non-finite value nan at index \[37, 2, 5\]"):
        quantize_file(path, tmp_path / "out.safetensors", label, chunk_mb=TINY_CHUNK_MB)
    assert _listing(tmp_path) == before  # no output, no temporary file left behind


def test_non_floating_and_bad_dims(tmp_path):
    path = tmp_path / "in.safetensors"
    save_file({"ids": torch.arange(64).reshape(2, 32), "odd": torch.randn(2, 48)}, str(path))
    with pytest.raises(InputError, match="ids: dtype int64 is not floating point"):
        quantize_file(path, tmp_path / "o.safetensors", "mxfp4")
    with pytest.raises(FormatError, match="48 is not divisible"):
        quantize_file(path, tmp_path / "o.safetensors", "mxfp4", exclude=["ids"])
    assert not (tmp_path / "o.safetensors").exists()


# ------------------------------------------------------------------------------------------------ writing
def test_writer_is_read_by_safetensors_and_atomic(tmp_path):
    target = tmp_path / "w.safetensors"
    plan = [("a", torch.bfloat16, (3, 5)), ("s", torch.float32, ()), ("z", torch.uint8, (0, 4))]
    with SafetensorsWriter(target, plan, {"k": "v"}) as w:
        a = torch.randn(3, 5).bfloat16()
        w.write_rows("a", 0, a[:2])
        with pytest.raises(KvtoolError, match="out-of-order"):
            w.write_rows("a", 0, a[2:])
        w.write_rows("a", 2, a[2:])
        w.write_rows("s", 0, torch.tensor([[2.5]]))
        assert not target.exists()  # nothing at the target before commit
        w.commit(lambda: {"k": "final"})
    assert (8 + struct.unpack("<Q", target.read_bytes()[:8])[0]) % 8 == 0
    with safe_open(str(target), "pt") as f:
        assert f.metadata() == {"k": "final"}
        assert torch.equal(f.get_tensor("a"), a) and float(f.get_tensor("s")) == 2.5
        assert f.get_tensor("z").shape == (0, 4)
    assert _listing(tmp_path) == ["w.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    with SafetensorsWriter(tmp_path / "never.safetensors", plan):
        pass  # leaving the block without commit removes the temporary file
    assert _listing(tmp_path) == ["w.safetensors"]


def test_check_output_catches_every_spelling_of_the_input(src, tmp_path):
    (tmp_path / "sub").mkdir()
    os.symlink(src, tmp_path / "link.safetensors")
    os.link(src, tmp_path / "hard.safetensors")
    spellings = [src, tmp_path / "sub" / ".." / src.name, tmp_path / "link.safetensors",
                 tmp_path / "hard.safetensors"]
    for out in spellings:
        with pytest.raises(OutputError, match="is the input file"):
            check_output(out, [src])
    with pytest.raises(OutputError, match="is the input file"):
        check_output(src, [tmp_path / "link.safetensors"])
    with pytest.raises(OutputError, match="does not exist"):
        check_output(tmp_path / "missing" / "o.safetensors", [src])
    with pytest.raises(OutputError, match="is a directory"):
        check_output(tmp_path / "sub", [src])


def test_unwritable_output_directory(src, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:  # root writes through mode bits; the mkstemp failure path below covers it
        ro.chmod(0o555)
        with pytest.raises(OutputError, match="not writable"):
            quantize_file(src, ro / "o.safetensors", "mxfp4")
    import kvtool.container

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(kvtool.container, "_open_new", refuse)  # where the temporary file is created
    monkeypatch.setattr(os, "access", lambda *a, **k: True)
    with pytest.raises(OutputError, match="Permission denied"):
        quantize_file(src, ro / "o.safetensors", "mxfp4")
    assert _listing(ro) == []


# ------------------------------------------------------------------------------------------------ backends
@pytest.mark.parametrize("label", ["mxfp4-even", "nvfp4-auto", "fp8-token"])
def test_triton_backend_writes_the_same_bytes(label, tmp_path):
    """Under the interpreter (conftest sets TRITON_INTERPRET=1 on CPU) the Triton path must write the torch bytes."""
    path = tmp_path / "in.safetensors"
    save_file({"k": _cache()["k"][:4]}, str(path))
    quantize_file(path, tmp_path / "torch.safetensors", label, backend="torch")
    quantize_file(path, tmp_path / "triton.safetensors", label, backend="triton")
    assert (tmp_path / "torch.safetensors").read_bytes() == (tmp_path / "triton.safetensors").read_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.label)
def test_cuda_quantize_and_dequantize_match_cpu(fmt, tmp_path):
    quantize_file(FIX, tmp_path / "cpu.safetensors", fmt.label, device="cpu")
    quantize_file(FIX, tmp_path / "gpu.safetensors", fmt.label, device="cuda", chunk_mb=0.05)
    assert (tmp_path / "cpu.safetensors").read_bytes() == (tmp_path / "gpu.safetensors").read_bytes()
    dequantize_file(tmp_path / "cpu.safetensors", tmp_path / "d_cpu.safetensors", device="cpu")
    dequantize_file(tmp_path / "cpu.safetensors", tmp_path / "d_gpu.safetensors", device="cuda")
    assert (tmp_path / "d_cpu.safetensors").read_bytes() == (tmp_path / "d_gpu.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------------ memory
RSS_SCRIPT = textwrap.dedent("""
    import resource, sys, time
    from pathlib import Path
    from kvtool.workflows.cache_ops import quantize_file
    src, tiny, out, label, chunk = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    quantize_file(tiny, out, label, chunk_mb=chunk)  # warm up: imports, allocator pools
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    quantize_file(src, out, label, chunk_mb=chunk)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(base * 1024, peak * 1024, time.perf_counter() - t, out.stat().st_size)
""")


def make_big_file(path: Path, nbytes: int, dim: int = 128) -> None:
    """A bf16 [rows, dim] safetensors file of `nbytes`, written row block by row block (never whole in memory)."""
    rows = nbytes // (dim * 2)
    g = torch.Generator().manual_seed(0)
    with SafetensorsWriter(path, [("layers.0.k", torch.bfloat16, (rows, dim))]) as w:
        step = 1 << 16
        for a in range(0, rows, step):
            w.write_rows("layers.0.k", a, torch.randn(min(step, rows - a), dim, generator=g).bfloat16())
        w.commit()


def measure_rss(src: Path, tmp: Path, label: str, chunk_mb: float) -> tuple[int, int, float, int]:
    """(baseline RSS, peak RSS, seconds, output bytes) of `quantize_file` on `src` in a fresh interpreter."""
    tiny = tmp / "tiny.safetensors"
    save_file({"layers.0.k": torch.randn(4, 128).bfloat16()}, str(tiny))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(src), str(tiny), str(tmp / "rss_out.safetensors"),
                          label, str(chunk_mb)], capture_output=True, text=True, env=env, check=True)
    base, peak, secs, size = run.stdout.split()
    return int(base), int(peak), float(secs), int(size)


def test_streaming_peak_memory_follows_the_chunk_not_the_file(tmp_path):
    src = tmp_path / "big.safetensors"
    make_big_file(src, 32 << 20)
    base, peak, secs, size = measure_rss(src, tmp_path, "nvfp4-auto", 1.0)  # amax pass + quantize pass
    assert size < (32 << 20) * 0.3
    assert peak - base < 12 << 20, f"peak RSS grew by {(peak - base) >> 20} MiB on a 32 MiB file with 1 MiB chunks"


if __name__ == "__main__":  # the by-hand measurement: python tests/test_container.py --rss-gib 4 [--dir DIR]
    import argparse
    import tempfile

    p = argparse.ArgumentParser()
    p.add_argument("--rss-gib", type=float, default=4.0)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--label", default="nvfp4-auto")
    p.add_argument("--chunk-mb", type=float, default=64.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        big = Path(d) / "big.safetensors"
        make_big_file(big, int(args.rss_gib * (1 << 30)))
        base, peak, secs, size = measure_rss(big, Path(d), args.label, args.chunk_mb)
        print(f"{args.rss_gib} GiB bf16 -> {args.label} ({size / (1 << 30):.3f} GiB), chunk {args.chunk_mb} MiB: "
              f"{secs:.1f} s, peak RSS {peak / (1 << 20):.0f} MiB (baseline after imports {base / (1 << 20):.0f} MiB)")
