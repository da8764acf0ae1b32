"""Rotation as a cache-format option: an orthogonal transform applied before quantization and undone after.

A rotated format quantizes `x @ R` and dequantizes to `dequant(codes) @ R^T`, with R block-diagonal along the last
dimension (the head dim): one normalized Hadamard matrix H_n / sqrt(n) (Sylvester order) per run of n elements. The
normalized Sylvester Hadamard is symmetric and orthogonal, so R^T = R and the inverse is the same transform.

Why it helps 4-bit caches: a K or V row with a few large channels has one block scale set by the outlier, and every
other element in that block rounds coarsely; after a Hadamard each output mixes all n inputs, so the energy spreads
and the block amax drops towards the row's RMS (llama.cpp rotates K and V with a 64 x 64 Hadamard by default).

Why consumers need no change: for any orthogonal R, (q R) . (k R) = q . k, so an index cache whose query and key are
both rotated gives the same scores (up to rounding), and attention over a rotated K with a rotated q gives the same
probabilities; with V rotated too the output comes out rotated (sum p (v R) = (sum p v) R) and one multiply by R^T
restores it. The torch path simply dequantizes to the original domain; a kernel that reads the paged bytes works in
the rotated domain when its caller rotates q (and un-rotates the output).

Names: `+rot` after any format label (`nvfp4+rot`, `mxfp4-floor+rot64`). `+rot` rotates the whole last dimension
(a power of two); `+rotN` uses blocks of N (a power of two dividing it). The `--rotate` flag spells the same choice
`hadamard` / `hadamard:N` (`none` to switch it off).
"""

from __future__ import annotations

import functools

import torch

from kvtool.errors import FormatError

__all__ = [
    "SUFFIX", "block_size", "check_rotation", "from_meta", "hadamard", "label_suffix", "parse_flag", "rotate",
    "split_label", "to_meta", "unrotate"
]

SUFFIX = "+rot"


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@functools.lru_cache(maxsize=32)
def _hadamard_cpu(n: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix H_n / sqrt(n), fp32 [n, n] (symmetric, orthogonal)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).float()


_ON_DEVICE: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """H_n / sqrt(n) as fp32 [n, n] on `device` (cached)."""
    if not _is_pow2(n):
        raise FormatError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    key = (n, str(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = _hadamard_cpu(n).to(device)
    return _ON_DEVICE[key]


def block_size(rotation: int, dim: int) -> int:
    """The Hadamard block used on a last dimension of `dim` (`rotation` 0 = the whole dim)."""
    return dim if rotation == 0 else rotation


def check_rotation(rotation: int, dim: int, name: str = "tensor") -> None:
    """FormatError unless a rotation of size `rotation` (0 = whole) fits a last dimension of `dim`."""
    n = block_size(rotation, dim)
    if not _is_pow2(n):
        raise FormatError(f"{name}: a whole-dim Hadamard rotation needs a power-of-two last dimension, got {dim} "
                          f"(give a block size: +rotN)")
    if dim % n:
        raise FormatError(f"{name}: last dimension {dim} is not divisible by the rotation block {n}")


def rotate(x: torch.Tensor, rotation: int) -> torch.Tensor:
    """x [..., D] -> fp32 x R (R block-diagonal Hadamard, blocks of `block_size(rotation, D)`). Its own inverse."""
    d = x.shape[-1]
    n = block_size(rotation, d)
    check_rotation(rotation, d)
    xb = x.float().reshape(*x.shape[:-1], d // n, n)
    return (xb @ hadamard(n, x.device)).reshape(x.shape)


unrotate = rotate  # the normalized Sylvester Hadamard is symmetric and orthogonal: R^-1 = R^T = R


def split_label(name: str) -> tuple[str, int | None]:
    """`nvfp4-auto+rot64` -> ('nvfp4-auto', 64); `fp8+rot` -> ('fp8', 0); `nvfp4` -> ('nvfp4', None)."""
    text = str(name).strip()
    head, sep, tail = text.partition(SUFFIX)
    if not sep:
        return text, None
    if tail == "":
        return head, 0
    if not tail.isdigit() or not _is_pow2(int(tail)):
        raise FormatError(f"bad rotation {SUFFIX}{tail!r} in {name!r}: give {SUFFIX} (whole head dim) or "
                          f"{SUFFIX}N with N a power of two")
    return head, int(tail)


def label_suffix(rotation: int | None) -> str:
    """The label suffix of a rotation ('' when none)."""
    if rotation is None:
        return ""
    return SUFFIX if rotation == 0 else f"{SUFFIX}{rotation}"


def parse_flag(value: str | None) -> int | None:
    """The `--rotate` flag: None / 'none' -> None, 'hadamard' -> 0 (whole dim), 'hadamard:N' -> N."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("", "none", "off"):
        return None
    kind, _, size = text.partition(":")
    if kind != "hadamard":
        raise FormatError(f"unknown rotation {value!r} (choose none|hadamard|hadamard:N)")
    if not size:
        return 0
    if not size.isdigit() or not _is_pow2(int(size)):
        raise FormatError(f"--rotate hadamard:N needs N a power of two, got {size!r}")
    return int(size)


def to_meta(rotation: int | None) -> dict:
    """The container / JSON record of a rotation, in the `--rotate` spelling (`hadamard`, `hadamard:64`; a plain
    string, as every format field is); empty when none."""
    if rotation is None:
        return {}
    return {"rotation": "hadamard" if rotation == 0 else f"hadamard:{rotation}"}


def from_meta(meta: dict) -> int | None:
    """Inverse of `to_meta` (None when the metadata has no rotation)."""
    rot = meta.get("rotation")
    if rot is None:
        return None
    if not isinstance(rot, str) or parse_flag(rot) is None:
        raise FormatError(f"unknown rotation in the format metadata: {rot!r} (hadamard or hadamard:N)")
    return parse_flag(rot)
