"""`kvtool verify-attn`: the sparse-attention kernel over quantized paged K/V against the dequantized reference and
the bf16 original, per layer and overall, formats side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from kvtool.cli.root import app
from kvtool.cli.common import DeviceOpt, JsonOpt, emit, examples, handle_errors, lazy_module, line, stderr, stdout
from kvtool.errors import InputError

__all__ = ["DEFAULT_TOLERANCE", "EPILOG", "FORMATS_DEFAULT", "va", "verify_attn_cmd"]

va = lazy_module("kvtool.workflows.verify_attn")  # torch-heavy: imported on first use, not for --help
DEFAULT_TOLERANCE = 2e-3  # kvtool.workflows.verify_attn.DEFAULT_TOLERANCE (a test checks they agree)

EPILOG = examples(
    "kvtool verify-attn --synthetic --device cuda --formats nvfp4,mxfp4,fp8-token,bf16",
    "kvtool verify-attn --synthetic --batch 8 --context-lens 1,127,128,129,4097,32768,65536,150000 --device cuda",
    "kvtool verify-attn --synthetic --batch 128 --device cuda --formats nvfp4,mxfp4 --kernel gluon  (the fast path)",
    "kvtool verify-attn m3.safetensors --formats nvfp4,nvfp4-rcp-auto,mxfp4-floor --layers 3-5 --device cuda",
    "TRITON_INTERPRET=1 kvtool verify-attn --synthetic --batch 2 --context-lens 300 --formats nvfp4  (kernel on CPU)",
    "kvtool verify-attn --synthetic --impl vllm --formats bf16,fp8,fp8-token --device cuda  (vLLM's kernel beside)",
    "kvtool verify-attn fixtures/smollm2_capture.safetensors --impl vllm --block-size 128 --device cuda",
)

FORMATS_DEFAULT = "nvfp4,mxfp4,fp8-token,fp8,bf16"


@app.command("verify-attn", epilog=EPILOG)
@handle_errors
def verify_attn_cmd(
    file: Annotated[Optional[Path], typer.Argument(metavar="FILE", help="A capture file (kvtool capture).")] = None,
    synthetic: Annotated[bool, typer.Option("--synthetic", help="One synthetic decode step at M3's TP4 shape "
                                                                "instead of a file.")] = False,
    formats: Annotated[str, typer.Option("--formats", help="Comma-separated formats or labels (nvfp4-rcp-auto, "
                                                           "mxfp4-floor, fp8-token, ...).")] = FORMATS_DEFAULT,
    layers: Annotated[Optional[str], typer.Option("--layers", help="File: layers to check (0-3, 0,5, all).")] = None,
    max_queries: Annotated[int, typer.Option("--max-queries", help="File: query positions per layer (evenly "
                                                                   "spaced, with the last; 0 = all).")] = 256,
    page_size: Annotated[Optional[int], typer.Option("--page-size", help="File: page size (default: the block "
                                                                         "size).")] = None,
    block_size: Annotated[Optional[int], typer.Option("--block-size", help="File: sparse block size of the "
                                                                           "selection (default: the file's).")] = None,
    topk: Annotated[Optional[int], typer.Option("--topk", help="File: blocks per query (default: the file's).")] = None,
    impl: Annotated[Optional[str], typer.Option("--impl", help="Engine implementations to run beside kvtool's kernel "
                                                               "(vllm, or module:function; comma separated).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Synthetic: requests in the step.")] = 4,
    context_lens: Annotated[Optional[str], typer.Option("--context-lens", help="Synthetic: one length for all or "
                                                        "one per request (default: random in [1, 8192]).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic data and page shuffles.")] = 0,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Max max_rel against the dequantized "
                                                                 "reference.")] = DEFAULT_TOLERANCE,
    backend: Annotated[str, typer.Option("--backend", help="auto | triton | torch (auto: Triton on cuda, and on "
                                                           "cpu under TRITON_INTERPRET=1).")] = "auto",
    kernel: Annotated[str, typer.Option("--kernel", help="Synthetic (decode kernel): auto | portable | gluon (auto: "
                                                         "the NVIDIA Gluon fast path where the default launch takes "
                                                         "it; gluon: require it).")] = "auto",
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """Check the sparse-attention kernels against the references.

    Runs sparse attention on quantized paged K/V (kvtool's kernel, and --impl engine kernels beside it) and compares
    with (a) the reference on the DEQUANTIZED cache (kernel accuracy: exit 1 when max_rel exceeds --tolerance) and
    (b) the reference on the bf16 original (what the format costs). Files: every captured layer, selections from the
    reference indexer. --synthetic: M3 TP4 decode."""
    from kvtool.backend import resolve_device
    if synthetic == (file is not None):
        raise InputError("give either a capture FILE or --synthetic (not both)")
    names = [f.strip() for f in formats.split(",") if f.strip()]
    if not names:
        raise InputError("--formats needs at least one format")
    dev = str(resolve_device(device))
    progress = (lambda msg: stderr.print(msg, style="dim", markup=False, highlight=False))  # text, not markup
    impls = [i.strip() for i in (impl or "").split(",") if i.strip()]
    if synthetic:
        report = va.verify_attn_synthetic(names, batch=batch, context_lens=context_lens, seed=seed, device=dev,
                                          backend=backend, tolerance=tolerance, kernel=kernel, progress=progress,
                                          impls=impls)
    else:
        from kvtool.workflows.capture import parse_layers

        report = va.verify_attn_file(file, names, layers=parse_layers(layers), max_queries=max_queries,
                                     page_size=page_size, seed=seed, device=dev, backend=backend,
                                     tolerance=tolerance, kernel=kernel, progress=progress, impls=impls,
                                     block_size=block_size, topk=topk)
    emit(report, as_json, _render)
    if not report.passed:
        raise typer.Exit(1)


def _render(r) -> None:
    geo = ", ".join(f"{k} {v}" for k, v in r.geometry.items() if k != "context_lens")
    # Compact enough for 80 columns: the JSON report also has max_abs and cosine of (a).
    table = Table(title=Text(f"verify-attn: {r.source} — {r.backend} on {r.device}"), caption=geo,
                  box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=(0, 0), collapse_padding=True)
    for col in ("layer", "format", "impl", "q", "a\nrel_l2", "a\nmax_rel", "a bf16\nmax_rel", "b\nrel_l2",
                "b\nmax_rel", "b\ncos", "verdict"):
        text = col in ("layer", "format", "impl", "verdict")
        table.add_column(col, justify="left" if text else "right", no_wrap=col != "verdict", overflow="fold",
                         min_width=None if text or col == "q" else 7)
    several = len({row.layer for row in r.layers}) > 1
    for i, row in enumerate(r.layers + (r.overall if several else [])):
        if i == len(r.layers):
            table.add_section()  # the overall rows, over every layer
        a, b = row.vs_dequant, row.vs_original
        if a is None:  # skipped: the reason instead of numbers
            table.add_row(Text(row.layer), row.format, row.impl, str(row.queries), *["-"] * 6, row.verdict, style="dim")
            continue
        verdict = "[green]PASS[/green]" if row.verdict == "PASS" else f"[red]FAIL (> {row.tolerance:.2g})[/red]" \
            if not row.passed else "[yellow]SKIPPED: no kernel ran[/yellow]"  # the reference compared with itself
        table.add_row(Text(row.layer), row.format, row.impl, str(row.queries), f"{a.rel_l2:.1e}", f"{a.max_rel:.1e}",
                      f"{row.bf16_out_max_rel:.1e}", f"{b.rel_l2:.3f}", f"{b.max_rel:.3f}", f"{b.cosine:.4f}",
                      verdict)
    stdout.print(table)  # a rich Table: laid out by kvtool.cli.render
    if "context_lens" in r.geometry:
        line(f"context lengths: {r.geometry['context_lens']}")
    ran = {row.format: row.kernel for row in r.layers if row.kernel and row.impl == "kvtool"}
    if ran:
        line("kernel: " + ", ".join(f"{fmt} {k}" for fmt, k in ran.items()))
    line(f"selection: {r.selection}. a = kernel (fp32 out) vs the reference on the dequantized cache (goal "
                 f"max_rel <= {r.tolerance:g}); a bf16 = a's max_rel with the bf16 output rounding; b = vs the "
                 f"reference on the bf16 original; q = queries")
    for spec in r.impls:
        line(f"impl {spec} (held to the tolerance + 2^-8 when its output path is bf16)")
    for note in r.notes:
        line(f"note: {note}")
    if r.verdict.startswith("SKIPPED"):
        line(r.verdict, style="yellow")
    else:
        line("PASS" if r.passed else "FAIL: kernel beyond accumulation noise", style="green" if r.passed else "red")
