"""How far to trust a `kvtool decode` number: bootstrap intervals, the noise floor, and llama.cpp's statistics.

Input: the per-(sequence, position) values that `StreamMetrics` logs for each configuration against the baseline
(KL, top-1 agreement, delta-p of the stream's next token, both NLLs, has-a-next-token), numpy [B, N].

- **Bootstrap** (`bootstrap`): a two-stage resample, documents (the B sequences) with replacement, then within each
  chosen document blocks of `BLOCK` consecutive positions with replacement (a moving-block bootstrap: neighbouring
  positions share most of their context, so single positions are not independent). Every configuration uses the SAME
  resample indices, so differences between two configurations are paired; a configuration pair whose difference
  interval contains 0 is reported as not distinguishable. Percentile intervals (`LEVEL`, default 95 %). With one
  document the interval is over positions only (it says so: `basis`).
- **Noise floor**: the baseline against itself under a harmless change (the decode workflow runs it; here it is
  one more configuration), so every KL / top-1 / delta-p reads against what rounding noise alone gives.
- **llama.cpp's set** (`llama_stats`): the statistics `llama-perplexity --kl-divergence` prints, under its names
  (tools/perplexity/perplexity.cpp): "Mean    KLD" ... "Same top p", its percentiles (linear interpolation at
  fraction * (n - 1)), its +- uncertainties (standard error of the mean), delta-p in percent. Computed over the
  positions that have a next token, as llama.cpp scores them (llama.cpp scores only the second half of each of its
  chunks; kvtool scores every position, so compare like with like by position range).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "BLOCK", "Comparison", "Confidence", "DP_HIGH", "DP_LOW", "Interval", "KLD_LOW", "KLD_PERCENTILES", "LEVEL",
    "METRICS", "RESAMPLES", "Resampler", "bootstrap", "llama_lines", "llama_stats"
]

BLOCK = 16  # positions per bootstrap block (bucket edges 64, 128, ... are multiples)
RESAMPLES = 1000
LEVEL = 0.95
METRICS = ("kl_mean", "top1_pct", "dp_mean", "dp_rms", "ppl_ratio")


@dataclass
class Interval:
    """A point estimate and its bootstrap percentile interval [lo, hi]."""

    value: float
    lo: float
    hi: float

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi


@dataclass
class Comparison:
    """Paired bootstrap of `a - b` for each metric; `distinguishable` False when every interval contains 0."""

    a: str
    b: str
    diff: dict[str, Interval]
    distinguishable: bool
    differs_on: list[str] = field(default_factory=list)


def _block_sums(v: dict[str, np.ndarray], lo: int, hi: int, block: int) -> np.ndarray:
    """Per (sequence, block) sums over positions [lo, hi): [B, nblocks, 7] of (count, kl, agree, scored, dp, dp^2,
    nll - nll_base)."""
    sl = slice(lo, hi)
    cols = [np.ones_like(v["kl"][:, sl]), v["kl"][:, sl], v["agree"][:, sl], v["has"][:, sl], v["dp"][:, sl],
            v["dp"][:, sl] ** 2, v["nll"][:, sl] - v["nll_base"][:, sl]]
    x = np.stack(cols, axis=-1)                                                   # [B, n, 7]
    n = x.shape[1]
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        x = np.concatenate([x, np.zeros((x.shape[0], pad, 7))], axis=1)
    return x.reshape(x.shape[0], nb, block, 7).sum(axis=2)


def _metrics(s: np.ndarray) -> np.ndarray:
    """Sums [..., 7] -> metrics [..., 5] in METRICS order."""
    n, scored = np.maximum(s[..., 0], 1), np.maximum(s[..., 3], 1)
    return np.stack([s[..., 1] / n, 100.0 * s[..., 2] / n, s[..., 4] / scored, np.sqrt(s[..., 5] / scored),
                     np.exp(s[..., 6] / scored)], axis=-1)


class Resampler:
    """Fixed resample indices (documents, then blocks within each document) shared by every configuration."""

    def __init__(self, n_docs: int, n_blocks: int, resamples: int = RESAMPLES, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.docs = rng.integers(0, n_docs, size=(resamples, n_docs))               # [R, B]
        self.blocks = rng.integers(0, n_blocks, size=(resamples, n_docs, n_blocks))  # [R, B, nb]
        self.basis = (f"{n_docs} documents x {n_blocks} blocks of {BLOCK} positions" if n_docs > 1 else
                      f"1 document: {n_blocks} blocks of {BLOCK} positions (no document-to-document spread)")

    def resampled_metrics(self, sums: np.ndarray) -> np.ndarray:
        """Block sums [B, nb, 7] -> metrics of every resample [R, 5]."""
        picked = sums[self.docs[:, :, None], self.blocks]                          # [R, B, nb, 7]
        return _metrics(picked.sum(axis=(1, 2)))


def _interval(point: float, samples: np.ndarray, level: float = LEVEL) -> Interval:
    a = (1 - level) / 2
    lo, hi = np.quantile(samples, [a, 1 - a])
    return Interval(float(point), float(lo), float(hi))


@dataclass
class Confidence:
    """Bootstrap intervals of each configuration's metrics (overall and per bucket) and the paired comparisons."""

    basis: str
    level: float
    resamples: int
    overall: dict[str, dict[str, Interval]]           # label -> metric -> interval
    buckets: dict[str, list[dict[str, Interval]]]     # label -> per bucket: metric -> interval
    comparisons: list[Comparison]


def bootstrap(values: dict[str, dict[str, np.ndarray]], edges: list[tuple[int, int]], floor: str | None = None,
              resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> Confidence:
    """values: label -> the logged arrays of that configuration (all the same [B, N]); edges: the position buckets.
    Comparisons: every candidate against the floor (when given), then every pair of candidates."""
    labels = list(values)
    some = next(iter(values.values()))
    n_docs, n = some["kl"].shape
    res = Resampler(n_docs, -(-n // BLOCK), resamples, seed)
    samples, overall, buckets = {}, {}, {}
    for label, v in values.items():
        sums = _block_sums(v, 0, n, BLOCK)
        point = _metrics(sums.sum(axis=(0, 1)))
        samples[label] = res.resampled_metrics(sums)
        overall[label] = {m: _interval(point[i], samples[label][:, i], level) for i, m in enumerate(METRICS)}
        per = []
        for lo, hi in edges:  # each bucket resampled on its own blocks (same document draw)
            bs = _block_sums(v, lo, hi, BLOCK)
            rb = Resampler(n_docs, bs.shape[1], resamples, seed + 1 + lo)
            bp, bsamp = _metrics(bs.sum(axis=(0, 1))), rb.resampled_metrics(bs)
            per.append({m: _interval(bp[i], bsamp[:, i], level) for i, m in enumerate(METRICS)})
        buckets[label] = per
    pairs = [(c, floor) for c in labels if floor is not None and c != floor]
    cands = [c for c in labels if c != floor]
    pairs += [(a, b) for i, a in enumerate(cands) for b in cands[i + 1:]]
    comparisons = []
    for a, b in pairs:
        d = samples[a] - samples[b]
        diff = {m: _interval(overall[a][m].value - overall[b][m].value, d[:, i], level)
                for i, m in enumerate(METRICS)}
        differs = [m for m, iv in diff.items() if not iv.contains(0.0)]
        comparisons.append(Comparison(a, b, diff, bool(differs), differs))
    return Confidence(res.basis, level, resamples, overall, buckets, comparisons)


# ------------------------------------------------------------------------------------------ llama.cpp's statistics
def _percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation at fraction * (n - 1) of the sorted values."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)])


def _median(sorted_values: np.ndarray) -> float:
    n = len(sorted_values)
    return float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2])


def _mean_unc(x: np.ndarray) -> tuple[float, float]:
    """llama.cpp's mean_and_uncertainty: mean and sqrt(var / (n - 1)) (0 for n <= 10)."""
    n = len(x)
    if n < 1:
        return 0.0, 0.0
    f = float(x.sum() / n)
    df = float((x * x).sum() / n - f * f)
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


KLD_PERCENTILES = (("99.9%   KLD", 0.999), ("99.0%   KLD", 0.990), ("95.0%   KLD", 0.950), ("90.0%   KLD", 0.900))
KLD_LOW = (("10.0%   KLD", 0.100), (" 5.0%   KLD", 0.050), (" 1.0%   KLD", 0.010), (" 0.1%   KLD", 0.001))
DP_HIGH = (("99.9%   Δp", 0.999), ("99.0%   Δp", 0.990), ("95.0%   Δp", 0.950), ("90.0%   Δp", 0.900),
           ("75.0%   Δp", 0.750))
DP_LOW = (("25.0%   Δp", 0.250), ("10.0%   Δp", 0.100), (" 5.0%   Δp", 0.050), (" 1.0%   Δp", 0.010),
          (" 0.1%   Δp", 0.001))


def llama_stats(v: dict[str, np.ndarray]) -> dict[str, object]:
    """llama.cpp `--kl-divergence` statistics of one configuration (module docstring). Keys are llama.cpp's printed
    names (leading space kept for " 5.0%   KLD" and the like); a value with an uncertainty is [value, +-]. Delta-p
    and "Same top p" are in percent, as llama.cpp prints them. Empty when no position has a next token."""
    has = v["has"].astype(bool).reshape(-1)
    if not has.any():
        return {}
    kld = np.sort(v["kl"].reshape(-1)[has])
    dp = np.sort(v["dp"].reshape(-1)[has])
    nll, nll_b = v["nll"].reshape(-1)[has], v["nll_base"].reshape(-1)[has]
    same = v["agree"].reshape(-1)[has]
    n = len(kld)
    out: dict[str, object] = {}
    lq, lq_u = _mean_unc(nll)
    lb, lb_u = _mean_unc(nll_b)
    cov = float((nll * nll_b).sum() / n - (nll.sum() / n) * (nll_b.sum() / n)) / (n - 1) if n >= 10 else 0.0
    ppl_q, ppl_b = math.exp(lq), math.exp(lb)
    out["Mean PPL(Q)"] = [ppl_q, ppl_q * lq_u]
    out["Mean PPL(base)"] = [ppl_b, ppl_b * lb_u]
    out["Cor(ln(PPL(Q)), ln(PPL(base)))"] = 100.0 * cov / (lq_u * lb_u) if lq_u * lb_u > 0 else None
    ratio_u = math.sqrt(max(lq_u ** 2 + lb_u ** 2 - 2 * cov, 0.0))
    out["Mean ln(PPL(Q)/PPL(base))"] = [lq - lb, ratio_u]
    out["Mean PPL(Q)/PPL(base)"] = [math.exp(lq - lb), math.exp(lq - lb) * ratio_u]
    diff_u = math.sqrt(max((ppl_q * lq_u) ** 2 + (ppl_b * lb_u) ** 2 - 2 * ppl_q * ppl_b * cov, 0.0))
    out["Mean PPL(Q)-PPL(base)"] = [ppl_q - ppl_b, diff_u]
    out["Mean    KLD"] = list(_mean_unc(kld))
    out["Maximum KLD"] = float(kld[-1])
    out.update({name: _percentile(kld, f) for name, f in KLD_PERCENTILES})
    out["Median  KLD"] = _median(kld)
    out.update({name: _percentile(kld, f) for name, f in KLD_LOW})
    out["Minimum KLD"] = float(kld[0])
    m, u = _mean_unc(dp)
    out["Mean    Δp"] = [100.0 * m, 100.0 * u]
    out["Maximum Δp"] = 100.0 * float(dp[-1])
    out.update({name: 100.0 * _percentile(dp, f) for name, f in DP_HIGH})
    out["Median  Δp"] = 100.0 * _median(dp)
    out.update({name: 100.0 * _percentile(dp, f) for name, f in DP_LOW})
    out["Minimum Δp"] = 100.0 * float(dp[0])
    mse, mse_u = _mean_unc(dp * dp)
    rms = math.sqrt(mse)
    out["RMS Δp"] = [100.0 * rms, 100.0 * (0.5 / rms * mse_u if rms > 0 else 0.0)]
    top = float(same.mean())
    out["Same top p"] = [100.0 * top, 100.0 * math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0]
    return out


def llama_lines(stats: dict[str, object]) -> list[str]:
    """The statistics as llama.cpp prints them (its three sections, its label widths), for the text report."""
    def val(key, fmt="{:10.6f}", pct=False):
        x = stats[key]
        suffix = " %" if pct else ""
        if isinstance(x, list):
            return f"{fmt.format(x[0])} ± {fmt.format(x[1])}{suffix}"
        return "-" if x is None else fmt.format(x) + ("%" if pct else "")

    lines = ["====== Perplexity statistics ======"]
    for key in ("Mean PPL(Q)", "Mean PPL(base)"):
        lines.append(f"{key:<30}: {val(key)}")
    cor = stats["Cor(ln(PPL(Q)), ln(PPL(base)))"]
    lines.append("Cor(ln(PPL(Q)), ln(PPL(base))): " + ("-" if cor is None else f"{cor:6.2f}%"))
    for key in ("Mean ln(PPL(Q)/PPL(base))", "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)"):
        lines.append(f"{key:<30}: {val(key)}")
    lines += ["", "====== KL divergence statistics ======"]
    for key in ["Mean    KLD", "Maximum KLD"] + [k for k, _ in KLD_PERCENTILES] + ["Median  KLD"] + \
            [k for k, _ in KLD_LOW] + ["Minimum KLD"]:
        lines.append(f"{key}: {val(key)}")
    lines += ["", "====== Token probability statistics ======"]
    lines.append(f"Mean    Δp: {stats['Mean    Δp'][0]:6.3f} ± {stats['Mean    Δp'][1]:5.3f} %")
    for key in ["Maximum Δp"] + [k for k, _ in DP_HIGH] + ["Median  Δp"] + [k for k, _ in DP_LOW] + ["Minimum Δp"]:
        lines.append(f"{key}: {stats[key]:6.3f}%")
    lines.append(f"RMS Δp    : {stats['RMS Δp'][0]:6.3f} ± {stats['RMS Δp'][1]:5.3f} %")
    lines.append(f"Same top p: {stats['Same top p'][0]:6.3f} ± {stats['Same top p'][1]:5.3f} %")
    return lines
