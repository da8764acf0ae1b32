"""`kvtool convert` (move a cache's bytes between engine layouts) and `kvtool layouts` (the presets and byte maps)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from kvtool.cli import app
from kvtool.cli.common import JsonOpt, OutOpt, emit, handle_errors, stdout
from kvtool.layouts.presets import PRESETS
from kvtool.layouts.workflows import ConvertReport, LayoutsReport, convert_layout, list_layouts

_NAMES = "|".join(PRESETS)
GeometryOpt = Annotated[Optional[str], typer.Option(
    "--geometry", help="Input geometry KEY=VAL[,KEY=VAL...]: format, page, heads, dim, tokens, tensor_scale, outer "
                       "(missing keys: file metadata, then the preset, then heads=1, dim=128, whole pages).")]

CONVERT_EXAMPLES = """Examples:

  kvtool convert fixtures/vllm_mxfp4_k.bin -o /tmp/k.planes.safetensors --from-layout vllm-mxfp4-page
  --to-layout planes --geometry format=mxfp4,page=128,heads=2,dim=128,tokens=256

  kvtool convert /tmp/k_mxfp4.safetensors -o /tmp/k.vllm.bin --from-layout planes --to-layout vllm-mxfp4-page
  --include 'layers.0.k'

  kvtool convert /tmp/k_mxfp4.safetensors -o /tmp/all.vllm.safetensors --from-layout planes
  --to-layout vllm-mxfp4-page --json

  kvtool convert kv.safetensors -o trt.bin --from-layout vllm-nvfp4-kv --to-layout trtllm-nvfp4-kv
"""


@app.command("convert", epilog=CONVERT_EXAMPLES)
@handle_errors
def convert(
    input: Annotated[Path, typer.Argument(help="Engine dump: raw .bin, .pt or .safetensors.")],
    output: OutOpt,
    from_layout: Annotated[str, typer.Option("--from-layout", help=f"Layout of the input ({_NAMES}).")],
    to_layout: Annotated[str, typer.Option("--to-layout", help=f"Layout to write ({_NAMES}).")],
    geometry: GeometryOpt = None,
    to_geometry: Annotated[Optional[str], typer.Option(
        "--to-geometry", help="Output page size, page=N (default: the target preset's).")] = None,
    include: Annotated[Optional[list[str]], typer.Option(
        "--include", help="Only tensors whose name matches this glob (fnmatch; repeatable). A raw .bin output "
                          "holds one cache: pick it here.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", help="Leave out tensors whose name matches this glob (repeatable).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Move a quantized cache's bytes from one engine layout to another (the format is unchanged).

    A kvtool cache file read as `planes` brings every tensor's own format, shape and scales (plain passthrough
    tensors are skipped with a note). A raw .bin output holds one cache; a .safetensors output holds each tensor's
    engine buffers as NAME.BUFFER (read back with --layout), and `planes` as .safetensors is a kvtool cache file."""
    report = convert_layout(input, output, from_layout, to_layout, geometry, to_geometry, include, exclude)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    emit(report, as_json, _render_convert)


def _render_convert(report: ConvertReport) -> None:
    table = Table(title=f"convert {report.from_layout} -> {report.to_layout} ({report.format})")
    for column in ("", "file", "layout", "pages x page", "bytes"):
        table.add_column(column)
    for side, path, layout, geo, nbytes in (
            ("in", report.input, report.from_layout, report.geometry_in, report.input_bytes),
            ("out", report.output, report.to_layout, report.geometry_out, report.output_bytes)):
        table.add_row(side, Text(path), layout, f"{geo['pages']} x {geo['page']}", f"{nbytes:,}")
    stdout.print(table)
    for item in report.items:
        gi, go = item.geometry_in, item.geometry_out
        stdout.print(Text(f"{item.name}: {item.format} {item.shape}, tokens={gi['tokens']}, heads={gi['heads']}, "
                          f"dim={gi['dim']}: {gi['pages']} x {gi['page']} -> {go['pages']} x {go['page']}"))


LAYOUTS_EXAMPLES = """Examples:

  kvtool layouts

  kvtool layouts --format fp8-token --heads 4 --json
"""


@app.command("layouts", epilog=LAYOUTS_EXAMPLES)
@handle_errors
def layouts(
    dim: Annotated[int, typer.Option("--dim", help="Head dim the byte maps are drawn for.")] = 128,
    heads: Annotated[int, typer.Option("--heads", help="Heads counted in the bytes per page.")] = 1,
    fmt: Annotated[Optional[str], typer.Option("--format", help="Draw maps for this format where the preset "
                                                                "holds it (default: the preset's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the engine layout presets with their byte maps (per page, P tokens, H heads)."""
    emit(list_layouts(dim, heads, fmt), as_json, _render_layouts)


def _render_layouts(report: LayoutsReport) -> None:
    table = Table(title=f"layout presets (byte maps per page at D = {report.dim}; bytes at H = {report.heads})",
                  show_lines=True)
    for column in ("name", "holds", "tensors", "page", "byte map per page", "page bytes"):
        table.add_column(column, overflow="fold")
    for row in report.presets:
        maps = "\n".join(f"{name}: {m}" for name, m in row.byte_map.items())
        maps += "".join(f"\n{name}: {formula}" for name, formula in row.rules.items())
        page = f"{row.page_size}" + (" (fixed)" if row.page_fixed else "")
        table.add_row(row.name, "/".join(row.families), "/".join(row.tensors), page,
                      Text(f"({row.format})\n{maps}"), f"{row.page_bytes:,}")
    stdout.print(table)
    for row in report.presets:
        stdout.print(Text(f"{row.name}: {row.note}. Source: {row.source}"))
