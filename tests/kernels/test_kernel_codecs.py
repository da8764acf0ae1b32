"""Every `@triton.jit` helper in kernels/codecs.py against the torch codecs in kvtool/formats, bit for bit.

Two small test kernels (in this file) run the helpers: `_unary_kernel` applies one elementwise helper (chosen by a
constexpr OP) to a flat array; `_block_kernel` quantizes [rows, D] rows through `mxfp4_quantize_block` /
`nvfp4_quantize_block` + `pack_nibbles` (or round-trips `pack_nibbles` / `unpack_nibbles`). Inputs: fresh random data
of several distributions, random fp32 bit patterns (every exponent), the shared edge-case table, and whole-domain sweeps
(every E2M1 / E4M3 / E8M0 code, every exponent for exp2_int). Under the interpreter (CPU) the sizes are small; the
`gpu`-marked variants rerun the same checks at large sizes on the device.

The attention / indexer decode helpers (fp16 E4M3 decodes, FP4 word quarters / paired words / bytes, pow2_f16, E8M0
relative factors) run through `_decode_kernel`, `_words_kernel` and `_factors_kernel` on every code (every byte, every
nibble in every word position) plus random words, against references built from the torch codecs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from edge_cases import edge_case_tensor

from kvtool.formats import E4M3, NvRecipe, ScaleRule, get_format
from kvtool.formats import codecs as fc
from kvtool.formats.elements import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    exp2_int,
    pack_nibbles,
    unpack_nibbles,
)
from kvtool.kernels import codecs as kc
from kvtool.kernels.sparse_attn import paired_order

# Zero scales make the nvfp4 helper compute 1 / 0 on lanes that `tl.where` then discards (the interpreter warns).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SEED = int(np.random.SeedSequence().entropy % 2**31)
BLOCK = 1024

# OP codes of _unary_kernel (one constexpr-parameterized kernel, not one kernel per helper).
E2M1_ENCODE, E2M1_DECODE_F16, E2M1_DECODE_F32, E4M3_ENCODE, E4M3_DECODE, E8M0_DECODE, EXP2_INT, MX_EXPONENT, \
    FP8_ENCODE_SCALED, FP8_ROW_SCALE, E8M0_DECODE_ANY, E8M0_FROM_FIELD = range(12)


@triton.jit
def _unary_kernel(x_ptr, s_ptr, out_ptr, n,  # input, second input (scale) or dummy, output, element count
                  OP: tl.constexpr, RULE: tl.constexpr, BLOCK: tl.constexpr):  # helper, its rule, elements / program
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if OP == 0:
        y = kc.e2m1_encode(x)
    elif OP == 1:
        y = kc.e2m1_decode_f16(x)
    elif OP == 2:
        y = kc.e2m1_decode_f32(x)
    elif OP == 3:
        y = kc.e4m3_encode(x)
    elif OP == 4:
        y = kc.e4m3_decode(x)
    elif OP == 5:
        y = kc.e8m0_decode(x)
    elif OP == 6:
        y = kc.exp2_int(x)
    elif OP == 7:
        y = kc.mx_exponent(x, RULE)
    elif OP == 8:
        y = kc.fp8_encode_scaled(x, tl.load(s_ptr + offs, mask=mask, other=1.0))
    elif OP == 9:
        y = kc.fp8_row_scale(x, RULE >= 1, RULE == 2)  # RULE: 0 plain, 1 DeepSeek floor, 2 floor + pow2
    elif OP == 10:
        y = kc.e8m0_decode_any(x)
    else:
        y = kc.e8m0_from_field(x)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _block_kernel(x_ptr, payload_ptr, scale_ptr, n_rows, g_dec, g_enc,  # fp32 [n, D], u8 [n, D/2], u8 [n, D/BS]
                  D: tl.constexpr, BS: tl.constexpr,  # head dim, block size (32 mxfp4, 16 nvfp4, 0: pack round trip)
                  RULE: tl.constexpr, RECIPE: tl.constexpr, BLOCK_R: tl.constexpr):  # constexprs, rows / program
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows[:, None] < n_rows
    cols = tl.arange(0, D)
    half = tl.arange(0, D // 2)
    if BS == 0:  # payload_ptr holds packed bytes: unpack, store codes to x_ptr (as u8), repack into scale_ptr
        packed = tl.load(payload_ptr + rows[:, None] * (D // 2) + half[None, :], mask=rmask, other=0)
        codes = kc.unpack_nibbles(packed, BLOCK_R, D // 2)
        tl.store(x_ptr + rows[:, None] * D + cols[None, :], codes, mask=rmask)
        tl.store(scale_ptr + rows[:, None] * (D // 2) + half[None, :], kc.pack_nibbles(codes, BLOCK_R, D), mask=rmask)
    else:
        x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=rmask, other=0.0)
        xb = tl.reshape(x, [BLOCK_R, D // BS, BS])
        if BS == 32:
            codes, scale = kc.mxfp4_quantize_block(xb, RULE)
        else:
            codes, scale = kc.nvfp4_quantize_block(xb, g_dec, g_enc, RECIPE)
        packed = kc.pack_nibbles(tl.reshape(codes, [BLOCK_R, D]), BLOCK_R, D)
        tl.store(payload_ptr + rows[:, None] * (D // 2) + half[None, :], packed, mask=rmask)
        nb = tl.arange(0, D // BS)
        tl.store(scale_ptr + rows[:, None] * (D // BS) + nb[None, :], scale, mask=rmask)


def run_unary(op: int, x: torch.Tensor, out_dtype: torch.dtype, rule: int = 0, s: torch.Tensor | None = None):
    """Flat `x` through one helper; returns a tensor of `out_dtype` on x's device."""
    x = x.contiguous().reshape(-1)
    out = torch.empty(x.numel(), dtype=out_dtype, device=x.device)
    s = x if s is None else s.contiguous().reshape(-1)
    _unary_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, s, out, x.numel(), OP=op, RULE=rule, BLOCK=BLOCK)
    return out


def run_block(x: torch.Tensor, bs: int, rule: int = 0, recipe: int = 0, g_dec: float = 1.0, g_enc: float = 1.0,
              block_r: int = 16):
    """fp32 [n, D] -> (payload u8 [n, D/2], scales u8 [n, D/bs]) through the block helpers."""
    n, d = x.shape
    payload = torch.empty(n, d // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, d // bs, dtype=torch.uint8, device=x.device)
    _block_kernel[(triton.cdiv(n, block_r),)](x.contiguous(), payload, scales, n, g_dec, g_enc, D=d, BS=bs,
                                              RULE=rule, RECIPE=recipe, BLOCK_R=block_r)
    return payload, scales


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        width = {2: torch.int16, 4: torch.int32}[a.element_size()]
        a, b = a.view(width), b.to(a.dtype).view(width)
    return a.shape == b.shape and torch.equal(a, b)


def first_diff(a, b) -> str:
    a, b = a.cpu(), b.cpu()
    bad = torch.nonzero(a.reshape(-1) != b.reshape(-1).to(a.dtype))
    i = int(bad[0]) if len(bad) else 0
    return f"seed {SEED}: {len(bad)} differ; first at {i}: kernel {a.reshape(-1)[i]} vs torch {b.reshape(-1)[i]}"


# ---------------------------------------------------------------------------------------------------------- inputs
def fp32_values(n: int, device: str, seed: int = SEED) -> torch.Tensor:
    """Finite fp32 probes: random bit patterns (every exponent incl. subnormals), normals at several scales, heavy
    tails, the edge-case table, E2M1 ties and E4M3 values / midpoints one ulp either side."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    bits = bits[torch.isfinite(bits)]
    normal = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    t = torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(1e-3)
    e4 = E4M3.values()
    e4 = e4[torch.isfinite(e4)].unique()
    mids = ((e4[1:].double() + e4[:-1].double()) / 2).float()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 448.0, 464.0, 465.0, 3e38])
    special = torch.cat([e4, mids, ties])
    special = torch.cat([special, torch.nextafter(special, torch.tensor(1e38)),
                         torch.nextafter(special, torch.tensor(0.0))])
    out = torch.cat([bits, normal, t, edge_case_tensor(128).reshape(-1), special, -special])
    return out.float().to(device)


def block_rows(n_rows: int, device: str, seed: int = SEED) -> torch.Tensor:
    """[rows, 128] fp32: per-row magnitudes 1e-8 .. 1e4 (normal and heavy-tailed rows) plus the edge-case table."""
    g = torch.Generator().manual_seed(seed + 1)
    scale = 10.0 ** (torch.rand(n_rows, 1, generator=g) * 12 - 8)
    x = torch.randn(n_rows, 128, generator=g) * scale
    heavy = torch.randn(n_rows, 128, generator=g) / torch.rand(n_rows, 128, generator=g).clamp_min(1e-3) * scale
    return torch.cat([x, heavy, edge_case_tensor(128)]).float().to(device)


# ----------------------------------------------------------------------------------------------- elementwise checks
def check_elementwise(device: str, n: int) -> None:
    x = fp32_values(n, device)
    codes16 = torch.arange(16, dtype=torch.uint8, device=device)
    bytes256 = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    e4_ok = bytes256[(bytes256.int() & 0x7F) != 0x7F]  # the NaN codes are never written (e4m3_decode_any reads them)
    e8_ok = bytes256[bytes256 != 255]
    checks = [
        ("e2m1_encode", run_unary(E2M1_ENCODE, x, torch.uint8), e2m1_encode(x)),
        ("e2m1_decode_f16", run_unary(E2M1_DECODE_F16, codes16, torch.float16), e2m1_decode(codes16).half()),
        ("e2m1_decode_f32", run_unary(E2M1_DECODE_F32, codes16, torch.float32), e2m1_decode(codes16)),
        ("e4m3_encode", run_unary(E4M3_ENCODE, x, torch.uint8), e4m3_encode(x)),
        ("e4m3_decode", run_unary(E4M3_DECODE, e4_ok, torch.float32), e4m3_decode(e4_ok)),
        ("e8m0_decode", run_unary(E8M0_DECODE, e8_ok, torch.float32), e8m0_decode(e8_ok)),
        ("e8m0_decode[int32]", run_unary(E8M0_DECODE, e8_ok.int(), torch.float32), e8m0_decode(e8_ok)),
        # every byte, 255 (never written) included: NaN (the index scorer's Gluon path passes int32 bytes)
        ("e8m0_decode_any", run_unary(E8M0_DECODE_ANY, bytes256, torch.float32), e8m0_decode(bytes256)),
        ("e8m0_decode_any[int32]", run_unary(E8M0_DECODE_ANY, bytes256.int(), torch.float32), e8m0_decode(bytes256)),
    ]
    e = torch.arange(-149, 128, dtype=torch.int32, device=device)
    checks.append(("exp2_int", run_unary(EXP2_INT, e, torch.float32), exp2_int(e)))
    amax = x.abs()
    for rule in ScaleRule:
        checks.append((f"mx_exponent[{rule.name}]", run_unary(MX_EXPONENT, amax, torch.int32, int(rule)),
                       fc.mx_exponent(amax, rule)))
    s = fc.fp8_row_scale(amax.roll(1), False, False)
    checks.append(("fp8_encode_scaled", run_unary(FP8_ENCODE_SCALED, x, torch.uint8, s=s), e4m3_encode(x / s)))
    for mode, (ds, pow2) in enumerate(((False, False), (True, False), (True, True))):
        checks.append((f"fp8_row_scale[{mode}]", run_unary(FP8_ROW_SCALE, amax, torch.float32, mode),
                       fc.fp8_row_scale(amax, ds, pow2)))
    bad = [f"{name}: {first_diff(k, t)}" for name, k, t in checks if not same_bits(k, t)]
    # every byte in the exponent field (the Gluon index scorer's mx_factors): the same values, NaN for byte 255
    # (y * 0 + y makes the device's NaN, whose bits are not e8m0_decode's)
    got = run_unary(E8M0_FROM_FIELD, bytes256.int() << 23, torch.float32).cpu()
    want = e8m0_decode(bytes256).cpu()
    nan = torch.isnan(want)
    if not (torch.equal(torch.isnan(got), nan) and same_bits(got[~nan], want[~nan])):
        nan_at = torch.isnan(got).nonzero().tolist()
        bad.append(f"e8m0_from_field: {first_diff(got[~nan], want[~nan])}, NaN at {nan_at}")
    assert not bad, "\n".join(bad)


def check_domain_round_trips(device: str) -> None:
    """Whole domains: every E2M1 and E4M3 code (both signs) decodes and re-encodes to itself in the kernel."""
    codes16 = torch.arange(16, dtype=torch.uint8, device=device)
    back = run_unary(E2M1_ENCODE, run_unary(E2M1_DECODE_F32, codes16, torch.float32), torch.uint8)
    assert torch.equal(back.cpu(), codes16.cpu())
    b = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    b = b[(b.int() & 0x7F) != 0x7F]
    back = run_unary(E4M3_ENCODE, run_unary(E4M3_DECODE, b, torch.float32), torch.uint8)
    assert torch.equal(back.cpu(), b.cpu())


# ----------------------------------------------------------------------------------------------------- block checks
def assert_block_codecs(x: torch.Tensor, run) -> None:
    """run(block, rule=, recipe=, g_dec=, g_enc=) -> (payload, scale bytes) of a kernel's FP4 block codec on rows x:
    the same bits as the torch codecs for every mxfp4 rule and every nvfp4 recipe with outer scale 1 and auto."""
    bad = []
    for rule in ScaleRule:
        q = get_format("mxfp4", scale_rule=rule).quantize(x)
        payload, scales = run(32, rule=int(rule))
        if not (same_bits(payload, q.payload) and same_bits(scales, q.scales)):
            bad.append(f"mxfp4 {rule.name}: payload {first_diff(payload, q.payload)}; scales "
                       f"{first_diff(scales, q.scales)}")
    for recipe in NvRecipe:
        for outer in ("1", "auto"):
            q = get_format("nvfp4", recipe=recipe, outer_scale=outer).quantize(x)
            assert outer == "1" or q.outer_scale != 1.0  # `auto` gives a non-trivial outer scale on these rows
            g_dec = torch.tensor(q.outer_scale, dtype=torch.float32)
            payload, scales = run(16, recipe=int(recipe), g_dec=float(g_dec), g_enc=float(1.0 / g_dec))
            if not (same_bits(payload, q.payload) and same_bits(scales, q.scales)):
                bad.append(f"nvfp4 {recipe.name} {outer}: payload {first_diff(payload, q.payload)}; scales "
                           f"{first_diff(scales, q.scales)}")
    assert not bad, "\n".join(bad)


def block_codec_runner(kernel, x: torch.Tensor, payload_dtype: torch.dtype, block_r: int, native: bool):
    """A `run` for assert_block_codecs over a test kernel (x, payload, scales, n, g_dec, g_enc, D, BS, RULE, RECIPE,
    NATIVE, BLOCK_R) that writes packed nibbles as bytes (uint8) or as words (int32)."""
    def run(bs, rule=0, recipe=0, g_dec=1.0, g_enc=1.0):
        n, d = x.shape
        payload = torch.empty(n, d // 2 // payload_dtype.itemsize, dtype=payload_dtype, device=x.device)
        scales = torch.empty(n, d // bs, dtype=torch.uint8, device=x.device)
        kernel[(triton.cdiv(n, block_r),)](x, payload, scales, n, g_dec, g_enc, D=d, BS=bs, RULE=rule, RECIPE=recipe,
                                           NATIVE=native, BLOCK_R=block_r)
        return payload.view(torch.uint8), scales
    return run


def check_blocks(device: str, n_rows: int, block_r: int) -> None:
    x = block_rows(n_rows, device)
    assert_block_codecs(x, lambda bs, **kw: run_block(x, bs, block_r=block_r, **kw))


def check_pack(device: str, n_rows: int, block_r: int) -> None:
    g = torch.Generator().manual_seed(SEED + 2)
    codes = torch.randint(0, 16, (n_rows, 128), generator=g, dtype=torch.uint8).to(device)
    packed = pack_nibbles(codes)
    out_codes = torch.empty_like(codes)
    repacked = torch.empty_like(packed)
    _block_kernel[(triton.cdiv(n_rows, block_r),)](out_codes, packed, repacked, n_rows, 1.0, 1.0, D=128, BS=0,
                                                   RULE=0, RECIPE=0, BLOCK_R=block_r)
    assert torch.equal(out_codes.cpu(), unpack_nibbles(packed).cpu()) and torch.equal(out_codes.cpu(), codes.cpu())
    assert torch.equal(repacked.cpu(), packed.cpu())



# --------------------------------------------------------------------------- decode helpers (attention, indexer)
@triton.jit
def _decode_kernel(x_ptr, o_ptr, o2_ptr, N: tl.constexpr, OP: tl.constexpr, NATIVE: tl.constexpr):
    """N values through one decode helper pair (OP) -> two fp32 outputs (fp16 results widened exactly)."""
    o = tl.arange(0, N)
    x = tl.load(x_ptr + o)
    if OP == 0:
        a = kc.e4m3_decode_f16(x).to(tl.float32)
        b = kc.e4m3_decode_f16(x, False).to(tl.float32)
    elif OP == 1:
        a = kc.e4m3_decode_to(x, NATIVE, True).to(tl.float32)
        b = kc.e4m3_decode_to(x, NATIVE, False)
    elif OP == 2:
        a = kc.pow2_f16(x).to(tl.float32)
        b = a
    else:
        even, odd = kc.fp4_bytes(x)
        a = even.to(tl.float32)
        b = odd.to(tl.float32)
    tl.store(o_ptr + o, a)
    tl.store(o2_ptr + o, b)


@triton.jit
def _words_kernel(w_ptr, q_ptr, p_ptr, c_ptr, R: tl.constexpr, NW: tl.constexpr):
    """Words [R, NW] -> the four fp4_quarter tiles q [4, R, 2 NW], e2m1_words_paired p [R, 8 NW] (fp32) and
    paired_cols of every column c [8 NW]."""
    r = tl.arange(0, R)
    offs = r[:, None] * NW + tl.arange(0, NW)[None, :]
    w = tl.load(w_ptr.to(tl.pointer_type(tl.uint32)) + offs)
    c = tl.arange(0, 2 * NW)
    for k in tl.static_range(4):
        x = kc.fp4_quarter(w, k, R, NW).to(tl.float32)
        tl.store(q_ptr + k * R * 2 * NW + r[:, None] * 2 * NW + c[None, :], x)
    c8 = tl.arange(0, 8 * NW)
    p = kc.e2m1_words_paired(tl.load(w_ptr + offs), R, NW).to(tl.float32)
    tl.store(p_ptr + r[:, None] * 8 * NW + c8[None, :], p)
    tl.store(c_ptr + c8, kc.paired_cols(c8))


@triton.jit
def _factors_kernel(s_ptr, f_ptr, r_ptr, T: tl.constexpr, N: tl.constexpr, WORD: tl.constexpr):
    """E8M0 scales of T tokens -> factors f [T, N] (fp32) and row factors r [T]: WORD reads one uint32 word per
    token (N = 4, e8m0_word_factors), else a byte tile [T, N] (e8m0_tile_factors)."""
    t = tl.arange(0, T)
    n = tl.arange(0, N)
    if WORD:
        f, rf = kc.e8m0_word_factors(tl.load(s_ptr.to(tl.pointer_type(tl.uint32)) + t))
    else:
        f, rf = kc.e8m0_tile_factors(tl.load(s_ptr + t[:, None] * N + n[None, :]))
    tl.store(f_ptr + t[:, None] * N + n[None, :], f.to(tl.float32))
    tl.store(r_ptr + t, rf)


def run_decode(op: int, x: torch.Tensor, native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    a, b = torch.empty(x.numel(), device=x.device), torch.empty(x.numel(), device=x.device)
    _decode_kernel[(1,)](x, a, b, N=x.numel(), OP=op, NATIVE=native)
    return a, b


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same NaN positions, and every other value bit for bit (as fp32: -0 and subnormals included)."""
    got, want = got.cpu().float(), want.cpu().float().reshape(got.shape)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN pattern differs"
    assert same_bits(got[~nan], want[~nan]), f"{what}: {first_diff(got[~nan], want[~nan])}"


def every_byte(device: str) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)


def e4m3_portable(b: torch.Tensor) -> torch.Tensor:
    """The torch codec's values, except the NaN codes: the bit decode reads 0x7F / 0xFF as +-480 (never written)."""
    v = e4m3_decode(b)
    return torch.where((b.int() & 0x7F) == 0x7F, torch.where(b.int() >= 0x80, -480.0, 480.0), v)


def fp4_words(rows: int, nw: int, seed: int = SEED) -> torch.Tensor:
    """int32 words [rows, nw]: row 0 has every nibble value in every nibble position (word j holds (j + p) % 16 in
    nibble p, 16 words), the other rows random bits (signs included)."""
    g = torch.Generator().manual_seed(seed + 3)
    nib = torch.arange(16, dtype=torch.int64)
    cyc = sum(((nib + p) % 16) << (4 * p) for p in range(8))  # [16]
    rnd = torch.randint(0, 2**32, (rows * nw - 16,), generator=g)
    words = torch.cat([cyc, rnd]).reshape(rows, nw)
    return torch.where(words < 2**31, words, words - 2**32).to(torch.int32)


def e8m0_factor_reference(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes [T, N] -> (2**(e - emax + 14) as fp16, NaN for 255; fp32 2**(emax - 14)) from formats.e8m0_decode, in
    fp64 (exact): emax is the largest exponent of the bytes other than 255 (255 counts as byte 0)."""
    bmax = torch.where(b == 255, 0, b.int()).amax(dim=1).to(torch.uint8)
    top = e8m0_decode(bmax).double()
    f = (e8m0_decode(b).double() * 2.0**14 / top[:, None]).half()
    return f, (top * 2.0**-14).float()


def e8m0_rows(n: int, t_random: int, seed: int = SEED) -> torch.Tensor:
    """Bytes [256 n + 1 + t_random, n]: every byte value in every column (the others random, sometimes 255), a row
    of 255 only, then random rows."""
    g = torch.Generator().manual_seed(seed + 4)
    rows = []
    for col in range(n):
        r = torch.randint(0, 256, (256, n), generator=g)
        r[:, col] = torch.arange(256)
        rows.append(r)
    rows += [torch.full((1, n), 255), torch.randint(0, 256, (t_random, n), generator=g)]
    return torch.cat(rows).to(torch.uint8)


def check_e4m3_fp16_decodes(device: str) -> None:
    b = every_byte(device)
    scaled, unscaled = run_decode(0, b)
    assert_same(scaled, e4m3_decode(b), "e4m3_decode_f16")
    assert_same(unscaled, e4m3_decode(b) * 2.0**-8, "e4m3_decode_f16 unscaled")
    f16, f32 = run_decode(1, b)
    assert_same(f16, e4m3_portable(b).half(), "e4m3_decode_to F16")
    assert_same(f32, e4m3_portable(b), "e4m3_decode_to fp32")


def check_fp4_decodes(device: str, rows: int) -> None:
    """fp4_bytes on every byte; fp4_quarter and e2m1_words_paired on every nibble in every position + random words:
    element order as formats.unpack_nibbles, values formats.e2m1_decode * 2**-14."""
    b = every_byte(device)
    even, odd = run_decode(3, b)
    codes = unpack_nibbles(b.cpu()[:, None])  # [256, 2]: low nibble, high nibble
    assert_same(even, e2m1_decode(codes[:, 0]) * 2.0**-14, "fp4_bytes even")
    assert_same(odd, e2m1_decode(codes[:, 1]) * 2.0**-14, "fp4_bytes odd")

    nw = 16
    w32 = fp4_words(rows, nw)
    quarters = torch.empty(4, rows, 2 * nw, device=device)
    paired = torch.empty(rows, 8 * nw, device=device)
    cols = torch.empty(8 * nw, dtype=torch.int32, device=device)
    _words_kernel[(1,)](w32.to(device), quarters, paired, cols, R=rows, NW=nw)
    want = e2m1_decode(unpack_nibbles(w32.view(torch.uint8).reshape(rows, 4 * nw))) * 2.0**-14  # element order
    for k in range(4):
        idx = 8 * (torch.arange(2 * nw) // 2) + k + 4 * (torch.arange(2 * nw) % 2)
        assert_same(quarters[k], want[:, idx], f"fp4_quarter {k}")
    order = paired_order(8 * nw)
    assert torch.equal(cols.cpu().long(), order) and torch.equal(order[order], torch.arange(8 * nw))
    assert_same(paired, want[:, order], "e2m1_words_paired")


def check_e8m0_factors(device: str, t_random: int) -> None:
    """pow2_f16 over its whole useful domain; e8m0_word_factors / e8m0_tile_factors on every byte in every column."""
    x = torch.arange(-240, 16, dtype=torch.int32)  # 256 values (a power of two for tl.arange)
    got, _ = run_decode(2, x.to(device))
    assert_same(got, exp2_int(x.clamp(min=-149)).half(), "pow2_f16")
    for n, word in ((4, True), (4, False), (8, False)):
        b = e8m0_rows(n, t_random)
        t = triton.next_power_of_2(b.shape[0])
        b = torch.cat([b, torch.full((t - b.shape[0], n), 7, dtype=torch.uint8)])  # pad to a power of two
        f = torch.empty(t, n, device=device)
        r = torch.empty(t, device=device)
        _factors_kernel[(1,)](b.to(device), f, r, T=t, N=n, WORD=word)
        wf, wr = e8m0_factor_reference(b)
        name = "e8m0_word_factors" if word else f"e8m0_tile_factors[{n}]"
        assert_same(f, wf, name)
        assert_same(r, wr, name + " row")


# ------------------------------------------------------------------------------------- interpreter (small) and GPU
def test_elementwise_helpers(device):
    check_elementwise(device, 1 << 14)


def test_domain_round_trips(device):
    check_domain_round_trips(device)


def test_block_quantizers(device):
    check_blocks(device, 48, block_r=16)


def test_pack_unpack(device):
    check_pack(device, 40, block_r=16)


def test_kernel_checks_can_fail(device):
    """The harness sees a one-code difference (guards against a comparison that always passes)."""
    x = block_rows(4, device)
    payload, scales = run_block(x, 32, rule=int(ScaleRule.FLOOR))
    q = get_format("mxfp4-rceil").quantize(x)
    assert not (same_bits(payload, q.payload) and same_bits(scales, q.scales))


def test_e4m3_fp16_decodes(device):
    check_e4m3_fp16_decodes(device)


def test_fp4_decodes(device):
    check_fp4_decodes(device, 16)


def test_e8m0_factors(device):
    check_e8m0_factors(device, 64)


def test_decode_checks_can_fail(device):
    """A one-ulp change is seen by assert_same, and the quarter reference's element order matters."""
    b = every_byte(device)
    scaled, _ = run_decode(0, b)
    with pytest.raises(AssertionError):
        assert_same(scaled, e4m3_decode(b).nextafter(torch.tensor(1e9)), "probe")
    with pytest.raises(AssertionError):
        assert_same(scaled, e4m3_decode(b).roll(1), "probe")


@pytest.mark.gpu
def test_elementwise_helpers_gpu(device):
    check_elementwise(device, 1 << 24)


@pytest.mark.gpu
def test_block_quantizers_gpu(device):
    check_blocks(device, 1 << 16, block_r=64)


@pytest.mark.gpu
def test_pack_unpack_gpu(device):
    check_pack(device, 1 << 16, block_r=64)


@pytest.mark.gpu
def test_fp4_decodes_gpu(device):
    check_fp4_decodes(device, 128)


@pytest.mark.gpu
def test_e4m3_decode_to_native_gpu(device):
    """The hardware conversion path (sm_89+): every byte, the NaN codes to NaN."""
    b = every_byte(device)
    f16, f32 = run_decode(1, b, native=True)
    assert_same(f16, e4m3_decode(b).half(), "e4m3_decode_to native F16")
    assert_same(f32, e4m3_decode(b), "e4m3_decode_to native fp32")


# ---------------------------------------------------------------------------------- store engineer: fast helpers
# mx_rceil_exponent, mxfp4_quantize_block_fast, nvfp4_quantize_block_fast (kernels/codecs.py, end).


@triton.jit
def _rceil_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, kc.mx_rceil_exponent(tl.load(x_ptr + offs, mask=mask)), mask=mask)


@triton.jit
def _fast_block_kernel(x_ptr, payload_ptr, scale_ptr, n_rows, g_dec, g_enc, D: tl.constexpr, BS: tl.constexpr,
                       RULE: tl.constexpr, RECIPE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows[:, None] < n_rows
    cols = tl.arange(0, D)
    half = tl.arange(0, D // 2)
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=rmask, other=0.0)
    xb = tl.reshape(x, [BLOCK_R, D // BS, BS])
    if BS == 32:
        codes, scale = kc.mxfp4_quantize_block_fast(xb, RULE)
    else:
        codes, scale = kc.nvfp4_quantize_block_fast(xb, g_dec, g_enc, RECIPE, NATIVE)
    packed = kc.pack_nibbles(tl.reshape(codes, [BLOCK_R, D]), BLOCK_R, D)
    tl.store(payload_ptr + rows[:, None] * (D // 2) + half[None, :], packed, mask=rmask)
    nb = tl.arange(0, D // BS)
    tl.store(scale_ptr + rows[:, None] * (D // BS) + nb[None, :], scale, mask=rmask)


def rceil_formula(a32: np.ndarray) -> np.ndarray:
    """mx_rceil_exponent in numpy (int64 so that the bias add cannot overflow)."""
    bits = a32.view(np.int32).astype(np.int64)
    e = np.maximum((bits + (0x3FFFFF - (129 << 23))) >> 23, -127)
    return np.where(bits == 0x01400001, -127, e)


def bit_range(lo: int, hi: int) -> np.ndarray:
    return np.arange(lo, hi, dtype=np.uint32).view(np.float32)


def test_mx_rceil_formula_exhaustive_low_range():
    """mx_rceil_exponent's formula == mx_exponent(RCEIL) (torch) on every fp32 below 2**-123 (all subnormal quotients
    and the 0x01400001 exception), a whole normal binade, the top binade and random bit patterns."""
    g = np.random.default_rng(SEED)
    rand = g.integers(0, 0x7F800000, 1 << 20, dtype=np.uint32).view(np.float32)
    for a in (bit_range(0, 0x02000000), bit_range(0x3F800000, 0x40000000), bit_range(0x7F000000, 0x7F800000), rand):
        want = fc.mx_exponent(torch.from_numpy(a.copy()), ScaleRule.RCEIL).numpy()
        got = rceil_formula(a)
        bad = np.nonzero(got != want)[0]
        assert not len(bad), f"rceil formula: {len(bad)} differ, first amax bits {a[bad[0]:bad[0] + 1].view(np.uint32)}"
    # without the exception the formula is wrong at exactly that amax
    a = np.array([0x01400001], dtype=np.uint32).view(np.float32)
    assert fc.mx_exponent(torch.from_numpy(a), ScaleRule.RCEIL).item() == -127
    assert ((a.view(np.int32).astype(np.int64) + (0x3FFFFF - (129 << 23))) >> 23).item() == -126


def fast_probe_values(device: str, n: int) -> torch.Tensor:
    """Non-negative finite fp32 probes for the fast helpers: fp32_values' magnitudes plus the rceil boundary region."""
    x = fp32_values(n, device).abs()
    edge = torch.from_numpy(bit_range(0x013FFFF0, 0x01400010).copy())
    six = torch.tensor([6.0 * 2.0**k for k in range(-126, 126, 7)])
    six = torch.cat([six, torch.nextafter(six, torch.tensor(0.0)), torch.nextafter(six, torch.tensor(1e38))])
    return torch.cat([x, edge.to(device), six.to(device), torch.tensor([0.0, 3.4028234663852886e38], device=device)])


def run_rceil(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.numel(), dtype=torch.int32, device=x.device)
    _rceil_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK=BLOCK)
    return out


def check_fast_helpers(device: str, n: int) -> None:
    x = fast_probe_values(device, n)
    got = run_rceil(x)
    want = fc.mx_exponent(x.cpu(), ScaleRule.RCEIL)
    assert same_bits(got, want), f"mx_rceil_exponent: {first_diff(got, want)}"


def check_fast_blocks(device: str, n_rows: int, block_r: int, native: bool = False) -> None:
    """The fast block quantizers == the torch codecs, every rule / recipe / outer scale (as check_blocks)."""
    x = block_rows(n_rows, device)
    assert_block_codecs(x, block_codec_runner(_fast_block_kernel, x, torch.uint8, block_r, native))


def test_fast_helpers(device):
    check_fast_helpers(device, 1 << 12)


def test_fast_block_quantizers(device):
    check_fast_blocks(device, 24, block_r=16)


@pytest.mark.gpu
def test_fast_helpers_gpu(device):
    """Compiled mx_rceil_exponent on the probes and on every fp32 below 2**-123 (the subnormal-quotient range)."""
    check_fast_helpers(device, 1 << 22)
    a = torch.from_numpy(bit_range(0, 0x02000000).copy())
    got = run_rceil(a.to(device))
    want = fc.mx_exponent(a, ScaleRule.RCEIL)
    assert same_bits(got, want), f"mx_rceil_exponent: {first_diff(got, want)}"


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True])
def test_fast_block_quantizers_gpu(device, native):
    check_fast_blocks(device, 1 << 15, block_r=64, native=native)


# ------------------------------------------------------------------ store engineer: scaled values -> payload words
# e2m1_words, mxfp4_scale_block, nvfp4_scale_block (kernels/codecs.py, end): the same bytes as the torch codecs.
@triton.jit
def _e2m1_words_kernel(x_ptr, out_ptr, n_rows, D: tl.constexpr, SATURATE: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=rows[:, None] < n_rows, other=0.0)
    w = tl.arange(0, D // 8)
    tl.store(out_ptr + rows[:, None] * (D // 8) + w[None, :], kc.e2m1_words(x, BLOCK_R, D, SATURATE),
             mask=rows[:, None] < n_rows)


@triton.jit
def _scaled_words_kernel(x_ptr, payload_ptr, scale_ptr, n_rows, g_dec, g_enc, D: tl.constexpr, BS: tl.constexpr,
                         RULE: tl.constexpr, RECIPE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows[:, None] < n_rows
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=rmask, other=0.0)
    xb = tl.reshape(x, [BLOCK_R, D // BS, BS])
    words, scale = kc.fp4_scaled_words(xb, g_dec, g_enc, BS == 32, RULE, RECIPE, NATIVE, BLOCK_R, D)
    w = tl.arange(0, D // 8)
    tl.store(payload_ptr + rows[:, None] * (D // 8) + w[None, :], words, mask=rmask)
    nb = tl.arange(0, D // BS)
    tl.store(scale_ptr + rows[:, None] * (D // BS) + nb[None, :], scale, mask=rmask)


def check_e2m1_words(device: str, n: int) -> None:
    """e2m1_words on fp32 probes (every exponent, ties, -0, saturation) == torch e2m1_encode, nibbles packed."""
    x = fp32_values(n, device)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 0.25, -0.25, 0.75, 2.5, -5.0, 6.0, 7.0, -1e30], device=device)])
    x = torch.cat([x, torch.zeros((-x.numel()) % 64, device=device)]).reshape(-1, 64).contiguous()
    from kvtool.formats.elements import e2m1_encode, pack_nibbles
    want = pack_nibbles(e2m1_encode(x.cpu())).contiguous().view(torch.int32)
    for sat in (True, False):
        xs = x if sat else x.clamp(-6.5, 6.5)
        w = pack_nibbles(e2m1_encode(xs.cpu())).contiguous().view(torch.int32) if not sat else want
        out = torch.empty(xs.shape[0], 8, dtype=torch.int32, device=device)
        _e2m1_words_kernel[(triton.cdiv(xs.shape[0], 16),)](xs.contiguous(), out, xs.shape[0], D=64, SATURATE=sat,
                                                            BLOCK_R=16)
        assert same_bits(out, w), f"e2m1_words SATURATE={sat}: {first_diff(out, w)}"


def check_scaled_words(device: str, n_rows: int, block_r: int, native: bool = False) -> None:
    """*_scale_block + e2m1_words == the torch codecs' payload words and scale bytes, every rule / recipe / outer."""
    x = block_rows(n_rows, device)
    assert_block_codecs(x, block_codec_runner(_scaled_words_kernel, x, torch.int32, block_r, native))


def test_e2m1_words(device):
    check_e2m1_words(device, 1 << 12)


def test_scaled_words(device):
    check_scaled_words(device, 24, block_r=16)


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True])
def test_scaled_words_gpu(device, native):
    check_e2m1_words(device, 1 << 22)
    check_scaled_words(device, 1 << 15, block_r=64, native=native)


@triton.jit
def _pairs_kernel(w_ptr, out_ptr, lo3, sign8, N: tl.constexpr, RUNTIME: tl.constexpr):
    """e2m1_pairs (masks as run-time values or the defaults) and e2m1_pair K = 0..3 of int32 words [N] -> int32
    out [8, N]: rows 0..3 e2m1_pairs, rows 4..7 e2m1_pair."""
    o = tl.arange(0, N)
    w = tl.load(w_ptr + o)
    if RUNTIME:
        p0, p1, p2, p3 = kc.e2m1_pairs(w, lo3, sign8)
    else:
        p0, p1, p2, p3 = kc.e2m1_pairs(w)
    tl.store(out_ptr + o, p0)
    tl.store(out_ptr + N + o, p1)
    tl.store(out_ptr + 2 * N + o, p2)
    tl.store(out_ptr + 3 * N + o, p3)
    for k in tl.static_range(4):
        tl.store(out_ptr + (4 + k) * N + o, kc.e2m1_pair(w, k))


def check_e2m1_pairs(device: str, rows: int) -> None:
    """e2m1_pairs equals e2m1_pair (K = 0..3) bit for bit on every nibble in every position and random words, with
    constant and with run-time masks; and it is the E2M1 decode (fp16 halves, value * 2**-14)."""
    w = fp4_words(rows, 16).reshape(-1).to(device)
    n = w.numel()
    for runtime in (False, True):
        out = torch.empty(8, n, dtype=torch.int32, device=device)
        _pairs_kernel[(1,)](w, out, 0x07070707, -0x7F7F7F80, N=n, RUNTIME=runtime)
        assert torch.equal(out[:4].cpu(), out[4:].cpu()), f"e2m1_pairs (runtime masks: {runtime}) != e2m1_pair"
    halves = out[:4].cpu().contiguous().view(torch.float16).reshape(4, n, 2).float() * 2.0**14  # [K, word, half]
    codes = unpack_nibbles(w.cpu().view(torch.uint8).reshape(n, 4)).reshape(n, 8)  # nibble k of each word
    want = e2m1_decode(codes)
    for k in range(4):
        assert torch.equal(halves[k, :, 0], want[:, k]) and torch.equal(halves[k, :, 1], want[:, k + 4]), k


def test_e2m1_pairs(device):
    check_e2m1_pairs(device, 4)


@pytest.mark.gpu
def test_e2m1_pairs_gpu(device):
    check_e2m1_pairs(device, 4096)


# ----------------------------------------------------------------------------------- amax / 6 of a bf16 amax (Markstein)
def _rn32(x):
    """A Fraction rounded to the nearest fp32 (ties to even, subnormals included), as a Fraction."""
    from fractions import Fraction

    if x == 0:
        return Fraction(0)
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e += 1 if Fraction(2) ** (e + 1) <= a else 0
    e -= 1 if Fraction(2) ** e > a else 0
    ulp = Fraction(2) ** (max(e, -126) - 23)
    m = a / ulp
    fl = m.numerator // m.denominator
    if m - fl > Fraction(1, 2) or (m - fl == Fraction(1, 2) and fl % 2):
        fl += 1
    return (1 if x > 0 else -1) * fl * ulp


def test_amax_div6_markstein_exact_for_bf16():
    """kc.amax_div6's BF16_AMAX sequence (q = RN(a c), r = fma(-q, 6, a), fma(r, c, q), c = RN(1/6)) in exact
    arithmetic equals RN(a / 6) for every non-negative finite bf16 a: the proof behind using it in the store kernels.
    The same sequence on fp32 inputs is not exact (the ties of subnormal quotients), which the last check shows."""
    from fractions import Fraction

    c = _rn32(Fraction(1, 6))
    assert c == Fraction(float(np.float32(0.16666667163372039795)))
    bits = np.arange(0, 0x7F80, dtype=np.uint32) << 16  # +0 .. the largest finite bf16
    for a32 in bits.view(np.float32).tolist():
        a = Fraction(a32)
        q = _rn32(a * c)
        assert _rn32(_rn32(a - 6 * q) * c + q) == _rn32(a / 6), a32
    tie = Fraction(3 * (2 * 5 + 1), 2**149)  # 33 * 2**-149 (an fp32 subnormal): a / 6 = 5.5 ulps, a tie
    q = _rn32(tie * c)
    assert _rn32(_rn32(tie - 6 * q) * c + q) != _rn32(tie / 6)


@triton.jit
def _div6_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, kc.amax_div6(tl.load(x_ptr + offs, mask=mask), True), mask=mask)


@pytest.mark.gpu
def test_amax_div6_gpu(device):
    """Compiled (a real fma): kc.amax_div6(a, BF16_AMAX=True) == a / 6 (IEEE, torch on the CPU) for every
    non-negative finite bf16 a."""
    a = (torch.arange(0, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    out = torch.empty_like(a, device=device)
    _div6_kernel[(triton.cdiv(a.numel(), 1024),)](a.to(device), out, a.numel(), BLOCK=1024)
    assert same_bits(out.cpu(), a / 6), f"amax_div6: {first_diff(out.cpu(), a / 6)}"


@pytest.mark.parametrize("g_dec", [1.0, 0.37, 3.0e-20, 7.5e25])
def test_rcp_table(device, g_dec):
    """kc.rcp_table (the nvfp4 rcp reciprocal per scale byte that the Gluon store gathers) == 1 / (e4m3(b) * g_dec)
    in IEEE fp32 (torch on the CPU) for every byte the encoder writes, 0 for byte 0 (and the NaN bytes)."""
    g = float(torch.tensor(g_dec, dtype=torch.float32))
    out = torch.empty(256, dtype=torch.float32, device=device)
    kc.rcp_table[(1,)](out, g)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    want = 1.0 / (s * torch.tensor(g, dtype=torch.float32))
    want[(torch.arange(256) & 0x7F) == 0] = 0.0
    want[(torch.arange(256) & 0x7F) == 0x7F] = 0.0
    assert same_bits(out.cpu(), want), f"rcp_table: {first_diff(out.cpu(), want)}"
