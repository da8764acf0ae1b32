"""The `kvtool` command: thin Typer commands, each parsing options, calling one workflow and rendering its report.

Command modules register themselves on `app` when imported below; each command is wrapped by `handle_errors`, so a
`KvtoolError` from any layer becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvtool",
    help="Quantize, dequantize, inspect, diff and verify low-precision KV and indexer caches (FP8, NVFP4, MXFP4).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)

# Command modules (imported for their registrations on `app` / `bench_app`). One line per module.
from kvtool.cli import bench  # noqa: E402,F401
from kvtool.cli import attn_cmds  # noqa: E402,F401
from kvtool.cli import decode_cmds  # noqa: E402,F401
from kvtool.cli import cache_cmds  # noqa: E402,F401
from kvtool.cli import layout_cmds  # noqa: E402,F401
from kvtool.cli import model_cmds  # noqa: E402,F401
from kvtool.cli import topk_cmds  # noqa: E402,F401


def main() -> None:
    app()
