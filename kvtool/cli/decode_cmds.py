"""`kvtool decode`: cache formats compared end to end on a model (the workflow is `kvtool.workflows.decode`)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvtool.cli.root import app
from kvtool.cli.common import (DeviceOpt, Fp8ScaleOpt, JsonOpt, OuterScaleOpt, RecipeOpt, ScaleRuleOpt, emit,
                               examples, format_options, handle_errors, line, stderr, stdout, warn)
from kvtool.errors import InputError, OutputError

__all__ = ["EPILOG", "LiveProgress", "decode_cmd", "plot_report", "render"]

if TYPE_CHECKING:  # annotations only; the workflow (torch) is imported when the command runs
    from kvtool.workflows.decode import DecodeReport, ProgressEvent

EPILOG = examples(
    'kvtool decode --kv nvfp4 --index fp4  (smollm2, stdlib docs, vs bf16 K/V + bf16 index)',
    'kvtool decode --kv fp8,nvfp4,mxfp4 --index fp8,fp4 --tokens 1024 --plot decode.png',
    'kvtool decode --kv mxfp4-floor,mxfp4-rceil --index bf16 --prompt-file notes.txt --json > decode.json',
    'kvtool decode --model synthetic-m3 --kv nvfp4 --index fp4 --batch 8 --device cuda',
    'kvtool decode --kv fp8 --dense --baseline-kv fp8-token',
    'kvtool decode --kv nvfp4,nvfp4+rot --index fp4,fp4+rot  (Hadamard rotation of the head dim before quantizing)',
    'kvtool decode --kv nvfp4,mxfp4 --rotate hadamard:64 --batch 4  (4 documents: intervals over texts too)',
)


@app.command("decode", epilog=EPILOG)
@handle_errors
def decode_cmd(
    kv: Annotated[str, typer.Option("--kv", help="Candidate K/V cache formats, comma separated (bf16, fp8, nvfp4 "
                                                  "alias fp4, mxfp4, or labels such as mxfp4-floor, fp8-token).")]
    = "nvfp4",
    index: Annotated[str, typer.Option("--index", help="Candidate index-key cache formats, comma separated. Every "
                                                        "(kv, index) pair is one configuration.")] = "fp4",
    baseline_kv: Annotated[str, typer.Option("--baseline-kv", help="The baseline's K/V format.")] = "bf16",
    baseline_index: Annotated[str, typer.Option("--baseline-index", help="The baseline's index format.")] = "bf16",
    scale_rule: ScaleRuleOpt = None,
    recipe: RecipeOpt = None,
    outer_scale: OuterScaleOpt = None,
    fp8_scale: Fp8ScaleOpt = None,
    model: Annotated[str, typer.Option("--model", help="smollm2 (real SmolLM2-135M) | synthetic-m3 (M3 geometry, "
                                                        "random weights) | tiny-llama.")] = "smollm2",
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Prompt text (default: stdlib docs).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a UTF-8 file.")]
    = None,
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="Teacher-forced positions: the prompt (cut to "
                                                                    "N), then the baseline's greedy continuation. "
                                                                    "Default: smollm2 1024, synthetic-m3 2560; with "
                                                                    "--prompt, the prompt + --gen-tokens.")] = None,
    gen_tokens: Annotated[Optional[int], typer.Option("--gen-tokens", help="Free-running greedy tokens per "
                                                                            "configuration after the prompt (timed; "
                                                                            "default 32, synthetic-m3 16).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic weights and random prompts.")] = 0,
    device: DeviceOpt = "cpu",
    backend: Annotated[str, typer.Option("--backend", help="auto (Triton kernels on cuda, torch on cpu) | torch | "
                                                            "triton.")] = "auto",
    batch: Annotated[int, typer.Option("--batch", help="Sequences decoded together (corpus slices / random "
                                                        "prompts).")] = 1,
    sparse: Annotated[bool, typer.Option("--sparse/--dense", help="M3 block-sparse attention (default) or dense.")]
    = True,
    block_size: Annotated[Optional[int], typer.Option("--block-size", help="Selection block (default: the "
                                                                            "model's; smollm2 64).")] = None,
    topk: Annotated[Optional[int], typer.Option("--topk", help="Blocks selected per query (smollm2 8).")] = None,
    local: Annotated[Optional[int], typer.Option("--local", help="Forced local blocks (default 1).")] = None,
    init: Annotated[Optional[int], typer.Option("--init", help="Forced initial blocks (default 0).")] = None,
    model_layers: Annotated[Optional[int], typer.Option("--model-layers", help="Depth (decoder layers) of the "
                                                                               "synthetic models.")] = None,
    old_layers: Annotated[Optional[int], typer.Option("--layers", hidden=True, help="Deprecated spelling of "
                                                                                    "--model-layers.")] = None,
    mem_gb: Annotated[float, typer.Option("--mem-gb", help="Memory (GiB) for the tokens-that-fit column.")] = 8.0,
    rotate: Annotated[Optional[str], typer.Option("--rotate", help="Rotate every candidate format: hadamard (whole "
                                                                    "head dim) | hadamard:N | none. Same as a +rot / "
                                                                    "+rotN label suffix.")] = None,
    floor: Annotated[bool, typer.Option("--floor/--no-floor", help="Run the noise floor: the baseline again under a "
                                                                    "harmless change (split-K attention).")] = True,
    resamples: Annotated[int, typer.Option("--resamples", help="Bootstrap resamples for the intervals (0: "
                                                                "none).")] = 1000,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write KL / top-1 / delta-p against position to "
                                                                "this PNG (needs matplotlib).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare cache formats end to end on a model.

    Compare K/V and index cache formats end to end: teacher-forced KL, top-1 and perplexity by position against
    a bf16 baseline, free-running generations side by side, per-layer top-k and attention error, bytes per token
    and tokens/s (beside a plain bf16 dense decode)."""
    from kvtool.models import corpus
    from kvtool.workflows.decode import DecodeOptions, run_decode

    if old_layers is not None:
        print("note: --layers is deprecated in decode: use --model-layers (the model's depth)", file=sys.stderr)
    if plot is not None:
        _check_plot(plot)
    text = corpus.read_prompt(prompt, prompt_file) if prompt is not None or prompt_file is not None else None
    opts = DecodeOptions(kv=[kv], index=[index], baseline_kv=baseline_kv, baseline_index=baseline_index,
                         format_opts=format_options(scale_rule, recipe, outer_scale, fp8_scale), model=model,
                         prompt=text, tokens=tokens, gen_tokens=gen_tokens, seed=seed, device=device, batch=batch,
                         sparse=sparse, block_size=block_size, topk=topk, local_blocks=local, init_blocks=init,
                         layers=model_layers if model_layers is not None else old_layers, mem_gb=mem_gb,
                         backend=backend,
                         **_verdict_options(rotate, floor, resamples))
    with LiveProgress() as live:
        report = run_decode(opts, progress=live.update, warn=live.warn)
    if plot is not None:
        plot_report(report, plot)
        stderr.print(f"wrote {plot}", markup=False, highlight=False)
    emit(report, as_json, render)


def _verdict_options(rotate: str | None, floor: bool, resamples: int) -> dict:
    """Only the non-default verdict options (so DecodeOptions compares equal to one built with its defaults)."""
    from kvtool.formats import rotation

    if resamples < 0:
        raise InputError(f"--resamples must be >= 0, got {resamples}")
    out = {}
    rot = rotation.parse_flag(rotate)
    if rot is not None:
        out["rotate"] = rot
    if not floor:
        out["floor"] = False
    if resamples != 1000:
        out["resamples"] = resamples
    return out


# ------------------------------------------------------------------------------------------------- live progress
class LiveProgress:
    """Progress on stderr: on a terminal a rich display, one bar per phase with each configuration's running KL and
    top-1; piped or in a log, plain lines `decode PHASE: done/total STATS`, at most one every `every_s` seconds per
    phase plus one when a phase completes (a rich display would only be drawn once, at the end)."""

    def __init__(self, every_s: float = 5.0):
        self.plain = not stderr.is_terminal
        self.every_s, self.last, self.done_phases = every_s, {}, set()
        self.progress = Progress(TextColumn("{task.description:<15}"), BarColumn(bar_width=16),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                                 console=stderr, transient=False)
        self.tasks: dict[str, int] = {}
        self.started = False

    def __enter__(self) -> "LiveProgress":
        return self

    def __exit__(self, *exc) -> None:
        # Started on the first event only, so an option error exits with its one line and no empty display.
        if self.started:
            self.progress.stop()

    def update(self, ev: ProgressEvent) -> None:
        if self.plain:
            self._line(ev)
            return
        if not self.started:
            self.progress.start()
            self.started = True
        if ev.phase not in self.tasks:
            self.tasks[ev.phase] = self.progress.add_task(ev.phase, total=max(ev.total, 1), stats="")
        stats = "  ".join(f"[cyan]{label}[/] KL {kl:.4f} {top1:.1f}%" for label, (kl, top1) in
                          list(ev.running.items())[:2])
        self.progress.update(self.tasks[ev.phase], completed=ev.done, stats=stats)

    def _line(self, ev: ProgressEvent) -> None:
        now = time.monotonic()
        finished = ev.done >= ev.total
        if ev.phase in self.done_phases or (not finished and now - self.last.get(ev.phase, 0.0) < self.every_s):
            return
        self.last[ev.phase] = now
        if finished:
            self.done_phases.add(ev.phase)
        stats = "  ".join(f"{label} KL {kl:.4f} top-1 {top1:.1f}%" for label, (kl, top1) in ev.running.items())
        print(f"decode {ev.phase}: {ev.done}/{max(ev.total, 1)} {stats}".rstrip(), file=sys.stderr, flush=True)

    def warn(self, msg: str) -> None:
        if self.plain:
            print(f"warning: {msg}", file=sys.stderr, flush=True)
            return
        self.progress.console.print(f"warning: {msg}", style="yellow", markup=False, highlight=False)


# ------------------------------------------------------------------------------------------------------- render
def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _si(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def render(r: DecodeReport) -> None:
    m = r.model
    sel = "dense" if r.selection is None else (f"sparse: block {r.selection['block_size']}, top-{r.selection['topk']}"
                                               f", init {r.selection['init_blocks']}, local "
                                               f"{r.selection['local_blocks']}")
    line(f"{m['name']}: {m['n_layers']} layers, {m['n_heads']}/{m['n_kv_heads']} heads, head dim "
         f"{m['head_dim']}; {sel}; batch {r.batch}, {r.tokens} teacher-forced positions ({r.prompt_tokens} "
         f"prompt), {r.gen_tokens} generated; {r.device} (store {r.paths['store']}, attention "
         f"{r.paths['attention']})")
    level = f"{100 * r.confidence['level']:.0f}%" if r.confidence else None
    table = Table(title=f"vs baseline {r.baseline.label} (K/V / index)",
                  caption=(f"[..]: {level} bootstrap interval over {r.confidence['basis']}" if level else None),
                  box=box.SIMPLE_HEAVY)
    for col in ("config", "B/tok", f"fit {r.mem_gb:g}GiB", "tok/s", "x bf16", "KL", "top-1%", "ppl x", "1st div"):
        table.add_column(col, justify="left" if col == "config" else "right")
    rows = [r.baseline] + r.candidates + ([r.floor] if r.floor else [])
    for i, c in enumerate(rows):
        o, g = c.overall, c.generation
        div = "-" if g is None or i == 0 else ("none" if g.first_divergence is None else str(g.first_divergence))
        table.add_row(c.label, f"{c.bytes_per_token:,}", f"{_si(c.tokens_in_mem)} {c.capacity_vs_baseline:.1f}x",
                      _num(c.tokens_per_s, ".1f"), _num(c.speed_vs_bf16, ".2f"),
                      _ci(o and o.kl_mean, c.intervals.get("kl_mean"), ".3g"),
                      _ci(o and o.top1_pct, c.intervals.get("top1_pct"), ".1f"),
                      _ci(o and o.ppl_ratio, c.intervals.get("ppl_ratio"), ".3f"), div)
    stdout.print(table)
    if r.floor is not None:
        line(f"noise floor ({r.floor.label}): {r.floor_change}", style="dim")
    _render_verdict(r)
    if r.bf16_dense_tokens_per_s:
        line(f"plain bf16 dense decode of the same model: {r.bf16_dense_tokens_per_s:.1f} tok/s")
    _render_buckets(r)
    _render_layers(r)
    _render_generations(r)
    _render_llama(r)
    warn(r.warnings)


def _render_buckets(r: DecodeReport) -> None:
    table = Table(title="by position (teacher-forced)", box=box.SIMPLE,
                  caption="KL x floor: the bucket's mean KL over the noise floor's" if r.floor else None)
    cols = ("config", "positions", "KL mean", "KL max", "top-1%", "dp mean", "dp RMS", "ppl x")
    for col in cols + (("KL x floor",) if r.floor else ()):
        table.add_column(col, justify="left" if col == "config" else "right")
    for c in r.candidates + ([r.floor] if r.floor else []):
        for i, b in enumerate(c.buckets):
            iv = c.bucket_intervals[i] if c.bucket_intervals else {}
            cells = [c.label, f"{b.lo}-{b.hi - 1}", _ci(b.kl_mean, iv.get("kl_mean"), ".3g"), f"{b.kl_max:.3g}",
                     _ci(b.top1_pct, iv.get("top1_pct"), ".1f"), f"{b.dp_mean:+.4f}", f"{b.dp_rms:.4f}",
                     f"{b.ppl_ratio:.4f}"]
            if r.floor:
                fl = r.floor.buckets[i].kl_mean
                cells.append("-" if c is r.floor else (f"{b.kl_mean / fl:.3g}" if fl > 0 else "inf"))
            table.add_row(*cells)
    stdout.print(table)


def _ci(x: float | None, iv, fmt: str) -> str:
    """`x [lo, hi]` (the bootstrap interval when there is one)."""
    if x is None:
        return "-"
    return format(x, fmt) if iv is None else f"{x:{fmt}} [{iv.lo:{fmt}}, {iv.hi:{fmt}}]"


def _render_verdict(r: DecodeReport) -> None:
    """One line per paired comparison: distinguishable or not at the bootstrap level."""
    if not r.confidence:
        return
    level = f"{100 * r.confidence['level']:.0f}%"
    for cmp in r.confidence["comparisons"]:
        kl = cmp.diff["kl_mean"]
        what = f"{cmp.a} vs {cmp.b}: KL difference {kl.value:+.4g} [{kl.lo:+.4g}, {kl.hi:+.4g}]"
        if cmp.distinguishable:
            line(f"{what}: distinguishable at {level} (on {', '.join(cmp.differs_on)})")
        else:
            line(f"{what}: not distinguishable at {level} on any metric")


def _render_llama(r: DecodeReport) -> None:
    """llama.cpp's --kl-divergence statistics, as llama-perplexity prints them, one block per configuration."""
    from kvtool.workflows import decode_stats

    for c in r.candidates + ([r.floor] if r.floor else []):
        if not c.llama_cpp:
            continue
        line(f"{c.label}: llama.cpp statistics (llama-perplexity --kl-divergence names; every position with a next "
             "token)")
        for text in decode_stats.llama_lines(c.llama_cpp):
            stdout.print(text, markup=False, highlight=False)


def _render_layers(r: DecodeReport) -> None:
    sparse = r.selection is not None
    legend = ("top-k exact % / recall (rows where top-k is a choice) / " if sparse else "") + "attention rel_l2"
    table = Table(title="per layer vs the baseline", caption=legend, box=box.SIMPLE)
    table.add_column("layer", justify="right")
    for c in r.candidates:
        table.add_column(c.label, justify="right")
    for i in range(len(r.candidates[0].layers) if r.candidates else 0):
        cells = []
        for c in r.candidates:
            lm = c.layers[i]
            top = "" if lm.topk is None else ("- / - / " if lm.topk.rows == 0 else
                                              f"{lm.topk.exact_pct:5.1f} / {lm.topk.recall:.3f} / ")
            cells.append(f"{top}{lm.attn_rel_l2:.4f}")
        table.add_row(str(i), *cells)
    stdout.print(table)


def _render_generations(r: DecodeReport) -> None:
    if r.baseline.generation is None:
        return
    if r.baseline.generation.text is None:  # no tokenizer: token agreement only
        for c in r.candidates:
            g = c.generation
            line(f"{c.label}: generated tokens agree {g.agreement_pct:.1f} % with the baseline, first divergence "
                 f"{'none' if g.first_divergence is None else g.first_divergence}")
        return
    if r.prompt_tail:
        line(f"...{r.prompt_tail!r}", style="dim", wrap=False)  # the prompt as it is: no markup, no wrapping
    table = Table(title=f"free-running greedy continuation ({r.gen_tokens} tokens)", box=box.SIMPLE, show_lines=True)
    for col in ("config", "agree %", "1st div", "text"):
        table.add_column(col, justify="right" if col in ("agree %", "1st div") else "left", overflow="fold")
    for i, c in enumerate([r.baseline] + r.candidates):
        g = c.generation
        div = "-" if i == 0 else ("none" if g.first_divergence is None else str(g.first_divergence))
        table.add_row(c.label, "-" if i == 0 else f"{g.agreement_pct:.1f}", div, Text(repr(g.text)))  # not markup
    stdout.print(table)


# ---------------------------------------------------------------------------------------------------------- plot
def _check_plot(path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise OutputError("--plot needs matplotlib: pip install matplotlib")
    if path.suffix.lower() != ".png":
        raise OutputError(f"--plot writes a PNG: give a path ending in .png, got {path}")
    if not path.resolve().parent.is_dir():
        raise OutputError(f"--plot: directory {path.parent} does not exist")


def plot_report(r: DecodeReport, path: Path, window: int = 16) -> None:
    """KL, top-1 agreement and delta-p of every candidate against position (moving average over `window`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    keys = (("kl", "kl_mean"), ("top1_pct", "top1_pct"), ("dp", "dp_mean"))
    for c in r.candidates + ([r.floor] if r.floor else []):
        style = dict(color="black", linestyle=":", linewidth=1.2) if c is r.floor else {}
        for ax, (key, metric) in zip(axes, keys):
            y = np.asarray(c.series[key], dtype=float)
            w = max(1, min(window, len(y)))
            line, = ax.plot(np.arange(w - 1, len(y)), np.convolve(y, np.ones(w) / w, mode="valid"), label=c.label,
                            **style)
            for b, iv in zip(c.buckets, c.bucket_intervals):  # the bucket's bootstrap interval as a band
                if metric in iv:
                    ax.fill_between([b.lo, b.hi - 1], iv[metric].lo, iv[metric].hi, color=line.get_color(),
                                    alpha=0.12, linewidth=0)
    choice = r.selection and r.selection["topk"] * r.selection["block_size"]  # top-k is a choice from here on
    axes[0].set_yscale("symlog", linthresh=1e-6)  # the floor sits decades below the formats (and may be 0)
    axes[0].set_ylim(bottom=0)
    for ax, title in zip(axes, ("KL(p_base || p) [nats]", "top-1 agreement [%]", "delta-p of the next token")):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if choice and choice < r.tokens:
            ax.axvline(choice, color="gray", linestyle="--", linewidth=1)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel(f"position (trailing mean over {window}; dashed: top-k becomes a choice)\n"
                        f"dotted black: the noise floor; bands: per-bucket bootstrap intervals")
    fig.suptitle(f"kvtool decode: {r.model['name']}, {r.mode}, vs {r.baseline.label}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
