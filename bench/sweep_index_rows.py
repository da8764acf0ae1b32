"""`kvtool bench index --sweep` restricted to some of its variant rows (kvtool.bench.index.SWEEP, by name), so that a
device call times only the rows in question beside the defaults.

    PYTHONPATH=. python3 bench/sweep_index_rows.py "ch4,ch8,gluon rows in shared memory" -- --batches 64 \
        --contexts 32768,150000 --prefill '' --formats bf16,nvfp4,mxfp4 --no-peers

Everything after `--` goes to `kvtool bench index` (which gets --sweep added); an unknown row name is an error.
"""

from __future__ import annotations

import sys

import kvtool.bench.index as bench_index
from kvtool.cli import main


def run(argv: list[str]) -> None:
    if len(argv) < 1 or "--" not in argv:
        raise SystemExit(__doc__)
    names = [n.strip() for n in argv[0].split(",") if n.strip()]
    known = {row[0] for row in bench_index.SWEEP}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"unknown sweep rows {unknown}; known: {sorted(known)}")
    bench_index.SWEEP = tuple(row for row in bench_index.SWEEP if row[0] in names)
    rest = argv[argv.index("--") + 1:]
    sys.argv = ["kvtool", "bench", "index", "--sweep", *rest]
    main()


if __name__ == "__main__":
    run(sys.argv[1:])
