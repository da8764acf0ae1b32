"""The model API every workflow (capture, decode) builds on, and the model registry.

A `CausalLM` is stateless apart from its weights: the caller owns the caches. One decoder layer is split at the points
where a KV-cache engine steps in:

    h = model.embed(tokens)                                   # h: [T, hidden]
    for layer in range(config.n_layers):
        q, k, v = model.qkv(layer, h, pos)                    # q: [T, Hq, D], k, v: [T, Hkv, D] (post-RoPE)
        iq, ik = model.index_qk(layer, q, k, h, pos)          # iq: [T, Hi, Di], ik: [T, Di] (one shared index key)
        attn = <attention of q over the cached k, v>          # attn: [T, Hq, D]
        h = model.attn_out(layer, h, attn)                    # o_proj + residual + MLP block
    logits = model.logits(h)                                  # [T, vocab]

All tensors are fp32 on the model's device unless noted. `dense_causal_attention` and `dense_forward` below are the
plain full-precision path (capture and the decode baseline use them).
"""

from __future__ import annotations

import abc
import importlib
import math
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

import torch

from kvtool.errors import KvtoolError

__all__ = [
    "CausalLM", "ModelConfig", "Tokenizer", "available_models", "dense_causal_attention", "dense_forward",
    "greedy_generate", "load_model"
]


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a model and its sparse-selection defaults.

    name: registry name; n_layers: decoder layers; n_heads / n_kv_heads: query / KV heads (GQA group = n_heads //
    n_kv_heads); head_dim: D; index_heads: index query heads (= n_kv_heads, one per KV head as in M3); index_dim: Di of
    the index query and the one shared index key; vocab_size; hidden: residual width; block_size, topk, init_blocks,
    local_blocks: the M3-style block selection defaults for this model (SPEC section 3).
    """

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    index_heads: int
    index_dim: int
    vocab_size: int
    hidden: int
    block_size: int
    topk: int
    init_blocks: int
    local_blocks: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CausalLM(abc.ABC):
    """A decoder-only model split at the cache boundaries (see the module docstring). Stateless apart from weights."""

    config: ModelConfig
    device: torch.device
    tokenizer: Tokenizer | None = None

    @abc.abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: LongTensor [T] -> h: fp32 [T, hidden]."""

    @abc.abstractmethod
    def qkv(self, layer: int, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [T, hidden], pos: LongTensor [T] (absolute positions) -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D];
        q and k are post-RoPE (what an engine stores in its K cache)."""

    @abc.abstractmethod
    def index_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor, h: torch.Tensor,
                 pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The M3-style lightning indexer: q [T, Hq, D], k [T, Hkv, D] (post-RoPE, from `qkv`), h [T, hidden] (the
        layer input), pos LongTensor [T] (pass the positions given to `qkv`; an indexer with its own RoPE needs them,
        and when omitted it uses those of the last `qkv(layer, ...)` call) -> iq [T, Hi, Di], ik [T, Di] (one shared
        index key per token)."""

    @abc.abstractmethod
    def attn_out(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] (layer input), attn: [T, Hq, D] (attention output per head) -> next h [T, hidden]
        (o_proj, residual, then the MLP block with its residual)."""

    @abc.abstractmethod
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] (last layer output) -> fp32 logits [T, vocab] (final norm + LM head)."""


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None = None,
                           k_pos: torch.Tensor | None = None, chunk: int = 512) -> torch.Tensor:
    """Full causal GQA attention in fp32: q [T, Hq, D], k/v [S, Hkv, D] -> [T, Hq, D].

    Query t sees key s when k_pos[s] <= q_pos[t]; by default q occupies the last T positions of the S keys (prefill
    when T == S, a decode step when T == 1). Scale 1/sqrt(D). Queries run `chunk` at a time to bound memory.
    """
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    if q_pos is None:
        q_pos = torch.arange(S - T, S, device=q.device)
    if k_pos is None:
        k_pos = torch.arange(S, device=q.device)
    if T > chunk:  # bound the [Hq, T, S] score matrix for long prompts
        return torch.cat([dense_causal_attention(q[i:i + chunk], k, v, q_pos[i:i + chunk], k_pos, chunk)
                          for i in range(0, T, chunk)])
    g = Hq // Hkv
    qg = q.float().reshape(T, Hkv, g, D).permute(1, 2, 0, 3)              # [Hkv, g, T, D]
    kf = k.float().permute(1, 0, 2)                                       # [Hkv, S, D]
    vf = v.float().permute(1, 0, 2)                                       # [Hkv, S, D]
    scores = torch.einsum("hgtd,hsd->hgts", qg, kf) / math.sqrt(D)        # [Hkv, g, T, S]
    mask = k_pos[None, :] > q_pos[:, None]                                # [T, S] True = hidden
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("hgts,hsd->hgtd", torch.softmax(scores, dim=-1), vf)
    return out.permute(2, 0, 1, 3).reshape(T, Hq, D)


@torch.no_grad()
def dense_forward(model: CausalLM, tokens: torch.Tensor, hook: Callable | None = None) -> torch.Tensor:
    """Run `tokens` (LongTensor [T]) through `model` with dense causal fp32 attention from position 0.

    `hook(layer, q, k, v, iq, ik)` (if given) sees every layer's post-RoPE tensors (shapes as in `CausalLM`).
    Returns logits fp32 [T, vocab].
    """
    tokens = tokens.to(model.device)
    pos = torch.arange(tokens.shape[0], device=model.device)
    h = model.embed(tokens)
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, h, pos)
        if hook is not None:
            iq, ik = model.index_qk(layer, q, k, h, pos)
            hook(layer, q, k, v, iq, ik)
        h = model.attn_out(layer, h, dense_causal_attention(q, k, v))
    return model.logits(h)


@torch.no_grad()
def greedy_generate(model: CausalLM, tokens: torch.Tensor, n_new: int) -> list[int]:
    """Greedy continuation by full recomputation (the simple, obviously-correct path): tokens LongTensor [T] ->
    the `n_new` generated ids."""
    ids = tokens.tolist()
    for _ in range(n_new):
        logits = dense_forward(model, torch.tensor(ids, dtype=torch.long))
        ids.append(int(logits[-1].argmax()))
    return ids[len(tokens):]


# name -> "module:factory"; factories take (device, **kw). Imported lazily so optional extras stay optional.
_REGISTRY = {
    "smollm2": "kvtool.models.gguf_loader:load_smollm2",
    "synthetic-m3": "kvtool.models.synthetic_m3:load_synthetic_m3",
    "tiny-llama": "kvtool.models.llama:load_tiny_llama",
}


def available_models() -> list[str]:
    """Names `load_model` accepts."""
    return list(_REGISTRY)


def load_model(name: str, device: str | torch.device = "cpu", **kw) -> CausalLM:
    """Build a model by name ('smollm2', 'synthetic-m3', 'tiny-llama') on `device`; `kw` go to its factory
    (e.g. `seed=`, `layers=` for the synthetic models, `cache_dir=` for smollm2)."""
    if name not in _REGISTRY:
        raise KvtoolError(f"unknown model {name!r} (choose {'|'.join(_REGISTRY)})")
    module, factory = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), factory)(device=torch.device(device), **kw)
