"""Metric definitions (SPEC section 6), one implementation used everywhere.

Value metrics compare a candidate `a` with a reference `b`: `rel_l2 = |a - b| / |b|`, `max_rel = max|a - b| / max|b|`,
`max_abs`, SQNR dB `= 10 log10(sum b^2 / sum (a - b)^2)`, cosine. Sums run in fp64. `ValueAccumulator` gives the same
numbers over a stream of chunks, so files larger than memory are compared chunk by chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ValueAccumulator", "ValueMetrics", "value_metrics"]


@dataclass
class ValueMetrics:
    rel_l2: float
    max_rel: float
    max_abs: float
    sqnr_db: float
    cosine: float
    numel: int


@dataclass
class ValueAccumulator:
    """Running sums for ValueMetrics; `update(a, b)` per chunk, `result()` at the end."""

    sum_sq_diff: float = 0.0
    sum_sq_ref: float = 0.0
    sum_sq_cand: float = 0.0
    dot: float = 0.0
    max_abs_diff: float = 0.0
    max_abs_ref: float = 0.0
    numel: int = 0

    def update(self, a: torch.Tensor, b: torch.Tensor) -> "ValueAccumulator":
        a = a.detach().double().reshape(-1)
        b = b.detach().double().reshape(-1)
        if a.shape != b.shape:
            raise ValueError(f"metric inputs differ in size: {a.numel()} vs {b.numel()}")
        if a.numel() == 0:
            return self
        d = a - b
        self.sum_sq_diff += float(d.square().sum())
        self.sum_sq_ref += float(b.square().sum())
        self.sum_sq_cand += float(a.square().sum())
        self.dot += float((a * b).sum())
        self.max_abs_diff = max(self.max_abs_diff, float(d.abs().max()))
        self.max_abs_ref = max(self.max_abs_ref, float(b.abs().max()))
        self.numel += a.numel()
        return self

    def result(self) -> ValueMetrics:
        return ValueMetrics(
            rel_l2=_ratio(math.sqrt(self.sum_sq_diff), math.sqrt(self.sum_sq_ref)),
            max_rel=_ratio(self.max_abs_diff, self.max_abs_ref),
            max_abs=self.max_abs_diff,
            sqnr_db=_sqnr(self.sum_sq_ref, self.sum_sq_diff),
            cosine=_cosine(self.dot, self.sum_sq_cand, self.sum_sq_ref),
            numel=self.numel,
        )


def value_metrics(a: torch.Tensor, b: torch.Tensor) -> ValueMetrics:
    """Metrics of candidate `a` against reference `b` (any shapes with equal numel)."""
    return ValueAccumulator().update(a, b).result()


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _cosine(dot: float, sq_a: float, sq_b: float) -> float:
    if sq_a == 0.0 and sq_b == 0.0:
        return 1.0
    if sq_a == 0.0 or sq_b == 0.0:
        return 0.0
    return dot / math.sqrt(sq_a * sq_b)
