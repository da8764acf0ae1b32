"""`kvtool decode` progress when stderr is not a terminal (a pipe, a CI log): plain lines, at least one per phase
and one when each phase completes, never a rich display drawn once at the end."""

from __future__ import annotations

from typer.testing import CliRunner

from kvtool.cli import app


def test_piped_decode_prints_plain_progress_lines():
    res = CliRunner().invoke(app, ["decode", "--model", "tiny-llama", "--kv", "nvfp4", "--index", "fp4",
                                   "--tokens", "96", "--gen-tokens", "4", "--no-floor", "--resamples", "0"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("decode ")]
    phases = {ln.split(":")[0] for ln in lines}
    assert {"decode teacher-forced", "decode generate"} <= phases, res.stderr
    assert any(ln.startswith("decode teacher-forced: 96/96") for ln in lines), res.stderr
    assert all("KL" in ln for ln in lines) and "\x1b[" not in res.stderr  # stats, and no terminal control codes
