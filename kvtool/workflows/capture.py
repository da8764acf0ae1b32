"""`kvtool capture`: run a prompt through a model (dense causal fp32 attention) and save its real caches.

File (plain safetensors, bf16, written to a temporary file then renamed), per captured layer i:
    layers.{i}.k        [S, Hkv, D]   post-RoPE keys (the K cache)
    layers.{i}.v        [S, Hkv, D]   values (the V cache)
    layers.{i}.q        [S, Hq, D]    post-RoPE queries
    layers.{i}.index_k  [S, Di]       the shared index key per token (the index cache)
    layers.{i}.index_q  [S, Hi, Di]   index queries
metadata (all strings): kvtool.capture "1", model, prompt (the text the tokens cover), positions (S), block_size, topk,
init, local (the model's selection defaults), layers ("0,1,2,3"), token_ids (JSON list), config (JSON ModelConfig).
Other commands (quantize, diff, verify-topk, verify-attn) read it as a plain safetensors cache file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtool.errors import InputError, OutputError
from kvtool.models import dense_causal_attention, load_model, tokenize

__all__ = ["CAPTURE_SCHEMA", "CaptureReport", "KINDS", "capture", "parse_layers", "read_capture"]

CAPTURE_SCHEMA = "1"
KINDS = ("k", "v", "q", "index_k", "index_q")


@dataclass
class CaptureReport:
    """What `capture` wrote: the file, model, token count, layers and each stored tensor (name, shape, dtype)."""

    output: str
    model: str
    tokens: int
    layers: list[int]
    block_size: int
    topk: int
    init_blocks: int
    local_blocks: int
    file_bytes: int
    seconds: float
    prompt_preview: str
    tensors: list[dict] = field(default_factory=list)


def parse_layers(spec: str | None, n_layers: int | None = None) -> list[int] | None:
    """'0-3' / '0,2,5' / '1-2,7' -> sorted unique layer ids; None or 'all' -> None (every layer). Checked against
    `n_layers` when given."""
    if spec is None or spec.strip().lower() == "all":
        return None
    out = set()
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            lo_i = int(lo)
            hi_i = int(hi) if hi else lo_i
            if lo_i < 0 or hi_i < lo_i:
                raise ValueError
            out.update(range(lo_i, hi_i + 1))
    except ValueError:
        raise InputError(f"bad --layers {spec!r} (examples: 0-3, 0,5,7, all)") from None
    if not out:
        raise InputError(f"bad --layers {spec!r} (examples: 0-3, 0,5,7, all)")
    if n_layers is not None and max(out) >= n_layers:
        raise InputError(f"--layers {spec!r} asks for layer {max(out)}, the model has {n_layers}")
    return sorted(out)


def _write_atomic(tensors: dict[str, torch.Tensor], metadata: dict[str, str], output: Path) -> None:
    from safetensors.torch import save_file

    output = Path(output)
    if not output.parent.is_dir():
        raise OutputError(f"output directory {output.parent} does not exist")
    from kvtool.container import create_temp

    fd, tmp = create_temp(output)  # `.NAME.kvtool-PID-RANDOM.tmp`: a killed run's leftover is removed next time
    os.close(fd)
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, output)
    except OSError as err:
        raise OutputError(f"cannot write {output}: {err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@torch.no_grad()
def capture(model_name: str, text: str, output: Path, *, max_tokens: int | None = 1024, layers: str | None = None,
            chat: bool = False, device: str = "cpu", seed: int = 0, model_layers: int | None = None) -> CaptureReport:
    """Tokenize `text` (wrapped in the model's chat template when `chat`), run it through `model_name` with dense
    causal fp32 attention and write the caches of `layers` (all by default) to `output` (schema in the module
    docstring). `model_layers` sets the depth of the synthetic models (default: theirs). Layers after the last one
    asked for are not computed (they cannot change earlier layers)."""
    start = time.perf_counter()
    model = load_model(model_name, device=device, seed=seed,
                       **({} if model_layers is None else {"layers": model_layers}))
    selected = parse_layers(layers, model.config.n_layers) or list(range(model.config.n_layers))
    if chat:
        if model.tokenizer is None or not hasattr(model.tokenizer, "chat"):
            raise InputError(f"--chat needs a model with a chat template; {model_name} has none")
        text = model.tokenizer.chat(text)
    tokens = tokenize(model, text, max_tokens).to(model.device)
    pos = torch.arange(len(tokens), device=model.device)
    stored: dict[str, torch.Tensor] = {}
    h = model.embed(tokens)
    for layer in range(selected[-1] + 1):
        q, k, v = model.qkv(layer, h, pos)
        if layer in selected:
            iq, ik = model.index_qk(layer, q, k, h, pos)
            for kind, t in zip(KINDS, (k, v, q, ik, iq)):
                stored[f"layers.{layer}.{kind}"] = t.to(torch.bfloat16).cpu().contiguous()
        h = model.attn_out(layer, h, dense_causal_attention(q, k, v))
    c = model.config
    covered = model.tokenizer.decode(tokens.tolist()) if model.tokenizer is not None else text[:len(tokens)]
    metadata = {
        "kvtool.capture": CAPTURE_SCHEMA, "model": model_name, "prompt": covered, "positions": str(len(tokens)),
        "block_size": str(c.block_size), "topk": str(c.topk), "init": str(c.init_blocks),
        "local": str(c.local_blocks), "layers": ",".join(map(str, selected)),
        "token_ids": json.dumps(tokens.tolist()), "config": json.dumps(c.to_dict()),
    }
    _write_atomic(stored, metadata, output)
    return CaptureReport(
        output=str(output), model=model_name, tokens=len(tokens), layers=selected, block_size=c.block_size,
        topk=c.topk, init_blocks=c.init_blocks, local_blocks=c.local_blocks, file_bytes=Path(output).stat().st_size,
        seconds=round(time.perf_counter() - start, 3), prompt_preview=covered[:80],
        tensors=[{"name": n, "shape": list(t.shape), "dtype": "bf16"} for n, t in stored.items()])


def read_capture(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a capture file; a file without `kvtool.capture` metadata is an InputError."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, Exception) as err:  # safetensors raises its own error types for corrupt headers
        raise InputError(f"cannot read capture {path}: {err}") from None
    if meta.get("kvtool.capture") != CAPTURE_SCHEMA:
        raise InputError(f"{path} is not a kvtool capture (no kvtool.capture metadata)")
    return meta, tensors
