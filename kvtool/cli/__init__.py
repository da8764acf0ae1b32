"""The `kvtool` command: thin Typer commands, each parsing options, calling one workflow and rendering its report.

Command modules register themselves on `app` (kvtool/cli/root.py, so that they need not import this package) when
imported below; each command is wrapped by `handle_errors`, so a `KvtoolError` from any layer becomes one line on
stderr and exit code 2, and a usage error (unknown option, missing argument) is one line with a hint, exit 2
(`KvtoolGroup`). Building the app imports no torch: command modules import their workflows inside the command
functions (conventions: kvtool/cli/common.py).
"""

from __future__ import annotations

from kvtool.cli.root import app

__all__ = ["app", "main"]

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
