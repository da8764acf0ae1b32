"""`kvtool decode`'s text report prints the model's and the user's text as it is: a prompt, a generation or a
warning holding square brackets (chat templates: `[INST] ... [/INST]`) is not rich markup, so it neither vanishes
nor raises rich's MarkupError (which made the command exit 3 after the whole run)."""

from __future__ import annotations

from types import SimpleNamespace

from cli_helpers import kv

from kvtool.cli import decode_cmds

TEMPLATE = "<s>[INST] [bold]hi[/bold] [/INST]"


def _report():
    gen = SimpleNamespace(text=TEMPLATE, agreement_pct=100.0, first_divergence=None)
    config = SimpleNamespace(label="bf16 / bf16", generation=gen)
    return SimpleNamespace(baseline=config, candidates=[], prompt_tail=TEMPLATE, gen_tokens=3,
                           warnings=[f"context too short for {TEMPLATE}"])


def test_prompt_generation_and_warnings_print_brackets_as_they_are(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    r = _report()
    decode_cmds._render_generations(r)
    decode_cmds.warn(r.warnings)
    out, err = capsys.readouterr()
    assert out.count(repr(TEMPLATE)) == 2  # the prompt tail line and the generation's cell, brackets and all
    assert f"warning: context too short for {TEMPLATE}" in err


def test_text_report_at_80_columns_wraps_prose_whole(monkeypatch):
    """The model line, verdicts and notes wrap between clauses with indented continuations (render.line), never with
    rich's own wrapping, which left trailing blanks."""
    monkeypatch.setenv("COLUMNS", "80")
    result = kv("decode", "--model", "tiny-llama", "--kv", "nvfp4", "--index", "fp4", "--tokens", "96",
                "--gen-tokens", "4")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("tiny-llama: 2 layers") and lines[1].startswith("  ")
    assert not [line for line in lines if line != line.rstrip()]
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
