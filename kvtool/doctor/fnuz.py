"""E4M3FNUZ, the fp8 element of AMD MI300 (gfx942) caches. Not a kvtool format: the doctor needs it to recognise
E4M3FNUZ bytes that a reader took for E4M3FN (and back).

E4M3FNUZ: sign, 4 exponent bits with bias 8 (E4M3FN: 7), 3 mantissa bits, no Inf, no -0, and the one NaN is 0x80
(`0b1_0000_000`, the code E4M3FN uses for -0). Max 240 = 2^7 * 1.875 (code 0x7F, which E4M3FN reads as NaN), smallest
subnormal 2^-10. Every other code decodes to exactly half its E4M3FN value, which is why an FNUZ cache read as FN gives
values off by 2x, NaN where the FNUZ encoder saturated, and no -0 anywhere.
"""

from __future__ import annotations

import torch

from kvtool.formats import ElementCodec

__all__ = ["E4M3FNUZ", "E4M3FNUZ_MAX", "E4M3FNUZ_TABLE", "FNUZ_NAN", "e4m3fnuz_decode", "e4m3fnuz_encode"]

# nan_top_code=False: 0x7F / 0xFF are the finite +-240; the NaN is 0x80, set below.
E4M3FNUZ = ElementCodec("e4m3fnuz", ebits=4, mbits=3, bias=8, nan_top_code=False)  # max 240, min subnormal 2**-10
E4M3FNUZ_MAX = E4M3FNUZ.max  # 240.0
FNUZ_NAN = 0b1_0000_000  # 0x80


def _values() -> torch.Tensor:
    out = E4M3FNUZ.values()
    out[FNUZ_NAN] = float("nan")
    return out


E4M3FNUZ_TABLE = _values()


def e4m3fnuz_decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3FNUZ bytes (uint8) -> fp32 values (0x80 is NaN)."""
    index = codes.to(torch.int32).reshape(-1)
    return E4M3FNUZ_TABLE.to(codes.device).index_select(0, index).reshape(codes.shape)


# Encode thresholds: every positive finite code's value, ascending (codes 0x00 .. 0x7F).
_POS = E4M3FNUZ_TABLE[:0x80].double()


def e4m3fnuz_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3FNUZ bytes: clamp to [-240, 240], round half to even, -0 and every value that rounds to 0 give
    0x00 (FNUZ has no -0). Written as a search over the 128 code values (exact in fp64) so that it depends on no
    cast: code i is chosen when the magnitude is nearer to value i than to its neighbours, ties to the even code."""
    m = x.double().abs().clamp(max=E4M3FNUZ_MAX).reshape(-1)
    hi = torch.searchsorted(_POS, m, right=False).clamp(max=0x7F)  # first code value >= m
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = m - _POS[lo], _POS[hi] - m
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(up, hi, lo).to(torch.int32)
    sign = (x.reshape(-1) < 0) & (code != 0)
    return (code | (sign.to(torch.int32) << 7)).to(torch.uint8).reshape(x.shape)
