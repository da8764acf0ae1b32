"""A small plain-torch Llama (RMSNorm, rotate-half RoPE, GQA, SiLU-gated MLP) behind the `CausalLM` API.

It runs the real SmolLM2 (weights from `gguf_loader`) and `tiny-llama`, a seeded random model for fast tests.
Weights are a flat dict in HF layout (Linear weights [out, in]; Q/K rows in the rotate-half order HF and vLLM use):

    embed [V, hidden], norm [hidden], output [V, hidden] (absent = tied to embed),
    layers.{i}.attn_norm [hidden], layers.{i}.wq [Hq*D, hidden], layers.{i}.wk / wv [Hkv*D, hidden],
    layers.{i}.wo [hidden, Hq*D], layers.{i}.ffn_norm [hidden], layers.{i}.w_gate / w_up [F, hidden],
    layers.{i}.w_down [hidden, F]

The indexer (a Llama has none; this stands in for M3's lightning indexer, built from the layer's own attention):
    ik(s)    = mean over the Hkv KV heads of the post-RoPE key k[s, j, :]          -> [T, Di], Di = D
    iq_j(p)  = mean over the query heads of KV head j's group of post-RoPE q[p]    -> [T, Hkv, Di], one per KV head
so iq_j . ik is the group-mean query against the head-mean key: one shared index key per token (MQA, as in M3) and
one index query per KV head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.models.base import CausalLM, ModelConfig, Tokenizer

__all__ = ["Llama", "TINY_LLAMA", "apply_rope", "load_tiny_llama", "random_llama_weights", "rms_norm", "rope_cos_sin"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] fp32, weight [N] -> x / sqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_cos_sin(pos: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pos LongTensor [T] -> cos, sin fp32 [T, 1, dim] in the rotate-half layout (frequency i at columns i, i+dim/2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=pos.device, dtype=torch.float64) / dim))
    freqs = pos.double()[:, None] * inv_freq[None, :]                     # [T, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)                               # [T, dim]
    return emb.cos().float()[:, None, :], emb.sin().float()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> x * cos + rotate_half(x) * sin (rotate_half(a, b) = (-b, a) on the two halves). With cos/sin
    narrower than D (partial rotary, R = cos.shape[-1]) only the first R dims rotate; the rest pass through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    a, b = rot.chunk(2, dim=-1)
    return torch.cat([rot * cos + torch.cat([-b, a], dim=-1) * sin, rest], dim=-1)


class Llama(CausalLM):
    """Plain-torch Llama over a weight dict (module docstring). fp32 compute on `device`."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, rms_eps: float, rope_theta: float,
                 device: torch.device | str = "cpu", tokenizer: Tokenizer | None = None):
        self.config = config
        self.device = torch.device(device)
        self.w = {k: v.to(device=self.device, dtype=torch.float32) for k, v in weights.items()}
        self.rms_eps = rms_eps
        self.rope_theta = rope_theta
        self.tokenizer = tokenizer

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w["embed"][tokens.to(self.device)]

    def qkv(self, layer: int, h: torch.Tensor, pos: torch.Tensor):
        c, p = self.config, f"layers.{layer}."
        T = h.shape[0]
        x = rms_norm(h, self.w[p + "attn_norm"], self.rms_eps)
        q = (x @ self.w[p + "wq"].T).view(T, c.n_heads, c.head_dim)
        k = (x @ self.w[p + "wk"].T).view(T, c.n_kv_heads, c.head_dim)
        v = (x @ self.w[p + "wv"].T).view(T, c.n_kv_heads, c.head_dim)
        cos, sin = rope_cos_sin(pos.to(self.device), c.head_dim, self.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def index_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor, h: torch.Tensor, pos=None):
        c = self.config
        iq = q.reshape(q.shape[0], c.n_kv_heads, c.group, c.head_dim).mean(dim=2)   # [T, Hkv, D]
        ik = k.mean(dim=1)                                                          # [T, D]
        return iq, ik

    def attn_out(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = f"layers.{layer}."
        h = h + attn.reshape(h.shape[0], -1) @ self.w[p + "wo"].T
        x = rms_norm(h, self.w[p + "ffn_norm"], self.rms_eps)
        mlp = (F.silu(x @ self.w[p + "w_gate"].T) * (x @ self.w[p + "w_up"].T)) @ self.w[p + "w_down"].T
        return h + mlp

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, self.w["norm"], self.rms_eps)
        return x @ self.w.get("output", self.w["embed"]).T


def random_llama_weights(config: ModelConfig, ffn: int, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in the `Llama` layout, fp32 on CPU, scaled 1/sqrt(fan_in) so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    w = {"embed": torch.randn(c.vocab_size, c.hidden, generator=g), "norm": 1 + 0.1 * torch.randn(c.hidden, generator=g),
         "output": lin(c.vocab_size, c.hidden)}  # untied, so logits are O(1) rather than O(sqrt(hidden))
    for i in range(c.n_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"] = 1 + 0.1 * torch.randn(c.hidden, generator=g)
        w[p + "wq"] = lin(c.n_heads * c.head_dim, c.hidden)
        w[p + "wk"] = lin(c.n_kv_heads * c.head_dim, c.hidden)
        w[p + "wv"] = lin(c.n_kv_heads * c.head_dim, c.hidden)
        w[p + "wo"] = lin(c.hidden, c.n_heads * c.head_dim)
        w[p + "ffn_norm"] = 1 + 0.1 * torch.randn(c.hidden, generator=g)
        w[p + "w_gate"] = lin(ffn, c.hidden)
        w[p + "w_up"] = lin(ffn, c.hidden)
        w[p + "w_down"] = lin(c.hidden, ffn)
    return w


TINY_LLAMA = ModelConfig(name="tiny-llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, index_heads=2,
                         index_dim=32, vocab_size=64, hidden=128, block_size=16, topk=4, init_blocks=0, local_blocks=1)


def load_tiny_llama(device: torch.device | str = "cpu", seed: int = 0, layers: int | None = None, **_) -> Llama:
    """`tiny-llama`: 2 layers, 4 query heads, 2 KV heads, head dim 32, vocab 64, hidden 128, seeded random weights;
    selection defaults block 16 / top-4 / init 0 / local 1 (small enough that a 100-token prompt spans several blocks).
    No tokenizer."""
    config = TINY_LLAMA if layers is None else ModelConfig(**{**TINY_LLAMA.to_dict(), "n_layers": layers})
    weights = random_llama_weights(config, ffn=256, seed=seed)
    return Llama(config, weights, rms_eps=1e-5, rope_theta=10000.0, device=device)
