"""`kvtool verify-topk`: the lightning-indexer scorer over quantized paged index caches against the reference fed
the dequantized cache and against the bf16 original, per layer and overall, formats side by side."""

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

__all__ = ["EPILOG", "FORMATS_DEFAULT", "verify_topk_cmd", "vt"]

vt = lazy_module("kvtool.workflows.verify_topk")  # torch-heavy: imported on first use, not for --help

EPILOG = examples(
    "kvtool verify-topk --synthetic --device cuda --formats bf16,fp8,nvfp4,mxfp4",
    "kvtool verify-topk --synthetic --batch 8 --context-lens 1,127,128,129,4097,32768,131072,150000 --device cuda",
    "kvtool verify-topk capture.safetensors --formats nvfp4,mxfp4-floor --layers 3-5 --min-recall 0.9 --device cuda",
    "kvtool verify-topk index_k.safetensors --queries index_q.safetensors --formats fp8,nvfp4 --json",
    "TRITON_INTERPRET=1 kvtool verify-topk --synthetic --batch 2 --context-lens 700 --formats nvfp4  (kernel on CPU)",
    "kvtool verify-topk --synthetic --impl vllm --formats bf16,fp8 --device cuda  (vLLM's kernel beside kvtool's)",
    "kvtool verify-topk --edge-scores --impl vllm --device cuda  (top-k alone on -inf / NaN / tie rows)",
    "kvtool verify-topk --scores rows.safetensors --nan-rule any --impl mypkg.kernels:my_select",
)

FORMATS_DEFAULT = "bf16,fp8,nvfp4,mxfp4"


@app.command("verify-topk", epilog=EPILOG)
@handle_errors
def verify_topk_cmd(
    file: Annotated[Optional[Path], typer.Argument(
        metavar="FILE", help="A capture file (kvtool capture), or an index cache file (float keys or kvtool quantize "
                             "output) with --queries.")] = None,
    queries: Annotated[Optional[Path], typer.Option("--queries", help="Query file for an index cache FILE: [Q, Hi, "
                                                                      "D] queries of the last Q positions.")] = None,
    synthetic: Annotated[bool, typer.Option("--synthetic", help="One synthetic M3 decode step instead of a "
                                                                "file.")] = False,
    edge_scores: Annotated[bool, typer.Option("--edge-scores", help="Top-k alone on built-in block-score rows with "
                                                                    "-inf / NaN blocks and ties.")] = False,
    scores: Annotated[Optional[Path], typer.Option("--scores", help="Top-k alone on a file of block scores: `scores` "
                                                                    "[R, NB] fp32 and `q_pos` [R].")] = None,
    impl: Annotated[Optional[str], typer.Option("--impl", help="Engine implementations to run beside kvtool's kernel "
                                                               "(vllm, or module:function; comma separated).")] = None,
    nan_rule: Annotated[str, typer.Option("--nan-rule", help="NaN / -inf blocks: low (SPEC: NaN ranks -1e30) | "
                                                             "neg-inf | any (free among non-finite).")] = "low",
    formats: Annotated[str, typer.Option("--formats", help="Comma-separated formats or labels (bf16, fp8, nvfp4, "
                                                           "mxfp4-floor, ...).")] = FORMATS_DEFAULT,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Capture: layers to check (0-3, 0,5, all).")] = None,
    max_queries: Annotated[int, typer.Option("--max-queries", help="Files: query positions per layer (evenly "
                                                                   "spaced, with the last; 0 = all).")] = 256,
    batch: Annotated[int, typer.Option("--batch", help="Synthetic: requests in the step.")] = 4,
    context_lens: Annotated[Optional[str], typer.Option("--context-lens", help="Synthetic: one length for all or "
                                                        "one per request (default: random in [1, 8192]).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic data and page shuffles.")] = 0,
    block_size: Annotated[Optional[int], typer.Option("--block-size", help="Index block size (default: the "
                                                                           "file's, else 128).")] = None,
    topk: Annotated[Optional[int], typer.Option("--topk", help="Blocks per query (default: the file's, else "
                                                               "16).")] = None,
    tie_rule: Annotated[str, typer.Option("--tie-rule", help="higher-id (ATOM) | lower-id | any.")] = "higher-id",
    page_size: Annotated[Optional[int], typer.Option("--page-size", help="Tokens per cache page (default: the "
                                                                         "block size).")] = None,
    min_recall: Annotated[Optional[float], typer.Option("--min-recall", help="Exit 1 when recall@k against the "
                                                                             "original falls below R.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="auto | triton | torch (auto: Triton on cuda, and on "
                                                           "cpu under TRITON_INTERPRET=1).")] = "auto",
    device: DeviceOpt = "cpu",
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the checksums and decoded codes of "
                                         "kvtool cache files read (FILE with --queries, --scores) as they are read "
                                         "(default); --no-verify trusts them, for speed.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Check the top-k index kernels against the references.

    Selects top-k index blocks from quantized paged index caches (kvtool's kernel, and --impl engine kernels beside
    it) and compares with (a) the reference scorer fed the DEQUANTIZED cache (every difference must be a tie, ids in
    rank order, no dropped finite block: exit 1 otherwise) and (b) the reference on the original keys (exact-set %,
    recall@k, relative block-score error; --min-recall gates it)."""
    from kvtool.backend import resolve_device
    from kvtool.indexer import IndexerConfig

    if int(synthetic) + int(file is not None) + int(edge_scores) + int(scores is not None) != 1:
        raise InputError("give one of FILE, --synthetic, --edge-scores, --scores")
    names = [f.strip() for f in formats.split(",") if f.strip()]
    if not names:
        raise InputError("--formats needs at least one format")
    dev = str(resolve_device(device))
    progress = (lambda msg: stderr.print(msg, style="dim", markup=False, highlight=False))  # text, not markup
    impls = [i.strip() for i in (impl or "").split(",") if i.strip()]
    common = dict(device=dev, backend=backend, min_recall=min_recall, progress=progress, impls=impls)
    if synthetic or edge_scores or scores is not None:
        cfg = IndexerConfig(block_size=block_size or 128, topk=topk or 16, tie_rule=tie_rule, nan_rule=nan_rule)
    if synthetic:
        report = vt.verify_topk_synthetic(names, batch=batch, context_lens=context_lens, seed=seed, cfg=cfg,
                                          page_size=page_size or cfg.block_size, **common)
    elif edge_scores or scores is not None:
        rows = pos = None
        if scores is not None:
            rows, pos = _read_scores(scores, verify)
        report = vt.verify_topk_scores(rows, pos, cfg=cfg, source=str(scores or "edge cases"), device=dev,
                                       backend=backend, impls=impls)
    elif queries is not None:
        report = vt.verify_topk_files(file, queries, names, max_queries=max_queries, page_size=page_size,
                                      block_size=block_size, topk=topk, tie_rule=tie_rule, nan_rule=nan_rule,
                                      verify=verify, **common)
    else:
        from kvtool.workflows.capture import parse_layers

        report = vt.verify_topk_capture(file, names, layers=parse_layers(layers), max_queries=max_queries,
                                        page_size=page_size, block_size=block_size, topk=topk, tie_rule=tie_rule,
                                        nan_rule=nan_rule, **common)
    emit(report, as_json, _render)
    if not report.passed:
        raise typer.Exit(1)


def _read_scores(path: Path, verify: bool = True):
    from kvtool.readers import open_input

    with open_input(Path(path), verify=verify) as f:
        if "scores" not in f.entries or "q_pos" not in f.entries:
            raise InputError(f"{path}: needs tensors `scores` [R, NB] and `q_pos` [R] (has {list(f.entries)})")
        out = []
        for name in ("scores", "q_pos"):
            e = f.entries[name]
            out.append(e.read(0, e.rows).reshape(e.shape))
    return out[0].float(), out[1].long()


def _render(r) -> None:
    cfg = ", ".join(f"{k} {v}" for k, v in r.config.items() if k != "context_lens")
    table = Table(title=Text(f"verify-topk: {r.source} ({r.backend}, {r.device})"), caption=cfg, box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    for col in ("layer", "format", "impl", "rows", "a\nexact%", "a\ntie%", "a\norder%", "a\nmax err", "b\nexact%",
                "b\nrecall", "b\nrel err", "rules", "verdict"):
        text = col in ("layer", "format", "impl", "rules", "verdict")  # names fold (80-column pipes); numbers never shrink
        table.add_column(col, justify="left" if text else "right", no_wrap=not text, overflow="fold",
                         min_width=({"layer": 9, "format": 11}.get(col, 6)) if text else
                         max(len(p) for p in col.split("\n")))
    several = len({row.layer for row in r.layers}) > 1
    for i, row in enumerate(r.layers + (r.overall if several else [])):
        if i == len(r.layers):
            table.add_section()  # the overall rows, over every layer
        a, b, c = row.vs_dequant, row.vs_original, row.checks
        if a is None:  # skipped: the reason instead of numbers
            table.add_row(Text(row.layer), row.format, row.impl, str(row.rows), *["-"] * 8, "-", row.verdict,
                          style="dim")
            continue
        table.add_row(Text(row.layer), row.format, row.impl, str(row.rows), f"{a.exact_pct:.1f}",
                      f"{a.tie_aware_pct:.1f}",
                      "-" if c is None else f"{c.order_pct:.1f}",
                      "-" if row.max_score_err != row.max_score_err else f"{row.max_score_err:.1e}",
                      "-" if b is None else f"{b.exact_pct:.1f}",
                      "-" if b is None else f"{b.recall:.3f}", "-" if b is None else f"{b.rel_score_err:.1e}",
                      "-" if c is None else c.rule_text(), row.verdict.split(" (")[0],
                      style=None if row.passed else "bold red")  # failing rows in red
    stdout.print(table)  # a rich Table: laid out by kvtool.cli.render
    if "context_lens" in r.config:
        line(f"context lengths: {r.config['context_lens']}")
    line("a = scorer vs the reference on the dequantized cache (differences must be ties up to the fp32 "
                 "accumulation bound; max err = largest block-score difference); b = vs the reference on the "
                 "original keys (recall@k = |A n B| / |B|; rel err = |sum R(A) - sum R(B)| / sum |R(B)| over "
                 "unforced blocks)" + (f"; min recall {r.min_recall:g}" if r.min_recall is not None else ""))
    line("order% = rows whose ids are in descending rank order; rules = tie / NaN rules the selection equals "
                 "exactly on every row (tie any: only tie order differs; nan any: only NaN / -inf blocks differ)")
    for spec in r.impls:
        line(f"impl {spec}")
    for row in r.layers:
        c = row.checks
        if c is None or row.passed:
            continue
        kinds = ", ".join(f"{n} {k}" for n, k in ((c.defect, "DEFECT"), (c.nonfinite, "NaN/-inf policy"),
                                                   (c.order_bad, "out of rank order")) if n)
        line(f"{row.impl} {row.layer}/{row.format}: {kinds} of {c.rows} rows", style="red")
        for e in c.evidence:
            line(f"  {e}")
        for d in c.diagnosis:
            line(f"  diagnosis: {d}")
    for note in r.notes:
        line(f"note: {note}")
    failed = [f"{row.impl} {row.layer}/{row.format}" for row in r.layers + r.overall if not row.passed]
    if r.verdict.startswith("SKIPPED"):
        line(r.verdict, style="yellow")
    else:
        line("PASS" if r.passed else f"FAIL: {', '.join(failed)}", style="green" if r.passed else "red")
