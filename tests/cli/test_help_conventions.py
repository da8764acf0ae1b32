"""Help and start-up conventions of every `kvtool` command (kvtool/cli/common.py says them): a one-line summary, a
description, examples, -h, --version, 80-column help, one-line usage errors (exit 2), and no torch at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from cli_helpers import kv

from kvtool import __version__
from kvtool.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[tuple[str, ...]]:
    """Every command path: ("quantize",), ("bench", "codecs"), ... and the groups themselves."""
    root = typer.main.get_command(app)
    out = []

    def walk(group, prefix):
        for name in group.list_commands(None):
            cmd = group.get_command(None, name)
            out.append(prefix + (name,))
            if hasattr(cmd, "list_commands"):
                walk(cmd, prefix + (name,))

    walk(root, ())
    return out


COMMANDS = _commands()


def test_the_command_list_is_complete():
    names = {c[0] for c in COMMANDS}
    assert {"quantize", "dequantize", "inspect", "diff", "convert", "layouts", "verify-topk", "verify-attn", "decode",
            "capacity", "capture", "bench"} <= names
    assert {c[1] for c in COMMANDS if c[0] == "bench" and len(c) == 2} >= {"codecs", "quant", "index", "attn", "decode"}


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_has_a_summary_a_description_and_examples(path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = kv(*path, "-h")
    assert result.exit_code == 0, result.output
    text = result.output
    lines = text.splitlines()
    assert lines[0].startswith(f"Usage: kvtool {' '.join(path)} ")
    summary = lines[2].strip()
    assert summary and len(summary) <= 60 and not summary.endswith("..."), summary
    assert "Examples:" in text and f"kvtool {' '.join(path)}" in text.split("Examples:")[1]
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "…" not in text and "()" not in text and "╭" not in text


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_names_values_not_python_types(path, monkeypatch):
    """A repeatable option shows what one value is (GLOB, A_NAME=B_NAME), not typer's `<list[str]>`; arguments are
    named in capitals in the usage line, as the options' metavars are (INPUT, FILE, PATH)."""
    import re

    monkeypatch.setenv("COLUMNS", "80")
    text = kv(*path, "-h").output
    assert not re.search(r"<(list|tuple|dict|set|Optional)\b", text), text
    usage = text.splitlines()[0].removeprefix(f"Usage: kvtool {' '.join(path)} ")
    args = re.findall(r"[{\[]([A-Za-z_]+)[}\]]", usage.replace("[OPTIONS]", ""))
    assert all(a.isupper() for a in args if a != "ARGS"), usage


def test_group_help_lists_one_line_summaries(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    for args in ((), ("bench",)):
        text = kv(*args, "--help").output
        listed = text.split("Commands:")[1].split("Examples:")[0].strip().splitlines()
        assert listed and all("..." not in line for line in listed), listed
    assert kv().exit_code == 0  # no arguments: the help, exit 0


def test_version_and_short_help_option():
    result = kv("--version")
    assert result.exit_code == 0 and result.output.strip() == f"kvtool {__version__}"
    assert kv("inspect", "-h").exit_code == 0


@pytest.mark.parametrize("args,words", [
    (["inspect", "--tok", "x"], "No such option: --tok"),
    (["inspect"], "Missing argument"),
    (["quantize", "fixtures/synthetic_cache.safetensors", "-o", "/tmp/x.safetensors"], "Missing option '--to'"),
    (["nosuch"], "No such command 'nosuch'"),
    (["bench", "codecs", "--size", "big"], "Invalid value for '--size'"),
])
def test_a_usage_error_is_one_line_with_a_hint(args, words):
    result = kv(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    assert "-h'" in lines[0] and not result.stdout


def test_exclude_help_says_what_each_command_does_with_it():
    assert "copied unchanged" in kv("quantize", "-h").output
    for cmd in ("inspect", "diff"):
        assert "copies" not in kv(cmd, "-h").output


def test_model_depth_and_layer_selection_have_distinct_names():
    assert "--model-layers" in kv("bench", "decode", "-h").output
    assert "--layers " not in kv("bench", "decode", "-h").output  # the old spelling is hidden, still accepted
    assert "--model-layers" in kv("capture", "-h").output and "--layers" in kv("capture", "-h").output


def test_startup_imports_no_torch():
    """`kvtool -h` (the app with every command registered) and `import kvtool` stay torch-free: commands import their
    workflows inside the function (the whole start-up cost of a --help is then typer and rich)."""
    code = ("import sys, kvtool, kvtool.cli; from typer.main import get_command; get_command(kvtool.cli.app); "
            "heavy = sorted(m for m in ('torch', 'numpy', 'triton', 'safetensors') if m in sys.modules); print(heavy)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_examples_break_long_commands_into_shell_continuations_that_still_run():
    import shlex

    from kvtool.cli.common import EXAMPLE_WIDTH, examples

    cmd = ('kvtool capture --model smollm2 --prompt "The capital of France is a city with a long name" '
           "-o cache.safetensors --layers 0-3 --max-tokens 200 --json")
    text = examples(cmd + "  (a comment)")
    body = text.split("\b\n", 1)[1].splitlines()
    assert all(len(line) <= EXAMPLE_WIDTH + 2 for line in body) and len(body) > 1
    joined = " ".join(line.strip().removesuffix("\\").strip() for line in body)
    assert joined.endswith("(a comment)")
    assert shlex.split(joined.removesuffix("(a comment)")) == shlex.split(cmd)
