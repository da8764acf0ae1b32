"""Shared CLI plumbing: option aliases named alike in every command, the one error handler, report output."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console

from kvtool.errors import KvtoolError

# Progress, tables and hints go to stderr when --json owns stdout; plain runs print tables to stdout.
stdout = Console()
stderr = Console(stderr=True)

FormatOpt = Annotated[str, typer.Option("--to", help="Target format: bf16, fp8, nvfp4 (alias fp4), mxfp4, or a label "
                                                     "such as mxfp4-floor, nvfp4-div-auto, fp8-token.")]
ScaleRuleOpt = Annotated[Optional[str], typer.Option("--scale-rule", help="MXFP4 scale rule: floor|even|ceil|rceil "
                                                                          "(default rceil).")]
RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", help="NVFP4 element recipe: rcp|div|unrounded "
                                                                   "(default rcp).")]
OuterScaleOpt = Annotated[Optional[str], typer.Option("--outer-scale", help="NVFP4 decode-direction outer scale: "
                                                                            "1|auto|VALUE (default 1).")]
Fp8ScaleOpt = Annotated[Optional[str], typer.Option("--fp8-scale", help="FP8 scale: unit|tensor|token "
                                                                        "(default unit).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a stable machine-readable JSON report on stdout.")]
OutOpt = Annotated[Path, typer.Option("-o", "--output", help="Output file (written to a temporary file, then renamed).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu (torch reference path) or cuda (Triton kernels).")]


def format_options(scale_rule=None, recipe=None, outer_scale=None, fp8_scale=None) -> dict:
    """The recipe options as keyword arguments of `kvtool.formats.get_format` (None where not given)."""
    return {"scale_rule": scale_rule, "recipe": recipe, "outer_scale": outer_scale, "fp8_scale": fp8_scale}


def handle_errors(fn: Callable) -> Callable:
    """Turn KvtoolError into one line on stderr and exit code 2; unexpected errors show a traceback only with
    KVTOOL_DEBUG=1 (exit 3 otherwise)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
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
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return value


def to_json(report) -> str:
    """A report dataclass (or dict) as stable JSON: keys in declaration order, non-finite floats as null/'inf'."""
    return json.dumps(_jsonable(report), indent=2)


def emit(report, as_json: bool, render: Callable) -> None:
    """Print `report` as JSON on stdout, or render it with rich."""
    if as_json:
        sys.stdout.write(to_json(report) + "\n")
    else:
        render(report)
