"""The `kvtool` command: thin Typer commands, each parsing options, calling one workflow and rendering its report.

Command modules register themselves on `app` when imported below; each command is wrapped by `handle_errors`, so a
`KvtoolError` from any layer becomes one line on stderr and exit code 2, and a usage error (unknown option, missing
argument) is one line with a hint, exit 2 (`KvtoolGroup`). Building the app imports no torch: command modules import
their workflows inside the command functions (conventions: kvtool/cli/common.py).
"""

from __future__ import annotations

import typer

from kvtool.cli.common import KvtoolGroup, VersionOpt

__all__ = ["app", "main"]

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


# Command modules (imported for their registrations on `app` / `bench_app`). One line per module.
# The order is the order of `kvtool -h`: files, layouts, checks, end to end, models, benchmarks.
from kvtool.cli import cache_cmds  # noqa: E402,F401
from kvtool.cli import layout_cmds  # noqa: E402,F401
from kvtool.cli import recipe_cmds  # noqa: E402,F401
from kvtool.cli import topk_cmds  # noqa: E402,F401
from kvtool.cli import attn_cmds  # noqa: E402,F401
from kvtool.cli import decode_cmds  # noqa: E402,F401
from kvtool.cli import model_cmds  # noqa: E402,F401
from kvtool.cli import bench  # noqa: E402,F401
from kvtool.cli import doctor_cmds  # noqa: E402,F401


def main() -> None:
    app()
