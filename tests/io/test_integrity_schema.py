"""Issue 30, the container's metadata schema: every field typed and ranged, no duplicate keys, no bools for ints, limits
on header size and nesting checked before parsing; each failure a one-line FileFormatError naming the field. The
entries here are rewritten WITH recomputed metadata digests, so that the schema (not the checksum) must catch them."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from integrity_helpers import edit_entry, join, quantized, split, write_schema1
from safetensors.torch import save_file

from kvtool.container import MAX_JSON_DEPTH, json_depth, load_json, read_header
from kvtool.errors import FileFormatError, InputError, KvtoolError
from kvtool.readers import open_input
from kvtool.workflows.cache_ops import dequantize_file, quantize_file


def _raw(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("case,words", [
    (b'{"t":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}', "unsupported dtype"),  # crashed: TypeError
    (b'{"t":{"dtype":{"a":1},"shape":[1],"data_offsets":[0,4]}}', "unsupported dtype"),
    (b'{"t":{"dtype":"F32","shape":[1180591620717411303424,0],"data_offsets":[0,0]}}', "field shape"),  # 2^70
    (b'{"t":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', "field shape"),  # a bool is not an int
    (b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[false,4]}}', "data_offsets"),
    (b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
     "duplicate key 't'"),
    (b'{"t":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', "NaN"),
    (b'{"t":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}}', "field shape"),
])
def test_safetensors_header_schema(case, words, tmp_path):
    with pytest.raises(FileFormatError, match=words.replace("[", r"\[")):
        read_header(_raw(tmp_path / "x.safetensors", case, b"\0" * 4))


def test_deep_json_is_refused_before_parsing(tmp_path):
    deep = b"[" * 200_000 + b"]" * 200_000  # the json module would raise RecursionError
    with pytest.raises(FileFormatError, match="nested 200000 deep"):
        read_header(_raw(tmp_path / "deep.safetensors", deep))
    assert json_depth(b'{"a":"[[[[[[","b":[[1]]}') == 3  # brackets inside strings do not count
    assert json_depth(rb'{"a":"\"[[[["}') == 1  # nor after an escaped quote
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(ok, "x") is not None
    with pytest.raises(FileFormatError, match="nested"):
        load_json("[" + ok + "]", "x")


def test_header_size_limit(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 200 * 1024 * 1024) + b"{}")
    with pytest.raises(FileFormatError, match="header length"):
        read_header(path)


GOOD = "nvfp4"


@pytest.mark.parametrize("field,value,words", [
    ("dtype", ["bf16"], "field dtype"),  # crashed: TypeError at the dtype lookup
    ("dtype", {"a": 1}, "field dtype"),
    ("dtype", "int8", "field dtype"),
    ("shape", [32, True, 64], "field shape"),
    ("shape", [2 ** 70, 0, 64], "field shape"),
    ("shape", [32, 2, 0], "last dimension"),
    ("shape", "32x2x64", "field shape"),
    ("outer_scale", float("inf"), "constant Infinity"),  # json.dumps writes the non-standard literal
    ("outer_scale", 1e300, "field outer_scale"),
    ("outer_scale", 0.0, "field outer_scale"),
    ("outer_scale", -1.0, "field outer_scale"),
    ("outer_scale", True, "field outer_scale"),
    ("outer_scale", "1", "field outer_scale"),
    ("outer_scale", 1e6, "says 1.0"),  # nvfp4 with outer scale 1 in its format: the entry must say 1.0
    ("tensor_scale", 2.0, "field tensor_scale"),  # only fp8 tensor scaling has one
    ("layout", "paged", "field layout"),
    ("payload", 7, "field payload"),
    ("scales", ["k.scales"], "field scales"),
    ("checksum", "deadbeef", "field checksum"),
    ("format", "nvfp4", "field format"),
    ("format", {"family": ["nvfp4"]}, "field format"),
    ("extra", 1, "unknown field"),
])
def test_entry_schema_names_the_field(field, value, words, tmp_path):
    src = quantized(tmp_path, GOOD)
    bad = edit_entry(src, tmp_path / "bad.safetensors", "k", lambda e: e.__setitem__(field, value))
    with pytest.raises(KvtoolError, match=words):
        open_input(bad)
    with pytest.raises(KvtoolError, match=words):  # the schema holds with --no-verify too
        open_input(bad, verify=False)


def test_format_block_and_option_types(tmp_path):
    src = quantized(tmp_path, "mxfp4")
    for edit, words in ((lambda e: e["format"].update(block=16), "format.block"),
                        (lambda e: e["format"].update(scale_rule=3), "format"),
                        (lambda e: e["format"].update(scale_rule={"x": 1}), "format.scale_rule"),
                        (lambda e: e["format"].update(scale_element="e4m3"), "format.scale_element")):
        with pytest.raises(KvtoolError, match=words):
            open_input(edit_entry(src, tmp_path / "bad.safetensors", "k", edit))


def test_nvfp4_outer_scale_must_match_a_numeric_label(tmp_path):
    src = quantized(tmp_path, "nvfp4-g0.5")
    with open_input(src) as inp:
        assert inp.entries["k"].outer_scale == 0.5
    bad = edit_entry(src, tmp_path / "bad.safetensors", "k", lambda e: e.update(outer_scale=0.25))
    with pytest.raises(FileFormatError, match="says 0.5"):
        open_input(bad)


def test_fp8_tensor_scale_must_equal_the_stored_scalar(tmp_path):
    src = quantized(tmp_path, "fp8-tensor")
    with open_input(src) as inp:
        assert inp.entries["k"].scalar_scale is not None
    bad = edit_entry(src, tmp_path / "bad.safetensors", "k", lambda e: e.update(tensor_scale=e["tensor_scale"] * 2))
    with pytest.raises(FileFormatError, match="differs from the stored scale"):
        open_input(bad)
    null = edit_entry(src, tmp_path / "null.safetensors", "k", lambda e: e.update(tensor_scale=None))
    with pytest.raises(FileFormatError, match="field tensor_scale"):
        open_input(null)


def test_two_entries_may_not_share_a_plane(tmp_path):
    save_file({"a": torch.randn(8, 64), "b": torch.randn(8, 64)}, str(tmp_path / "ab.safetensors"))
    src = tmp_path / "q.safetensors"
    quantize_file(tmp_path / "ab.safetensors", src, "nvfp4")
    bad = edit_entry(src, tmp_path / "bad.safetensors", "b", lambda e: e.update(payload="a.payload"))
    with pytest.raises(FileFormatError, match="both name stored tensor"):
        open_input(bad)


def test_duplicate_keys_in_the_kvtool_table(tmp_path):
    src = quantized(tmp_path, "nvfp4")
    header, data = split(src)
    table = header["__metadata__"]["kvtool.tensors"]
    entry = json.dumps(json.loads(table)["k"])
    header["__metadata__"]["kvtool.tensors"] = table[:-1] + ',"k":' + entry + "}"
    with pytest.raises(FileFormatError, match="duplicate key 'k'"):
        open_input(join(tmp_path / "dup.safetensors", header, data))


def test_passthrough_tensors_are_recorded(tmp_path):
    src = quantized(tmp_path, "nvfp4")
    meta = read_header(src).metadata
    assert set(json.loads(meta["kvtool.passthrough"])) == {"pos"}
    header, data = split(src)
    header["__metadata__"]["kvtool.passthrough"] = "{}"
    with pytest.raises(FileFormatError, match="neither a kvtool entry's plane nor listed"):
        open_input(join(tmp_path / "unlisted.safetensors", header, data))
    header["__metadata__"]["kvtool.passthrough"] = meta["kvtool.passthrough"].replace('"I32"', '"F32"')
    with pytest.raises(FileFormatError, match="recorded as 'F32'"):
        open_input(join(tmp_path / "retyped.safetensors", header, data))


@pytest.mark.parametrize("schema,words", [("3", "newer kvtool"), ("0", "corrupt"), ("2.0", "not a number"),
                                          ("1" * 40, "not a number")])
def test_schema_numbers(schema, words, tmp_path):
    header, data = split(quantized(tmp_path))
    header["__metadata__"]["kvtool.schema"] = schema
    with pytest.raises(FileFormatError, match=words):
        open_input(join(tmp_path / "s.safetensors", header, data))


def test_schema1_files_stay_readable_with_a_warning(tmp_path):
    src = quantized(tmp_path, "mxfp4")
    old = write_schema1(src, tmp_path / "old.safetensors")
    with open_input(old) as inp:
        assert inp.schema == 1 and any("schema 1" in n and "not covered by checksums" in n for n in inp.notes)
        assert torch.equal(inp.entries["k"].read(0, 64), open_input(src).entries["k"].read(0, 64))
    report = dequantize_file(old, tmp_path / "d.safetensors")
    assert any("schema 1" in h for h in report.hints)


def test_zero_rows_quantize_to_empty_planes_and_zero_width_is_bad_input(tmp_path):
    save_file({"e": torch.zeros(0, 64), "w": torch.zeros(4, 0)}, str(tmp_path / "z.safetensors"))
    for label in ("nvfp4", "mxfp4", "fp8-tensor", "fp8-token", "bf16", "nvfp4-auto"):
        out = tmp_path / f"{label}.safetensors"
        quantize_file(tmp_path / "z.safetensors", out, label, include=["e"])
        with open_input(out) as inp:
            assert inp.entries["e"].shape == (0, 64) and inp.entries["e"].read(0, 0).shape == (0, 64)
            assert inp.entries["w"].shape == (4, 0)  # copied unchanged
        dequantize_file(out, tmp_path / "d.safetensors")
    with pytest.raises(InputError, match=r"\[4, 0\] has a last dimension of 0"):
        quantize_file(tmp_path / "z.safetensors", tmp_path / "o.safetensors", "nvfp4")


def test_fp8_input_tensor_is_bad_input(tmp_path):
    save_file({"f": torch.randn(4, 32).to(torch.float8_e4m3fn)}, str(tmp_path / "f8.safetensors"))
    with pytest.raises(InputError, match="float8_e4m3fn is already a low-precision format"):
        quantize_file(tmp_path / "f8.safetensors", tmp_path / "o.safetensors", "nvfp4")
    with open_input(tmp_path / "f8.safetensors") as inp:  # readable as it is (inspect, diff)
        assert inp.entries["f"].read(0, 4).dtype == torch.float8_e4m3fn
