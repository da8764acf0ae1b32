"""The per-configuration cache of `kvtool decode`: one (K/V format, index format) pair, every layer, B sequences.

Per layer a `ConfigCache` holds `PagedCache`s (SPEC section 5): K and V ([pages, Hkv, page bytes] each; on CPU one
cache of 2*Hkv heads, K heads then V heads, see `fused`) and, in sparse mode, the index keys ([pages, 1, page bytes]:
one shared index key per token, as in M3). Every decode step
writes the new tokens through `store` (quantize-on-write), exactly as an engine does.

What attention reads:
- CPU (`shadow=True`): cached tokens never change after they are written, so each token is decoded once, right after
  its store, into an fp32 shadow of the dequantized cache. Attention and the indexer read the shadow:
  they see exactly the values a dequantize of the paged bytes would give at every step (a test checks this), at close
  to bf16 speed (no per-step re-decode of the whole context). The shadow is head-major [B, H, max_len, D], so the
  matmuls read each head's tokens in place.
- CUDA (`shadow=False`): the Triton kernels read the paged bytes directly (`block_table`, `slots`); the torch fallback
  dequantizes the tokens it needs from the paged bytes on demand.

Whole-tensor scales (fp8 `tensor`, nvfp4 `auto`) are frozen at the first store (the first prefill chunk), as
`PagedCache` documents.

`PlainCache` is the reference for speed: a contiguous bf16 K/V tensor cache with no paging and no codec, what a plain
bf16 dense decode keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool import backend as kv_backend
from kvtool.formats import Format, get_format, rotation
from kvtool.paged import PagedCache, contiguous_slots

__all__ = [
    "CacheSpec", "ConfigCache", "PlainCache", "attend_triton", "select_triton", "short_label"
]


@dataclass(frozen=True)
class CacheSpec:
    """One configuration: the K/V cache format and the index-key cache format (None in dense mode)."""

    kv: Format
    index: Format | None

    @property
    def label(self) -> str:
        """`K/V / index` with each format's short label (`nvfp4 / nvfp4`, `mxfp4-floor / fp8`)."""
        kv = short_label(self.kv)
        return kv if self.index is None else f"{kv} / {short_label(self.index)}"

    def bytes_per_token(self, n_layers: int, n_kv_heads: int, head_dim: int, index_dim: int) -> int:
        """Cache bytes per token over all layers: K + V (Hkv heads each) + one shared index key (SPEC section 4)."""
        per_layer = 2 * n_kv_heads * self.kv.bytes_per_token(head_dim)
        if self.index is not None:
            per_layer += self.index.bytes_per_token(index_dim)
        return n_layers * per_layer


def short_label(fmt: Format) -> str:
    """The format's label without the options that equal its family's defaults (`nvfp4-rcp` -> `nvfp4`,
    `mxfp4-floor` stays, `fp8-unit` -> `fp8`). Parses back to the same format."""
    default = get_format(fmt.family).label.split("-")[1:]
    parts = fmt.unrotated.label.split("-")
    return "-".join(parts[:1] + [p for p in parts[1:] if p not in default]) + rotation.label_suffix(fmt.rotation)


class ConfigCache:
    """Paged K, V and index-key caches of one `CacheSpec` for every layer of a model, for B sequences of up to
    `max_len` tokens each. Sequence b owns its own run of pages (`block_table` [B, pages] int32, `slots` [B, max_len]
    int64, slot = page * page_size + offset)."""

    def __init__(self, spec: CacheSpec, n_layers: int, n_kv_heads: int, head_dim: int, index_dim: int, batch: int,
                 max_len: int, page_size: int, device: str | torch.device = "cpu", shadow: bool = True,
                 store_backend: str = "auto", validate: bool = True):
        self.spec, self.batch, self.max_len, self.shadow, self.page_size = spec, batch, max_len, shadow, page_size
        self.store_backend, self.validate = store_backend, validate  # validate: the store's finite / slot checks
        table, slots = contiguous_slots([max_len] * batch, page_size)
        self.block_table = table.to(device)                          # [B, pages_per_seq] int32
        self.slots = torch.stack(slots).to(device)                   # [B, max_len] int64
        n_pages = int(table.max()) + 1

        def paged(fmt: Format, heads: int, dim: int) -> list[PagedCache]:
            return [PagedCache.allocate(fmt, n_pages, page_size, heads, dim, device) for _ in range(n_layers)]

        def plane(heads: int, dim: int) -> list[torch.Tensor]:  # head-major, so each head's tokens are contiguous
            return [torch.zeros(batch, heads, max_len, dim, device=device) for _ in range(n_layers)] if shadow else []

        # CPU: K and V of a layer share one PagedCache of 2*Hkv heads ([K heads | V heads], and the index key as one
        # more head when it has the same format and dim), so each step pays one quantize call for all of them (the
        # codec's per-call overhead dominates at one token). Not with whole-tensor scales, where each tensor keeps
        # its own amax, and not for the kernels, which read separate caches.
        self.fused = shadow and not spec.kv.needs_tensor_amax
        self.index_fused = self.fused and spec.index == spec.kv and index_dim == head_dim
        self.n_kv_heads = n_kv_heads
        if self.fused:
            heads = 2 * n_kv_heads + int(self.index_fused)
            self.kv_paged, self.k, self.v = paged(spec.kv, heads, head_dim), [], []
            self.kv_deq = plane(heads, head_dim)
        else:
            self.k, self.v = paged(spec.kv, n_kv_heads, head_dim), paged(spec.kv, n_kv_heads, head_dim)
            self.k_deq, self.v_deq = plane(n_kv_heads, head_dim), plane(n_kv_heads, head_dim)
        separate_index = spec.index is not None and not self.index_fused
        self.ik = paged(spec.index, 1, index_dim) if separate_index else []
        self.ik_deq = plane(1, index_dim) if separate_index else []

    def _store(self, cache: PagedCache, shadow: list[torch.Tensor], layer: int, pos: torch.Tensor,
               x: torch.Tensor) -> None:
        """x [B, T, H, D] at positions pos [T] -> paged bytes (and the decoded shadow when kept)."""
        slots = self.slots[:, pos].reshape(-1)                        # [B*T]
        flat = x.reshape(-1, *x.shape[2:])                            # [B*T, H, D]
        store = getattr(kv_backend, "store", None)                    # B's kernel dispatch, when present
        if store is not None:
            store(cache, flat, slots, backend=self.store_backend, validate=self.validate)
        else:
            cache.store(flat, slots)
        if self.shadow:
            shadow[layer][:, :, pos] = cache.dequantize(slots).view(x.shape).transpose(1, 2)  # [B, H, T, D]

    def update(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ik: torch.Tensor | None) -> None:
        """Write the new tokens of `layer`: pos [T] (the same positions in every sequence), k, v [B, T, Hkv, D],
        ik [B, T, Di] (None in dense mode). Quantize-on-write through `store`."""
        has_ik = self.spec.index is not None and ik is not None
        if self.fused:
            parts = [k, v] + ([ik.unsqueeze(2)] if self.index_fused and has_ik else [])
            self._store(self.kv_paged[layer], self.kv_deq, layer, pos, torch.cat(parts, dim=2))
        else:
            self._store(self.k[layer], self.k_deq, layer, pos, k)
            self._store(self.v[layer], self.v_deq, layer, pos, v)
        if has_ik and not self.index_fused:
            self._store(self.ik[layer], self.ik_deq, layer, pos, ik.unsqueeze(2))

    def kv(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized K, V of sequence b's first `length` tokens: fp32 [length, Hkv, D] each."""
        h = self.n_kv_heads
        if self.fused:
            kv = self.kv_deq[layer][b, :2 * h, :length].transpose(0, 1)  # [length, 2*Hkv, D] (a view)
            return kv[:, :h], kv[:, h:]
        if self.shadow:
            return self.k_deq[layer][b, :, :length].transpose(0, 1), self.v_deq[layer][b, :, :length].transpose(0, 1)
        slots = self.slots[b, :length]
        return self.k[layer].dequantize(slots), self.v[layer].dequantize(slots)

    def index_keys(self, layer: int, b: int, length: int) -> torch.Tensor:
        """The dequantized index keys of sequence b's first `length` tokens: fp32 [length, Di]."""
        if self.index_fused:
            return self.kv_deq[layer][b, 2 * self.n_kv_heads, :length]
        if self.shadow:
            return self.ik_deq[layer][b, 0, :length]
        return self.ik[layer].dequantize(self.slots[b, :length])[:, 0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the paged caches (not the shadow)."""
        return sum(c.data.numel() for c in self.k + self.v + self.ik + (self.kv_paged if self.fused else []))


class PlainCache:
    """A plain contiguous bf16 K/V cache [B, Hkv, max_len, D] per layer (no paging, no index, no codec): the speed
    reference `kvtool decode` reports beside the paged configurations."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, batch: int, max_len: int,
                 device: str | torch.device = "cpu"):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.batch = batch
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(n_layers)]

    def update(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ik=None) -> None:
        """k, v [B, T, Hkv, D] at positions pos [T]."""
        self.k[layer][:, :, pos] = k.transpose(1, 2).to(torch.bfloat16)
        self.v[layer][:, :, pos] = v.transpose(1, 2).to(torch.bfloat16)

    def kv(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [length, Hkv, D] K and V of sequence b."""
        return (self.k[layer][b, :, :length].transpose(0, 1).float(),
                self.v[layer][b, :, :length].transpose(0, 1).float())

    def attend(self, layer: int, q: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """Dense causal attention over the first `length` tokens, batched: q [B, T, Hq, D] at positions pos [T] ->
        fp32 [B, T, Hq, D]. CUDA: torch's fused SDPA in bf16 (a decode step folds the G query heads of a KV head into
        G query rows of one head: plain MHA, any backend; prefill uses enable_gqa and a causal mask). CPU: fp32
        matmuls with the same folding (torch's CPU SDPA kernel runs tiny decode steps 10-50x slower on a loaded
        2-core machine, which would flatter every comparison against this reference)."""
        B, T, hq, D = q.shape
        hkv = self.k[layer].shape[1]
        g = hq // hkv
        mask = None if T == 1 else torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [T, S]
        if q.is_cuda:
            k, v = self.k[layer][:, :, :length], self.v[layer][:, :, :length]       # k, v: [B, Hkv, S, D] bf16
            if T == 1:
                out = F.scaled_dot_product_attention(q.view(B, hkv, g, D).to(k.dtype), k, v)  # [B, Hkv, G, D]
                return out.reshape(B, 1, hq, D).float()
            out = F.scaled_dot_product_attention(q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask,
                                                 enable_gqa=True)                # [B, Hq, T, D]
            return out.transpose(1, 2).float()
        k, v = self.k[layer][:, :, :length].float(), self.v[layer][:, :, :length].float()
        qg = q.permute(0, 2, 1, 3).reshape(B, hkv, g * T, D)                      # qg: [B, Hkv, G*T, D]
        scores = (qg @ k.transpose(2, 3)).view(B, hkv, g, T, length) * (1.0 / math.sqrt(D))
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        out = torch.softmax(scores, dim=-1).view(B, hkv, g * T, length) @ v        # out: [B, Hkv, G*T, D]
        return out.view(B, hq, T, D).transpose(1, 2)


# --------------------------------------------------------------------------------------------- the Triton reads
def select_triton(cache: ConfigCache, layer: int, iq: torch.Tensor, pos: torch.Tensor, length: int, cfg,
                  with_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block selection from the paged index cache by the Triton scorer (C's kernels): iq [B, T, Hi, Di] (cast to
    bf16, as the kernels take it) at positions pos [T] (`length` = pos[-1] + 1, known on the host) -> ids int32
    [B, Hi, T, K] and, when asked, block scores fp32 [B, Hi, T, NB] (for the per-layer comparison)."""
    B, T = iq.shape[:2]
    ctx = torch.full((B,), length, dtype=torch.int32, device=iq.device)
    q_pos = pos[None].expand(B, T).to(torch.int32)
    index = (iq, cache.ik[layer], cache.block_table, ctx, cfg)  # the kernel takes bf16, rotated as the keys are
    ids = kv_backend.triton_index_topk(*index, q_pos=None if T == 1 else q_pos, dtype=torch.bfloat16)
    ids = ids.transpose(1, 2)                                                                # [B, Hi, T, K]
    scores = None
    if with_scores:
        scores = kv_backend.triton_index_block_scores(*index, q_pos=q_pos, dtype=torch.bfloat16,
                                                      max_context=length).transpose(1, 2)  # [B, Hi, T, NB]
    return ids, scores


def attend_triton(cache: ConfigCache, layer: int, q: torch.Tensor, pos: torch.Tensor, length: int,
                  ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sparse attention over the paged K/V by D's kernels: q [B, T, Hq, D] (cast to bf16), positions pos [T], block
    ids int32 [B, Hkv, T, K] -> fp32 [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    k, v, table = cache.k[layer], cache.v[layer], cache.block_table  # the kernel takes bf16 q, rotated as K / V
    if T == 1:
        ctx = torch.full((B,), length, dtype=torch.int32, device=q.device)
        out = kv_backend.triton_sparse_decode(q[:, 0].contiguous(), k, v, table, ctx, ids[:, :, 0].contiguous(),
                                              block_size, dtype=torch.bfloat16, out_dtype=torch.float32)
        return out[:, None]
    q_req = torch.arange(B, dtype=torch.int32, device=q.device).repeat_interleave(T)        # [B*T]
    q_pos = pos.to(torch.int32).repeat(B)                                                   # [B*T]
    sel = ids.permute(0, 2, 1, 3).reshape(B * T, ids.shape[1], ids.shape[3]).contiguous()  # [B*T, Hkv, K]
    out = kv_backend.triton_sparse_prefill(q.reshape(B * T, Hq, D), k, v, table, q_req, q_pos, sel, block_size,
                                           dtype=torch.bfloat16, out_dtype=torch.float32)
    return out.view(B, T, Hq, D)

