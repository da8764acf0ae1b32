"""`synthetic-m3`: MiniMax-M3's attention geometry with seeded random weights, small enough to run anywhere.

Geometry (SPEC section 3): 64 query heads, 4 KV heads (GQA 16), head dim 128; lightning indexer with 4 index query
heads (one per KV head) of dim 128 and one shared 128-d index key per token (MQA); selection: 128-token blocks, top-16,
init 0, local 1. The rest is shrunk so it runs fast: hidden 512, SiLU MLP 1024, vocab 1024, 2 layers by default.

Per layer (all RMSNorms eps 1e-6, RoPE rotate-half on the first 64 of 128 dims, theta 5e6 — partial rotary as in
MiniMax-M2's public config; an assumption for M3, stated so it can be checked):
    x = rmsnorm(h);  q = rope(rmsnorm_head(x Wq));  k = rope(rmsnorm_head(x Wk));  v = x Wv
    iq = rope(rmsnorm_head(x Wiq)) [T, 4, 128];     ik = rope(rmsnorm(x Wik)) [T, 128]
Heavy tails, as real activations have: 4 of 512 hidden channels of the embeddings are scaled x16 (massive
activations), and 4 of 128 channels of the k / index-k norm weights are x8 (key outlier channels), so per-block amax is
dominated by a few channels the way quantizers meet it in real caches.
"""

from __future__ import annotations

import torch

from kvtool.models.base import ModelConfig
from kvtool.models.llama import Llama, apply_rope, random_llama_weights, rms_norm, rope_cos_sin

__all__ = ["ROTARY_DIM", "SYNTHETIC_M3", "SyntheticM3", "load_synthetic_m3", "synthetic_m3_weights"]

SYNTHETIC_M3 = ModelConfig(name="synthetic-m3", n_layers=2, n_heads=64, n_kv_heads=4, head_dim=128, index_heads=4,
                           index_dim=128, vocab_size=1024, hidden=512, block_size=128, topk=16, init_blocks=0,
                           local_blocks=1)
ROTARY_DIM = 64
HIDDEN_OUTLIERS, HIDDEN_OUTLIER_GAIN = 4, 16.0
KEY_OUTLIERS, KEY_OUTLIER_GAIN = 4, 8.0


class SyntheticM3(Llama):
    """M3-shaped attention (q/k RMSNorm per head, partial RoPE, a real indexer with its own projections) over the
    `Llama` residual / MLP skeleton."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last_pos: dict[int, torch.Tensor] = {}

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(pos.to(self.device), ROTARY_DIM, self.rope_theta)
        return apply_rope(x, cos, sin)

    def qkv(self, layer: int, h: torch.Tensor, pos: torch.Tensor):
        c, p = self.config, f"layers.{layer}."
        T = h.shape[0]
        x = rms_norm(h, self.w[p + "attn_norm"], self.rms_eps)
        q = rms_norm((x @ self.w[p + "wq"].T).view(T, c.n_heads, c.head_dim), self.w[p + "q_norm"], self.rms_eps)
        k = rms_norm((x @ self.w[p + "wk"].T).view(T, c.n_kv_heads, c.head_dim), self.w[p + "k_norm"], self.rms_eps)
        v = (x @ self.w[p + "wv"].T).view(T, c.n_kv_heads, c.head_dim)
        self._last_pos[layer] = pos  # for index_qk calls that omit pos (the API's fallback)
        return self._rope(q, pos), self._rope(k, pos), v

    def index_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor, h: torch.Tensor, pos=None):
        c, p = self.config, f"layers.{layer}."
        T = h.shape[0]
        pos = self._last_pos.get(layer) if pos is None else pos
        if pos is None or pos.shape[0] != T:
            raise ValueError("synthetic-m3 index_qk needs the positions: pass pos= (or call qkv first)")
        x = rms_norm(h, self.w[p + "attn_norm"], self.rms_eps)
        iq = rms_norm((x @ self.w[p + "wiq"].T).view(T, c.index_heads, c.index_dim), self.w[p + "iq_norm"],
                      self.rms_eps)
        ik = rms_norm(x @ self.w[p + "wik"].T, self.w[p + "ik_norm"], self.rms_eps)     # [T, Di]
        return self._rope(iq, pos), self._rope(ik[:, None, :], pos)[:, 0, :]


def synthetic_m3_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights (fp32, CPU) with the outlier channels of the module docstring."""
    c = config
    w = random_llama_weights(c, ffn=1024, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    hidden_out = torch.randperm(c.hidden, generator=g)[:HIDDEN_OUTLIERS]
    w["embed"][:, hidden_out] *= HIDDEN_OUTLIER_GAIN
    for i in range(c.n_layers):
        p = f"layers.{i}."
        w[p + "wiq"] = torch.randn(c.index_heads * c.index_dim, c.hidden, generator=g) / c.hidden ** 0.5
        w[p + "wik"] = torch.randn(c.index_dim, c.hidden, generator=g) / c.hidden ** 0.5
        w[p + "q_norm"] = 1 + 0.1 * torch.randn(c.head_dim, generator=g)
        w[p + "iq_norm"] = 1 + 0.1 * torch.randn(c.index_dim, generator=g)
        for name, dim in (("k_norm", c.head_dim), ("ik_norm", c.index_dim)):
            norm = 1 + 0.1 * torch.randn(dim, generator=g)
            norm[torch.randperm(dim, generator=g)[:KEY_OUTLIERS]] *= KEY_OUTLIER_GAIN
            w[p + name] = norm
    return w


def load_synthetic_m3(device: torch.device | str = "cpu", seed: int = 0, layers: int | None = None,
                      **_) -> SyntheticM3:
    """`synthetic-m3` with `layers` decoder layers (default 2) and weights from `seed`. No tokenizer."""
    config = SYNTHETIC_M3 if layers is None else ModelConfig(**{**SYNTHETIC_M3.to_dict(), "n_layers": layers})
    return SyntheticM3(config, synthetic_m3_weights(config, seed), rms_eps=1e-6, rope_theta=5e6, device=device)
