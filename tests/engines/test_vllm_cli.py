"""`--impl vllm` from the command line: the -inf / NaN top-k evidence on stdout and in JSON (exit 1), and a
one-line exit 2 with the fetch command when vLLM cannot be had."""

import json

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.engines.wheels import EngineUnavailable


def _vllm_or_skip():
    from kvtool.engines.vllm_m3 import load_ops

    try:
        load_ops()
    except EngineUnavailable as exc:
        pytest.skip(f"vLLM 0.33.0 not obtainable here: {exc}")


def test_edge_scores_report_the_defect(device):
    _vllm_or_skip()
    run = CliRunner().invoke
    res = run(app, ["verify-topk", "--edge-scores", "--impl", "vllm", "--device", device, "--json"])
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    assert report["verdict"] == "FAIL" and report["impls"][0].startswith("vllm: vllm 0.33.0")
    rows = {row["impl"]: row for row in report["layers"]}
    assert rows["vllm"]["verdict"] == "FAIL" and rows["vllm"]["checks"]["defect"] >= 1
    assert any("finite block 2 (score 3) dropped" in e for e in rows["vllm"]["checks"]["evidence"])
    text = " ".join(run(app, ["verify-topk", "--edge-scores", "--impl", "vllm", "--device", device]).stdout.split())
    assert "DEFECT" in text and "dropped while block 3 (score -inf) kept" in text and "FAIL" in text


def test_without_vllm_exit_2_with_the_fetch_command(tmp_path, monkeypatch):
    from kvtool.engines import vllm_m3, wheels

    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVTOOL_OFFLINE", "1")
    monkeypatch.setattr(wheels, "installed_root", lambda pkg: None)
    vllm_m3.load_ops.cache_clear()
    try:
        res = CliRunner().invoke(app, ["verify-topk", "--edge-scores", "--impl", "vllm"])
    finally:
        vllm_m3.load_ops.cache_clear()
    assert res.exit_code == 2
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "pip download --no-deps vllm==0.33.0" in lines[0]


def test_cli_tolerance_default_is_the_workflow_default():
    from kvtool.cli import attn_cmds
    from kvtool.workflows import verify_attn

    assert attn_cmds.DEFAULT_TOLERANCE == verify_attn.DEFAULT_TOLERANCE
