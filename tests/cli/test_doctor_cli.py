"""`kvtool doctor`: exit codes (0 clean / warnings, 1 an error finding, 2 bad input), the rich table, the stable
--json findings list, and the arguments the command passes to kvtool.doctor.examine."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from cli_helpers import kv, one_line_error

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"
GEO = "format=mxfp4,page=128,heads=2,dim=128,tokens=256"
FINDING_KEYS = ["code", "severity", "tensor", "layer", "head", "message", "fix", "evidence"]


def test_clean_fixture_exit_0():
    result = kv("doctor", FIX / "synthetic_cache.safetensors")
    assert result.exit_code == 0, result.output
    assert "looks clean" in result.stdout


def test_wrong_page_exit_1_table_and_json():
    args = ("doctor", FIX / "vllm_mxfp4_k.bin", "--layout", "vllm-mxfp4-page", "--geometry", GEO.replace("page=128",
                                                                                                         "page=32"))
    result = kv(*args)
    assert result.exit_code == 1, result.output
    assert "wrong-geometry" in result.stdout and "page=128" in result.stdout
    result = kv(*args, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["errors"] >= 1
    first = report["findings"][0]
    assert list(first) == FINDING_KEYS and first["code"] == "wrong-geometry" and first["severity"] == "error"
    assert "page=128" in report["candidates"]["geometry"][0]["what"]


def test_fnuz_pt_with_reference(tmp_path):
    """An MI300 cache (E4M3FNUZ bytes) saved as float8_e4m3fn: found from the bytes, pinned with the reference."""
    x = torch.randn(64, 2, 128, generator=torch.Generator().manual_seed(0)) * 100
    codes = torch.clamp(x, -240, 240).to(torch.float8_e4m3fnuz).view(torch.uint8)
    torch.save({"layers.0.k": codes.view(torch.float8_e4m3fn)}, tmp_path / "k.pt")
    save_file({"layers.0.k": x}, str(tmp_path / "ref.safetensors"))
    result = kv("doctor", tmp_path / "k.pt", "--reference", tmp_path / "ref.safetensors", "--json")
    assert result.exit_code == 1, result.output
    codes_found = {f["code"] for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"}
    # x100 saturates ~2 % of the values at FNUZ's 240 (that 0x7F is what gives FNUZ away without a reference), so the
    # cache is clipped too, measured at 240
    assert codes_found == {"fp8-fnuz-as-fn", "clipping"}, result.stdout


def test_topk_ids_npy(tmp_path):
    import numpy as np

    # row p: the top-4 of blocks 0..p (block size 1), descending, -1 padded: fine unless the consumer needs ascending
    ids = np.array([[b if b >= 0 else -1 for b in range(min(p, 3), min(p, 3) - 4, -1)] for p in range(600)],
                   dtype=np.int32)
    np.save(tmp_path / "topk.npy", ids)
    result = kv("doctor", tmp_path / "topk.npy", "--topk-block", "1", "--json")
    assert result.exit_code == 1, result.output
    findings = json.loads(result.stdout)["findings"]
    assert [(f["code"], f["evidence"]["order"]) for f in findings] == [("topk-contract", "ascending")], findings
    result = kv("doctor", tmp_path / "topk.npy", "--topk-order", "any", "--topk-block", "1")
    assert result.exit_code == 0, result.output
    result = kv("doctor", tmp_path / "topk.npy", "--topk-order", "any", "--topk-block", "128")
    assert result.exit_code == 1 and "causal range" in result.stdout, result.output


def test_bad_input_exit_2(tmp_path):
    one_line_error(kv("doctor", tmp_path / "missing.safetensors"), "no such file")
    one_line_error(kv("doctor", FIX / "synthetic_cache.safetensors", "--fp8-element", "e5m2"), "fp8 element")
    one_line_error(kv("doctor", FIX / "vllm_mxfp4_k.bin"), "--layout")
    one_line_error(kv("doctor", FIX / "synthetic_cache.safetensors", "--geometry", "page=16"), "--layout")


def test_passes_options_to_examine(monkeypatch):
    import kvtool.doctor as doctor
    from kvtool.doctor import DoctorReport

    seen = {}

    def fake(path, **kw):
        seen.update(kw, path=path)
        return DoctorReport(str(path), "kvtool")

    monkeypatch.setattr(doctor, "examine", fake)
    result = kv("doctor", "x.safetensors", "--reference", "r.safetensors", "--fp8-element", "fnuz", "--topk-order",
                "any", "--topk-block", "64", "--page", "32", "--include", "*.k")
    assert result.exit_code == 0, result.output
    assert seen["path"] == Path("x.safetensors") and seen["reference"] == Path("r.safetensors")
    assert (seen["fp8_element"], seen["topk_order"], seen["topk_block"], seen["page"]) == ("fnuz", "any", 64, 32)
    assert seen["include"] == ["*.k"] and seen["layout"] is None
