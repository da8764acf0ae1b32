"""`kvtool capture` (real caches from a model) and `kvtool capacity` (pool bytes per format pair)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtool.cli.root import app
from kvtool.cli.common import DeviceOpt, JsonOpt, OutOpt, Table, emit, examples, handle_errors, line, print_table

__all__ = ["capacity_cmd", "capture_cmd"]


@app.command("capture", epilog=examples(
    'kvtool capture --model smollm2 --prompt "The capital of France is" -o cache.safetensors',
    "kvtool capture --model smollm2 --layers 0-3 --max-tokens 200 -o small.safetensors  (stdlib docs as the prompt)",
    "kvtool capture --model synthetic-m3 --prompt-file notes.txt --max-tokens 4096 -o m3.safetensors --device cuda"))
@handle_errors
def capture_cmd(
    output: OutOpt,
    model: Annotated[str, typer.Option("--model", help="smollm2 | synthetic-m3 | tiny-llama.")] = "smollm2",
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a UTF-8 file.")]
    = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Keep the first N tokens.")] = 1024,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Layers to save: 0-3, 0,5,7 or all.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Weight seed of the synthetic models.")] = 0,
    model_layers: Annotated[Optional[int], typer.Option("--model-layers", help="Depth of the synthetic models "
                                                                               "(default 2).")] = None,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """Save a prompt's real K, V, Q and index caches from a model.

    The prompt runs through the model (dense fp32 attention) and its caches are saved as bf16 safetensors. Without
    --prompt / --prompt-file the prompt is Python standard-library documentation."""
    from kvtool.backend import resolve_device
    from kvtool.models import corpus
    from kvtool.workflows import capture as capture_mod

    text = corpus.read_prompt(prompt, prompt_file, default_chars=8 * max_tokens)
    report = capture_mod.capture(model, text, output, max_tokens=max_tokens, layers=layers, chat=chat,
                                 device=str(resolve_device(device)), seed=seed, model_layers=model_layers)
    emit(report, as_json, _render_capture)


def _render_capture(r) -> None:
    from kvtool.cli.common import stderr

    line(f"wrote {r.output}: {r.model}, {r.tokens} tokens, layers {_ranges(r.layers)}, {r.file_bytes:,} bytes in "
         f"{r.seconds:.2f} s")
    line(f"selection defaults: block {r.block_size}, top-{r.topk}, init {r.init_blocks}, local {r.local_blocks}")
    first = f"layers.{r.layers[0]}."
    shapes = {t["name"].split(".", 2)[2]: t["shape"] for t in r.tensors if t["name"].startswith(first)}
    line("per layer: " + ", ".join(f"{k}=[{','.join(map(str, v))}]" for k, v in shapes.items()))  # one word each
    line(f"prompt: {r.prompt_preview!r}...", stderr)


def _ranges(ids: list[int]) -> str:
    contiguous = ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1
    return f"{ids[0]}-{ids[-1]}" if contiguous else ",".join(map(str, ids))


@app.command("capacity", epilog=examples(
    "kvtool capacity --model minimax-m3.1-flash --kv nvfp4 --index fp4",
    "kvtool capacity --model minimax-m3 --kv fp8 --index fp8 --pool-gb 168.8",
    "kvtool capacity --model minimax-m3.1-flash --blocks 57011 --json"))
@handle_errors
def capacity_cmd(
    model: Annotated[str, typer.Option("--model", help="minimax-m3 | minimax-m3.1-flash | smollm2.")] = "minimax-m3",
    kv: Annotated[str, typer.Option("--kv", help="KV cache format (fp8 = per-token scaled, as ATOM).")] = "fp8",
    index: Annotated[str, typer.Option("--index", help="Index cache format (fp8 = plain cast).")] = "fp8",
    kv_dense: Annotated[str, typer.Option("--kv-dense", help="Dense layers' KV format; auto = the KV format, "
                                                             "but at least fp8.")] = "auto",
    tp: Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel ranks (default: the preset's).")] = None,
    pool_gb: Annotated[Optional[float], typer.Option("--pool-gb", help="Pool size per rank in GiB (2^30 B).")] = None,
    blocks: Annotated[Optional[int], typer.Option("--blocks", help="Pool size as N blocks of the --kv/--index pair.")]
    = None,
    as_json: JsonOpt = False,
) -> None:
    """Bytes per 128-token pool block for a KV + index format pair.

    SPEC section 4: the bytes per block of the chosen pair and the tokens a pool holds, with the table of every
    pair."""
    from kvtool import capacity as capacity_mod

    report = capacity_mod.capacity(model, kv, index, tp=tp, pool_gb=pool_gb, blocks=blocks, kv_dense=kv_dense)
    emit(report, as_json, _render_capacity)


def _render_capacity(r) -> None:
    from kvtool.capacity import GIB
    from kvtool.cli.common import stderr

    pool = "" if r.pool_bytes is None else f", pool {r.pool_bytes / GIB:.2f} GiB"
    table = Table(f"{r.model} TP{r.tp}: L={r.pool_layers}, S={r.sparse_layers}, {r.kv_heads_per_rank} KV head/rank, "
                  f"D={r.head_dim}, {r.block_tokens}-token blocks{pool}")
    for col in ("KV", "index", "dense KV", "B/token", "block bytes", "vs fp8", "blocks"):
        table.column(col, justify="left" if col in ("KV", "index", "dense KV") else "right")
    published = False
    for row in r.rows:
        pub = row.published_block_bytes
        published |= pub is not None
        mark = "" if pub is None else ("*" if pub == row.block_bytes else f" (published {pub:,})")
        table.row(row.kv, row.index, row.kv_dense, f"{row.bytes_per_token:,}", f"{row.block_bytes:,}{mark}",
                  f"{row.vs_baseline:.2f}x", "" if row.blocks is None else f"{row.blocks:,}",
                  style="bold" if row.selected else None)
    if published:
        table.legend = "* = the published block size, reproduced"
    print_table(table)
    s = r.selected
    line(f"selected: {s.kv} KV + {s.index} index (dense layers {s.kv_dense}): {s.block_bytes:,} B per block, "
         f"{s.bytes_per_token:,} B per token" + ("" if s.blocks is None else
                                                 f", {s.blocks:,} blocks = {s.tokens:,} tokens"))
    line(r.note, stderr)
