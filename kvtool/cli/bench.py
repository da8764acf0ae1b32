"""`kvtool bench ...`: one subcommand per benchmark table (codecs, quant, index, attn, decode)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvtool.cli.root import app
from kvtool.cli.common import DeviceOpt, JsonOpt, KvtoolGroup, emit, examples, handle_errors, note, stderr, stdout

__all__ = ["bench_app", "bench_attn", "bench_codecs", "bench_decode", "bench_index", "bench_quant"]

bench_app = typer.Typer(
    cls=KvtoolGroup, rich_markup_mode=None, no_args_is_help=True,
    help="Time kvtool's codecs and kernels beside their peers.\n\nEach benchmark measures the copy bandwidth first, "
         "then prints per case the time, the bytes it must move, the bandwidth and the fraction of the copy "
         "bandwidth, with the goals of the project.",
    epilog=examples("kvtool bench codecs", "kvtool bench quant --device cuda --sizes 64M --json",
                    "kvtool bench decode", "kvtool bench attn --device cuda"))
app.add_typer(bench_app, name="bench", short_help="Time kvtool's codecs and kernels beside their peers.")

# One section per benchmark table; each calls one workflow in kvtool/bench/ and renders its report.


def _progress(name: str) -> None:
    """One stderr line per case as it starts: says what the line is in a log, and prints the name as it is (a case
    name is not rich markup)."""
    stderr.print(f"timing {name}", style="dim", markup=False, highlight=False)


def _emit_bench(report, as_json: bool, render_extra) -> None:
    """Every bench's output: the JSON report, or the case table, the bench's own extra table and any note."""
    from kvtool.bench.common import render_report

    def render(r):
        render_report(r, stdout)
        render_extra(r, stdout)
        if r.extra.get("note"):
            note(r.extra["note"])

    emit(report, as_json, render)


# ------------------------------------------------------------------------------------------------ bench codecs
@bench_app.command("codecs", epilog=examples(
    'kvtool bench codecs',
    'kvtool bench codecs --size 32 --json',
    'kvtool bench codecs --device cuda --size 256',
))
@handle_errors
def bench_codecs(
    size: Annotated[float, typer.Option("--size", help="MB of bf16 input, as rows of 128 elements.")] = 8.0,
    device: Annotated[str, typer.Option("--device", help="Where the torch codecs and peers run (cpu | cuda); the "
                                        "Triton kernels are timed by `kvtool bench quant`.")] = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """Quantize throughput of the torch codecs beside their peers.

    Every torch codec (the bit-exact reference path) beside torchao / torch peers, with the speed-up over each
    peer."""
    from kvtool.bench.codecs import render_speedups, run_codec_bench

    report = run_codec_bench(size_mb=size, device=device, progress=_progress)

    _emit_bench(report, as_json, render_speedups)


# -------------------------------------------------------------------------------------------------- bench attn
@bench_app.command("attn", epilog=examples(
    'kvtool bench attn --device cuda',
    'kvtool bench attn --device cuda --batches 64,256 --formats fp8,nvfp4 --sweep',
    'kvtool bench attn --device cuda --json > attn.json',
    'kvtool bench attn --device cuda --peer vllm --formats bf16,fp8,fp8-token',
))
@handle_errors
def bench_attn(
    batches: Annotated[str, typer.Option("--batches", help="Comma-separated batch sizes.")] = "1,16,64,128,256",
    formats: Annotated[str, typer.Option("--formats", help="Comma-separated formats / labels.")]
    = "bf16,fp8,fp8-token,nvfp4,mxfp4",
    context: Annotated[int, typer.Option("--context", help="Tokens per request (16 of its blocks are read).")] = 8000,
    peers: Annotated[bool, typer.Option("--peers/--no-peers", help="Also time torch eager and SDPA.")] = True,
    peer: Annotated[str, typer.Option("--peer", help="Engine kernels timed beside kvtool's, same data and method "
                                                     "(vllm; comma separated), with the ratio per case.")] = "",
    sweep: Annotated[bool, typer.Option("--sweep", help="Also time launch variants (splits, tile, warps) and "
                                        "fixed-cost probes (0 / 1 / 4 of the 16 blocks).")] = False,
    device: DeviceOpt = "cuda",
    as_json: JsonOpt = False,
) -> None:
    """M3 sparse decode attention per cache format.

    TP4 shape, top-16 x 128-token blocks: the Triton kernel per format beside torch eager and SDPA; CUDA-graph replay
    of several layers back to back, time per step."""
    from kvtool.backend import resolve_device
    from kvtool.bench.attn import render_goals, run_attn_bench
    from kvtool.errors import InputError

    try:
        sizes = [int(b) for b in batches.split(",") if b.strip()]
    except ValueError:
        raise InputError(f"bad --batches {batches!r} (example: 1,16,64,128,256)") from None
    names = tuple(f.strip() for f in formats.split(",") if f.strip())
    if not sizes or min(sizes) < 1 or not names or context < 1:
        raise InputError("--batches, --formats and --context need positive values")
    report = run_attn_bench(sizes, names, context=context, device=str(resolve_device(device)), peers=peers,
                            sweep=sweep, progress=_progress, engines=[x.strip() for x in peer.split(",") if x.strip()])

    _emit_bench(report, as_json, render_goals)


# ------------------------------------------------------------------------------------------------- bench quant
@bench_app.command("quant", epilog=examples(
    'kvtool bench quant --device cuda',
    'kvtool bench quant --device cuda --sizes 64M,1G --formats nvfp4,mxfp4 --json',
    'kvtool bench quant --device cuda --sizes 256M --configs 16x4,64x4,64x8',
    'TRITON_INTERPRET=1 kvtool bench quant --device cpu --sizes 16K --formats mxfp4',
))
@handle_errors
def bench_quant(
    sizes: Annotated[str, typer.Option("--sizes", help="Comma-separated element counts (K/M/G = 2**10/20/30).")]
    = "64M,256M,1G",
    formats: Annotated[str, typer.Option("--formats", help="Comma-separated formats / labels.")]
    = "nvfp4,mxfp4,fp8,fp8-token,bf16",
    heads: Annotated[int, typer.Option("--heads", help="Heads per token (1: the index cache).")] = 1,
    eager: Annotated[bool, typer.Option("--eager/--no-eager", help="Also time the torch eager codec and torchao.")]
    = True,
    configs: Annotated[Optional[str], typer.Option("--configs", help="Extra launch configs ROWSxWARPS to time, "
                                                                     "e.g. 16x4,64x8.")] = None,
    device: DeviceOpt = "cuda",
    as_json: JsonOpt = False,
) -> None:
    """Store and gather-dequantize kernels per format and size.

    Store (quantize-on-write into a paged cache) and gather-dequantize, beside the torch eager codec and torchao;
    fraction of the copy bandwidth and the goals."""
    from kvtool.backend import resolve_device
    from kvtool.bench.quant import parse_configs, parse_sizes, render_goals, run_quant_bench
    from kvtool.errors import InputError

    names = tuple(f.strip() for f in formats.split(",") if f.strip())
    if not names or heads < 1:
        raise InputError("--formats needs at least one format and --heads a positive count")
    report = run_quant_bench(parse_sizes(sizes), names, device=str(resolve_device(device)), heads=heads, eager=eager,
                             configs=parse_configs(configs), progress=_progress)

    _emit_bench(report, as_json, render_goals)


# ------------------------------------------------------------------------------------------------ bench decode
@bench_app.command("decode", epilog=examples(
    'kvtool bench decode  (smollm2, batch 1, 1K context, CPU)',
    'kvtool bench decode --device cuda  (synthetic-m3, 4 layers, batch 64, 32K)',
    'kvtool bench decode --device cuda --kv nvfp4,fp8 --index fp4,fp8 --json',
    'kvtool bench decode --demo  (the default kvtool decode end to end: wall and CPU time, goal <= 30 s)',
))
@handle_errors
def bench_decode(
    model: Annotated[Optional[str], typer.Option("--model", help="Default: smollm2 on cpu, synthetic-m3 on cuda.")]
    = None,
    kv: Annotated[str, typer.Option("--kv", help="Candidate K/V formats, comma separated.")] = "nvfp4",
    index: Annotated[str, typer.Option("--index", help="Candidate index formats, comma separated.")] = "fp4",
    batch: Annotated[Optional[int], typer.Option("--batch", help="Sequences per step (cpu 1, cuda 64).")] = None,
    context: Annotated[Optional[int], typer.Option("--context", help="Tokens in the cache (cpu 1024, cuda 32768).")]
    = None,
    model_layers: Annotated[Optional[int], typer.Option("--model-layers", help="Depth of the synthetic model "
                                                        "(cuda 4).")] = None,
    old_layers: Annotated[Optional[int], typer.Option("--layers", hidden=True, help="Deprecated spelling of "
                                                      "--model-layers.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="auto | torch | triton.")] = "auto",
    device: DeviceOpt = "cpu",
    demo: Annotated[bool, typer.Option("--demo", help="Instead: time the default `kvtool decode` end to end "
                                                      "(wall and CPU time per phase).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """One decode step of the whole model per cache configuration.

    Plain bf16 dense SDPA, bf16 paged sparse and each candidate, as tokens/s with the goals."""
    from kvtool.bench.decode import render_demo, render_goals, run_decode_bench, run_demo_bench

    if demo:
        return _emit_bench(run_demo_bench(device, progress=_progress), as_json, render_demo)
    if old_layers is not None:
        note("--layers is deprecated here: use --model-layers (the model's depth)")
        model_layers = model_layers if model_layers is not None else old_layers
    split = lambda text: tuple(t.strip() for t in text.split(",") if t.strip())  # noqa: E731
    report = run_decode_bench(model, device, split(kv), split(index), batch, context, model_layers, backend,
                              progress=_progress)

    _emit_bench(report, as_json, render_goals)


# ------------------------------------------------------------------------------------------------- bench index
@bench_app.command("index", epilog=examples(
    'kvtool bench index --device cuda',
    "kvtool bench index --device cuda --batches 64 --contexts 150000 --prefill '' --sweep",
    'kvtool bench index --device cuda --formats nvfp4,fp8 --json > index.json',
    'TRITON_INTERPRET=1 kvtool bench index --device cpu --batches 1 --contexts 512 --prefill 256 --formats nvfp4',
    'kvtool bench index --device cuda --peer vllm --formats bf16,fp8',
))
@handle_errors
def bench_index(
    batches: Annotated[str, typer.Option("--batches", help="Comma-separated decode batch sizes.")] = "1,16,64",
    contexts: Annotated[str, typer.Option("--contexts", help="Comma-separated decode context lengths.")]
    = "8192,32768,150000",
    prefill: Annotated[str, typer.Option("--prefill", help="Comma-separated prefill lengths (every position a "
                                                           "query; '' for none).")] = "4096,32768",
    formats: Annotated[str, typer.Option("--formats", help="Comma-separated index cache formats / labels.")]
    = "bf16,fp8,nvfp4,mxfp4",
    peers: Annotated[bool, typer.Option("--peers/--no-peers", help="Also time the torch eager scorer.")] = True,
    peer: Annotated[str, typer.Option("--peer", help="Engine kernels timed beside kvtool's, same data and method "
                                                     "(vllm; comma separated), with the ratio per case.")] = "",
    sweep: Annotated[bool, typer.Option("--sweep", help="Also time fixed launch variants (chunk, prefetch / "
                                                        "pipelining, warps, portable fp8, the Gluon scorer's "
                                                        "query and register cap) at 64 x 32K and 64 x 150K.")]
    = False,
    device: DeviceOpt = "cuda",
    as_json: JsonOpt = False,
) -> None:
    """M3 lightning indexer scoring and top-k per index format.

    Decode scoring (block scores) and fused score + top-k per index-cache format, and causal prefill top-k, beside a
    torch eager scorer; bandwidth, fraction of copy and the goals."""
    from kvtool.backend import resolve_device
    from kvtool.bench.index import render_goals, run_index_bench
    from kvtool.errors import InputError

    def ints(text: str, name: str) -> list[int]:
        try:
            out = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise InputError(f"bad {name} {text!r} (example: 1,16,64)") from None
        if any(v < 1 for v in out):
            raise InputError(f"{name} needs positive values, got {text!r}")
        return out

    names = tuple(f.strip() for f in formats.split(",") if f.strip())
    if not names:
        raise InputError("--formats needs at least one format")
    report = run_index_bench(ints(batches, "--batches"), ints(contexts, "--contexts"), ints(prefill, "--prefill"),
                             names, device=str(resolve_device(device)), peers=peers, sweep=sweep,
                             progress=_progress, engines=[x.strip() for x in peer.split(",") if x.strip()])

    _emit_bench(report, as_json, render_goals)
