"""The torch codecs (kvtool/formats) against independent oracles, byte for byte (STYLE habit 6).

Oracles: ml_dtypes (float4_e2m1fn, float8_e4m3fn, float8_e8m0fnu) for elements; numpy re-derivations of the SPEC block
formulas (float64 frexp for MX exponents, numpy fp32 arithmetic + ml_dtypes for NVFP4 / FP8), written here from the
SPEC text, never calling kvtool; torchao's `to_mx` / `nvfp4_quantize` as a third opinion, with every known, documented
difference excluded and asserted to be the only place where they differ. Inputs: fresh random data of several
distributions (seed printed in every failure; fix it with KVTOOL_TEST_SEED), the edge-case table, the SPEC goldens.
"""

from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from edge_cases import EDGE_CASES, NONFINITE_CASES, edge_case_tensor

from kvtool.errors import FormatError, InputError
from kvtool.formats import (
    E2M1,
    E4M3,
    Fp8Scale,
    NvRecipe,
    ScaleRule,
    all_formats,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    get_format,
    pack_nibbles,
    unpack_nibbles,
)
from kvtool.formats.codecs import fp8_row_scale, mx_exponent
from kvtool.formats import codecs as fc
from kvtool.formats.elements import e2m1_encode_reference, exp2_int

F4, F8, E8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
SEED = int(os.environ.get("KVTOOL_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
D = 128
FORMATS = all_formats()


def bits_equal(a: torch.Tensor, b) -> bool:
    """Bit-for-bit equality (-0 != 0); NaN equals NaN whatever its payload bits (libraries pick different NaNs)."""
    b = torch.as_tensor(np.ascontiguousarray(b)) if isinstance(b, np.ndarray) else b
    if a.dtype == torch.float32:
        b = b.float().contiguous()
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return False
        a, b = a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b.to(a.dtype))


def where_differ(a, b) -> str:
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    idx = torch.nonzero(a != b)
    return f"seed {SEED}: {len(idx)} differ, first at {idx[:3].tolist()}: {a[tuple(idx[0])]} vs {b[tuple(idx[0])]}" \
        if len(idx) else f"seed {SEED}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"


# ----------------------------------------------------------------------------------------------------- inputs
def random_inputs(seed: int, rows: int = 96) -> dict[str, torch.Tensor]:
    """fp32 [rows, D] tensors: normal at scales 1e-8 .. 1e4, student-t (df 2), lognormal magnitudes with random signs,
    per-row scales spread over 1e-8 .. 1e4, and near-saturation blocks (block amax 6 * 2**k * (1 +- tiny), fp8 rows
    near 448 * s)."""
    rng = np.random.default_rng(seed)
    out = {f"normal_{s:g}": rng.standard_normal((rows, D)) * s for s in (1e-8, 1e-3, 1.0, 1e4)}
    out["student_t"] = rng.standard_t(2, (rows, D))
    out["lognormal"] = np.exp(rng.standard_normal((rows, D)) * 3) * rng.choice([-1.0, 1.0], (rows, D))
    out["row_scales"] = rng.standard_normal((rows, D)) * 10.0 ** rng.uniform(-8, 4, (rows, 1))
    near = rng.uniform(-1, 1, (rows, D // 16, 16)) * 6
    near[..., 0] = 6 * (1 + rng.choice([-1, 0, 1], (rows, D // 16)) * rng.uniform(0, 1e-6, (rows, D // 16)))
    out["near_saturation"] = (near * 2.0 ** rng.integers(-12, 12, (rows, D // 16, 1))).reshape(rows, D)
    return {k: torch.from_numpy(v.astype(np.float32)) for k, v in out.items()}


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    """Every random distribution and every edge case, concatenated: fp32 [N, D]."""
    return torch.cat([*random_inputs(SEED).values(), edge_case_tensor(D)])


# ----------------------------------------------------------------------------------------------- numpy oracles
def ml_e2m1(y: np.ndarray) -> np.ndarray:
    return np.asarray(y, np.float32).astype(F4).view(np.uint8) & 0xF


def ml_e4m3(x: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(F8).view(np.uint8)  # ml_dtypes gives NaN above 464


def np_pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def np_mx_exponent(amax: np.ndarray, rule: ScaleRule) -> np.ndarray:
    """Exact float64 log2 through frexp (amax = m * 2**ex, m in [0.5, 1)); clamp to [-127, 127]."""
    m, ex = np.frexp(amax.astype(np.float64))
    floor_log2, mant = ex - 1, 2 * m
    if rule == ScaleRule.FLOOR:
        e = floor_log2 - 2
    elif rule == ScaleRule.CEIL:
        e = floor_log2 + (mant != 1.0) - 2
    elif rule == ScaleRule.EVEN:
        e = floor_log2 + (mant >= 1.75) - 2
    else:  # ceil(log2 t) of the fp32 quotient t = amax / 6
        tm, tex = np.frexp((amax.astype(np.float32) / np.float32(6)).astype(np.float64))
        e = np.where(tm == 0, -127, np.where(tm == 0.5, tex - 1, tex))  # t underflows to 0: log2 is -inf
    return np.clip(e, -127, 127)


def np_mxfp4(x: torch.Tensor, rule: ScaleRule) -> tuple[np.ndarray, np.ndarray]:
    xb = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    e = np_mx_exponent(amax, rule)
    y = xb.astype(np.float64) * np.exp2(-e.astype(np.float64))[..., None]  # exact
    zero = amax == 0
    codes = np.where(zero[..., None], 0, ml_e2m1(y.astype(np.float32)))
    return np_pack(codes.reshape(x.shape)), np.where(zero, 0, e + 127).astype(np.uint8)


def np_nvfp4(x: torch.Tensor, recipe: NvRecipe, g_dec: np.float32) -> tuple[np.ndarray, np.ndarray]:
    xb = x.numpy().reshape(x.shape[0], -1, 16)
    amax = np.abs(xb).max(-1)
    g_enc = np.float32(1) / g_dec
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sb = ml_e4m3(amax / np.float32(6) * g_enc)
        s = sb.view(F8).astype(np.float32)
        if recipe == NvRecipe.RCP:
            y = xb * (np.float32(1) / (s * g_dec))[..., None]
        elif recipe == NvRecipe.DIV:
            y = xb / (s * g_dec)[..., None]
        else:
            y = xb / (amax / np.float32(6))[..., None]
        codes = np.where((sb == 0)[..., None], 0, ml_e2m1(np.nan_to_num(y)))
    return np_pack(codes.reshape(x.shape)), sb


def np_fp8_scale(amax: np.ndarray, ds: bool, pow2: bool) -> np.ndarray:
    amax = amax.astype(np.float32)
    s = np.maximum(amax, np.float32(1e-4)) / np.float32(448) if ds else amax / np.float32(448)
    s = np.where(s > 0, s, np.float32(1))  # also when amax / 448 underflows to 0 (amax < 448 * 2**-150)
    if pow2:
        m, ex = np.frexp(s.astype(np.float64))
        s = np.exp2(np.where(m == 0.5, ex - 1, ex)).astype(np.float32)
    return s.astype(np.float32)


# ------------------------------------------------------------------------------------------------ element codecs
def e2m1_probe_values() -> torch.Tensor:
    """Every tie and the values one ulp either side, every code value, both signs, and wide random magnitudes."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0, 0.0, 1e-45, 1e30, 3e38])
    near = torch.cat([ties, torch.nextafter(ties, torch.tensor(100.0)), torch.nextafter(ties, torch.tensor(0.0)),
                      E2M1.values()])
    rnd = torch.from_numpy(np.random.default_rng(SEED).standard_normal(20000).astype(np.float32)) * 4
    return torch.cat([near, -near, rnd, torch.exp(rnd * 8)]).float()


def test_e2m1_encode_matches_ml_dtypes():
    v = e2m1_probe_values()
    assert bits_equal(e2m1_encode(v), ml_e2m1(v.numpy())), where_differ(e2m1_encode(v), ml_e2m1(v.numpy()))
    assert e2m1_encode(torch.tensor([-0.0, -0.1]).float()).tolist() == [8, 8]  # the sign survives a zero code


def test_e2m1_table_equals_reference_rule():
    """The fast table encode equals the SPEC comparison chain on the edges and the inside of every class of the table
    (sign | exponent | 2 mantissa bits | sticky), and on a strided sweep of all 2**32 bit patterns."""
    idx = torch.arange(4096, dtype=torch.int64)
    lo = (idx >> 1) << 21
    inside = torch.from_numpy(np.random.default_rng(SEED).integers(1, 0x1FFFFF, 4096))
    members = torch.cat([lo, lo | 1, lo | 0x1FFFFF, lo | inside]).to(torch.int32)  # int64 -> int32 wraps the sign
    y = members.view(torch.float32)
    assert torch.equal(e2m1_encode(y), e2m1_encode_reference(y))
    start = int(np.random.default_rng(SEED).integers(0, 4093))
    sweep = torch.arange(start, 2**32, 4093, dtype=torch.int64).to(torch.int32).view(torch.float32)  # ~1M patterns
    assert torch.equal(e2m1_encode(sweep), e2m1_encode_reference(sweep))


@pytest.mark.gpu
def test_e2m1_table_every_fp32_pattern_gpu():
    for start in range(0, 2**32, 2**28):
        y = torch.arange(start, start + 2**28, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)
        assert torch.equal(e2m1_encode(y), e2m1_encode_reference(y)), hex(start)


def test_e2m1_domain_sweep():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert bits_equal(values, np.arange(16, dtype=np.uint8).view(F4).astype(np.float32))
    assert torch.equal(e2m1_encode(values), codes)  # every code, both signs, -0 -> 8
    assert E2M1.max == 6.0 and E2M1.bits == 4 and len(E2M1.values()) == 16


def e4m3_probe_values() -> torch.Tensor:
    """All E4M3 values, the midpoints between neighbours and one ulp either side, saturation, subnormals."""
    v = E4M3.values()
    v = v[torch.isfinite(v)].unique()
    mid = (v[1:].double() + v[:-1].double()) / 2
    mid = mid.float()
    edges = torch.tensor([448.0, 449.0, 464.0, 465.0, 480.0, 1e5, 3e38, 2.0**-10, 2.0**-11, 1e-45, 0.0])
    rnd = torch.from_numpy(np.random.default_rng(SEED + 1).standard_normal(20000).astype(np.float32))
    near = torch.cat([mid, edges])
    near = torch.cat([near, torch.nextafter(near, torch.tensor(1e9)), torch.nextafter(near, torch.tensor(0.0))])
    return torch.cat([v, near, -near, rnd * 100, torch.exp(rnd * 6)]).float()


def test_e4m3_encode_matches_ml_dtypes():
    v = e4m3_probe_values()
    ours, ref = e4m3_encode(v), ml_e4m3(v.numpy())
    assert bits_equal(ours, ref), where_differ(ours, ref)
    assert not torch.isnan(e4m3_decode(ours)).any()  # finite input never becomes NaN
    assert e4m3_encode(torch.tensor([-0.0, 1e9, -1e9])).tolist() == [0x80, 0x7E, 0xFE]


def test_e4m3_domain_sweep():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = e4m3_decode(codes)
    assert bits_equal(values, np.arange(256, dtype=np.uint8).view(F8).astype(np.float32))
    nan_code = (codes & 0x7F) == 0x7F  # 0b0_1111_111, both signs
    assert torch.isnan(values[nan_code]).all() and not torch.isnan(values[~nan_code]).any()
    assert torch.equal(e4m3_encode(values[~nan_code]), codes[~nan_code])
    assert E4M3.max == 448.0 and E4M3.min_subnormal == 2.0**-9 and E4M3.min_normal == 2.0**-6


def test_e8m0_domain_sweep():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = np.arange(256, dtype=np.uint8).view(E8).astype(np.float32)
    assert bits_equal(e8m0_decode(codes), ref)  # byte 0 = 2**-127 (fp32 subnormal), 255 = NaN
    e = torch.arange(-149, 128, dtype=torch.int32)
    assert bits_equal(exp2_int(e), np.exp2(e.numpy().astype(np.float64)).astype(np.float32))


def test_pack_nibbles_matches_numpy_and_inverts():
    codes = torch.from_numpy(np.random.default_rng(SEED).integers(0, 16, (7, 64), dtype=np.uint8))
    packed = pack_nibbles(codes)
    assert bits_equal(packed, np_pack(codes.numpy()))
    assert torch.equal(unpack_nibbles(packed), codes)


# ------------------------------------------------------------------------------------------------- SPEC goldens
def test_golden_e2m1_packing():
    assert pack_nibbles(e2m1_encode(torch.tensor([0.0, 0.5, 4.0, -0.0]))).tolist() == [0x10, 0x86]
    assert pack_nibbles(e2m1_encode(torch.tensor([1.0, 6.0]))).tolist() == [0x72]


GOLDEN_ROW = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
MX_GOLDEN = {ScaleRule.FLOOR: (127, "20 42 64 76 98 ba dc fe"), ScaleRule.RCEIL: (128, "10 21 42 64 88 a9 ba dc"),
             ScaleRule.CEIL: (128, "10 21 42 64 88 a9 ba dc"), ScaleRule.EVEN: (128, "10 21 42 64 88 a9 ba dc")}


@pytest.mark.parametrize("rule", list(ScaleRule), ids=lambda r: r.name.lower())
def test_golden_mxfp4_row(rule):
    q = get_format("mxfp4", scale_rule=rule).quantize(torch.tensor([GOLDEN_ROW * 2]))
    byte, payload = MX_GOLDEN[rule]
    assert q.scales.tolist() == [[byte]]
    assert q.payload[0].tolist() == [int(b, 16) for b in payload.split()] * 2


def test_golden_nvfp4_row_and_recipe_example():
    q = get_format("nvfp4").quantize(torch.tensor([GOLDEN_ROW]))
    assert e4m3_decode(q.scales).tolist() == [[1.125]]
    assert q.payload[0].tolist() == [int(b, 16) for b in "10 32 54 76 98 ba dc fe".split()]
    # SPEC example: scale byte 0x0F (S = 0.029296875), x = 0.03662109375: x * (1/S) = 1.2500001 -> 1.5, x / S = 1.25 -> 1
    x = torch.tensor([[6 * 0.029296875, 0.03662109375] + [0.0] * 14])
    for recipe, code in ((NvRecipe.RCP, 3), (NvRecipe.DIV, 2)):
        q = get_format("nvfp4", recipe=recipe).quantize(x)
        assert q.scales.tolist() == [[0x0F]] and unpack_nibbles(q.payload)[0, 1] == code, recipe


def test_golden_nvfp4_outer_scales():
    x = torch.tensor([[5376.0, 896.0, -2688.0] + [0.0] * 13, [12.0] + [0.0] * 15])
    q = get_format("nvfp4", outer_scale="auto").quantize(x)
    assert q.outer_scale == 2.0  # 5376 / (6 * 448)
    # block 0: 5376 / 6 / 2 = 448 -> 0x7E; codes 5376 -> 6, 896 / 896 -> 1, -2688 / 896 -> -3 (0b1_10_1)
    assert q.scales.tolist() == [[0x7E], [0x38]] and unpack_nibbles(q.payload)[0, :3].tolist() == [7, 2, 13]
    q = get_format("nvfp4", outer_scale="0.25").quantize(x)
    assert q.outer_scale == 0.25 and q.scales[1].tolist() == [0x50]  # 12 / 6 * 4 = 8 = 2**3 -> 0b0_1010_000
    assert get_format("nvfp4", outer_scale="auto").quantize(torch.zeros(1, 16)).outer_scale == 1.0
    assert torch.equal(q.dequantize()[1], x[1])


def test_golden_fp8_scales():
    x = torch.zeros(4, 16)
    x[0, 3], x[1, 0], x[2, 1], x[3, 2] = 896.0, 100.0, -1e-5, 0.0
    amax = x.abs().amax(-1, keepdim=True)
    assert fp8_row_scale(amax, False, False).reshape(-1).tolist() == [2.0, np.float32(100 / 448), np.float32(1e-5)
                                                                      / np.float32(448), 1.0]
    ds = np.float32(1e-4) / np.float32(448)
    assert fp8_row_scale(amax, True, False).reshape(-1).tolist() == [2.0, np.float32(100 / 448), ds, ds]
    assert fp8_row_scale(amax, True, True).reshape(-1).tolist() == [2.0, 0.25, 2.0**-22, 2.0**-22]
    q = get_format("fp8", fp8_scale="tensor").quantize(x)
    assert float(q.scales) == 2.0 and q.payload[0, 3] == 0x7E  # 896 / 2 = 448
    assert get_format("fp8", fp8_scale="token").quantize(x).scales.reshape(-1)[3] == 1.0  # all-zero row: s = 1


def test_golden_edge_expectations():
    """Hand-derived expectations on named edge cases (the table must keep meaning what its names say)."""
    cases = dict(EDGE_CASES)
    nv = get_format("nvfp4").quantize(cases["nvfp4_subnormal_scales"]).scales[:3, 0].tolist()
    assert nv == [0, 0, 1]  # amax/6 = 2**-11, 2**-10 (ties to 0), 2**-10 + ulp (rounds up to 2**-9)
    for name in ("all_zero", "neg_zero"):
        for fmt in ("nvfp4", "mxfp4"):
            q = get_format(fmt).quantize(cases[name])
            assert not q.payload.any() and not q.scales.any(), (name, fmt)
    floor = get_format("mxfp4-floor").quantize(cases["floor_clip"])
    assert (unpack_nibbles(floor.payload)[:, 0] == 7).all()  # maxima in (6, 8) * 2**k clip to code 7 (= 6)
    even = mx_exponent(torch.tensor([1.75 - 2**-22, 1.75, 1.875]), ScaleRule.EVEN).tolist()
    assert even == [-2, -1, -1]


# -------------------------------------------------------------------------------------- block codecs vs oracles
@pytest.mark.parametrize("rule", list(ScaleRule), ids=lambda r: r.name.lower())
def test_mxfp4_matches_oracle(data, rule):
    q = get_format("mxfp4", scale_rule=rule).quantize(data)
    payload, scales = np_mxfp4(data, rule)
    assert bits_equal(q.scales, scales), where_differ(q.scales, scales)
    assert bits_equal(q.payload, payload), where_differ(q.payload, payload)


@pytest.mark.parametrize("outer", ["1", "auto", "0.25", "0.003"])
@pytest.mark.parametrize("recipe", list(NvRecipe), ids=lambda r: r.name.lower())
def test_nvfp4_matches_oracle(data, recipe, outer):
    q = get_format("nvfp4", recipe=recipe, outer_scale=outer).quantize(data)
    g = np.float32(data.abs().max().item()) / np.float32(2688) if outer == "auto" else np.float32(float(outer))
    g = g if outer != "auto" or g >= 2.0**-118 else np.float32(1)  # keeps 1 / (S * g) finite for S >= 2**-9
    assert q.outer_scale == float(g)
    payload, scales = np_nvfp4(data, recipe, g)
    assert bits_equal(q.scales, scales), where_differ(q.scales, scales)
    assert bits_equal(q.payload, payload), where_differ(q.payload, payload)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.family == "fp8"], ids=lambda f: f.label)
def test_fp8_matches_oracle(data, fmt):
    q = fmt.quantize(data)
    x = data.numpy()
    if fmt.fp8_scale == Fp8Scale.UNIT:
        s = np.float32(1)
        assert q.scales is None
    elif fmt.fp8_scale == Fp8Scale.TENSOR:
        s = np_fp8_scale(np.abs(x).max(), False, False)
        assert bits_equal(q.scales.reshape(()), torch.tensor(s))
    else:
        s = np_fp8_scale(np.abs(x).max(-1, keepdims=True), fmt.ds_floor, fmt.pow2)
        assert bits_equal(q.scales, s), where_differ(q.scales, s)
    ref = ml_e4m3(x if fmt.fp8_scale == Fp8Scale.UNIT else x / s)
    assert bits_equal(q.payload, ref), where_differ(q.payload, ref)


# -------------------------------------------------------------------------------------- block codecs vs torchao
@pytest.fixture(scope="module")
def torchao_mx():
    pytest.importorskip("torchao")  # a third opinion only: the GPU machine has no torchao
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    return to_mx, ScaleCalculationMode, nvfp4_quantize


def torchao_log2_misrounds(amax: torch.Tensor) -> torch.Tensor:
    """Where torchao's RCEIL `ceil(log2(amax / 6))`, taken in fp32 with torch.log2, differs from the exact value (amax
    / 6 a few ulp above a power of two: log2 rounds to the integer)."""
    t = amax / 6.0
    exact = torch.from_numpy(np_mx_exponent(amax.numpy(), ScaleRule.RCEIL))
    return torch.ceil(torch.log2(t)).clamp(-127, 127).to(exact.dtype) != exact


@pytest.mark.parametrize("rule", list(ScaleRule), ids=lambda r: r.name.lower())
def test_mxfp4_matches_torchao(data, rule, torchao_mx):
    """Same bytes as torchao `to_mx(x, float4_e2m1fn_x2, 32, mode)` except, and only, where torchao documents or
    implements something else: (1) blocks with e = -127 (byte 0): torchao clamps the fp32 scale to the smallest normal
    2**-126 (FLOOR/EVEN/CEIL) or multiplies by 1.0 (RCEIL) instead of 2**127; (2) all-zero blocks holding -0: the SPEC
    writes codes 0, torchao keeps code 8; (3) RCEIL only: blocks whose amax / 6 sits a few ulp above a power of two,
    where torchao's fp32 log2 rounds to the integer and its ceil comes out one too small."""
    to_mx, mode, _ = torchao_mx
    q = get_format("mxfp4", scale_rule=rule).quantize(data)
    ts, tp = to_mx(data, torch.float4_e2m1fn_x2, 32, getattr(mode, rule.name))
    ts, tp = ts.view(torch.uint8), tp.view(torch.uint8)
    xb = data.reshape(data.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    excluded = (q.scales == 0) | ((amax == 0) & torch.signbit(xb).any(-1))
    if rule == ScaleRule.RCEIL:
        excluded |= torchao_log2_misrounds(amax)
    scale_diff = ts != q.scales
    payload_diff = (tp != q.payload).reshape(*amax.shape, 16).any(-1)
    assert not (scale_diff & ~excluded).any(), where_differ(ts[~excluded], q.scales[~excluded])
    assert not (payload_diff & ~excluded).any(), f"seed {SEED}: payload differs outside the documented exclusions"
    assert excluded.float().mean() < 0.2, "exclusions must stay the exception"


def test_torchao_rceil_difference_is_real(torchao_mx):
    """The RCEIL exclusion is not vacuous: on the rceil_pow2 edge case torchao's exponent is one lower than ours."""
    to_mx, mode, _ = torchao_mx
    x = dict(EDGE_CASES)["rceil_pow2"]
    q = get_format("mxfp4-rceil").quantize(x)
    ts = to_mx(x, torch.float4_e2m1fn_x2, 32, mode.RCEIL)[0].view(torch.uint8)
    misround = torchao_log2_misrounds(x.reshape(x.shape[0], -1, 32).abs().amax(-1))
    assert misround.any() and torch.equal(ts[misround].int(), q.scales[misround].int() - 1)


def test_nvfp4_matches_torchao(data, torchao_mx):
    """Same bytes as torchao `nvfp4_quantize(x)` (no per-tensor scale: our `rcp` recipe, outer scale 1) on every block
    whose scale amax / 6 is >= 2**-6: torchao clamps smaller scales up to the smallest normal E4M3 (its all-zero block
    is 0x08 where the SPEC writes 0x00)."""
    _, _, nvfp4_quantize = torchao_mx
    q = get_format("nvfp4").quantize(data)
    ts, tp = nvfp4_quantize(data)
    ts, tp = ts.view(torch.uint8), tp.view(torch.uint8)
    amax = data.reshape(data.shape[0], -1, 16).abs().amax(-1)
    compared = amax / 6.0 >= 2.0**-6
    assert compared.float().mean() > 0.5
    assert torch.equal(ts[compared], q.scales[compared]), where_differ(ts[compared], q.scales[compared])
    tp, qp = tp.reshape(*amax.shape, 8), q.payload.reshape(*amax.shape, 8)
    assert torch.equal(tp[compared], qp[compared]), where_differ(tp[compared], qp[compared])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_finite_input_never_gives_nan_or_inf(fmt):
    """Each edge case ALONE (so whole-tensor scales see tiny and huge tensors too), and tiny tensors around the nvfp4
    `auto` floor: no NaN code, no non-finite scale, and finite dequantized values (|x| < 2**127, see test_requantize)."""
    tiny = [torch.randn(4, D) * 10.0**p for p in (-30, -33, -36, -40)]
    for x in [x for _, x in EDGE_CASES] + tiny:
        x = x[x.abs().amax(-1) < 2.0**127]
        q = fmt.quantize(x)
        assert torch.isfinite(q.dequantize()).all(), fmt.label
        if fmt.family == "fp8":
            assert not ((q.payload & 0x7F) == 0x7F).any() and (q.scales is None or torch.isfinite(q.scales).all())
        if fmt.family == "nvfp4":
            assert not ((q.scales & 0x7F) == 0x7F).any() and 0 < q.outer_scale < float("inf")
        if fmt.family == "mxfp4":
            assert not (q.scales == 255).any()


# -------------------------------------------------------------------------------------------------- round trips
def oracle_dequantize(q) -> np.ndarray:
    """decode(code) * scale (* g_dec), from ml_dtypes decodes (fp32, the product order of the SPEC)."""
    fmt = q.fmt
    if fmt.family == "bf16":
        return q.payload.float().numpy()
    if fmt.family == "fp8":
        v = q.payload.numpy().view(F8).astype(np.float32)
        return v if q.scales is None else v * q.scales.numpy()
    codes = np.stack([q.payload.numpy() & 0xF, q.payload.numpy() >> 4], -1).reshape(*q.shape)
    v = codes.astype(np.uint8).view(F4).astype(np.float32).reshape(q.shape[0], -1, fmt.block)
    s = q.scales.numpy().view(F8 if fmt.family == "nvfp4" else E8).astype(np.float32)[..., None]
    with np.errstate(over="ignore"):  # mx: code 4 at e = 126 is 2**128, inf in fp32 (see test_requantize)
        out = v * s * np.float32(q.outer_scale) if fmt.family == "nvfp4" else v * s
    return out.reshape(q.shape)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_dequantize_matches_oracle_decode(data, fmt):
    q = fmt.quantize(data)
    assert bits_equal(q.dequantize(), oracle_dequantize(q))


# Which formats are idempotent (quantize(dequantize(q)) == q, bit for bit), and why the others are not:
# - bf16, fp8 unit: the values are representable already.
# - mxfp4 floor / even: the block max code is 4 or 6, whose value gives the same exponent back.
# - nvfp4 rcp / div / unrounded at outer scale 1: the block max code is 6 (the E4M3 scale rounds by < 1/16), so
#   6 * S / 6 = S comes back; the codes come back because c * S * (1/S) is within an ulp of c, far from any tie.
# NOT idempotent: fp8 tensor / token / ds (448 * s rounds, so s' = amax' / 448 can move by an ulp); fp8 ds-pow2 (s
# rounds UP to a power of two, so the max code is in (224, 448]; when it is 224, s' = s / 2: same values); mxfp4 rceil
# (amax / 2**e in (3, 3.5) has max code 3, and 3 * 2**e re-derives e - 1) and ceil (max code 2 re-derives e - 1):
# same values, other bytes; nvfp4 `auto` (g_dec is re-derived from the rounded amax'). Blocks whose every code is
# +-0 are excluded for all: the zero-block rule rewrites -0 codes (written by tiny blocks with e clamped at -127) to 0;
# NVFP4 blocks with subnormal scale bytes are excluded too (the scale rounds by up to 50 %, so the max code can be 3).
IDEMPOTENT = {"bf16", "fp8-unit", "mxfp4-floor", "mxfp4-even", "nvfp4-rcp", "nvfp4-div",
              "nvfp4-unrounded"}
VALUE_IDEMPOTENT = {"mxfp4-rceil", "mxfp4-ceil", "fp8-token-ds-pow2"}  # dequantize(quantize(dequantize(q))) == dequantize(q)


def test_idempotence_table_names_real_formats():
    labels = {f.label for f in FORMATS}
    assert IDEMPOTENT | VALUE_IDEMPOTENT <= labels


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.label in IDEMPOTENT | VALUE_IDEMPOTENT], ids=lambda f: f.label)
def test_requantize(data, fmt):
    # Rows with |x| near the top of fp32 are left out: under ceil / even / rceil a block max >= 1.75 * 2**127 gets
    # code 4 at e = 126, which decodes to 2**128 = inf in fp32 (the format holds it; fp32 cannot).
    data = data[data.abs().amax(-1) < 2.0**127]
    q = fmt.quantize(data)
    back = fmt.quantize(q.dequantize())
    if fmt.label in VALUE_IDEMPOTENT:
        assert torch.equal(back.dequantize(), q.dequantize())  # by value: the zero-block rule may turn -0 into 0
        return
    if not fmt.block:
        assert torch.equal(back.payload.view(torch.uint8), q.payload.view(torch.uint8))
        assert (q.scales is None) or bits_equal(back.scales, q.scales)
        return
    keep = ((unpack_nibbles(q.payload) & 7) != 0).reshape(*q.scales.shape, fmt.block).any(-1)
    if fmt.family == "nvfp4":
        keep &= q.scales >= 0x08
    assert torch.equal(back.scales[keep], q.scales[keep]), where_differ(back.scales[keep], q.scales[keep])
    pb, qb = (p.reshape(*q.scales.shape, fmt.block // 2) for p in (back.payload, q.payload))
    assert torch.equal(pb[keep], qb[keep])


def test_non_idempotent_rules_really_move():
    """The rceil / ceil exclusions above are real: a block with max code 3 (rceil) or 2 (ceil) re-derives e - 1."""
    x = torch.tensor([[3.25] + [0.5] * 31])  # rceil: e = ceil(log2(3.25 / 6)) = 0, max code 3 -> 3 / 6 gives e = -1
    for label, byte in (("mxfp4-rceil", 126), ("mxfp4-ceil", 126)):
        fmt = get_format(label)
        q = fmt.quantize(x if label.endswith("rceil") else torch.tensor([[2.25] + [0.5] * 31]))
        assert fmt.quantize(q.dequantize()).scales.item() == byte and q.scales.item() == byte + 1, label


# ------------------------------------------------------------------------------------------ registry invariants
SPEC_BYTES = {"bf16": 256, "fp8-unit": 128, "fp8-tensor": 128, "fp8-token": 132, "nvfp4": 72, "mxfp4": 68}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_registry_invariants(fmt):
    assert fmt.bytes_per_token(D) == fmt.payload_bytes(D) + fmt.scale_bytes(D)
    key = fmt.family if fmt.family != "fp8" else f"fp8-{fmt.fp8_scale.name.lower()}"
    assert fmt.bytes_per_token(128) == SPEC_BYTES[key]
    assert get_format(fmt.label) == fmt and type(fmt).from_meta(fmt.to_meta()) == fmt
    q = fmt.quantize(torch.randn(3, D))
    per_tensor = 4 if fmt.scale_element == "fp32-tensor" else 0  # one fp32 scale for the whole tensor
    assert q.nbytes == 3 * fmt.bytes_per_token(D) + per_tensor and q.shape == (3, D)
    if fmt.element is not None:
        assert fmt.element.bits == fmt.spec.payload_bits and len(fmt.element.values()) == 2**fmt.element.bits
        assert float(fmt.element.values().nan_to_num(0).abs().max()) == fmt.element.max


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_registry_rejects_bad_input(fmt):
    x = torch.randn(2, D)
    for name, bad, flat in NONFINITE_CASES:
        with pytest.raises(InputError, match=rf"keys: .*index \[{flat // D}, {flat % D}\]"):
            fmt.quantize(bad, name="keys")
    with pytest.raises(InputError, match="keys"):
        fmt.quantize(x.to(torch.int32), name="keys")
    if fmt.block:
        with pytest.raises(FormatError, match="keys"):
            fmt.quantize(torch.randn(2, D + fmt.block // 2), name="keys")


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.needs_tensor_amax], ids=lambda f: f.label)
def test_chunked_with_tensor_amax_equals_whole(data, fmt):
    whole = fmt.quantize(data)
    amax = data.abs().amax()
    parts = [fmt.quantize(c, tensor_amax=amax) for c in data.split(37)]
    assert all(p.outer_scale == whole.outer_scale for p in parts)
    assert torch.equal(torch.cat([p.payload for p in parts]), whole.payload)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.block], ids=lambda f: f.label)
def test_cpu_row_chunks_equal_one_piece(data, fmt, monkeypatch):
    """The CPU path quantizes in row chunks; chunk edges (here every 5 rows, and every row) change no byte."""
    whole = fmt.quantize(data)
    for rows in (5, 1):
        monkeypatch.setattr(fc, "CPU_CHUNK_ELEMENTS", rows * D)
        q = fmt.quantize(data[:203], tensor_amax=data.abs().amax())
        assert torch.equal(q.payload, whole.payload[:203]) and torch.equal(q.scales, whole.scales[:203]), rows
    q = fmt.quantize(data[:7].reshape(7, 2, D // 2) if fmt.block <= D // 2 else data[:7])  # leading dims, other D
    ref = fmt.quantize(data[:7].reshape(14, D // 2) if fmt.block <= D // 2 else data[:7])
    assert torch.equal(q.payload.reshape(ref.payload.shape), ref.payload) and q.scales.shape[:-1] == q.shape[:-1]


def test_bf16_input_equals_its_fp32_value(data):
    xb = data.clamp(-1e30, 1e30).to(torch.bfloat16)
    for fmt in FORMATS:
        a, b = fmt.quantize(xb), fmt.quantize(xb.float())
        assert torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8)), fmt.label


@pytest.mark.parametrize("name", ["fp5", "mxfp4-round", "nvfp4-floor", "fp8-ds-auto", "nvfp4-gabc", "nvfp4-g-1"])
def test_unknown_names_raise(name):
    with pytest.raises(FormatError):
        get_format(name)


def test_unknown_options_raise():
    for kwargs in ({"scale_rule": "nearest"}, {"recipe": "rcp"}, {"outer_scale": "auto"}):
        with pytest.raises(FormatError):
            get_format("mxfp4", **kwargs)
    with pytest.raises(FormatError):
        get_format("nvfp4", recipe="mul")
    with pytest.raises(FormatError):
        get_format("fp8", fp8_scale="tensor", ds_floor=True)
    assert get_format("fp4") == get_format("nvfp4") and get_format("fp8-ds").fp8_scale == Fp8Scale.TOKEN


def test_rule_enums_equal_kernel_constexprs():
    from kvtool.kernels import codecs as kc

    def value(c):
        return getattr(c, "value", c)

    for rule in ScaleRule:
        assert value(getattr(kc, f"RULE_{rule.name}")) == int(rule)
    for recipe in NvRecipe:
        assert value(getattr(kc, f"RECIPE_{recipe.name}")) == int(recipe)
    assert value(kc.E2M1_MAX) == E2M1.max and value(kc.E4M3_MAX) == E4M3.max
