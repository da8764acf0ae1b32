"""Issue 30, fuzzing the readers: mutated kvtool files (bytes and header JSON), plain safetensors, `.npy`, `.pt` and
raw layout dumps must give "a KvtoolError or a correct read, never anything else", through the library and, for a
share of them, through the CLI (exit 0, 1 or 2 with one `error:` line; never 3 or a traceback).

A correct read: every entry reads as [rows, D] in its dtype (quantized ones decode to fp32); for kvtool files read
with verification (the default) the decoded values equal the unmutated file's, since whatever passes the checksums
and the schema must be what was written.

CI runs a fixed-seed portion (hypothesis `derandomize`, FUZZ_EXAMPLES examples per test, about a minute in all on
an idle 2-core machine). The long mode for manual runs:
`KVTOOL_FUZZ_EXAMPLES=10000 pytest tests/io/test_container_fuzz.py`
(`KVTOOL_FUZZ_RANDOM=1` draws a fresh seed instead of the fixed one).
"""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvtool.errors import KvtoolError
from kvtool.readers import open_input

FUZZ_EXAMPLES = int(os.environ.get("KVTOOL_FUZZ_EXAMPLES", "0")) or None
FUZZ = settings(max_examples=FUZZ_EXAMPLES or 600, deadline=None, database=None,
                derandomize=os.environ.get("KVTOOL_FUZZ_RANDOM") != "1",
                suppress_health_check=list(HealthCheck))
FORMATS = ["nvfp4", "mxfp4-floor", "fp8-token", "fp8-tensor", "bf16", "nvfp4-auto"]
LAYOUT, GEOMETRY = "vllm-mxfp4-page", "format=mxfp4,page=16,heads=2,dim=64"


# ------------------------------------------------------------------------------------------------ seeds
class Seeds(dict):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example: not the seed bytes
        return f"Seeds({sorted(self['bytes'])})"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> Seeds:
    """Small valid files of every kind the readers take, and the decoded values of the kvtool ones."""
    from kvtool.formats import get_format
    from kvtool.layouts import write_layout
    from kvtool.workflows.cache_ops import quantize_file

    d = tmp_path_factory.mktemp("fuzz_seeds")
    g = torch.Generator().manual_seed(30)
    plain = {"k": torch.randn(8, 2, 64, generator=g).bfloat16(), "idx": torch.randn(8, 32, generator=g),
             "pos": torch.arange(8, dtype=torch.int32)}
    save_file(plain, str(d / "plain.safetensors"))
    out = {"plain": (d / "plain.safetensors").read_bytes()}
    reference = {}
    for label in FORMATS:
        path = d / f"{label}.safetensors"
        quantize_file(d / "plain.safetensors", path, label, exclude=["pos"])
        out[label] = path.read_bytes()
        reference[label] = _decoded(path)
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(0).standard_normal((6, 32)).astype(np.float32))
    out["npy"] = buf.getvalue()
    buf = io.BytesIO()
    torch.save({"a": torch.randn(4, 16), "b": [torch.ones(2, 8, dtype=torch.float16)]}, buf)
    out["pt"] = buf.getvalue()
    q = get_format("mxfp4").quantize(torch.randn(32, 2, 64, generator=g))
    write_layout({"x": q}, d / "dump.bin", LAYOUT, "page=16")
    out["dump"] = (d / "dump.bin").read_bytes()
    return Seeds(bytes=out, reference=reference)


def _decoded(path: Path, **kw) -> dict:
    with open_input(path, **kw) as inp:
        return {n: e.read(0, e.rows) for n, e in inp.entries.items()}


# ------------------------------------------------------------------------------------------------ the property
def _read_everything(path: Path, kind: str, verify: bool = True) -> tuple[str, dict]:
    """Open and read every entry fully; checks the shapes of what was read (a correct read). -> (input kind, values)"""
    layout = (LAYOUT, GEOMETRY) if kind == "dump" else (None, None)
    values = {}
    with open_input(path, *layout, verify=verify) as inp:
        opened = inp.kind
        for name, e in inp.entries.items():
            x = e.read(0, e.rows)
            assert tuple(x.shape) == (e.rows, e.dim), (name, x.shape, e.shape)
            assert x.dtype == (torch.float32 if e.quantized else e.dtype)
            if e.quantized and e.rows:
                q = e.read_q(0, min(e.rows, 3))
                assert q.payload.shape[0] == min(e.rows, 3)
            values[name] = x
    return opened, values


def _check(path: Path, kind: str, seeds: dict) -> None:
    try:
        opened, values = _read_everything(path, kind)
    except KvtoolError as err:
        assert str(err) and "\n" not in str(err).strip(), repr(err)  # one line
        return
    ref = seeds["reference"].get(kind)
    if ref is not None and opened == "kvtool":  # a kvtool file that passed every check holds what was written
        # (a header without kvtool.schema is a plain safetensors file: its stored planes read as the bytes they are)
        assert values.keys() == ref.keys(), (values.keys(), ref.keys())
        for name, x in values.items():
            assert torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x, ref[name].view(torch.uint8)
                               if ref[name].dtype.itemsize == 1 else ref[name]) or bool(
                torch.isnan(x).any() and torch.equal(torch.nan_to_num(x), torch.nan_to_num(ref[name]))), name


# ------------------------------------------------------------------------------------------------ mutations
def _header_span(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else len(data)


@st.composite
def byte_mutations(draw, data: bytes) -> bytes:
    """Flip, set, insert or delete a few bytes (mostly in the header), or truncate."""
    buf = bytearray(data)
    head = min(_header_span(data), len(buf))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "length"]))
        if not buf:
            break
        in_header = draw(st.booleans()) or head >= len(buf)
        pos = min(draw(st.integers(0, max(0, (head if in_header else len(buf)) - 1))), len(buf) - 1)
        if op == "flip":
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            buf[pos] = draw(st.sampled_from([0, 0x20, 0x22, 0x2C, 0x30, 0x39, 0x5B, 0x5D, 0x7B, 0x7D, 0x7F, 0xFF]))
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del buf[draw(st.integers(0, len(buf) - 1)):]
        else:  # the 8-byte header length
            buf[:8] = struct.pack("<Q", draw(st.sampled_from([0, 1, head - 9, head - 7, head, 1 << 40, 2 ** 64 - 1]))
                                  % 2 ** 64)
    return bytes(buf)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from([0, 1, -1, 2 ** 63, 2 ** 48 + 1])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["F32", "U8", "BF16", "F8_E4M3", "nvfp4", "mxfp4", "rceil", "auto", "planes", "fp32"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON tree; the kvtool metadata strings are descended into as JSON themselves."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, str) and k in ("kvtool.tensors", "kvtool.passthrough"):
                try:
                    yield from _paths(json.loads(v), prefix + (k, "<json>"))
                except ValueError:
                    pass
            else:
                yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value, delete=False):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if rest and rest[0] == "<json>":
        inner = _set(json.loads(obj[head]), rest[1:], value, delete)
        obj[head] = json.dumps(inner, allow_nan=True)
        return obj
    if not rest:
        if delete and isinstance(obj, dict):
            obj.pop(head, None)
        elif delete and isinstance(obj, list):
            obj.pop(head)
        else:
            obj[head] = value
        return obj
    obj[head] = _set(obj[head], rest, value, delete)
    return obj


@st.composite
def json_mutations(draw, data: bytes) -> bytes:
    """Replace or delete a value anywhere in the header (the kvtool metadata JSON included), or duplicate a key,
    keeping the file's framing valid, so that the schema (not the JSON parser) must catch it."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(header) if p]
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete"]))
        try:
            header = _set(header, path, draw(JSON_VALUES), delete=action == "delete")
        except (KeyError, IndexError, TypeError, ValueError):
            pass
    text = json.dumps(header, separators=(",", ":"), allow_nan=True)
    if draw(st.booleans()) and text.startswith('{"'):  # a duplicated top-level key
        key = text[1:text.index('":') + 1]
        text = "{" + f'{key}:0,' + text[1:]
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


# ------------------------------------------------------------------------------------------------ the tests
SAFETENSORS_KINDS = FORMATS + ["plain"]
SUFFIX = {"npy": ".npy", "pt": ".pt", "dump": ".bin"}


@FUZZ
@given(data=st.data())
def test_fuzz_kvtool_and_safetensors_bytes(data, seeds, tmp_path_factory):
    kind = data.draw(st.sampled_from(SAFETENSORS_KINDS))
    mutated = data.draw(byte_mutations(seeds["bytes"][kind]))
    path = tmp_path_factory.mktemp("m") / "m.safetensors"
    path.write_bytes(mutated)
    _check(path, kind, seeds)


@FUZZ
@given(data=st.data())
def test_fuzz_kvtool_header_json(data, seeds, tmp_path_factory):
    kind = data.draw(st.sampled_from(SAFETENSORS_KINDS))
    mutated = data.draw(json_mutations(seeds["bytes"][kind]))
    path = tmp_path_factory.mktemp("j") / "j.safetensors"
    path.write_bytes(mutated)
    _check(path, kind, seeds)


@FUZZ
@given(data=st.data())
def test_fuzz_npy_pt_and_raw_dumps(data, seeds, tmp_path_factory):
    kind = data.draw(st.sampled_from(["npy", "pt", "dump"]))
    mutated = data.draw(byte_mutations(seeds["bytes"][kind]))
    path = tmp_path_factory.mktemp("n") / f"m{SUFFIX[kind]}"
    path.write_bytes(mutated)
    _check(path, kind, seeds)


@settings(FUZZ, max_examples=max(10, (FUZZ_EXAMPLES or 600) // 8))
@given(data=st.data())
def test_fuzz_through_the_cli(data, seeds, tmp_path_factory):
    from cli_helpers import kv

    kind = data.draw(st.sampled_from(["nvfp4", "mxfp4-floor", "fp8-tensor", "plain", "npy", "dump"]))
    strategy = json_mutations if kind not in ("npy", "dump") and data.draw(st.booleans()) else byte_mutations
    mutated = data.draw(strategy(seeds["bytes"][kind]))
    d = tmp_path_factory.mktemp("c")
    path = d / f"m{SUFFIX.get(kind, '.safetensors')}"
    path.write_bytes(mutated)
    layout = ["--layout", LAYOUT, "--geometry", GEOMETRY] if kind == "dump" else []
    command = data.draw(st.sampled_from([["inspect", path], ["dequantize", path, "-o", d / "o.safetensors"],
                                         ["diff", path, path]]))
    r = kv(*command, *layout)
    assert r.exit_code in (0, 1, 2), r.output
    assert "internal error" not in r.output and "Traceback" not in r.output, r.output
    if r.exit_code == 2:
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, r.stderr
        assert not (d / "o.safetensors").exists()


def test_the_seeds_read_correctly(seeds, tmp_path):
    """The property's positive side: every unmutated seed reads, and the kvtool ones equal their reference."""
    for kind, blob in seeds["bytes"].items():
        path = tmp_path / f"s{SUFFIX.get(kind, '.safetensors')}"
        path.write_bytes(blob)
        opened, values = _read_everything(path, kind)
        assert values and opened == {"npy": "npy", "pt": "pt", "dump": f"layout:{LAYOUT}", "plain": "safetensors"}.get(
            kind, "kvtool")
        for name, ref in seeds["reference"].get(kind, {}).items():
            assert torch.equal(values[name], ref)
