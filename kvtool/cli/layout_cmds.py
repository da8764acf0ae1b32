"""`kvtool convert` (move a cache's bytes between engine layouts) and `kvtool layouts` (the presets and byte maps)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtool.cli.root import app
from kvtool.cli.common import JsonOpt, OutOpt, Table, emit, examples, handle_errors, line, note, print_table, warn

__all__ = ["GeometryOpt", "convert", "layouts"]

GeometryOpt = Annotated[Optional[str], typer.Option(
    "--geometry", help="Input geometry KEY=VAL[,KEY=VAL...]: format, page, heads, dim, tokens, tensor_scale, outer "
                       "(missing keys: file metadata, then the preset, then heads=1, dim=128, whole pages).")]
G = "format=mxfp4,page=128,heads=2,dim=128,tokens=256"


@app.command("convert", epilog=examples(
    f"kvtool convert fixtures/vllm_mxfp4_k.bin -o /tmp/k.planes.safetensors --from-layout vllm-mxfp4-page "
    f"--to-layout planes --geometry {G}",
    "kvtool convert /tmp/k_mxfp4.safetensors -o /tmp/k.vllm.bin --from-layout planes --to-layout vllm-mxfp4-page "
    "--include 'layers.0.k'",
    "kvtool convert /tmp/k_mxfp4.safetensors -o /tmp/all.vllm.safetensors --from-layout planes "
    "--to-layout vllm-mxfp4-page --json",
    "kvtool convert kv.safetensors -o trt.bin --from-layout vllm-nvfp4-kv --to-layout trtllm-nvfp4-kv"))
@handle_errors
def convert(
    input: Annotated[Path, typer.Argument(metavar="INPUT", help="Engine dump: raw .bin, .pt or .safetensors.",
                                          show_default=False)],
    output: OutOpt,
    from_layout: Annotated[str, typer.Option("--from-layout", help="Layout of the input (a preset: see "
                                                                   "'kvtool layouts').")],
    to_layout: Annotated[str, typer.Option("--to-layout", help="Layout to write (a preset: see 'kvtool layouts').")],
    geometry: GeometryOpt = None,
    to_geometry: Annotated[Optional[str], typer.Option(
        "--to-geometry", help="Output page size, page=N (default: the target preset's).")] = None,
    include: Annotated[Optional[list[str]], typer.Option(
        "--include", metavar="GLOB", help="Only tensors whose name matches this glob (fnmatch; repeatable). A raw .bin "
                                          "output holds one cache: pick it here.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", metavar="GLOB", help="Leave out tensors whose name matches this glob (repeatable).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Move a quantized cache's bytes between engine layouts.

    The format is unchanged. A kvtool cache file read as `planes` brings every tensor's own format, shape and scales
    (plain passthrough tensors are skipped with a note). A raw .bin output holds one cache; a .safetensors output
    holds each tensor's engine buffers as NAME.BUFFER (read back with --layout), and `planes` as .safetensors is a
    kvtool cache file."""
    from kvtool.layouts.workflows import convert_layout

    report = convert_layout(input, output, from_layout, to_layout, geometry, to_geometry, include, exclude)
    for text in report.notes:
        note(text)
    warn(report.warnings)
    emit(report, as_json, _render_convert)


def _render_convert(report) -> None:
    table = Table(f"convert {report.from_layout} -> {report.to_layout} ({report.format})")
    for column in ("", "file", "layout", "pages x page", "bytes"):
        table.column(column, justify="right" if column == "bytes" else "left")
    for side, path, layout, geo, nbytes in (
            ("in", report.input, report.from_layout, report.geometry_in, report.input_bytes),
            ("out", report.output, report.to_layout, report.geometry_out, report.output_bytes)):
        table.row(side, path, layout, f"{geo['pages']} x {geo['page']}", f"{nbytes:,}")
    print_table(table)
    for item in report.items:
        gi, go = item.geometry_in, item.geometry_out
        line(f"{item.name}: {item.format} {item.shape}, tokens={gi['tokens']}, heads={gi['heads']}, "
             f"dim={gi['dim']}: {gi['pages']} x {gi['page']} -> {go['pages']} x {go['page']}")


@app.command("layouts", epilog=examples("kvtool layouts", "kvtool layouts --format fp8-token --heads 4 --json"))
@handle_errors
def layouts(
    dim: Annotated[int, typer.Option("--dim", help="Head dim the byte maps are drawn for.")] = 128,
    heads: Annotated[int, typer.Option("--heads", help="Heads counted in the bytes per page.")] = 1,
    fmt: Annotated[Optional[str], typer.Option("--format", help="Draw maps for this format where the preset "
                                                                "holds it (default: the preset's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the engine layout presets and their byte maps.

    Per preset: the formats and tensors it holds, its page size (P tokens), the byte map of one page at head dim
    --dim, and the page bytes at --heads heads (H)."""
    from kvtool.layouts.workflows import list_layouts

    emit(list_layouts(dim, heads, fmt), as_json, _render_layouts)


def _fit_map(text: str, limit: int) -> list[str]:
    """A byte map `name: [a][b][c]` broken between its brackets (never inside one) to fit `limit` columns."""
    if len(text) <= limit or "][" not in text:
        return [text]
    pieces = text.replace("][", "]\0[").split("\0")
    out = [pieces[0]]
    for piece in pieces[1:]:
        if len(out[-1]) + len(piece) > limit:
            out.append("  " + piece)
        else:
            out[-1] += piece
    return out


def _render_layouts(report) -> None:
    from kvtool.cli.render import width

    limit = width() - 14  # the records layout's value column
    table = Table(f"layout presets: byte maps per page (P tokens, H heads) at D = {report.dim}; page bytes at "
                  f"H = {report.heads}", records=True)
    for column in ("name", "holds", "tensors", "page", "page bytes", "byte map", "note", "source"):
        table.column(column, wrap=column in ("note", "source"))
    for row in report.presets:
        maps = [piece for name, m in row.byte_map.items() for piece in _fit_map(f"{name}: {m}", limit)]
        for name, formula in row.rules.items():  # a long formula continues at its "(off = ...)" part
            rule = f"{name}: {formula}"
            head, sep, tail = rule.partition(" (")
            maps += [rule] if len(rule) <= limit or not sep else [head, f"  ({tail}"]
        page = f"{row.page_size}" + (" (fixed)" if row.page_fixed else "")
        table.row(row.name, "/".join(row.families), "/".join(row.tensors), page, f"{row.page_bytes:,}",
                  "\n".join([f"(drawn for {row.format})"] + maps), row.note, row.source)
    print_table(table)
