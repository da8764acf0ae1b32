"""`kvtool bench ...`: one subcommand per benchmark table (codecs, quant, index, attn, decode)."""

from __future__ import annotations

import typer

from kvtool.cli import app

bench_app = typer.Typer(help="Benchmarks: time, bytes, bandwidth and fraction of the copy bandwidth of the same run.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# Benchmark subcommands register on bench_app from their modules (imported at the end of kvtool/cli/__init__.py).
