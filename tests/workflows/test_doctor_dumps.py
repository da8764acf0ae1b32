"""kvtool doctor on raw engine dumps (as fixtures/make_layout_dumps.py makes them: write_layout, then the kvtool
sidecar removed): clean dumps of every engine preset give no error and no warning; a declared geometry that
misreads the bytes is `wrong-geometry` with the true geometry ranked first; missing geometry keys are ranked and
named; breaks written into the dump are found through the layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from doctor_breaks import FIXTURES, random_cache
from kvtool.doctor import examine
from kvtool.formats import get_format
from kvtool.layouts import write_layout

# preset -> (format, heads, page, a declared geometry that misreads the bytes, or None where the preset's buffers
# have no structure a geometry can get wrong: sglang-page1 and atom-index are flat token-major rows, so any head
# count / dim that splits them into whole rows reads the same bytes)
PRESETS = {
    "vllm-mxfp4-page": ("mxfp4", 2, 128, "page=32"),
    "vllm-nvfp4-kv": ("nvfp4", 2, 16, "page=32"),
    "trtllm-nvfp4-kv": ("nvfp4", 2, 32, "page=16"),
    "ds32-indexer-fp8": ("fp8-ds", 1, 64, "page=16"),
    "sglang-page1": ("nvfp4", 2, 1, None),
    "atom-index": ("fp8", 1, 128, None),
    "atom-kv": ("fp8-token", 2, 16, "dim=64,heads=4"),
}


def write_dump(tmp_path: Path, preset: str, seed: int = 3, breaker=None) -> tuple[Path, str]:
    """A clean (or broken by `breaker(q)`) dump of a random cache in `preset`; returns (path, true geometry)."""
    label, heads, page, _ = PRESETS[preset]
    cache = random_cache(seed, tokens=256, heads=heads, dim=128)
    fmt = get_format(label)
    from kvtool.layouts import get_preset

    names = get_preset(preset).tensors
    src = {"x": cache["layers.0.k"], "k": cache["layers.0.k"], "v": cache["layers.0.v"]}
    tensors = {n: fmt.quantize(src[n]) for n in names}
    if breaker is not None:
        tensors[names[0]] = breaker(tensors[names[0]])
    path = tmp_path / f"{preset}.bin"
    write_layout(tensors, path, preset, f"page={page}")
    Path(str(path) + ".json").unlink()  # an engine writes no kvtool sidecar
    return path, f"format={label},page={page},heads={heads},dim=128,tokens=256"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_clean_dump_no_error_no_warning(tmp_path, preset):
    path, geo = write_dump(tmp_path, preset)
    rep = examine(path, layout=preset, geometry=geo)
    assert not [f for f in rep.findings if f.severity != "info"], rep.findings


@pytest.mark.parametrize("preset", [p for p, v in PRESETS.items() if v[3]])
def test_wrong_geometry_found_and_true_one_ranked_first(tmp_path, preset):
    path, geo = write_dump(tmp_path, preset)
    keys = dict(item.split("=") for item in geo.split(","))
    for item in PRESETS[preset][3].split(","):
        k, v = item.split("=")
        keys[k] = v
    keys.pop("tokens")
    wrong = ",".join(f"{k}={v}" for k, v in keys.items())
    rep = examine(path, layout=preset, geometry=wrong)
    hits = [f for f in rep.errors if f.code == "wrong-geometry"]
    assert hits, rep.findings
    # the true geometry is among the most plausible readings (others that keep every plane aligned, with tokens
    # and heads renumbered, can score the same)
    fits = rep.candidates["geometry"]
    true = next((f for f in fits if f.what == geo), None)
    assert true is not None and true.score <= fits[0].score + 0.03, (geo, fits[:4])
    assert hits[0].evidence.get("declared_score", 1.0) > true.score + 0.1, hits[0].evidence
    assert not [f for f in rep.findings if f.severity == "error" and f.code != "wrong-geometry"], rep.findings


@pytest.mark.parametrize("preset", ["vllm-mxfp4-page", "sglang-page1", "ds32-indexer-fp8"])
def test_missing_keys_are_ranked(tmp_path, preset):
    path, geo = write_dump(tmp_path, preset)
    label = geo.split(",")[0]
    heads = [item for item in geo.split(",") if item.startswith("heads=")][0]
    given = f"{heads},dim=128" + ("" if preset != "sglang-page1" else "")
    rep = examine(path, layout=preset, geometry=given if preset == "sglang-page1" else f"{label},{given}")
    assert rep.ok, rep.findings
    assert "geometry-inferred" in rep.codes("info"), rep.findings
    best = rep.candidates["geometry"][0].what
    assert best.startswith(label), rep.candidates["geometry"][:4]


def _zero_page(q):
    payload = q.payload.clone()
    payload[128:256] = 0
    scales = q.scales.clone() if q.scales is not None and q.scales.dim() > 0 else q.scales
    if scales is not None and scales.dim() > 0:
        scales[128:256] = 0
    return type(q)(q.fmt, payload, scales, q.outer_scale, q.shape)


def _nan_scales(q):
    s = q.scales.clone()
    s.view(torch.uint8).reshape(-1)[5:50:7] = 0xFF
    return type(q)(q.fmt, q.payload, s, q.outer_scale, q.shape)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_break_in_dump_found(tmp_path, preset):
    label, heads, page, _ = PRESETS[preset]
    tokens_per_page = max(page, 1)
    path, geo = write_dump(tmp_path, preset, breaker=_zero_page)
    rep = examine(path, layout=preset, geometry=geo, page=128 if tokens_per_page == 1 else 16)
    assert "stale-or-missing-pages" in rep.codes("error") or "non-finite-codes" in rep.codes("error"), rep.findings
    if get_format(label).scale_element != "none":
        path, geo = write_dump(tmp_path, preset, breaker=_nan_scales)
        rep = examine(path, layout=preset, geometry=geo)
        assert "non-finite-codes" in rep.codes("error"), rep.findings


def test_trtllm_dump_read_as_vllm_scales_misaligned():
    """The committed TRT-LLM NVFP4 dump read with the vLLM preset: same sizes, V scales interleaved in groups of 4
    tokens where the reader expects them linear."""
    geo = "format=nvfp4,page=32,heads=2,dim=128,tokens=256"
    clean = examine(FIXTURES / "trtllm_nvfp4_kv.bin", layout="trtllm-nvfp4-kv", geometry=geo)
    assert clean.ok and not clean.warnings, clean.findings
    rep = examine(FIXTURES / "trtllm_nvfp4_kv.bin", layout="vllm-nvfp4-kv", geometry=geo)
    hits = [f for f in rep.errors if f.code == "scales-misaligned" and f.tensor == "v"]
    assert hits, rep.findings
    assert not [f for f in rep.errors if f.tensor == "k"], rep.findings


def test_committed_mxfp4_dump_wrong_page():
    path = FIXTURES / "vllm_mxfp4_k.bin"
    ok = examine(path, layout="vllm-mxfp4-page", geometry="format=mxfp4,page=128,heads=2,dim=128,tokens=256")
    assert ok.ok and not ok.warnings, ok.findings
    rep = examine(path, layout="vllm-mxfp4-page", geometry="format=mxfp4,page=32,heads=2,dim=128,tokens=256")
    assert "wrong-geometry" in rep.codes("error"), rep.findings
    assert "page=128" in rep.candidates["geometry"][0].what
