"""End-to-end metrics of `kvtool decode` (SPEC section 6), accumulated step by step against the baseline.

Per position p (the logits at p predict token p + 1 of the stream):
- KL(p_base || p) in nats, from log-softmax in fp64;
- top-1 agreement: argmax of the candidate logits equals the baseline's;
- delta-p of the reference token (the stream's next token): p(tok) - p_base(tok), mean and RMS;
- perplexity ratio: exp(mean NLL of the reference token under the candidate) / the same under the baseline.
Positions are grouped in buckets 0-63, 64-127, 128-255, 256-511, ... (doubling after the first 64), plus `overall`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvtool.indexer import TopkAccumulator, TopkMetrics
from kvtool.metrics import ValueAccumulator

__all__ = [
    "BaseChunk", "BucketMetrics", "LayerAccumulator", "LayerMetrics", "StreamMetrics", "agreement_pct", "bucket_edges",
    "first_divergence"
]


def bucket_edges(n: int, first: int = 64) -> list[tuple[int, int]]:
    """[lo, hi) position buckets covering [0, n): [0, 64), [64, 128), [128, 256), ... (the last one cut at n)."""
    edges, lo, hi = [], 0, first
    while lo < n:
        edges.append((lo, min(hi, n)))
        lo, hi = hi, hi * 2
    return edges


@dataclass
class BucketMetrics:
    """Metrics over positions [lo, hi) (times the batch): `positions` counted, `scored` with a next token."""

    lo: int
    hi: int
    positions: int
    kl_mean: float
    kl_max: float
    top1_pct: float
    dp_mean: float
    dp_rms: float
    ppl_ratio: float
    scored: int


@dataclass
class _Sums:
    n: int = 0
    kl: float = 0.0
    kl_max: float = 0.0
    agree: int = 0
    scored: int = 0
    dp: float = 0.0
    dp_sq: float = 0.0
    nll_base: float = 0.0
    nll: float = 0.0

    def result(self, lo: int, hi: int) -> BucketMetrics:
        n, s = max(self.n, 1), max(self.scored, 1)
        ppl = math.exp((self.nll - self.nll_base) / s) if self.scored else 1.0
        return BucketMetrics(lo, hi, self.n, self.kl / n, self.kl_max, 100.0 * self.agree / n if self.n else 100.0,
                             self.dp / s, math.sqrt(self.dp_sq / s), ppl, self.scored)


@dataclass
class BaseChunk:
    """The baseline's side of one teacher-forced chunk, computed once and shared by every configuration compared
    against it: fp64 log-probabilities lb [B, T, V], probabilities pb, and the argmax [B, T]."""

    logits: torch.Tensor
    lb: torch.Tensor
    pb: torch.Tensor
    top: torch.Tensor

    @classmethod
    def of(cls, logits_base: torch.Tensor) -> "BaseChunk":
        lb = torch.log_softmax(logits_base.double(), dim=-1)
        return cls(logits_base, lb, lb.exp(), logits_base.argmax(-1))


@dataclass
class StreamMetrics:
    """Running per-position sums of one candidate against the baseline; `series` keeps per-position means over the
    batch (KL, top-1 %, delta-p) for plots and JSON; `values` keeps every (sequence, position) value (KL, top-1
    agreement, delta-p, NLL under both, has-a-next-token), the input of the bootstrap and the llama.cpp-style
    statistics (`decode_stats`)."""

    sums: dict[int, _Sums] = field(default_factory=dict)  # position -> sums over the batch
    series_kl: list[float] = field(default_factory=list)
    series_top1: list[float] = field(default_factory=list)
    series_dp: list[float] = field(default_factory=list)
    values: dict[str, list] = field(default_factory=dict)  # name -> chunks of [B, T] float64 / bool tensors

    def update(self, pos0: int, logits_base, logits: torch.Tensor, next_tok: torch.Tensor) -> None:
        """logits_base ([B, T, V] logits or their `BaseChunk`), logits: [B, T, V] at positions pos0 .. pos0+T-1;
        next_tok: LongTensor [B, T] the stream's next token (-1 where there is none, e.g. the stream's last
        position)."""
        base = logits_base if isinstance(logits_base, BaseChunk) else BaseChunk.of(logits_base)
        lb = base.lb
        lc = torch.log_softmax(logits.double(), dim=-1)  # the baseline's own function: equal logits give KL 0
        kl = (base.pb * (lb - lc)).sum(-1).clamp(min=0.0)                  # [B, T]; >= 0 up to rounding
        agree = base.top == logits.argmax(-1)                               # [B, T]
        has = (next_tok >= 0).to(lb.device)
        tok = next_tok.clamp(min=0).unsqueeze(-1).to(lb.device)
        nb, nc = -lb.gather(-1, tok)[..., 0], -lc.gather(-1, tok)[..., 0]  # [B, T]
        dp = (torch.exp(-nc) - torch.exp(-nb)) * has
        h = has.double()
        for name, v in (("kl", kl), ("agree", agree), ("dp", dp), ("has", has), ("nll_base", nb * h),
                        ("nll", nc * h)):
            self.values.setdefault(name, []).append(v.cpu())
        cols = torch.stack([kl.sum(0), kl.amax(0), agree.sum(0).double(), h.sum(0), dp.sum(0), dp.square().sum(0),
                            (nb * h).sum(0), (nc * h).sum(0)], dim=1).cpu().tolist()   # [T, 8] sums over the batch
        batch = kl.shape[0]
        for t, (k, kmax, a, n_sc, d, d2, n_b, n_c) in enumerate(cols):
            s = self.sums.setdefault(pos0 + t, _Sums())
            s.n += batch
            s.kl += k
            s.kl_max = max(s.kl_max, kmax)
            s.agree += int(a)
            s.scored += int(n_sc)
            s.dp += d
            s.dp_sq += d2
            s.nll_base += n_b
            s.nll += n_c
            self.series_kl.append(k / batch)
            self.series_top1.append(100.0 * a / batch)
            self.series_dp.append(d / max(n_sc, 1.0))

    def arrays(self) -> dict[str, "np.ndarray"]:
        """Every logged (sequence, position) value as numpy [B, N] (positions in stream order)."""
        import numpy as np  # noqa: PLC0415

        return {k: torch.cat(v, dim=1).numpy().astype(np.float64) for k, v in self.values.items()}

    def merged(self, lo: int, hi: int) -> BucketMetrics:
        total = _Sums()
        for p in range(lo, hi):
            s = self.sums.get(p)
            if s is None:
                continue
            total.n += s.n
            total.kl += s.kl
            total.kl_max = max(total.kl_max, s.kl_max)
            total.agree += s.agree
            total.scored += s.scored
            total.dp += s.dp
            total.dp_sq += s.dp_sq
            total.nll_base += s.nll_base
            total.nll += s.nll
        return total.result(lo, hi)

    def buckets(self, n: int) -> list[BucketMetrics]:
        return [self.merged(lo, hi) for lo, hi in bucket_edges(n)]

    def running(self) -> tuple[float, float]:
        """(mean KL, top-1 %) so far, for the live display."""
        m = self.merged(0, len(self.series_kl))
        return m.kl_mean, m.top1_pct


@dataclass
class LayerMetrics:
    """One layer over the run: the candidate's block selection against the baseline's (SPEC top-k metrics over the
    (head, query) rows where the selection is a choice, i.e. more valid blocks than top-k; `rows` 0 when no position
    got there; None in dense mode) and the attention output error (rel_l2, SPEC value metrics) against the
    baseline's output, accumulated over the run (upstream drift included: the candidate's own hidden states)."""

    layer: int
    topk: TopkMetrics | None
    attn_rel_l2: float
    attn_max_rel: float
    attn_cosine: float


class LayerAccumulator:
    """Per-layer running sums: `update(layer, ids, base_ids, base_scores, attn, base_attn)` per step."""

    def __init__(self, n_layers: int, sparse: bool):
        self.topk = [TopkAccumulator() for _ in range(n_layers)] if sparse else None
        self.attn = [ValueAccumulator() for _ in range(n_layers)]

    def update(self, layer: int, ids, base_ids, base_scores, attn: torch.Tensor, base_attn: torch.Tensor) -> None:
        """ids, base_ids: int32 [B, Hi, T, K]; base_scores: fp32 [B, Hi, T, NB] (the baseline's block scores, forced
        blocks included); attn, base_attn: fp32 [B, T, Hq, D]."""
        if self.topk is not None and ids is not None:
            self.topk[layer].update(ids, base_ids, base_scores)
        self.attn[layer].update(attn, base_attn)

    def result(self) -> list[LayerMetrics]:
        out = []
        for i, acc in enumerate(self.attn):
            v = acc.result()
            out.append(LayerMetrics(i, self.topk[i].result() if self.topk else None, v.rel_l2, v.max_rel, v.cosine))
        return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two generations (None if equal over their common length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def agreement_pct(a: list[int], b: list[int]) -> float:
    """% of positions where two generations hold the same token."""
    n = min(len(a), len(b))
    return 100.0 * sum(x == y for x, y in zip(a, b)) / n if n else 100.0
