"""Does a cache read with some geometry look like a real cache? Heuristics that catch a wrong layout or geometry.

A wrong page size, head count or layout makes kvtool read payload bytes as scales (and the reverse). Payload bytes of
packed E2M1 codes look like random bytes, so as E8M0 scales they spread over the whole exponent range and hit 0xFF
(NaN); as E4M3 scales half of them have the sign bit set; as fp32 they give absurd or negative values. Real caches do
none of that: their block scales cluster within a few tens of binades, are never NaN and never negative.
"""

from __future__ import annotations

import torch

from kvtool.formats import QTensor

__all__ = ["E8M0_NAN", "MAX_FP32_SPREAD_BINADES", "MAX_SCALE_SPREAD_BINADES", "check_plausible"]

E8M0_NAN = 0xFF
# Real KV / index caches keep their block exponents within ~20 binades; random bytes spread over ~250.
MAX_SCALE_SPREAD_BINADES = 40
# fp32 per-token scales of real data stay within this many binades of each other.
MAX_FP32_SPREAD_BINADES = 60
_SAMPLE = 1 << 20  # torch.quantile limit is 16M elements; a sample is plenty for a percentile


def _pct(count: int, total: int) -> str:
    return f"{count} of {total}, {100.0 * count / max(total, 1):.2g}%"


def _spread(values: torch.Tensor) -> tuple[float, float]:
    """1st and 99th percentile of a float tensor (sampled when large)."""
    flat = values.reshape(-1).float()
    if flat.numel() > _SAMPLE:
        flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:_SAMPLE]]
    q = torch.quantile(flat, torch.tensor([0.01, 0.99]))
    return float(q[0]), float(q[1])


def _check_one(name: str, q: QTensor) -> list[str]:
    out = []
    hint = "wrong layout or geometry?"
    fmt, elem = q.fmt, q.fmt.scale_element
    if fmt.element is not None and fmt.element.nan_code is not None:  # E4M3FN: 0x7F / 0xFF are NaN
        codes = q.payload.reshape(-1).view(torch.uint8)
        nan = int(((codes & fmt.element.magnitude_mask) == fmt.element.nan_code).sum())
        if nan:
            out.append(f"{name}: {fmt.element.name.upper()} payload has NaN codes ({_pct(nan, codes.numel())}); "
                       f"{hint}")
    elif not fmt.is_quantized:
        bad = int((~torch.isfinite(q.payload.float())).sum())
        if bad:
            out.append(f"{name}: bf16 payload has non-finite values ({_pct(bad, q.payload.numel())}); {hint}")
    if q.scales is None or q.scales.numel() == 0:
        return out
    if elem == "e8m0":
        b = q.scales.reshape(-1).view(torch.uint8)
        nan = int((b == E8M0_NAN).sum())
        if nan:
            out.append(f"{name}: E8M0 scale bytes 0xFF (NaN) ({_pct(nan, b.numel())}); {hint}")
        live = b[(b != 0) & (b != E8M0_NAN)]
        if live.numel() > 1:
            lo, hi = _spread(live)
            if hi - lo > MAX_SCALE_SPREAD_BINADES:
                out.append(f"{name}: E8M0 scales spread over 2^{lo - 127:.0f}..2^{hi - 127:.0f} "
                           f"({hi - lo:.0f} binades; real caches span < {MAX_SCALE_SPREAD_BINADES}); {hint}")
    elif elem == "e4m3":
        b = q.scales.reshape(-1).view(torch.uint8)
        neg = int(((b & 0x80) != 0).sum())
        nan = int(((b & 0x7F) == 0x7F).sum())
        if neg:
            out.append(f"{name}: E4M3 block scales with the sign bit set ({_pct(neg, b.numel())}); {hint}")
        if nan:
            out.append(f"{name}: E4M3 block scales that are NaN ({_pct(nan, b.numel())}); {hint}")
    else:  # fp32 per token or per tensor
        s = q.scales.reshape(-1).float()
        bad = int((~torch.isfinite(s)).sum())
        neg = int((s < 0).sum())
        if bad:
            out.append(f"{name}: fp32 scales that are NaN/Inf ({_pct(bad, s.numel())}); {hint}")
        if neg:
            out.append(f"{name}: negative fp32 scales ({_pct(neg, s.numel())}); {hint}")
        pos = s[torch.isfinite(s) & (s > 0)]
        if pos.numel() > 1:
            lo, hi = _spread(torch.log2(pos))
            if hi - lo > MAX_FP32_SPREAD_BINADES:
                out.append(f"{name}: fp32 scales spread over 2^{lo:.0f}..2^{hi:.0f} ({hi - lo:.0f} binades); {hint}")
    return out


def check_plausible(tensors: dict) -> list[str]:
    """Warnings (one line each, empty when all looks plausible) for {name: QTensor} read from a dump: E8M0 scale
    bytes that are 0xFF or spread over an implausible exponent range, E4M3 scales with the sign bit set or NaN,
    E4M3 payload NaN codes, non-finite bf16 values, fp32 scales that are negative, non-finite or absurdly spread."""
    out = []
    for name, q in tensors.items():
        out.extend(_check_one(name, q))
    return out
