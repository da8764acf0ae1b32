"""Statistics of codes, exponents and scales that the detectors share (plain torch, CPU).

A quantized subject is looked at as scale groups: [rows, groups per row, group] element-code magnitudes, where a
group is one block (nvfp4 16, mxfp4 32) or one row (fp8, whose per-token scale covers the row). Row r of a
[N, H, D] tensor is token r // H, head r % H (token-major, as kvtool and the layouts read it).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvtool.formats import E2M1, E4M3, e2m1_decode, e4m3_decode, unpack_nibbles

__all__ = [
    "E4M3_NAN_LOW", "NEG_ZERO", "PILE_MIN", "SAMPLE_ROWS", "element_codes", "first_index", "gaussian_rates",
    "group_size", "grouped", "log2_spread", "magnitude_of_codes", "pct", "pile_min", "sample_rows", "top_code"
]

E4M3_NAN_LOW = 0b0_1111_111  # 0x7F: NaN in E4M3FN, 240 in E4M3FNUZ
NEG_ZERO = 0b1_0000_000  # 0x80: -0 in E4M3FN, NaN in E4M3FNUZ
SAMPLE_ROWS = 1 << 16  # the statistics read at most this many rows (evenly strided) of a large tensor


def sample_rows(t: torch.Tensor, heads: int = 1) -> torch.Tensor:
    """At most SAMPLE_ROWS rows of [rows, ...], whole tokens (multiples of `heads`) evenly strided."""
    rows = t.shape[0]
    if rows <= SAMPLE_ROWS:
        return t
    tokens = rows // heads
    step = -(-tokens * heads // SAMPLE_ROWS)
    keep = (torch.arange(0, tokens, step)[:, None] * heads + torch.arange(heads)).reshape(-1)
    return t[keep]


def element_codes(subject) -> torch.Tensor:
    """Element codes [rows, D] uint8 of a quantized fp4 / fp8 subject (nibbles unpacked)."""
    payload = subject.payload_rows()
    if subject.q.fmt.spec.payload_bits == 4:
        return unpack_nibbles(payload)
    return payload


def magnitude_of_codes(subject, codes: torch.Tensor) -> torch.Tensor:
    """|value| of each element code at unit scale (fp32; NaN codes stay NaN): E2M1 or E4M3FN (E4M3FNUZ when declared)."""
    if subject.q.fmt.element is E2M1:
        return e2m1_decode(codes).abs()
    if subject.fp8_element == "fnuz":
        from kvtool.doctor.fnuz import e4m3fnuz_decode

        return e4m3fnuz_decode(codes).abs()
    return e4m3_decode(codes).abs()


def top_code(subject) -> int:
    """The low bits (sign dropped) of the element's largest finite code (E4M3FNUZ's is 0x7F, NaN in E4M3FN)."""
    element = subject.q.fmt.element
    return E4M3_NAN_LOW if element is E4M3 and subject.fp8_element == "fnuz" else element.top_code


def group_size(subject) -> int:
    return subject.q.fmt.block or subject.dim


def grouped(codes: torch.Tensor, block: int) -> torch.Tensor:
    """[rows, D] -> [rows, D / block, block]."""
    return codes.reshape(codes.shape[0], -1, block)


def log2_spread(x: torch.Tensor) -> tuple[float, float, int]:
    """(1st percentile, 99th percentile, count) of log2 |x| over the non-zero finite elements (sampled)."""
    flat = x.reshape(-1).float()
    flat = flat[torch.isfinite(flat) & (flat != 0)]
    if flat.numel() == 0:
        return 0.0, 0.0, 0
    if flat.numel() > 1 << 20:
        flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[: 1 << 20]]
    q = torch.quantile(torch.log2(flat.abs()), torch.tensor([0.01, 0.99]))
    return float(q[0]), float(q[1]), int(flat.numel())


def first_index(mask: torch.Tensor, shape: tuple[int, ...]) -> list[int] | None:
    """Multi-index (in `shape`) of the first True of `mask` (any layout of the same numel), or None."""
    flat = mask.reshape(-1)
    hits = torch.nonzero(flat)
    if hits.numel() == 0:
        return None
    i = int(hits[0])
    return [int(v) for v in torch.unravel_index(torch.tensor(i), shape)] if shape else [i]


def pct(n: int, total: int) -> float:
    return round(100.0 * n / max(total, 1), 4)


# Elements at the top code that make a scale group piled up, per element (see `pile_min`).
PILE_MIN = {E4M3.name: 2, E2M1.name: 3}


def pile_min(fmt) -> int:
    """Elements at the top code that make a scale group 'piled up' (clipped). An fp8 row scaled from its amax holds
    one element at 448 (the top code covers the last 1 % of the range); an E2M1 block's top code covers (5/6, 1] of
    its amax, so a few elements there are normal."""
    return PILE_MIN[fmt.element.name]


@lru_cache(maxsize=None)
def gaussian_rates(label: str, dim: int) -> dict:
    """The format's own rates on standard-normal data (seeded; cached per label): share of elements at the top code,
    of zero codes, and of groups whose largest code is at most a quarter of the element max. What a well-scaled cache
    of that format shows; the clipping / flush detectors compare against it."""
    from kvtool.formats import get_format

    fmt = get_format(label)
    x = torch.randn(2048, dim, generator=torch.Generator().manual_seed(1234))
    q = fmt.quantize(x)
    codes = unpack_nibbles(q.payload) if fmt.spec.payload_bits == 4 else q.payload
    table = fmt.element.values().abs()
    mags = table[codes.long()]
    top = float(table[fmt.element.top_code])
    g = grouped(mags, fmt.block or dim)
    gmax = g.amax(-1)
    piled = (g == top).sum(-1) >= pile_min(fmt)
    return {"top_pct": pct(int((mags == top).sum()), mags.numel()),
            "piled_groups_pct": pct(int(piled.sum()), int((gmax > 0).sum())),
            "zero_pct": pct(int((mags == 0).sum()), mags.numel()),
            "under_range_pct": pct(int((gmax <= top / 4).sum()), gmax.numel())}

