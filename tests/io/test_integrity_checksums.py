"""Issue 30, checksums: each entry's metadata is digested as well as its bytes, passthrough tensors included; every
command that reads data verifies what it reads by default (quantize of a kvtool file, dequantize, diff, inspect,
convert); `--no-verify` is the escape; a missing or null checksum record is an error when verifying."""

from __future__ import annotations

import json

import pytest
from cli_helpers import kv, kv_json, one_line_error
from integrity_helpers import edit_entry, flip_byte, quantized, split, join, write_schema1

from kvtool.container import ChecksumError
from kvtool.readers import open_input
from kvtool.workflows.cache_ops import dequantize_file, quantize_file
from kvtool.workflows.diff import diff_files
from kvtool.workflows.inspect import inspect_file


@pytest.fixture
def q(tmp_path):
    return quantized(tmp_path, "nvfp4")


def _read_all(path, **kw):
    with open_input(path, **kw) as inp:
        for e in inp.entries.values():
            e.read(0, e.rows)


@pytest.mark.parametrize("tensor", ["k.payload", "k.scales", "pos"])
def test_a_flipped_byte_fails_every_reading_command(tensor, q, tmp_path):
    bad = flip_byte(q, tmp_path / "bad.safetensors", tensor, offset=5)
    with pytest.raises(ChecksumError, match=f"checksum mismatch in the '{tensor}' bytes"):
        _read_all(bad)
    _read_all(bad, verify=False)  # the escape
    with pytest.raises(ChecksumError):
        dequantize_file(bad, tmp_path / "d.safetensors")
    assert not (tmp_path / "d.safetensors").exists()
    with pytest.raises(ChecksumError):
        diff_files(bad, q)
    with pytest.raises(ChecksumError):
        quantize_file(bad, tmp_path / "r.safetensors", "mxfp4", include=["k", "idx"])
    assert not (tmp_path / "r.safetensors").exists()
    report = inspect_file(bad)  # inspect reports per tensor (exit 1), it does not stop at the first mismatch
    status = {t.name: t.checksum for t in report.tensors}
    assert not report.ok and status[tensor.split(".")[0]].startswith("mismatch")
    assert all(v == "ok" for n, v in status.items() if n != tensor.split(".")[0])
    dequantize_file(bad, tmp_path / "d.safetensors", verify=False)  # --no-verify reads it


def test_partial_reads_are_verified_at_close(q, tmp_path):
    bad = flip_byte(q, tmp_path / "bad.safetensors", "k.payload", offset=2000)  # a byte in a later row
    with pytest.raises(ChecksumError):
        with open_input(bad) as inp:
            inp.entries["k"].read(0, 2)  # only the first rows: the rest is hashed when the file is closed
    with pytest.raises(ChecksumError):  # an out-of-order read hashes the whole plane first
        with open_input(bad) as inp:
            inp.entries["k"].read(40, 41)


@pytest.mark.parametrize("edit", [
    lambda e: e.update(outer_scale=2.0, format={**e["format"], "outer_scale": "2.0", "label": "nvfp4-rcp-g2.0"}),
    lambda e: e["format"].update(label="nvfp4-edited"),
    lambda e: e.update(dtype="fp16"),
    lambda e: e["format"].update(recipe="div", label="nvfp4-div"),
])
def test_edited_metadata_fails_its_digest(edit, q, tmp_path):
    """A tampered entry that stays schema-valid (scale x2, a reshaped tensor, another dtype or recipe) is caught by
    the metadata digest, which the issue's outer_scale x1e6 passed. (A reshaped entry is caught by the plane
    shapes: tests/io/test_container.py.)"""
    bad = edit_entry(q, tmp_path / "bad.safetensors", "k", edit, redigest=False)
    with pytest.raises(ChecksumError, match="metadata checksum mismatch"):
        open_input(bad)
    assert inspect_file(bad).tensors[0].checksum.endswith("meta") or not inspect_file(bad).ok
    open_input(bad, verify=False).close()


def test_edited_passthrough_record_fails_its_digest(q, tmp_path):
    header, data = split(q)
    table = json.loads(header["__metadata__"]["kvtool.passthrough"])
    table["pos"]["checksum"]["meta"] = "0" * 64
    header["__metadata__"]["kvtool.passthrough"] = json.dumps(table)
    with pytest.raises(ChecksumError, match="passthrough tensor 'pos': metadata checksum mismatch"):
        open_input(join(tmp_path / "bad.safetensors", header, data))


@pytest.mark.parametrize("record", [None, {}])
def test_a_missing_checksum_record_is_an_error_when_verifying(record, q, tmp_path):
    bad = edit_entry(q, tmp_path / "bad.safetensors", "k", lambda e: e.update(checksum=record))
    with pytest.raises(ChecksumError, match="has no checksum record"):
        open_input(bad)
    report = inspect_file(bad)
    assert {t.name: t.checksum for t in report.tensors}["k"] == "missing" and not report.ok
    open_input(bad, verify=False).close()
    r = kv("inspect", bad, "--verify")
    assert r.exit_code == 1 and "missing" in r.stdout and "checksums: MISMATCH" in r.stdout, r.output
    one_line_error(kv("dequantize", bad, "-o", tmp_path / "d.safetensors"), "has no checksum record")


def test_schema1_record_without_digests_is_missing(q, tmp_path):
    old = write_schema1(q, tmp_path / "old.safetensors")
    assert inspect_file(old).ok  # schema 1 digests of the planes still verify
    bad = edit_entry(old, tmp_path / "bad.safetensors", "k", lambda e: e.update(checksum=None))
    assert not inspect_file(bad).ok


def test_cli_dequantize_and_diff_verify_by_default(q, tmp_path):
    bad = flip_byte(q, tmp_path / "bad.safetensors", "k.payload", offset=0)
    one_line_error(kv("dequantize", bad, "-o", tmp_path / "d.safetensors"), "checksum mismatch")
    assert not (tmp_path / "d.safetensors").exists()
    one_line_error(kv("diff", bad, q), "checksum mismatch")
    r = kv("quantize", bad, "-o", tmp_path / "r.safetensors", "--to", "mxfp4", "--exclude", "pos")
    assert r.exit_code == 2 and "error: " in r.stderr and "checksum mismatch" in r.stderr, r.output  # after hints
    assert not (tmp_path / "r.safetensors").exists()
    kv_json("dequantize", bad, "-o", tmp_path / "d.safetensors", "--no-verify")
    assert kv("diff", bad, q, "--no-verify").exit_code == 0
    assert kv("inspect", bad).exit_code == 1 and kv("inspect", bad, "--no-verify").exit_code == 0
