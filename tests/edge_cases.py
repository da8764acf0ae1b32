"""The one frozen table of named edge-case inputs (STYLE habit 7), shared by torch, interpreter and GPU tests.

Every case is a name and a deterministic fp32 tensor [rows, dim] (dim a multiple of 32, so that every MXFP4 block of
32 and every NVFP4 block of 16 sees the pattern). Patterns are written per 32-element block and tiled along `dim`.

Why each case is here (the rounding reasoning, SPEC sections 1-2):
- E2M1 ties: |y| exactly at 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 round half to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
  1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Each block holds its own amax 6 * 2**k so that the NVFP4 scale is 2**k
  exactly and the MX (floor / even / rceil) exponent is k: the ties survive the scaling. `e2m1_ties_ulp` puts values one
  fp32 ulp either side of each tie, which must round away from the tie the other way.
- Zero blocks: all-zero blocks write scale byte 0 and codes 0, also when the zeros are -0 (SPEC).
- Saturation: E2M1 saturates at 6, E4M3 at 448 (ml_dtypes would give NaN above 464, so clamp first).
- NVFP4 subnormal scales: amax / 6 in [2**-10, 2**-6] gives E4M3 subnormal scale bytes; amax / 6 == 2**-10 ties to
  byte 0 (all codes 0), one ulp above rounds to byte 1 (2**-9). torchao clamps scales below 2**-6.
- MX exponent rules: amax mantissa >= 1.75 (the `even` rule rounds up a binade), block maxima in (6, 8) * 2**k (the
  `floor` rule clips them to 6), amax / 6 at and a few ulp above a power of two (`rceil`: torchao's fp32 log2 misrounds
  there), tiny amax (e clamps at -127, fp32 subnormal amax) and huge amax (~1e30 .. 1e38).
- NVFP4 recipes: the SPEC example (scale byte 0x0F, x = 0.03662109375: `rcp` -> 1.5, `div` -> 1), E4M3 scale ties.
- Mixed sign, a single outlier per block, subnormal inputs beside normal ones, constant blocks, per-block magnitudes
  from 1e-8 to 1e4 in one row (ragged), DeepSeek fp8 floor (row amax < 1e-4) and power-of-two fp8 scales.

Non-finite inputs are a separate table, `NONFINITE_CASES` (quantize must raise on them, naming the first bad index).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

BLOCK = 32  # every pattern is written per MXFP4 block (two NVFP4 blocks)
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
ULP = 2.0**-23


def _tile(blocks: list[list[float]], dim: int) -> torch.Tensor:
    """Rows of 32-element block patterns -> [rows, dim] fp32; a row of several blocks cycles through them."""
    if dim % BLOCK:
        raise ValueError(f"edge cases need dim % {BLOCK} == 0, got {dim}")
    out = []
    for row in blocks:
        flat = torch.tensor(row, dtype=torch.float64).reshape(-1, BLOCK)
        reps = math.ceil(dim // BLOCK / flat.shape[0])
        out.append(flat.repeat(reps, 1)[: dim // BLOCK].reshape(-1))
    return torch.stack(out).to(torch.float32)


def _pad(values: list[float], fill: float = 0.0) -> list[float]:
    assert len(values) <= BLOCK, len(values)
    return list(values) + [fill] * (BLOCK - len(values))


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -------------------------------------------------------------------------------------------------- the patterns
def _ties(dim: int) -> torch.Tensor:
    """Each 16-half: [6, +ties, -ties, -6] * 2**k; NVFP4 scale 2**k must be E4M3 (k in [-9, 8])."""
    half = [6.0, *TIES, *(-t for t in TIES), -6.0]
    return _tile([[v * 2.0**k for v in half * 2] for k in (-9, -6, -2, 0, 3, 8)], dim)


def _ties_ulp(dim: int) -> torch.Tensor:
    """Each 16-half: [6, ties one fp32 ulp up, -(ties one ulp down), -6] * 2**k, and the mirror row (down / up)."""
    ties = torch.tensor(TIES, dtype=torch.float32)
    up, down = torch.nextafter(ties, torch.tensor(10.0)), torch.nextafter(ties, torch.tensor(0.0))
    rows = []
    for k in (-4, 0, 5):
        for a, b in ((up, down), (down, up)):
            half = [6.0, *a.tolist(), *(-b).tolist(), -6.0]
            rows.append([v * 2.0**k for v in half * 2])
    return _tile(rows, dim)


def _all_zero(dim: int) -> torch.Tensor:
    return torch.zeros(2, dim)


def _neg_zero(dim: int) -> torch.Tensor:
    return torch.full((2, dim), -0.0)


def _zero_blocks_mixed(dim: int) -> torch.Tensor:
    """Zero / -0 blocks next to non-zero blocks, and half-zero NVFP4 blocks inside an MX block."""
    nz = [0.5 * (i % 7) - 1.5 for i in range(BLOCK)]
    return _tile([[0.0] * BLOCK + nz, [-0.0] * BLOCK + nz, [-0.0] * 16 + [0.0] * 16 + nz,
                  [0.0] * 16 + nz[:16] + [-0.0] * BLOCK], dim)


def _saturation(dim: int) -> torch.Tensor:
    """fp8 saturation around 448 (the next E4M3 step would be 480; 464 is the rounding midpoint) and beyond."""
    fp8 = [448.0, 449.0, 455.99, 456.0, 463.99, 464.0, 465.0, 479.0, 480.0, 500.0, 1e4, 1e5, 6e4, 3e38, -3e38,
           -449.0, -464.0, -465.0, -1e5, 447.0, 432.0, 440.0, 416.0, 0.0, -0.0, 1.0, -1.0, 240.0, 248.0, 256.0,
           -448.0, 6.0]
    return _tile([fp8, [v * 1e-3 for v in fp8]], dim)


def _nvfp4_rounded_scale(dim: int) -> torch.Tensor:
    """amax / 6 just above an E4M3 value (scale rounds down: y slightly above 6 saturates) and at E4M3 midpoints
    (1.0625, 1.1875 .. tie to even)."""
    rows = []
    for m in (1.0 + ULP * 8, 1.0625, 1.1875, 1.3125, 1.9375, 1.03, 1.97):
        for k in (-3, 0, 4):
            amax = 6.0 * m * 2.0**k
            rows.append(_pad([amax, -amax, amax * 0.9, amax * 0.51, amax / 6, amax * 0.7], amax / 12)[:16] * 2)
    return _tile(rows, dim)


def _nvfp4_subnormal_scales(dim: int) -> torch.Tensor:
    """Block amax / 6 from 2**-11 to 2**-6 (E4M3 subnormal scales), at 2**-10 exactly (ties to byte 0) and one ulp
    above (byte 1)."""
    targets = [2.0**-11, 2.0**-10, 2.0**-10 * (1 + ULP), 2.0**-10 * 1.5, 2.0**-9, 2.0**-9 * 1.25, 2.0**-8 * 1.5,
               2.0**-7, 2.0**-7 * 1.75, 2.0**-6 * (1 - ULP), 2.0**-6]
    rows = []
    for t in targets:
        amax = _f32(_f32(t) * 6.0)
        rows.append(_pad([amax, -amax / 2, amax / 3, -amax / 5, amax / 7, amax * 0.9, amax / 12, -amax / 4],
                         amax / 9)[:16] * 2)
    return _tile(rows, dim)


def _mx_even_roundup(dim: int) -> torch.Tensor:
    """Block amax with mantissa 1.75 - ulp, 1.75, 1.875, 2 - ulp: the `even` rule rounds amax up a binade from 1.75."""
    rows = []
    for m in (1.75 - ULP * 2, 1.75, 1.75 + ULP * 2, 1.875, 2.0 - ULP * 2, 1.5, 1.0):
        for k in (-20, 0, 7):
            amax = m * 2.0**k
            rows.append(_pad([amax, -amax * 0.3, amax * 0.125, -amax * 0.71, amax * 0.5, amax * 0.9], amax * 0.2))
    return _tile(rows, dim)


def _floor_clip(dim: int) -> torch.Tensor:
    """Block maxima in (6, 8) * 2**k: the `floor` rule clips them to code 6 (up to 25 % error)."""
    rows = []
    for m in (6.0 + 6 * ULP * 2, 6.5, 7.0, 7.5, 8.0 - 8 * ULP * 2):
        for k in (-10, 0, 10):
            amax = m * 2.0**k
            rows.append(_pad([amax, -amax * 0.99, amax * 0.75, 2.0**k * 5, -(2.0**k) * 3.5], 2.0**k * 0.3))
    return _tile(rows, dim)


def _rceil_pow2(dim: int) -> torch.Tensor:
    """amax / 6 exactly a power of two and 1..4 ulp above it (fp32 log2 misrounds there), and 1 ulp below."""
    rows = []
    for k in (-100, -20, -1, 0, 1, 9, 60):
        row = []
        for j in (-1, 0, 1, 2, 4):
            t = _f32(2.0**k * (1 + j * ULP * (0.5 if j < 0 else 1)))
            amax = _f32(t * 6.0)
            row += _pad([amax, -amax / 3, amax / 2.5], amax / 8)[:16]
        rows.append((row + row[:16])[:BLOCK * 3])
    return _tile(rows, dim)


def _tiny_amax(dim: int) -> torch.Tensor:
    """MX exponent at or below -127: amax from 2**-120 down to fp32 subnormals (2**-149, 1e-40, 1e-45)."""
    rows = []
    for amax in (2.0**-120, 2.0**-125, 2.0**-126, 2.0**-126 * 1.5, 2.0**-127, 2.0**-128 * 1.75, 1e-40, 2.0**-140,
                 2.0**-149):
        a = _f32(amax)
        rows.append(_pad([a, -a, a / 2, -a / 4, a * 0.75], 0.0))
    return _tile(rows, dim)


def _huge_amax(dim: int) -> torch.Tensor:
    """Block maxima near the top of fp32 (still finite in bf16): 1e30, 2**126 * 1.9, 1e38."""
    rows = []
    for amax in (1e30, 2.0**126 * 1.9, 1e38, 2.0**100):
        rows.append(_pad([amax, -amax / 2, amax / 7, -amax * 0.3, 1.0, -1.0], amax * 1e-3))
    return _tile(rows, dim)


def _mixed_sign(dim: int) -> torch.Tensor:
    g = _gen(11)
    mag = torch.exp2(torch.randint(-6, 7, (4, dim), generator=g).float()) * torch.rand(4, dim, generator=g)
    sign = torch.where(torch.rand(4, dim, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).float()


def _single_outlier(dim: int) -> torch.Tensor:
    """One large element per 16-block (position varies) among small normal values."""
    g = _gen(12)
    x = torch.randn(4, dim, generator=g) * 0.01
    nb = dim // 16
    pos = torch.randint(0, 16, (4, nb), generator=g)
    idx = (torch.arange(nb) * 16)[None, :] + pos
    big = torch.where(torch.rand(4, nb, generator=g) < 0.5, -100.0, 100.0)
    x.scatter_(1, idx, big)
    return x


def _subnormal_inputs(dim: int) -> torch.Tensor:
    """fp32 subnormal elements beside a normal amax (codes 0 with the sign), and blocks of subnormals only."""
    tiny = [1e-40, -1e-40, 2.0**-149, -(2.0**-149), 1e-39, -3e-39]
    return _tile([_pad([1.0] + tiny, 1e-41), _pad(tiny, -1e-42)], dim)


def _constant_blocks(dim: int) -> torch.Tensor:
    return _tile([[c] * BLOCK for c in (1.0, -3.0, 0.1, 1e-5, 448.0, 7.0)], dim)


def _ragged_magnitudes(dim: int) -> torch.Tensor:
    """Per-block magnitudes 1e-8 .. 1e4 inside one row (per-block scales must not leak into each other)."""
    g = _gen(13)
    base = torch.randn(3, dim, generator=g)
    nb = dim // 16
    mags = torch.tensor([10.0 ** (-8 + 12 * i / max(nb - 1, 1)) for i in range(nb)])
    return (base.reshape(3, nb, 16) * mags[None, :, None]).reshape(3, dim).float()


def _recipe_divergence(dim: int) -> torch.Tensor:
    """SPEC example: scale byte 0x0F (S = 0.029296875 = 6 * ... / 6), x = 0.03662109375: x / S = 1.25 -> 1 (`div`),
    x * (1 / S) = 1.2500001 -> 1.5 (`rcp`). amax = 6 * S pins the scale."""
    s = 0.029296875
    half = _pad([6 * s, 0.03662109375, -0.03662109375, 0.03662109375 * 3, s * 2.5, s * 0.75], s * 1.75)[:16]
    return _tile([half * 2], dim)


def _fp8_scales(dim: int) -> torch.Tensor:
    """Rows whose fp8 per-row scale is special: amax < 1e-4 (DeepSeek floor), amax / 448 a power of two and one ulp
    above (pow2 rounds up), amax exactly 448 (s = 1)."""
    rows = []
    for amax in (5e-5, 1e-4, 448.0 * 2.0**-3, _f32(448.0 * 2.0**-3 * (1 + 2 * ULP)), 448.0, 0.7):
        rows.append(_pad([amax, -amax / 3, amax / 100, amax * 0.999], -amax / 7))
    return _tile(rows, dim)


# name -> maker(dim) -> fp32 [rows, dim]. Frozen: a tuple, in a fixed order.
EDGE_CASE_MAKERS: tuple[tuple[str, Callable[[int], torch.Tensor]], ...] = (
    ("e2m1_ties", _ties),
    ("e2m1_ties_ulp", _ties_ulp),
    ("all_zero", _all_zero),
    ("neg_zero", _neg_zero),
    ("zero_blocks_mixed", _zero_blocks_mixed),
    ("saturation", _saturation),
    ("nvfp4_rounded_scale", _nvfp4_rounded_scale),
    ("nvfp4_subnormal_scales", _nvfp4_subnormal_scales),
    ("mx_even_roundup", _mx_even_roundup),
    ("floor_clip", _floor_clip),
    ("rceil_pow2", _rceil_pow2),
    ("tiny_amax", _tiny_amax),
    ("huge_amax", _huge_amax),
    ("mixed_sign", _mixed_sign),
    ("single_outlier", _single_outlier),
    ("subnormal_inputs", _subnormal_inputs),
    ("constant_blocks", _constant_blocks),
    ("ragged_magnitudes", _ragged_magnitudes),
    ("recipe_divergence", _recipe_divergence),
    ("fp8_scales", _fp8_scales),
)


def edge_cases(dim: int = 128) -> tuple[tuple[str, torch.Tensor], ...]:
    """Every case as (name, fp32 [rows, dim]) at head dim `dim` (a multiple of 32)."""
    return tuple((name, make(dim)) for name, make in EDGE_CASE_MAKERS)


def edge_case_tensor(dim: int = 128) -> torch.Tensor:
    """All cases concatenated along rows: fp32 [total_rows, dim] (one tensor for one kernel launch)."""
    return torch.cat([x for _, x in edge_cases(dim)], dim=0)


# The table at D = 128, (name, tensor) pairs; `pytest.mark.parametrize("name,x", EDGE_CASES, ids=EDGE_CASE_NAMES)`.
# Treat the tensors as read-only (clone before writing into one).
EDGE_CASES: tuple[tuple[str, torch.Tensor], ...] = edge_cases(128)
EDGE_CASE_NAMES: tuple[str, ...] = tuple(name for name, _ in EDGE_CASE_MAKERS)

# Inputs that quantize must reject: (name, tensor, first bad flat index).
NONFINITE_CASES: tuple[tuple[str, torch.Tensor, int], ...] = tuple(
    (name, torch.arange(2 * 128, dtype=torch.float32).reshape(2, 128).index_put_((torch.tensor([r]),
                                                                                   torch.tensor([c])),
                                                                                  torch.tensor(v)), r * 128 + c)
    for name, v, r, c in (("nan", float("nan"), 1, 5), ("pos_inf", float("inf"), 0, 127),
                          ("neg_inf", float("-inf"), 1, 0))
)
