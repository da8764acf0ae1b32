"""Shared CLI plumbing: option aliases named alike in every command, help and error conventions, the one error
handler, progress, and report output (tables through `kvtool.cli.render`, or `--json`).

Conventions a command follows (tests/cli/test_help_conventions.py checks them for every registered command):
- its docstring's first line is a one-line summary (at most 60 characters, shown in `kvtool -h`), then a blank line
  and a short description; its epilog is `examples(...)` (at least one example);
- it imports nothing heavy at module level (no torch): its workflow is imported inside the function, so that
  `kvtool -h` and `kvtool CMD -h` start in a fraction of a second;
- it renders with `render.Table` / `print_table` / `line` (never a rich Table of its own), and prints notes, hints and
  warnings with `note` / `hint` / `warn` (stderr).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import typer
from typer.core import TyperGroup

from kvtool.cli.render import Table, line, print_table, stderr, stdout
from kvtool.errors import KvtoolError

__all__ = [
    "DeviceOpt", "FormatOpt", "JsonOpt", "KvtoolGroup", "OutOpt", "OuterScaleOpt", "RecipeOfDumpOpt", "RecipeOfOpt",
    "RecipeOpt", "ScaleRuleOpt", "Table", "emit", "examples", "format_options", "geometry_with_recipe",
    "handle_errors", "hint", "lazy_module", "line", "note", "print_table", "progress", "stderr", "stdout", "to_json",
    "warn"
]

FormatOpt = Annotated[str, typer.Option(
    "--to", metavar="FORMAT", help="Target format: bf16, fp8, nvfp4 (alias fp4), mxfp4, or a label such as "
                                   "mxfp4-floor, nvfp4-div-auto, fp8-token.")]
ScaleRuleOpt = Annotated[Optional[str], typer.Option(
    "--scale-rule", metavar="RULE", help="MXFP4 scale rule: floor|even|ceil|rceil (default rceil).")]
RecipeOpt = Annotated[Optional[str], typer.Option(
    "--recipe", metavar="RECIPE", help="NVFP4 element recipe: rcp|div|unrounded (default rcp).")]
OuterScaleOpt = Annotated[Optional[str], typer.Option(
    "--outer-scale", metavar="G", help="NVFP4 decode-direction outer scale: 1|auto|VALUE (default 1).")]
Fp8ScaleOpt = Annotated[Optional[str], typer.Option(
    "--fp8-scale", metavar="SCALE", help="FP8 scale: unit|tensor|token (default unit).")]
RecipeOfOpt = Annotated[Optional[str], typer.Option("--recipe-of", help="Engine recipe ENGINE.FUNCTION (see 'kvtool "
                                                                       "recipes'): write that engine function's "
                                                                       "bytes instead of the SPEC's.")]
RecipeOfDumpOpt = Annotated[Optional[str], typer.Option("--recipe-of", help="Engine recipe of the dump read with "
                                                                           "--layout (see 'kvtool recipes'); kvtool "
                                                                           "cache files record their own.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a stable machine-readable JSON report on stdout.")]
OutOpt = Annotated[Path, typer.Option(
    "-o", "--output", metavar="PATH", help="Output file (written to a temporary file, then renamed).")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", metavar="DEVICE", help="cpu (torch reference path) or cuda (Triton kernels).")]

EXAMPLE_WIDTH = 76  # examples are broken into shell continuation lines to fit 80-column help (click indents 2)


def format_options(scale_rule=None, recipe=None, outer_scale=None, fp8_scale=None, recipe_of=None) -> dict:
    """The recipe options as keyword arguments of `kvtool.formats.get_format` (None where not given; the engine
    recipe only when one is named)."""
    out = {"scale_rule": scale_rule, "recipe": recipe, "outer_scale": outer_scale, "fp8_scale": fp8_scale}
    if recipe_of:
        out["engine"] = recipe_of
    return out


def geometry_with_recipe(geometry: "str | None", recipe_of: "str | None", layout: "str | None") -> "str | None":
    """--geometry plus the dump's engine recipe (the `recipe_of` geometry key). A recipe without --layout is an
    error: a kvtool cache file records its recipe in its format metadata."""
    if not recipe_of:
        return geometry
    if not layout:
        raise KvtoolError("--recipe-of reads an engine dump with --layout; a kvtool cache file records its recipe")
    return f"{geometry},recipe_of={recipe_of}" if geometry else f"recipe_of={recipe_of}"


class LazyModule:
    """A module imported on its first attribute access: command modules name their torch-heavy workflows at module
    level (`vt = lazy_module("kvtool.workflows.verify_topk")`) and `kvtool -h` still imports none of them."""

    def __init__(self, name: str):
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str):
        import importlib

        module = importlib.import_module(self.__dict__["_lazy_name"])
        return getattr(module, attr)


def lazy_module(name: str) -> LazyModule:
    return LazyModule(name)


# ------------------------------------------------------------------------------------------------ help and errors
def examples(*commands: str) -> str:
    """A command's help epilog: "Examples:" and each command, a long one broken before an option (kept with its
    value) into shell continuation lines, so that it fits 80-column help and still runs when copied. Text after two
    spaces and "(" is a comment, kept on the command's last line when it fits."""
    out = []
    for cmd in commands:
        cmd, sep, comment = cmd.partition("  (")
        comment = f"  ({comment}" if sep else ""
        words: list[str] = []  # shell words: a quoted string with spaces stays one word
        for word in cmd.split(" "):
            if words and (words[-1].count('"') % 2 or words[-1].count("'") % 2):
                words[-1] += " " + word
            else:
                words.append(word)
        units: list[str] = []  # the command and its positionals one by one; an option with the value after it
        for word in words:
            if units and not word.startswith("-") and units[-1].startswith("-") and " " not in units[-1]:
                units[-1] += " " + word
            else:
                units.append(word)
        lines, current = [], ""
        for unit in units:
            if current and len(current) + 1 + len(unit) > EXAMPLE_WIDTH - 2:
                lines.append(current + " \\")
                current = "    " + unit
            else:
                current = f"{current} {unit}" if current else unit
        if comment and len(current) + len(comment) > EXAMPLE_WIDTH:
            lines.append(current)
            current = "    " + comment.strip()
        else:
            current += comment
        lines.append(current)
        out.append("\n".join(f"  {text}" for text in lines))
    # "\b" keeps click from rewrapping the paragraph (one paragraph: no blank line inside).
    return "Examples:\n\n\b\n" + "\n".join(out)


def _version(value: bool) -> None:
    if value:
        from kvtool import __version__

        print(f"kvtool {__version__}")
        raise typer.Exit()


VersionOpt = Annotated[bool, typer.Option("--version", help="Print the version and exit.", callback=_version,
                                          is_eager=True)]


class KvtoolGroup(TyperGroup):
    """The `kvtool` group: a usage error is one line on stderr with a hint, exit 2 (not a boxed panel)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
        from typer.exceptions import Abort

        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as err:  # `kvtool` / `kvtool bench` alone: the help, as --help prints it
            print(err.ctx.get_help())
            sys.exit(0)
        except UsageError as err:
            print(usage_error_line(err), file=sys.stderr)
            sys.exit(2)
        except Abort:
            print("error: aborted", file=sys.stderr)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def usage_error_line(err) -> str:
    """A click UsageError as one line: `error: <message> (see 'kvtool CMD -h')`."""
    message = " ".join(err.format_message().split())
    path = err.ctx.command_path if err.ctx is not None else "kvtool"
    return f"error: {message} (see '{path} -h')"


def handle_errors(fn: Callable) -> Callable:
    """Turn KvtoolError into one line on stderr and exit code 2; unexpected errors show a traceback only with
    KVTOOL_DEBUG=1 (exit 3 otherwise)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            from kvtool.options import check_options  # every option's range and conflicts, in one place

            check_options(fn.__name__, kwargs)
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KvtoolError as err:
            print(f"error: {err}", file=sys.stderr)
            raise typer.Exit(err.exit_code) from None
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except Exception as err:  # noqa: BLE001 - the last line of defence for users
            if os.environ.get("KVTOOL_DEBUG") == "1":
                raise
            print(f"internal error: {type(err).__name__}: {err} (set KVTOOL_DEBUG=1 for a traceback)", file=sys.stderr)
            raise typer.Exit(3) from None

    return wrapper


# ------------------------------------------------------------------------------------------------ stderr messages
def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def hint(text: str) -> None:
    print(f"hint: {text}", file=sys.stderr)


def warn(texts: str | list[str]) -> None:
    for text in [texts] if isinstance(texts, str) else texts:
        print(f"warning: {text}", file=sys.stderr)


@contextlib.contextmanager
def progress(label: str, *, enabled: bool = True, every_s: float = 5.0) -> Iterator:
    """Progress of a workflow on stderr; yields its `progress(done, total, what)` callback (or None when disabled).
    A terminal gets a rich bar (removed when done); otherwise (a pipe, a log) plain lines `LABEL: 42% (done/total)
    what`, at most one every `every_s` seconds, and (after any of those) a last one with the elapsed time."""
    if not enabled:
        yield None
        return
    if stderr.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeElapsedColumn(), console=stderr, transient=True) as bar:
            task = bar.add_task(label, total=None)

            def update(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=f"{label} {what}"[:48])

            yield update
        return
    start = time.monotonic()
    state = {"last": start, "line": None}

    def plain(done: int, total: int, what: str) -> None:
        pct = 100 * done / total if total else 100.0
        state["line"] = f"{label}: {pct:3.0f}% ({done}/{total}) {what}".rstrip()
        now = time.monotonic()
        if now - state["last"] >= every_s:
            print(state["line"], file=sys.stderr, flush=True)
            state["last"] = now

    yield plain
    if state["line"] is not None and state["last"] > start:  # a run long enough to have shown progress: its end
        print(f"{state['line']} in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ output
def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no infinities: null (e.g. the SQNR of two equal tensors, +inf)
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return value


def to_json(report) -> str:
    """A report dataclass (or dict) as stable JSON: keys in declaration order; numbers stay numbers, and a
    non-finite float (inf, -inf, NaN) is null."""
    return json.dumps(_jsonable(report), indent=2, allow_nan=False)


def emit(report, as_json: bool, render: Callable) -> None:
    """Print `report` as JSON on stdout, or render it (a table through kvtool.cli.render)."""
    if as_json:
        sys.stdout.write(to_json(report) + "\n")
    else:
        render(report)
