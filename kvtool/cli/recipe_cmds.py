"""`kvtool recipes`: the engine recipes (each engine function's byte-level choices) that `--recipe-of` selects."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvtool.cli.root import app
from kvtool.cli.common import JsonOpt, Table, emit, examples, handle_errors, line, print_table

__all__ = ["recipes"]


@app.command("recipes", epilog=examples(
    "kvtool recipes",
    "kvtool recipes --engine torchao",
    "kvtool recipes --json",
    "kvtool quantize fixtures/synthetic_cache.safetensors -o /tmp/k.safetensors --to nvfp4 "
    "--recipe-of vllm.ref_nvfp4 --outer-scale auto"))
@handle_errors
def recipes(
    engine: Annotated[Optional[str], typer.Option("--engine", help="Only recipes whose name or engine contains "
                                                                   "this (e.g. vllm, sglang, torchao).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the engine recipes that --recipe-of selects.

    Each recipe reproduces one engine function's bytes: its engine and version, the function, the kvtool format it
    writes (label `FAMILY@RECIPE`) and every byte-level choice (tie and sign rules, scale formula, clamps, outer
    scale direction, zero blocks). SPEC behaviour stays the default when no recipe is named."""
    from kvtool.formats.registry import list_recipes

    emit(list_recipes(engine), as_json, _render)


def _render(report) -> None:
    table = Table(f"engine recipes ({len(report.recipes)}): --recipe-of NAME, or a format label FAMILY@NAME",
                  records=True)
    for column in ("name", "engine", "function", "label", "choices", "oracle", "note"):
        table.column(column, wrap=column in ("function", "choices", "oracle", "note"))
    for r in report.recipes:
        choices = ", ".join(f"{k}={v}" for k, v in r["choices"].items())
        table.row(r["name"], f"{r['engine']} ({r['version']})", r["function"], r["label"], choices, r["oracle"],
                  r["note"] or "-")
    print_table(table)
    line("Checked byte for byte against the engines' own functions by tests/engines (where `oracle` says so).")
