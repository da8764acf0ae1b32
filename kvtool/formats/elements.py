"""Element codecs (SPEC section 1) in plain, vectorized torch: E2M1, E4M3FN and E8M0.

An element codec is data (`ElementCodec`: exponent bits, mantissa bits, bias, specials); its max, smallest normal and
smallest subnormal are derived from those fields, never typed by hand. The encode/decode functions below work on CPU and
CUDA tensors alike and are the references that every Triton kernel is compared with, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E2M1", "E2M1_MAX", "E2M1_STEPS", "E2M1_TABLE", "E2M1_VALUES", "E4M3", "E4M3_MAX", "E4M3_TABLE", "E8M0_BIAS",
    "ElementCodec", "e2m1_decode", "e2m1_encode", "e2m1_encode_reference", "e4m3_decode", "e4m3_encode", "e8m0_decode",
    "exp2_int", "f32_bits", "f32_mantissa_nonzero", "f32_unbiased_exponent", "pack_nibbles", "unpack_nibbles"
]


@dataclass(frozen=True)
class ElementCodec:
    """A small float element: sign + `ebits` exponent + `mbits` mantissa, exponent `bias`.

    `finite_only`: no Inf; `nan_top_code`: the all-ones code (exponent and mantissa) is NaN (E4M3FN); E2M1 has neither.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    nan_top_code: bool

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def max(self) -> float:
        """Largest finite magnitude: top exponent, with the all-ones mantissa reserved for NaN when `nan_top_code`."""
        top_exp = (1 << self.ebits) - 1 - self.bias
        top_mant = (1 << self.mbits) - 1 - (1 if self.nan_top_code else 0)
        return 2.0**top_exp * (1 + top_mant / (1 << self.mbits))

    @property
    def magnitude_mask(self) -> int:
        """The code bits below the sign (0x7F for E4M3, 0x7 for E2M1): `code & mask` is the magnitude's code."""
        return (1 << (self.bits - 1)) - 1

    @property
    def top_code(self) -> int:
        """The sign-less code of the largest finite magnitude (0x7E for E4M3FN, 0x7 for E2M1)."""
        return self.magnitude_mask - (1 if self.nan_top_code else 0)

    @property
    def nan_code(self) -> int | None:
        """The sign-less code that is NaN (the all-ones magnitude when `nan_top_code`), or None: no code is NaN."""
        return self.magnitude_mask if self.nan_top_code else None

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mbits)

    def values(self) -> torch.Tensor:
        """fp32 value of every code 0 .. 2**bits - 1 (NaN where the code is NaN): the whole domain, for sweeps."""
        codes = torch.arange(1 << self.bits, dtype=torch.int32)
        sign = torch.where((codes >> (self.bits - 1)) & 1 == 1, -1.0, 1.0)
        exp = (codes >> self.mbits) & ((1 << self.ebits) - 1)
        mant = (codes & ((1 << self.mbits) - 1)).to(torch.float64)
        frac = mant / (1 << self.mbits)
        normal = (1 + frac) * torch.pow(2.0, exp.to(torch.float64) - self.bias)
        subnormal = frac * 2.0 ** (1 - self.bias)
        mag = torch.where(exp == 0, subnormal, normal)
        out = (sign * mag).to(torch.float32)
        if self.nan_top_code:
            low = (1 << (self.bits - 1)) - 1  # 0b0_1111_111: both signs of it are NaN
            out[(codes & low) == low] = float("nan")
        return out


E2M1 = ElementCodec("e2m1", ebits=2, mbits=1, bias=1, nan_top_code=False)  # max 6, min subnormal 0.5
E4M3 = ElementCodec("e4m3", ebits=4, mbits=3, bias=7, nan_top_code=True)  # max 448, min subnormal 2**-9

E2M1_MAX = E2M1.max  # 6.0
E4M3_MAX = E4M3.max  # 448.0
E8M0_BIAS = 127

# E2M1 decode table: code -> value (codes 0..7 positive, 8..15 the same magnitudes negative; 8 is -0).
E2M1_VALUES = E2M1.values()

# Round-half-to-even thresholds on |y| (SPEC section 1). Each pair is (boundary, inclusive?): a magnitude moves to the
# next code when it is above the boundary, or equal to it and the boundary's tie goes up (towards the even code).
# Midpoints 0.25, 1.25, 2.5, 5 tie DOWN to the even codes 0, 2, 4, 6 (values 0, 1, 2, 4); midpoints 0.75, 1.75, 3.5
# tie UP to the even codes 2, 4, 6 (values 1, 2, 4). So: `>` at 0.25/1.25/2.5/5 and `>=` at 0.75/1.75/3.5.
E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode_reference(y: torch.Tensor) -> torch.Tensor:
    """The SPEC rule as written: count the thresholds that |y| passes (E2M1_STEPS). Readable and slow (seven compare
    passes); `e2m1_encode` is built from it and must equal it on every fp32 bit pattern."""
    y = y.float()
    m = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for boundary, inclusive in E2M1_STEPS:
        code += (m >= boundary if inclusive else m > boundary).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _e2m1_table() -> torch.Tensor:
    """E2M1 code of every class of fp32 bit patterns that agree on sign, exponent, the top two mantissa bits and
    whether the 21 low mantissa bits are all zero (index `sign|exp|m22 m21|sticky`, 4096 entries).

    Why a class has one code: every E2M1 threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) has its 21 low mantissa
    bits zero, so a threshold is either a whole class (sticky 0: the exact value, with its tie rule) or the lower edge
    of one (sticky 1: the open interval above it). NaN classes get the reference's NaN code (0 plus the sign)."""
    idx = torch.arange(4096, dtype=torch.int32)
    member = ((idx >> 1) << 21) | (idx & 1)  # one fp32 bit pattern of each class
    return e2m1_encode_reference(member.view(torch.float32))


E2M1_TABLE = _e2m1_table()
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`table` on `device`, cached (the lookups run on CPU and CUDA tensors alike)."""
    key = (name, torch.device(device))
    if key not in _TABLES:
        _TABLES[key] = table.to(device)
    return _TABLES[key]


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 `y` -> E2M1 codes (uint8, 0..15), round half to even, saturating at 6; the sign of `y` (also -0) is bit 3.

    One table lookup per element (E2M1_TABLE) instead of seven compare passes: index = bits 31..21 of `y` with the
    sticky bit `low 21 bits != 0` in place of bit 20. Equal to `e2m1_encode_reference` on every bit pattern."""
    bits = y.float().contiguous().view(torch.int32)
    index = torch.bitwise_right_shift(bits, 20).bitwise_and_(0xFFE)  # sign | exponent | m22 m21 | 0
    index += torch.bitwise_and(bits, 0x1FFFFF).clamp_(max=1)  # sticky (int32 all the way: a bool `ne` is 2x slower)
    table = _table("e2m1", E2M1_TABLE, y.device)
    return table.index_select(0, index.reshape(-1)).reshape(y.shape)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low nibble used) -> fp32 values."""
    index = (codes & 0xF).to(torch.int32)
    return _table("e2m1_values", E2M1_VALUES, codes.device).index_select(0, index.reshape(-1)).reshape(codes.shape)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes: element 2i in the low nibble, 2i+1 in the high nibble."""
    pairs = codes.to(torch.uint8).contiguous().view(torch.int16) & 0x0F0F  # little endian: 2i low byte, 2i+1 high
    return (pairs | (pairs >> 4)).to(torch.uint8)  # the low byte is now lo | hi << 4


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (inverse of `pack_nibbles`)."""
    v = packed.to(torch.int16)
    pairs = (v & 0xF) | ((v & 0xF0) << 4)  # low byte: code 2i, high byte: code 2i+1
    return pairs.view(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3FN bytes (uint8): clamp to [-448, 448], then round half to even. Finite input never gives NaN.

    torch's cast rounds to nearest even; clamping first makes it saturate on every torch version (older casts give NaN
    above 464). -0 stays -0 (0x80).
    """
    clamped = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    return clamped.to(torch.float8_e4m3fn).view(torch.uint8)


# Every E4M3FN byte's fp32 value, from torch's own float8 conversion (so NaN codes keep torch's NaN bits).
E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3FN bytes (uint8) -> fp32 values (a 256-entry table: torch's float8 -> fp32 cast is scalar on CPU)."""
    index = codes.to(torch.int32).reshape(-1)
    return _table("e4m3", E4M3_TABLE, codes.device).index_select(0, index).reshape(codes.shape)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 `2**(byte - 127)`; byte 255 is NaN; byte 0 is 2**-127 (an fp32 subnormal, exactly)."""
    out = exp2_int(codes.to(torch.int32) - E8M0_BIAS)
    return torch.where(codes == 255, torch.full_like(out, float("nan")), out)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 `2**e` for an int32 tensor `e` in [-149, 127], built from bits (subnormal results included)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of an fp32 tensor."""
    return x.float().contiguous().view(torch.int32)


def f32_unbiased_exponent(x: torch.Tensor) -> torch.Tensor:
    """`E(a)`: the unbiased exponent field of fp32 `a` (biased field - 127; -127 for zero and subnormals)."""
    return ((f32_bits(x) >> 23) & 0xFF) - 127


def f32_mantissa_nonzero(x: torch.Tensor) -> torch.Tensor:
    return (f32_bits(x) & 0x7FFFFF) != 0
