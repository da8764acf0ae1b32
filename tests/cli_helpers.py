"""The in-process CLI runner and the checks on its results that several CLI test files share."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtool.cli import app

runner = CliRunner()


def kv(*args):
    """`kvtool ARGS...` in process (arguments str()-ed) -> the click Result."""
    return runner.invoke(app, [str(a) for a in args])


def kv_json(*args) -> dict:
    """`kvtool ARGS... --json`, which must exit 0 -> the parsed report."""
    result = kv(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def one_line_error(result, words: str, *, empty_stdout: bool = False) -> None:
    """Exit 2 with exactly one `error:` line on stderr that contains `words`, and no traceback (`empty_stdout`: and
    nothing at all on stdout)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    if empty_stdout:
        assert not result.stdout
    else:
        assert "Traceback" not in result.output
