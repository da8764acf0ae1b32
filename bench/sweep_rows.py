"""`kvtool bench index --sweep` or `kvtool bench attn --sweep` restricted to some of its variant rows (the bench
module's SWEEP, by name), so that a device call times only the rows in question beside the defaults and the peers.

    PYTHONPATH=. python3 bench/sweep_rows.py index "ch4,ch8" -- --device cuda --batches 64 \
        --contexts 32768,150000 --prefill '' --formats bf16,fp8 --peer vllm --no-peers
    PYTHONPATH=. python3 bench/sweep_rows.py attn "pdl=0,probes" -- --device cuda --batches 16,64,256 \
        --formats bf16 --peer vllm --no-peers

Everything after `--` goes to `kvtool bench index|attn` (which gets --sweep added); an unknown row name is an error.
For attn, the row name "probes" keeps the fixed-cost probes (`kvtool.bench.attn.PROBE_KEEP`), which are otherwise
left out.
"""

from __future__ import annotations

import sys

import kvtool.bench.attn as bench_attn
import kvtool.bench.index as bench_index
from kvtool.cli import main

BENCHES = {"index": bench_index, "attn": bench_attn}


def run(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in BENCHES or "--" not in argv:
        raise SystemExit(__doc__)
    bench = BENCHES[argv[0]]
    names = [n.strip() for n in argv[1].split(",") if n.strip()]
    known = {row[0] for row in bench.SWEEP} | ({"probes"} if bench is bench_attn else set())
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"unknown sweep rows {unknown}; known: {sorted(known)}")
    bench.SWEEP = tuple(row for row in bench.SWEEP if row[0] in names)
    if bench is bench_attn and "probes" not in names:
        bench.PROBE_KEEP = ()
    rest = argv[argv.index("--") + 1:]
    sys.argv = ["kvtool", "bench", argv[0], "--sweep", *rest]
    main()


if __name__ == "__main__":
    run(sys.argv[1:])
