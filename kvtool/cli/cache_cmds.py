"""`kvtool quantize | dequantize | inspect | diff`: the cache-file commands. Each parses options, calls one workflow
(kvtool.workflows.cache_ops / inspect / diff) and renders its report with rich, or prints it as JSON (`--json`).

Exit codes: 0 ok; 1 a check failed (diff thresholds or differing tensor sets, inspect --verify checksum mismatch);
2 bad input or options (one line on stderr, no output file); 3 an internal error.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from kvtool.cli.root import app
from kvtool.cli.common import (
    DeviceOpt,
    FormatOpt,
    Fp8ScaleOpt,
    JsonOpt,
    OuterScaleOpt,
    OutOpt,
    RecipeOfDumpOpt,
    RecipeOfOpt,
    RecipeOpt,
    ScaleRuleOpt,
    Table,
    emit,
    examples,
    format_options,
    geometry_with_recipe,
    handle_errors,
    hint,
    line,
    print_table,
    progress,
    warn,
)

__all__ = ["ChunkOpt", "CopyExcludeOpt", "ExcludeOpt", "GeometryOpt", "InArg", "IncludeOpt", "LayoutOpt", "VerifyOpt",
           "dequantize", "diff", "inspect", "quantize"]

FIX = "fixtures/synthetic_cache.safetensors"

InArg = Annotated[Path, typer.Argument(
    metavar="INPUT", help="Input: kvtool cache, safetensors, .pt (weights_only) or .npy file.", show_default=False)]
IncludeOpt = Annotated[Optional[list[str]], typer.Option(
    "--include", metavar="GLOB", help="Only tensors whose name matches this glob (fnmatch; repeatable).")]
CopyExcludeOpt = Annotated[Optional[list[str]], typer.Option(
    "--exclude", metavar="GLOB", help="Leave tensors whose name matches this glob as they are: copied unchanged into "
                                      "the output (repeatable).")]
ExcludeOpt = Annotated[Optional[list[str]], typer.Option(
    "--exclude", metavar="GLOB", help="Skip tensors whose name matches this glob (repeatable).")]
ChunkOpt = Annotated[float, typer.Option(
    "--chunk-mb", metavar="MIB", help="Row-block size in MiB of fp32 working data: peak memory follows it, not the "
                                      "file size.")]
LayoutOpt = Annotated[Optional[str], typer.Option(
    "--layout", metavar="NAME", help="Engine dump layout of the input, e.g. vllm-mxfp4-page (see 'kvtool layouts').")]
GeometryOpt = Annotated[Optional[str], typer.Option(
    "--geometry", metavar="K=V,...", help="Layout geometry KEY=VAL[,KEY=VAL...] (keys format, page, heads, dim, "
                                          "tokens, tensor_scale, outer), e.g. "
                                          "format=mxfp4,page=128,heads=2,dim=128,tokens=256.")]
VerifyOpt = Annotated[bool, typer.Option("--verify/--no-verify", help="Check the input's checksums and decoded "
                                         "scale codes as it is read (exit 2 on a mismatch or a NaN/Inf code); "
                                         "--no-verify trusts it (faster).")]
LAYOUT_GEO = "--layout vllm-mxfp4-page --geometry format=mxfp4,page=128,heads=2,dim=128,tokens=256"


@contextlib.contextmanager
def _sigterm_cleans() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while writing, so the temporary output file is removed on `kill`."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _shape(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


# ------------------------------------------------------------------------------------------------ quantize
@app.command("quantize", epilog=examples(
    f"kvtool quantize {FIX} -o /tmp/k_mxfp4.safetensors --to mxfp4",
    f"kvtool quantize {FIX} -o /tmp/k_nvfp4.safetensors --to nvfp4 --recipe div --outer-scale auto",
    f"kvtool quantize {FIX} -o /tmp/idx_fp8.safetensors --to fp8 --fp8-scale token --include '*.index_k'",
    f"kvtool quantize {FIX} -o /tmp/k_floor.safetensors --to mxfp4-floor --exclude '*.v' --json",
    f"kvtool quantize {FIX} -o /tmp/k_vllm.safetensors --to nvfp4 --recipe-of vllm.ref_nvfp4 --outer-scale auto"))
@handle_errors
def quantize(src: InArg, output: OutOpt, to: FormatOpt, scale_rule: ScaleRuleOpt = None, recipe: RecipeOpt = None,
             outer_scale: OuterScaleOpt = None, fp8_scale: Fp8ScaleOpt = None, recipe_of: RecipeOfOpt = None,
             include: IncludeOpt = None,
             exclude: CopyExcludeOpt = None, device: DeviceOpt = "cpu", chunk_mb: ChunkOpt = 64.0,
             layout: LayoutOpt = None, geometry: GeometryOpt = None, verify: VerifyOpt = True,
             as_json: JsonOpt = False) -> None:
    """Quantize a cache file into a kvtool cache file.

    Each selected floating tensor is quantized along its last dimension; the others are copied unchanged. An input
    that is already quantized is decoded to fp32 first (a hint says so): the errors then compound."""
    from kvtool.workflows.cache_ops import quantize_file

    with _sigterm_cleans(), progress("quantize") as tick:
        options = format_options(scale_rule, recipe, outer_scale, fp8_scale, recipe_of)
        report = quantize_file(src, output, to, options=options,
                               include=include, exclude=exclude, device=device, chunk_mb=chunk_mb, layout=layout,
                               geometry=geometry, progress=tick, hint=hint, verify=verify)
    emit(report, as_json, _render_ops)


# ------------------------------------------------------------------------------------------------ dequantize
@app.command("dequantize", epilog=examples(
    "kvtool dequantize /tmp/k_mxfp4.safetensors -o /tmp/k_back.safetensors",
    "kvtool dequantize /tmp/k_nvfp4.safetensors -o /tmp/k_fp32.safetensors --dtype fp32 --json",
    f"kvtool dequantize fixtures/vllm_mxfp4_k.bin -o /tmp/k_dump.safetensors {LAYOUT_GEO}"))
@handle_errors
def dequantize(src: InArg, output: OutOpt,
               dtype: Annotated[Optional[str], typer.Option(
                   "--dtype", help="Output dtype bf16|fp16|fp32 (default: each tensor's original dtype, bf16 when "
                                   "unknown).")] = None,
               device: DeviceOpt = "cpu", chunk_mb: ChunkOpt = 64.0, layout: LayoutOpt = None,
               geometry: GeometryOpt = None, recipe_of: RecipeOfDumpOpt = None, verify: VerifyOpt = True,
               as_json: JsonOpt = False) -> None:
    """Decode a kvtool cache file into plain safetensors.

    The output has the original tensor names and shapes. An engine dump is read with --layout and --geometry."""
    from kvtool.workflows.cache_ops import dequantize_file

    with _sigterm_cleans(), progress("dequantize") as tick:
        report = dequantize_file(src, output, dtype=dtype, device=device, chunk_mb=chunk_mb, layout=layout,
                                 geometry=geometry_with_recipe(geometry, recipe_of, layout), progress=tick,
                                 hint=hint, verify=verify)
    emit(report, as_json, _render_ops)


def _render_ops(r) -> None:
    table = Table(f"{r.command} {r.input} -> {r.output}" + (f" ({r.format})" if r.format else ""),
                  legend="B/token: bytes per token per head (a row of D elements: payload + scales); x vs bf16: "
                         "compression against bf16")
    for col in ("tensor", "action", "format", "shape", "in", "out", "B/token", "x vs bf16"):
        table.column(col, justify="right" if col in ("in", "out", "B/token", "x vs bf16") else "left")
    for t in r.tensors:
        table.row(t.name, t.action, t.format, _shape(t.shape), _mib(t.bytes_in), _mib(t.bytes_out),
                  str(t.bytes_per_token), f"{t.compression_vs_bf16:.2f}")
    print_table(table)
    ratio = r.bytes_in / r.bytes_out if r.bytes_out else 0.0
    line(f"wrote {r.output}: {_mib(r.bytes_out)} from {_mib(r.bytes_in)} of input tensor data ({ratio:.2f}x)")


# ------------------------------------------------------------------------------------------------ inspect
@app.command("inspect", epilog=examples(
    f"kvtool inspect {FIX}",
    "kvtool inspect /tmp/k_mxfp4.safetensors --verify",
    "kvtool inspect /tmp/k_nvfp4.safetensors --include 'layers.0.*' --json",
    f"kvtool inspect fixtures/vllm_mxfp4_k.bin {LAYOUT_GEO}"))
@handle_errors
def inspect(path: Annotated[Path, typer.Argument(metavar="FILE", help="A kvtool cache, safetensors, .pt or .npy file.",
                                                 show_default=False)],
            verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Recompute the checksums (default; "
                                                 "exit 1 on a mismatch or a missing record, 2 on a NaN/Inf code; "
                                                 "--no-verify skips both checks).")] = True,
            include: IncludeOpt = None, exclude: ExcludeOpt = None, chunk_mb: ChunkOpt = 64.0,
            layout: LayoutOpt = None, geometry: GeometryOpt = None, recipe_of: RecipeOfDumpOpt = None,
            as_json: JsonOpt = False) -> None:
    """Show what a cache file holds, tensor by tensor.

    Per tensor: format, recipe, shape, bytes per token per head, compression vs bf16, scale statistics (range,
    exponent histogram, saturated and all-zero blocks) and checksum status. Engine dumps (--layout) are checked for
    a plausible geometry: warnings on stderr and in the JSON `warnings` (the exit code stays 0)."""
    with progress("inspect") as tick:
        report = _inspect(path, verify=verify, include=include, exclude=exclude, chunk_mb=chunk_mb,
                              layout=layout, geometry=geometry_with_recipe(geometry, recipe_of, layout),
                              progress=tick)
    emit(report, as_json, _render_inspect)
    warn(report.warnings)
    if not report.ok:
        raise typer.Exit(1)


def _inspect(path: Path, **kw):
    """inspect_file's report; a plain safetensors or .npy file is read from its header alone, without importing
    torch (kvtool.workflows.inspect_plain; a bad --chunk-mb or a --layout is inspect_file's to handle)."""
    from kvtool.workflows.inspect_plain import plain_report

    if kw["layout"] is None and kw["chunk_mb"] > 0:
        report = plain_report(path, verify=kw["verify"], include=kw["include"], exclude=kw["exclude"],
                              progress=kw["progress"])
        if report is not None:
            return report
    from kvtool.workflows.inspect import inspect_file

    return inspect_file(path, **kw)


INSPECT_LEGEND = "B/token: bytes per token per head (payload + scales); x bf16: compression against bf16"
SCALE_LEGEND = (
    "scale range: smallest nonzero .. largest decoded block scale\n"
    "sat%: blocks at the format's clipping point: mxfp4 and fp8 unit / tensor, blocks (rows) whose largest code is "
    "the element's max (E2M1 6, E4M3 448); nvfp4, blocks whose E4M3 scale is at its max, 448 (its elements reach 6 "
    "by design); '-' where nothing clips (fp8 token, bf16)\n"
    "zero%: all-zero blocks")


def _render_inspect(r) -> None:
    head = f"{r.path}: {r.kind}" + (f", kvtool schema {r.schema} (written by kvtool {r.kvtool_version})"
                                    if r.schema else "") + f", {_mib(r.file_bytes)}"
    scaled = any(t.scales for t in r.tensors)
    table = Table(head, legend=INSPECT_LEGEND + ("\n" + SCALE_LEGEND if scaled else ""))
    for col in ("tensor", "format", "options", "shape", "dtype", "B/token", "x bf16", "scale range", "sat%", "zero%",
                "checksum"):
        table.column(col, justify="right" if col in ("B/token", "x bf16", "sat%", "zero%") else "left",
                     optional=col in ("options", "dtype"))  # both are in the format label / JSON too
    for t in r.tensors:
        s = t.scales
        rng = f"{s.min_nonzero:.3g}..{s.max:.3g}" if s and s.min_nonzero is not None else "-"
        opts = [f"{k}={v}" for k, v in t.options.items() if v not in (False, None)]
        if t.outer_scale not in (None, 1.0):
            opts.append(f"g={t.outer_scale:.4g}")
        if t.tensor_scale is not None:
            opts.append(f"s={t.tensor_scale:.4g}")
        sat = "-" if s is None or s.saturated_pct is None else f"{s.saturated_pct:.2f}"
        table.row(t.name, t.format, " ".join(opts) or "-", _shape(t.shape), t.dtype, str(t.bytes_per_token),
                  f"{t.compression_vs_bf16:.2f}", rng, sat, f"{s.zero_pct:.2f}" if s else "-", t.checksum)
    print_table(table)
    for t in r.tensors:
        if t.scales and t.scales.exponent_histogram:
            hist = " ".join(f"2^{e}:{c}" for e, c in t.scales.exponent_histogram.items())
            line(f"{t.name} scale exponents (2^e: blocks): {hist}")
    if r.verified:
        recorded = any(t.checksum not in ("none", "unverified") for t in r.tensors)
        line("checksums: MISMATCH" if not r.ok else ("checksums: ok" if recorded else "checksums: none recorded"))


# ------------------------------------------------------------------------------------------------ diff
@app.command("diff", epilog=examples(
    f"kvtool diff /tmp/k_mxfp4.safetensors {FIX}",
    f"kvtool diff /tmp/k_mxfp4.safetensors {FIX} --max-rel-l2 0.2 --min-sqnr 15",
    "kvtool diff /tmp/k_floor.safetensors /tmp/k_mxfp4.safetensors --max-scale-mismatch 0 --json",
    f"kvtool diff /tmp/k_nvfp4.safetensors {FIX} --plot /tmp/errors.png",
    f"kvtool diff fixtures/vllm_mxfp4_k.bin /tmp/k_mxfp4.safetensors {LAYOUT_GEO} --pair x=layers.0.k"))
@handle_errors
def diff(a: Annotated[Path, typer.Argument(metavar="A", help="Candidate A (any input kvtool reads).",
                                            show_default=False)],
         b: Annotated[Path, typer.Argument(metavar="B", help="Reference B (e.g. the bf16 original).",
                                            show_default=False)],
         max_rel_l2: Annotated[Optional[float], typer.Option("--max-rel-l2", help="Fail (exit 1) when a tensor's "
                                                             "rel_l2 exceeds this.")] = None,
         max_abs: Annotated[Optional[float], typer.Option("--max-abs", help="Fail when a tensor's max |A - B| "
                                                          "exceeds this.")] = None,
         min_sqnr: Annotated[Optional[float], typer.Option("--min-sqnr", help="Fail when a tensor's SQNR (dB) is "
                                                           "below this.")] = None,
         max_scale_mismatch: Annotated[Optional[float], typer.Option("--max-scale-mismatch", help="Fail when the "
                                                                     "scale-byte disagreement % exceeds this.")] = None,
         include: IncludeOpt = None, exclude: ExcludeOpt = None, chunk_mb: ChunkOpt = 64.0,
         layout: LayoutOpt = None, geometry: GeometryOpt = None, recipe_of: RecipeOfDumpOpt = None,
         layout_b: Annotated[Optional[str], typer.Option("--layout-b", help="Engine dump layout of B.")] = None,
         geometry_b: Annotated[Optional[str], typer.Option("--geometry-b", help="Layout geometry of B.")] = None,
         plot: Annotated[Optional[Path], typer.Option("--plot", help="Write error histograms to this PNG "
                                                      "(needs matplotlib).")] = None,
         pair: Annotated[Optional[list[str]], typer.Option("--pair", metavar="A_NAME=B_NAME",
                                                           help="Compare tensor A_NAME of A with B_NAME of "
                                                           "B, e.g. x=layers.0.k (repeatable; only these pairs are "
                                                           "compared).")] = None,
         verify: VerifyOpt = True, as_json: JsonOpt = False) -> None:
    """Compare candidate A with reference B, tensor by tensor.

    Across formats: value metrics, decoded-value disagreement, and (when bytes are comparable) scale- and
    payload-byte disagreement with a scale-rule diagnosis. The thresholds gate the exit code; without any, the
    verdict is REPORT (exit 0 unless the tensor names or shapes differ)."""
    from kvtool.workflows.diff import diff_files

    with progress("diff") as tick:
        report = diff_files(a, b, max_rel_l2=max_rel_l2, max_abs=max_abs, min_sqnr=min_sqnr,
                            max_scale_mismatch=max_scale_mismatch, include=include, exclude=exclude,
                            chunk_mb=chunk_mb, layout=layout,
                            geometry=geometry_with_recipe(geometry, recipe_of, layout), layout_b=layout_b,
                            geometry_b=geometry_b, plot=plot, pair=pair, progress=tick, verify=verify)
    emit(report, as_json, _render_diff)
    warn(report.warnings)
    if not report.passed:
        raise typer.Exit(1)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.3g}"


DIFF_LEGEND = (
    "SQNR dB: inf when A equals B (null in --json)\n"
    "value / scale / payload !=%: share of decoded values / scale bytes / payload bytes that differ\n"
    "rule: one side plain, 'fits F P%' = the variant F of the quantized side's family that reproduces the most "
    "blocks (P % of them) from the plain values (F other than the declared format: the writer used another rule); "
    "both sides quantized in different declared formats, 'N blocks' = the blocks that rule change accounts for")


def _render_diff(r) -> None:
    table = Table(f"diff A={r.a} vs reference B={r.b}", legend=DIFF_LEGEND)
    for col in ("tensor", "A", "B", "rel_l2", "max_abs", "SQNR dB", "cosine", "value !=%", "scale !=%",
                "payload !=%", "rule", "status"):
        table.column(col, justify="left" if col in ("tensor", "A", "B", "rule", "status") else "right",
                     optional=col in ("cosine", "value !=%", "payload !=%"))  # in --json, and rel_l2 / SQNR say it
    for t in r.tensors:
        m, c = t.metrics, t.codes
        if t.rule_fit:
            best = next(iter(t.rule_fit))
            rule = f"fits {best} {t.rule_fit[best]:.3g}%"
        elif c is not None and c.rule_blocks:
            rule = f"{c.rule_blocks} blocks"
        else:
            rule = "-"
        status = "FAIL" if t.failures else ("ok" if r.verdict != "REPORT" else "-")
        table.row(t.name, t.format_a, t.format_b, f"{m.rel_l2:.4g}", f"{m.max_abs:.4g}", f"{m.sqnr_db:.2f}",
                  f"{m.cosine:.6f}", _pct(t.value_mismatch_pct), _pct(c.scale_mismatch_pct if c else None),
                  _pct(c.payload_mismatch_pct if c else None), rule, status,
                  style="bold red" if t.failures else None)
    print_table(table)
    for failure in r.failures:
        line(f"FAIL {failure}", wrap=False)
    if r.plot:
        line(f"plot: {r.plot}", wrap=False)
    if r.verdict == "REPORT":
        line("REPORT: no threshold given, so nothing was gated (give --max-rel-l2, --max-abs, --min-sqnr or "
             "--max-scale-mismatch for a verdict)")
    else:
        line(r.verdict, style="bold green" if r.verdict == "PASS" else "bold red")
