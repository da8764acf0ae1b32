"""Summarize an Nsight Compute source page (SASS) CSV: warp-stall samples by opcode and the hottest instructions.

    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 bench/ncu_source_top.py rep.csv [--top 40]

Columns are found by name (they differ across ncu versions): the SASS text ("Source"), the all-samples stall count
("Warp Stall Sampling (All Samples)") and, when present, the executed-instruction count. Several kernels in one
report come out as separate tables (a "Kernel Name" line or a repeated header starts the next)."""

from __future__ import annotations

import argparse
import collections
import csv
import io


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def tables(text: str):
    """Split the CSV text into (title, header, rows) per kernel."""
    title, header, rows = "", None, []
    for line in text.splitlines():
        if not line.strip():
            continue
        rec = next(csv.reader(io.StringIO(line)))
        if rec and rec[0] in ("Address", "# Address") or (rec and "Source" in rec and "Address" in " ".join(rec)):
            if header is not None and rows:
                yield title, header, rows
            header, rows = rec, []
        elif header is None or len(rec) < len(header) // 2:
            if header is not None and rows:  # a title line starts the next kernel's table
                yield title, header, rows
                header, rows = None, []
            title = line.strip()[:160]
        else:
            rows.append(rec)
    if header is not None and rows:
        yield title, header, rows


def col(header, *names):
    for n in names:
        for i, h in enumerate(header):
            if n.lower() in h.lower():
                return i
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    text = open(a.csv, errors="replace").read()
    for title, header, rows in tables(text):
        src = col(header, "Source")
        samp = col(header, "Warp Stall Sampling (All", "Sampling Data (All", "stall_sampling")
        nis = col(header, "Not-issued", "Not Issued")
        ex = col(header, "Instructions Executed")
        if src is None or samp is None:
            print(f"[{title}] columns not found: {header[:12]}")
            continue
        total = sum(_num(r[samp]) for r in rows) or 1.0
        print(f"== {title}\n{len(rows)} SASS lines, {total:.0f} stall samples")
        by_op = collections.Counter()
        count_op = collections.Counter()
        for r in rows:
            op = r[src].strip().split(" ")[0] if r[src].strip() else "?"
            if op.startswith("@"):
                op = r[src].strip().split(" ")[1]
            op = op.split(".")[0]
            by_op[op] += _num(r[samp])
            count_op[op] += _num(r[ex]) if ex is not None else 1
        print("opcode           samples%   executed")
        for op, s in by_op.most_common(25):
            print(f"{op:16s} {100 * s / total:7.2f}   {count_op[op]:.3g}")
        print("hottest lines (samples%, not-issued%, executed, sass):")
        for r in sorted(rows, key=lambda r: -_num(r[samp]))[: a.top]:
            ni = f"{100 * _num(r[nis]) / total:6.2f}" if nis is not None else "   -  "
            e = f"{_num(r[ex]):.3g}" if ex is not None else "-"
            print(f"{100 * _num(r[samp]) / total:6.2f} {ni} {e:>9s}  {r[0]}  {r[src].strip()[:90]}")


if __name__ == "__main__":
    main()
