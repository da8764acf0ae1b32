"""The root `kvtool` Typer app, on its own so that the command modules register on it without importing the package
facade (kvtool/cli/__init__.py), which imports them."""

from __future__ import annotations

import typer

from kvtool.cli.common import KvtoolGroup, VersionOpt

__all__ = ["app"]

app = typer.Typer(
    name="kvtool",
    cls=KvtoolGroup,
    help="Quantize, dequantize, inspect, diff and verify low-precision KV and indexer caches (FP8, NVFP4, MXFP4).\n\n"
         "Run 'kvtool COMMAND -h' for a command's options and examples.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: whole lines at any width, fast, and the same in a pipe
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


@app.callback()
def _root(version: VersionOpt = False) -> None:
    pass
