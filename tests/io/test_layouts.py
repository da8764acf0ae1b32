"""Engine layouts (issue 7, SPEC section 5): round trips through every preset, hand-computed byte offsets per preset
(so that a layout bug cannot hide behind a symmetric round trip), the TRT-LLM interleave element by element against the
SPEC formula, PagedCache agreement, plausibility warnings, and clear errors for bad geometry (API and CLI)."""

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
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.errors import FormatError, LayoutError
from kvtool.formats import QTensor, get_format
from kvtool.layouts import (
    PRESETS,
    RULES,
    check_plausible,
    encode_for_write,
    get_preset,
    parse_geometry,
    read_layout,
    write_layout,
)
from kvtool.layouts.engine import resolve_format
from kvtool.paged import PagedCache

ROOT = Path(__file__).resolve().parents[2]
# One representative of every scale kind: none, fp32 tensor, fp32 row (plain and DeepSeek), E4M3 (outer 1 / auto), E8M0.
FORMATS = ["bf16", "fp8-unit", "fp8-tensor", "fp8-token", "fp8-ds-pow2", "nvfp4", "nvfp4-div-auto", "mxfp4-floor"]


# ---------------------------------------------------------------------------------------------------------- helpers
def realistic(n: int, h: int, d: int = 128, seed: int = 0) -> torch.Tensor:
    """[n, h, d] fp32 with per-token magnitudes over 2^-4 .. 2^4 (like K/V rows)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n, h, 1).uniform_(-4, 4, generator=g))
    return torch.randn(n, h, d, generator=g) * mag


def quantized(label: str, n: int, h: int, d: int = 128, seed: int = 0) -> QTensor:
    return get_format(label).quantize(realistic(n, h, d, seed))


def marked(label: str, n: int, h: int, d: int = 128, seed: int = 1) -> QTensor:
    """A QTensor of random bytes (payload and scales), so that every (token, head) row is distinguishable in a dump."""
    fmt = get_format(label)
    g = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (n, h, fmt.payload_bytes(d)), dtype=torch.uint8, generator=g)
    if fmt.family == "bf16":
        payload = payload.view(torch.bfloat16)
    scales = None
    if fmt.scale_element in ("e4m3", "e8m0"):
        scales = torch.randint(0, 256, (n, h, d // fmt.block), dtype=torch.uint8, generator=g)
    elif fmt.scale_element == "fp32-row":
        scales = torch.rand(n, h, 1, generator=g) + 0.5
    return QTensor(fmt, payload, scales, 1.0, (n, h, d))


def assert_same(a: QTensor, b: QTensor) -> None:
    assert a.fmt == b.fmt and tuple(a.shape) == tuple(b.shape)
    assert torch.equal(a.payload.contiguous().view(torch.uint8), b.payload.contiguous().view(torch.uint8))
    if a.scales is None:
        assert b.scales is None
    else:
        assert torch.equal(a.scales.reshape(-1).contiguous().view(torch.uint8),
                           b.scales.reshape(-1).contiguous().view(torch.uint8))
    assert a.outer_scale == b.outer_scale


def named(preset: str, q: QTensor, other: "QTensor | None" = None) -> dict:
    return {"k": q, "v": other if other is not None else q} if get_preset(preset).paired else {"x": q}


def raw_bytes(tmp_path: Path, tensors: dict, layout: str, geometry: "str | None" = None) -> np.ndarray:
    path = tmp_path / f"{layout}.bin"
    write_layout(tensors, path, layout, geometry)
    return np.fromfile(path, dtype=np.uint8)


def holds(layout: str, label: str) -> bool:
    try:
        resolve_format(get_preset(layout), label)
    except LayoutError:
        return False
    return True


def pairs():
    for name in PRESETS:
        for label in FORMATS:
            if holds(name, label):
                yield pytest.param(name, label, id=f"{name}-{label}")


def geometries(preset_name: str):
    """(tokens, heads, dim, page): the preset's default page with a partial last page, and a small page with H > 1."""
    preset = get_preset(preset_name)
    out = [(preset.page_size * 2 + 3 if preset.page_size > 1 else 7, 1, 128, None)]
    if not preset.page_fixed:
        out.append((37, 3, 64 if preset_name not in ("ds32-indexer-fp8",) else 128, 16))
    else:
        out.append((2 * preset.page_size + 5, 3, 256, None))
    return out


# ------------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("layout,label", list(pairs()))
def test_planes_to_layout_to_planes_is_identity(tmp_path, layout, label):
    for i, (n, h, d, page) in enumerate(geometries(layout)):
        k, v = quantized(label, n, h, d, seed=i), quantized(label, n, h, d, seed=i + 10)
        src = tmp_path / f"planes{i}.safetensors"
        write_layout({"k": k}, src, "planes")  # planes holds one tensor per prefix: the prefix is "k"
        planes = read_layout(src, "planes")
        assert list(planes) == ["k"]
        assert_same(planes["k"], k)
        tensors = named(layout, planes["k"], v)
        geometry = None if page is None else f"page={page}"
        dump = tmp_path / f"dump{i}.bin"
        write_layout(tensors, dump, layout, geometry)
        back = read_layout(dump, layout)  # geometry from kvtool's sidecar
        for key, q in tensors.items():
            assert_same(back[key], q)
        # A raw engine dump has no sidecar: the geometry string alone must do.
        Path(str(dump) + ".json").unlink()
        g = f"format={label},heads={h},dim={d},tokens={n}" + ("" if page is None else f",page={page}")
        g += "".join(f",{key}={val}" for key, val in _scalars_of(tensors).items())
        again = read_layout(dump, layout, g)
        out = tmp_path / f"planes_out{i}.safetensors"
        write_layout({f"re.{key}": q for key, q in again.items()}, out, "planes")
        final = read_layout(out, "planes")
        for key, q in tensors.items():
            assert_same(final[f"re.{key}"], q)


def _scalars_of(tensors: dict) -> dict:
    """The whole-tensor scalars a raw dump lacks, as per-tensor geometry keys (tensor_scale.k=, outer.v=)."""
    out = {}
    for key, q in tensors.items():
        if q.fmt.scale_element == "fp32-tensor":
            out[f"tensor_scale.{key}"] = repr(float(q.scales))
        if q.fmt.outer_scale == "auto":
            out[f"outer.{key}"] = repr(float(q.outer_scale))
    return out


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_container_files_keep_prefixes_and_scalars(tmp_path, suffix):
    tensors = {f"layers.{i}.{kv}": quantized("nvfp4-div-auto", 21, 2, seed=i * 2 + (kv == "v"))
               for i in range(2) for kv in "kv"}
    path = tmp_path / f"kv{suffix}"
    write_layout(tensors, path, "vllm-nvfp4-kv", "page=16")
    back = read_layout(path, "vllm-nvfp4-kv")
    assert sorted(back) == sorted(tensors)
    for key, q in tensors.items():
        assert_same(back[key], q)


def test_engine_tensor_names_dtypes_and_shapes_are_only_bytes(tmp_path):
    """A dump saved by an engine: its own tensor name, dtype and shape; kvtool reads the bytes."""
    from safetensors.torch import save_file

    q = quantized("fp8-ds", 70, 1)
    buffers, _, _ = encode_for_write({"x": q}, "ds32-indexer-fp8")
    engine = buffers["indexer_k_cache"].reshape(2, 64, 132)  # vLLM's [blocks, page, 132] byte view
    path = tmp_path / "engine.safetensors"
    save_file({"model.layers.3.indexer.k_cache": engine.contiguous()}, str(path))
    back = read_layout(path, "ds32-indexer-fp8", "tokens=70")
    assert list(back) == ["model.layers.3.indexer.k_cache"]
    assert_same(back["model.layers.3.indexer.k_cache"], q)
    # .pt holding one bare fp8 tensor of engine shape reads like a raw dump
    torch.save(engine.view(torch.float8_e4m3fn), tmp_path / "engine.pt")
    assert_same(read_layout(tmp_path / "engine.pt", "ds32-indexer-fp8", "tokens=70")["x"], q)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_byte_rules_invert(rule):
    block = torch.randint(0, 256, (2, 3, 32, 64), dtype=torch.uint8)
    fwd = RULES[rule].forward(block)
    assert fwd.shape == block.shape
    assert torch.equal(RULES[rule].inverse(fwd.contiguous()), block)
    assert torch.equal(fwd.reshape(-1).sort().values, block.reshape(-1).sort().values)


# -------------------------------------------------------------------------------------- hand-computed byte offsets
def _at(raw: np.ndarray, start: int, stop: int) -> torch.Tensor:
    return torch.from_numpy(raw[start:stop].copy())


def _payload(q: QTensor, t: int, h: int) -> torch.Tensor:
    return q.payload[t, h].contiguous().view(torch.uint8)


def _scale(q: QTensor, t: int, h: int) -> torch.Tensor:
    return q.scales[t, h].contiguous().view(torch.uint8).reshape(-1)


def test_offsets_vllm_mxfp4_page(tmp_path):
    q = marked("mxfp4", 200, 1)
    raw = raw_bytes(tmp_path, {"x": q}, "vllm-mxfp4-page")
    assert raw.size == 2 * 8704
    # token 5, head 0: payload at bytes 320..383, scale at 8192 + 20..23
    assert torch.equal(_at(raw, 320, 384), _payload(q, 5, 0))
    assert torch.equal(_at(raw, 8212, 8216), _scale(q, 5, 0))
    # token 130 = page 1, offset 2: payload 8704 + 128..191, scale 8704 + 8192 + 8..11
    assert torch.equal(_at(raw, 8832, 8896), _payload(q, 130, 0))
    assert torch.equal(_at(raw, 16904, 16908), _scale(q, 130, 0))
    q2 = marked("mxfp4", 10, 2)
    raw2 = raw_bytes(tmp_path, {"x": q2}, "vllm-mxfp4-page")
    assert raw2.size == 17408  # one page, two heads of 8704
    # token 5, head 1: the second head's [128 x 64][128 x 4] block starts at 8704
    assert torch.equal(_at(raw2, 9024, 9088), _payload(q2, 5, 1))
    assert torch.equal(_at(raw2, 16916, 16920), _scale(q2, 5, 1))


def test_offsets_vllm_nvfp4_kv(tmp_path):
    k, v = marked("nvfp4", 20, 2, seed=1), marked("nvfp4", 20, 2, seed=2)
    raw = raw_bytes(tmp_path, {"k": k, "v": v}, "vllm-nvfp4-kv", "page=16")
    # page = [K_data 2x16x64 = 2048][K_scale 2x16x8 = 256][V_data 2048][V_scale 256] = 4608 B, two pages
    assert raw.size == 2 * 4608
    # token 5, head 1: row (1 * 16 + 5) = 21 of each head-major part
    assert torch.equal(_at(raw, 1344, 1408), _payload(k, 5, 1))
    assert torch.equal(_at(raw, 2216, 2224), _scale(k, 5, 1))
    assert torch.equal(_at(raw, 3648, 3712), _payload(v, 5, 1))
    assert torch.equal(_at(raw, 4520, 4528), _scale(v, 5, 1))
    # token 17 = page 1, offset 1, head 0
    assert torch.equal(_at(raw, 4672, 4736), _payload(k, 17, 0))
    assert torch.equal(_at(raw, 4608 + 2048 + 8, 4608 + 2048 + 16), _scale(k, 17, 0))


def test_offsets_trtllm_nvfp4_kv(tmp_path):
    k, v = marked("nvfp4", 20, 2, seed=1), marked("nvfp4", 20, 2, seed=2)
    raw = raw_bytes(tmp_path, {"k": k, "v": v}, "trtllm-nvfp4-kv", "page=16")
    assert raw.size == 2 * 4608
    # K data, K scales, V data: as vLLM (linear)
    assert torch.equal(_at(raw, 1344, 1408), _payload(k, 5, 1))
    assert torch.equal(_at(raw, 2216, 2224), _scale(k, 5, 1))
    assert torch.equal(_at(raw, 3648, 3712), _payload(v, 5, 1))
    # V scale s of token 5, head 1: head 1's [16 x 8] block at 4352 + 128 = 4480, then (5//4)*32 + 4*s + 5%4
    for s in range(8):
        assert int(raw[4513 + 4 * s]) == int(v.scales[5, 1, s]), s


def test_trtllm_interleave_matches_spec_formula_elementwise(tmp_path):
    """out[(t//4)*4*S + s*4 + t%4] = in[t*S + s], S = D/16, for every (t, s) of a page (SPEC section 5)."""
    P, D = 16, 128
    S = D // 16
    q = marked("nvfp4", P, 1)
    q.scales = (torch.arange(P * S) % 256).to(torch.uint8).reshape(P, 1, S)  # in[t*S + s] = t*S + s
    raw = raw_bytes(tmp_path, {"k": q, "v": q}, "trtllm-nvfp4-kv", f"page={P}")
    v_scale = raw[P * 64 + P * S + P * 64:]  # after K_data, K_scale, V_data
    assert v_scale.size == P * S
    for t in range(P):
        for s in range(S):
            assert int(v_scale[(t // 4) * 4 * S + s * 4 + t % 4]) == t * S + s, (t, s)


def test_offsets_ds32_indexer(tmp_path):
    q = marked("fp8-ds", 70, 1)
    raw = raw_bytes(tmp_path, {"x": q}, "ds32-indexer-fp8")
    assert raw.size == 2 * 8448  # [64 x 128][64 x 4] per page
    assert torch.equal(_at(raw, 640, 768), _payload(q, 5, 0))
    assert torch.equal(_at(raw, 8212, 8216), _scale(q, 5, 0))
    assert struct.unpack("<f", raw[8212:8216].tobytes())[0] == float(q.scales[5, 0, 0])
    # token 69 = page 1, offset 5
    assert torch.equal(_at(raw, 9088, 9216), _payload(q, 69, 0))
    assert torch.equal(_at(raw, 16660, 16664), _scale(q, 69, 0))


def test_offsets_sglang_page1(tmp_path):
    k, v = marked("nvfp4", 10, 2, seed=1), marked("nvfp4", 10, 2, seed=2)
    raw = raw_bytes(tmp_path, {"k": k, "v": v}, "sglang-page1")
    # [k_buffer 10x2x64 = 1280][v_buffer 1280][k_scale_buffer 10x2x8 = 160][v_scale_buffer 160]
    assert raw.size == 2880
    assert torch.equal(_at(raw, 704, 768), _payload(k, 5, 1))
    assert torch.equal(_at(raw, 1984, 2048), _payload(v, 5, 1))
    assert torch.equal(_at(raw, 2648, 2656), _scale(k, 5, 1))
    assert torch.equal(_at(raw, 2808, 2816), _scale(v, 5, 1))


def test_offsets_atom_kv(tmp_path):
    k, v = marked("fp8-token", 20, 1, seed=1), marked("fp8-token", 20, 1, seed=2)
    raw = raw_bytes(tmp_path, {"k": k, "v": v}, "atom-kv")
    # [k_cache 2 pages x 16 x 128][v_cache 4096][k_scale 2 x 16 x 4][v_scale 128]
    assert raw.size == 4096 + 4096 + 128 + 128
    kp, vp = _payload(k, 5, 0), _payload(v, 5, 0)
    # K SHUFFLE [D/16, 16, 16]: element d of token 5 at (d//16)*256 + 5*16 + d%16
    assert torch.equal(_at(raw, 80, 96), kp[0:16])
    assert torch.equal(_at(raw, 336, 352), kp[16:32])
    assert int(raw[7 * 256 + 80 + 15]) == int(kp[127])
    # token 19 = page 1 (base 2048), offset 3: d = 0..15 at 2048 + 48
    assert torch.equal(_at(raw, 2096, 2112), _payload(k, 19, 0)[0:16])
    # V SHUFFLE [1, D, 16]: element d of token 5 at 4096 + d*16 + 5
    assert int(raw[4101]) == int(vp[0]) and int(raw[4117]) == int(vp[1])
    assert int(raw[4096 + 127 * 16 + 5]) == int(vp[127])
    # per-token fp32 scales [pages, H, 16]
    assert torch.equal(_at(raw, 8192 + 20, 8192 + 24), _scale(k, 5, 0))
    assert torch.equal(_at(raw, 8192 + 128 + 64 + 12, 8192 + 128 + 64 + 16), _scale(v, 19, 0))


def test_offsets_atom_index_and_planes(tmp_path):
    q = marked("fp8-unit", 200, 1)
    raw = raw_bytes(tmp_path, {"x": q}, "atom-index")
    assert raw.size == 2 * 128 * 128
    assert torch.equal(_at(raw, 640, 768), _payload(q, 5, 0))
    assert torch.equal(_at(raw, 16640, 16768), _payload(q, 130, 0))
    q2 = marked("mxfp4", 10, 3)
    raw2 = raw_bytes(tmp_path, {"x": q2}, "planes")
    assert raw2.size == 10 * 3 * 68  # [payload 10 x 3 x 64][scales 10 x 3 x 4]
    assert torch.equal(_at(raw2, (5 * 3 + 1) * 64, (5 * 3 + 2) * 64), _payload(q2, 5, 1))
    assert torch.equal(_at(raw2, 1920 + (5 * 3 + 1) * 4, 1920 + (5 * 3 + 2) * 4), _scale(q2, 5, 1))


@pytest.mark.parametrize("label", ["mxfp4", "nvfp4", "fp8-token", "fp8-unit", "bf16"])
def test_paged_layout_is_paged_cache_buffer(label):
    """The `paged` preset's bytes are exactly kvtool.paged.PagedCache.data after store() (partial last page)."""
    n, h, page = 37, 2, 16
    x = realistic(n, h)
    fmt = get_format(label)
    cache = PagedCache.allocate(fmt, 3, page, h, 128)
    cache.store(x, torch.arange(n))
    buffers, _, _ = encode_for_write({"x": fmt.quantize(x)}, "paged", f"page={page}")
    assert torch.equal(buffers["data"].reshape(-1), cache.data.reshape(-1))


# ------------------------------------------------------------------------------------------------- plausibility
@pytest.mark.parametrize("label", ["mxfp4", "nvfp4", "fp8-token", "fp8-unit", "bf16", "fp8-ds"])
def test_real_caches_look_plausible(label):
    assert check_plausible({"x": quantized(label, 300, 2)}) == []


@pytest.mark.parametrize("layout,label,wrong", [
    ("vllm-mxfp4-page", "mxfp4", "page=64"),
    ("vllm-nvfp4-kv", "nvfp4", "page=8"),
    ("ds32-indexer-fp8", "fp8-ds", "page=32"),
])
def test_wrong_page_size_is_flagged(tmp_path, layout, label, wrong):
    q = quantized(label, 256, 1)
    path = tmp_path / "dump.bin"
    write_layout(named(layout, q), path, layout, None if layout != "vllm-nvfp4-kv" else "page=16")
    Path(str(path) + ".json").unlink()
    assert check_plausible(read_layout(path, layout, f"format={label},heads=1,dim=128")) == []
    warnings = check_plausible(read_layout(path, layout, f"format={label},heads=1,dim=128,{wrong}"))  # same size
    assert warnings and all("wrong layout or geometry?" in w for w in warnings), warnings


# --------------------------------------------------------------------------------------------------- bad geometry
@pytest.fixture
def mx_dump(tmp_path) -> Path:
    path = tmp_path / "mx.bin"
    write_layout({"x": quantized("mxfp4", 256, 1)}, path, "vllm-mxfp4-page")
    Path(str(path) + ".json").unlink()
    return path


def test_truncated_dump_names_expected_and_actual_bytes(mx_dump):
    data = mx_dump.read_bytes()
    mx_dump.write_bytes(data[:-100])
    with pytest.raises(LayoutError, match=r"needs 17408 bytes \(2 pages x 8704 B\), the file has 17308 bytes "
                                          r"\(truncated\?\)"):
        read_layout(mx_dump, "vllm-mxfp4-page", "format=mxfp4,page=128,heads=1,dim=128,tokens=256")
    with pytest.raises(LayoutError, match="8704-byte pages, the file has 17308 bytes"):
        read_layout(mx_dump, "vllm-mxfp4-page")


def test_wrong_heads_hints_the_geometry_that_fits(mx_dump):
    with pytest.raises(LayoutError, match=r"needs 34816 bytes.*that fit: tokens<=128 \(1 page\), heads=1"):
        read_layout(mx_dump, "vllm-mxfp4-page", "heads=2,dim=128,tokens=256")
    with pytest.raises(LayoutError, match=r"tokens<=256 \(2 pages\)"):
        read_layout(mx_dump, "vllm-mxfp4-page", "tokens=1000")


def test_geometry_string_parses_to_typed_values():
    assert parse_geometry("format=mxfp4, page=128,heads=1,dim=128,tokens=1000,outer.v=0.5,tensor_scale=2") == {
        "format": "mxfp4", "page": 128, "heads": 1, "dim": 128, "tokens": 1000, "outer.v": 0.5, "tensor_scale": 2.0}
    assert parse_geometry(None) == {} and parse_geometry(" ") == {}
    assert parse_geometry({"page": 64, "format": "nvfp4"}) == {"page": 64, "format": "nvfp4"}
    with pytest.raises(LayoutError, match="given twice"):
        parse_geometry("page=1,page=2")
    with pytest.raises(LayoutError, match="unknown geometry key 'page.k'"):
        parse_geometry("page.k=2")


@pytest.mark.parametrize("layout,geometry,match", [
    ("vllm-mxfp4-page", "pages=3", "unknown geometry key 'pages'"),
    ("vllm-mxfp4-page", "heads=two", "not a number"),
    ("vllm-mxfp4-page", "heads", "not KEY=VALUE"),
    ("vllm-mxfp4-page", "format=nvfp4", "holds mxfp4, not nvfp4"),
    ("trtllm-nvfp4-kv", "page=6", "page % 4"),
    ("atom-kv", "page=32", "fixed page size of 16"),
    ("vllm-mxfp4-page", "dim=100", "not divisible"),
    ("vllm-mxfp4-tile", None, "unknown layout"),
])
def test_bad_geometry_raises_layout_error(mx_dump, layout, geometry, match):
    with pytest.raises(LayoutError, match=match):
        read_layout(mx_dump, layout, geometry)


def test_whole_tensor_scalars_must_be_known(tmp_path):
    path = tmp_path / "t.bin"
    q = quantized("fp8-tensor", 10, 1)
    write_layout({"x": q}, path, "paged", "page=16")
    Path(str(path) + ".json").unlink()
    with pytest.raises(LayoutError, match="tensor_scale=VALUE"):
        read_layout(path, "paged", "format=fp8-tensor,page=16,heads=1,dim=128,tokens=10")
    back = read_layout(path, "paged", f"format=fp8-tensor,page=16,heads=1,dim=128,tokens=10,"
                                      f"tensor_scale={float(q.scales)!r}")
    assert_same(back["x"], q)


def test_write_checks_format_and_names(tmp_path):
    q = quantized("mxfp4", 10, 1)
    with pytest.raises(LayoutError, match="no place for the per-token scales of fp8-token"):
        write_layout({"x": quantized("fp8-token", 10, 1)}, tmp_path / "a.bin", "atom-index")
    with pytest.raises(LayoutError, match="use quantize to change the format"):
        write_layout({"x": q}, tmp_path / "a.bin", "paged", "format=nvfp4")
    with pytest.raises(LayoutError, match="pairs k/v"):
        write_layout({"key": q}, tmp_path / "a.bin", "sglang-page1")
    with pytest.raises(LayoutError, match="missing v"):
        write_layout({"k": q}, tmp_path / "a.bin", "sglang-page1")
    with pytest.raises(LayoutError, match="holds nvfp4, not mxfp4"):
        write_layout({"k": q, "v": q}, tmp_path / "a.bin", "vllm-nvfp4-kv")
    with pytest.raises(LayoutError, match="raw dump holds one cache"):
        write_layout({"a": q, "b": q}, tmp_path / "a.bin", "paged")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(68))
    with pytest.raises(FormatError, match="unknown format"):
        read_layout(junk, "planes", "format=fp9")


def test_metadata_layout_mismatch_and_atomic_write(tmp_path):
    q = quantized("mxfp4", 10, 1)
    path = tmp_path / "a.safetensors"
    write_layout({"x": q}, path, "paged")
    with pytest.raises(LayoutError, match="kvtool wrote it as layout paged"):
        read_layout(path, "vllm-mxfp4-page")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no temporary files left behind


# ------------------------------------------------------------------------------------------------------------ CLI
runner = CliRunner()


def test_cli_convert_json_report_and_result(tmp_path):
    q = quantized("mxfp4", 200, 1)
    src, dst = tmp_path / "ref.safetensors", tmp_path / "vllm.bin"
    write_layout({"x": q}, src, "planes")
    result = runner.invoke(app, ["convert", str(src), "-o", str(dst), "--from-layout", "planes",
                                 "--to-layout", "vllm-mxfp4-page", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["output_bytes"] == 2 * 8704 == dst.stat().st_size
    assert report["input_bytes"] == 200 * 68
    assert report["format"] == "mxfp4-rceil" and report["warnings"] == []
    assert report["geometry_out"] == {"format": "mxfp4-rceil", "page": 128, "heads": 1, "dim": 128, "tokens": 200,
                                      "pages": 2}
    assert_same(read_layout(dst, "vllm-mxfp4-page")["x"], q)
    table = runner.invoke(app, ["convert", str(dst), "-o", str(tmp_path / "t.bin"), "--from-layout",
                                "vllm-mxfp4-page", "--to-layout", "paged", "--to-geometry", "page=16"])
    assert table.exit_code == 0, table.output
    assert "vllm-mxfp4-page -> paged" in table.stdout


def test_cli_convert_bad_geometry_is_one_line_exit_2(mx_dump, tmp_path):
    result = runner.invoke(app, ["convert", str(mx_dump), "-o", str(tmp_path / "o.bin"), "--from-layout",
                                 "vllm-mxfp4-page", "--to-layout", "planes", "--geometry",
                                 "heads=2,dim=128,tokens=256"])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: mx.bin: vllm-mxfp4-page") and "needs 34816" in lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "o.bin").exists()


def test_cli_convert_subprocess_truncated(mx_dump, tmp_path):
    mx_dump.write_bytes(mx_dump.read_bytes()[:1000])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "kvtool", "convert", str(mx_dump), "-o", str(tmp_path / "o.bin"),
                           "--from-layout", "vllm-mxfp4-page", "--to-layout", "planes",
                           "--geometry", "tokens=256"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "truncated?" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_layouts_lists_presets_with_byte_maps():
    result = runner.invoke(app, ["layouts", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)["presets"]}
    assert set(rows) == set(PRESETS)
    assert rows["vllm-mxfp4-page"]["page_bytes"] == 8704
    assert rows["vllm-mxfp4-page"]["byte_map"]["cache"] == "H x ([x payload P x 64 B][x scale P x 4 B])"
    assert rows["ds32-indexer-fp8"]["page_bytes"] == 64 * 132
    assert "trtllm-v4" in rows["trtllm-nvfp4-kv"]["rules"]
    table = runner.invoke(app, ["layouts"])
    assert table.exit_code == 0 and "atom-kv" in table.stdout
