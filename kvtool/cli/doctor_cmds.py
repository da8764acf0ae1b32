"""`kvtool doctor FILE`: explain a broken cache. Calls kvtool.doctor.examine and renders its findings.

Exit codes: 0 no error finding (warnings / info only); 1 at least one error finding; 2 bad input (one line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtool.cli.root import app
from kvtool.cli.common import JsonOpt, Table, examples, handle_errors, line, print_table, to_json

__all__ = ["FIX", "SEVERITY_STYLE", "doctor", "findings_json"]

FIX = "fixtures/synthetic_cache.safetensors"
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def findings_json(report) -> dict:
    """The stable JSON of a report: path, kind, ok, tensors and the findings list (each: code, severity, tensor,
    layer, head, message, fix, evidence), plus the candidate rankings."""
    return {"path": report.path, "kind": report.kind, "reference": report.reference, "ok": report.ok,
            "errors": len(report.errors), "warnings": len(report.warnings), "tensors": report.tensors,
            "findings": [{"code": f.code, "severity": f.severity, "tensor": f.tensor, "layer": f.layer,
                          "head": f.head, "message": f.message, "fix": f.fix, "evidence": f.evidence}
                         for f in report.findings],
            "candidates": {topic: [{"what": c.what, "score": c.score} for c in fits]
                           for topic, fits in report.candidates.items()}}


@app.command("doctor", epilog=examples(
    f"kvtool doctor {FIX}",
    "kvtool doctor fixtures/vllm_mxfp4_k.bin --layout vllm-mxfp4-page --geometry format=mxfp4,page=32",
    "kvtool doctor /tmp/mi300_k.pt --reference fixtures/synthetic_cache.safetensors --json",
    "kvtool doctor /tmp/k.safetensors --fp8-element fnuz  (the reader is an MI300: E4M3FNUZ)",
    "kvtool doctor /tmp/topk.pt --topk-block 128 --topk-order ascending"))
@handle_errors
def doctor(path: Annotated[Path, typer.Argument(metavar="PATH",
                                                help="The cache: kvtool file, safetensors, .pt, .npy, or an engine "
                                                     "dump with --layout.", show_default=False)],
           layout: Annotated[Optional[str], typer.Option("--layout", help="Engine dump layout (kvtool layouts).")]
           = None,
           geometry: Annotated[Optional[str], typer.Option("--geometry", help="Layout geometry KEY=VAL,... (format, "
                                                           "page, heads, dim, tokens); missing keys are ranked.")]
           = None,
           reference: Annotated[Optional[Path], typer.Option("--reference", help="The original (unquantized) cache, "
                                                             "or the engine's expected output: pins down the "
                                                             "transformation that made the dump.")] = None,
           reference_layout: Annotated[Optional[str], typer.Option("--reference-layout",
                                                                   help="Layout of the reference, if a dump.")] = None,
           reference_geometry: Annotated[Optional[str], typer.Option("--reference-geometry",
                                                                     help="Geometry of the reference dump.")] = None,
           fp8_element: Annotated[str, typer.Option("--fp8-element", help="How the reader decodes fp8 bytes: fn "
                                                    "(E4M3FN) or fnuz (E4M3FNUZ, MI300).")] = "fn",
           topk_order: Annotated[str, typer.Option("--topk-order", help="What the top-k consumer needs: "
                                                   "ascending|descending|any.")] = "ascending",
           topk_block: Annotated[int, typer.Option("--topk-block", help="Tokens per index block (causal range "
                                                   "of top-k ids).")] = 128,
           page: Annotated[int, typer.Option("--page", help="Tokens per page for the stale-page check when no "
                                             "geometry gives one.")] = 16,
           include: Annotated[Optional[list[str]], typer.Option("--include", metavar="GLOB",
                                                                help="Only tensors matching this glob "
                                                                "(repeatable).")] = None,
           exclude: Annotated[Optional[list[str]], typer.Option("--exclude", metavar="GLOB",
                                                                help="Skip tensors matching this glob "
                                                                "(repeatable).")] = None,
           as_json: JsonOpt = False) -> None:
    """Explain a broken cache from its bytes.

    Every known failure is tested (FNUZ read as FN, fp16/bf16 mix-up, unit-scale fallback,
    MX scale rule, nibble order, geometry, K/V swap, misaligned scales, top-k contract, stale pages, NaN codes,
    clipping / flush-to-zero) from the bytes, and with --reference find the transformation that made the dump.
    Exit 1 when any finding is an error."""
    from kvtool.doctor import examine

    report = examine(path, layout=layout, geometry=geometry, reference=reference, reference_layout=reference_layout,
                     reference_geometry=reference_geometry, fp8_element=fp8_element, topk_order=topk_order,
                     topk_block=topk_block, page=page, include=include, exclude=exclude)
    if as_json:
        print(to_json(findings_json(report)))
    else:
        _render(report)
    if not report.ok:
        raise typer.Exit(1)


def _evidence(ev: dict) -> str:
    keys = [k for k in ev if k not in ("ranking", "expected", "declared_detail", "rule_rates_gaussian",
                                       "rule_rates_requantized", "per_head_pct", "block_max_histogram")]
    parts = []
    for k in keys[:3]:
        v = ev[k]
        text = str(v) if not isinstance(v, float) else f"{v:.4g}"
        parts.append(f"{k}={text[:40]}")
    return " ".join(parts)


def _render(r) -> None:
    title = f"doctor {r.path}: {r.kind}, {len(r.tensors)} tensors" + (f", reference {r.reference}" if r.reference
                                                                        else "")
    table = Table(title, legend="every finding's numbers: kvtool doctor --json")
    table.column("severity").column("code").column("tensor").column("layer", justify="right")
    table.column("head", justify="right").column("evidence", optional=True)
    for f in r.findings:
        table.row(f.severity, f.code, f.tensor, f.layer, f.head, _evidence(f.evidence),
                  style=SEVERITY_STYLE.get(f.severity))
    if r.findings:
        print_table(table)
    for f in r.findings:
        line(f"{f.code} ({f.tensor}): {f.message}")
        if f.fix:
            line(f"  fix: {f.fix}")
    fits = r.candidates.get("geometry") or []
    if fits:
        line("geometry candidates (lower score = more plausible): " +
             "; ".join(f"{c.what} {c.score:g}" for c in fits[:3]))
    errors, warnings = len(r.errors), len(r.warnings)
    line(f"{errors} error(s), {warnings} warning(s)" if r.findings else
         f"no finding in {len(r.tensors)} tensors: the cache looks clean")
