"""The break generator of the doctor tests: clean caches (the committed fixtures and fresh seeded random caches with
real caches' structure) in every format, and each failure of `kvtool doctor`'s table applied to them at several
severities. Breaks are written from first principles here (ml_dtypes for E4M3FNUZ, torch bit views), never with the
doctor's own writers, so a test cannot pass by agreeing with itself.

A break is `Break(name, code, formats, severities, make, needs)`: `make(cache, fmt, severity, gen) -> Broken`
(the broken tensors, the reference to give, the examine() options); `needs` says what the doctor needs to see it
("bytes": the bytes alone, "reference": only with the original).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import load_file

from kvtool.formats import QTensor, get_format, pack_nibbles

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"

# Every format family and option the break matrix covers (fp8 unit/tensor/token, nvfp4, mxfp4 each rule, bf16).
FORMATS = ("bf16", "fp8", "fp8-tensor", "fp8-token", "nvfp4", "nvfp4-auto", "mxfp4-floor", "mxfp4-even", "mxfp4-ceil",
           "mxfp4-rceil")
FP8 = ("fp8", "fp8-tensor", "fp8-token")
FP8_SCALED = ("fp8-tensor", "fp8-token")
FP4 = ("nvfp4", "nvfp4-auto", "mxfp4-floor", "mxfp4-even", "mxfp4-ceil", "mxfp4-rceil")
BLOCK_SCALED = FP4 + ("fp8-token",)


# ------------------------------------------------------------------------------------------------ clean caches
def random_cache(seed: int, tokens: int | None = None, heads: int | None = None, dim: int | None = None) -> dict:
    """A fresh cache with real caches' structure: keys with per-head outlier channels (5-30x) and a few outlier
    tokens, near-isotropic values, a magnitude drawn per seed (lognormal), and one planted all-zero block in k."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    t = tokens or pick((128, 192, 256))
    h = heads or pick((1, 2, 4))
    d = dim or pick((64, 128))
    sigma = float(torch.exp(torch.randn(1, generator=g) * 1.5))
    chan = torch.exp(0.3 * torch.randn(h, d, generator=g))
    for i in range(h):
        idx = torch.randperm(d, generator=g)[:4]
        chan[i, idx] *= 5 + 25 * torch.rand(4, generator=g)
    k = torch.randn(t, h, d, generator=g) * chan * sigma
    tok = torch.randperm(t, generator=g)[:3]
    k[tok] *= 8
    v = torch.randn(t, h, d, generator=g) * sigma * torch.exp(0.2 * torch.randn(h, d, generator=g))
    v[tok[:1]] *= 4
    zt, zh = int(torch.randint(t, (1,), generator=g)), int(torch.randint(h, (1,), generator=g))
    k[zt, zh, :32] = 0
    return {"layers.0.k": k.to(torch.bfloat16).float(), "layers.0.v": v.to(torch.bfloat16).float()}


def fixture_caches(layers: tuple[int, ...] = (0, 1)) -> dict:
    """{fixture: {name: fp32 tensor}} of the committed fixtures (k / v / index_k of the given layers)."""
    out = {}
    for f in ("synthetic_cache.safetensors", "smollm2_capture.safetensors"):
        d = load_file(str(FIXTURES / f))
        out[f] = {k: v.float() for k, v in d.items() if k.endswith((".k", ".v", ".index_k")) and k.startswith(
            tuple(f"layers.{i}." for i in layers))}
    return out


def quantize(cache: dict, label: str) -> dict:
    """The clean cache in format `label`. A unit-scale fp8 cache holds data inside +-448 (beyond it the format clips,
    and the doctor rightly says so): larger draws are scaled into range first."""
    fmt = get_format(label)
    out = {}
    for name, x in cache.items():
        if x.shape[-1] % (fmt.block or 2):
            continue
        if label == "fp8" and float(x.abs().amax()) > 448:
            x = x * (400 / float(x.abs().amax()))
        out[name] = fmt.quantize(x)
    return out


# ------------------------------------------------------------------------------------------------ byte helpers
def fnuz_bytes(x: torch.Tensor) -> torch.Tensor:
    """E4M3FNUZ codes of fp32 x (ml_dtypes: saturate at 240 first, as FNUZ writers do)."""
    a = np.clip(x.float().numpy(), -240.0, 240.0).astype(ml_dtypes.float8_e4m3fnuz)
    return torch.from_numpy(a.view(np.uint8).copy())


def fnuz_cache(x: torch.Tensor, label: str) -> QTensor:
    """An fp8 cache as an E4M3FNUZ writer makes it (per-row / tensor scale maps the amax onto 240)."""
    fmt = get_format(label)
    if fmt.scale_element == "none":
        return QTensor(fmt, fnuz_bytes(x), None, 1.0, tuple(x.shape))
    amax = x.abs().amax(-1, keepdim=True) if fmt.scale_element == "fp32-row" else x.abs().amax()
    s = torch.where(amax > 0, amax / 240.0, torch.ones_like(amax))
    return QTensor(fmt, fnuz_bytes(x / s), s, 1.0, tuple(x.shape))


def with_(q: QTensor, **kw) -> QTensor:
    return QTensor(kw.get("fmt", q.fmt), kw.get("payload", q.payload), kw.get("scales", q.scales),
                   kw.get("outer_scale", q.outer_scale), q.shape, dict(q.extra))


def swap_nibbles(p: torch.Tensor) -> torch.Tensor:
    return ((p & 0x0F) << 4) | (p >> 4)


def scaled_writer(x: torch.Tensor, label: str, k: int) -> QTensor:
    """A cache whose scales are 2^k times what the format's rule gives, codes computed at those scales (k < 0:
    clipping, k > 0: flush). Built from the correct quantization: the stored scale moves by exactly 2^k."""
    fmt = get_format(label)
    q = fmt.quantize(x)
    if fmt.family == "mxfp4":
        sc = q.scales.to(torch.int32)
        sc = torch.where(sc > 0, (sc + k).clamp(1, 254), sc).to(torch.uint8)
        s = torch.exp2(sc.float() - 127).repeat_interleave(32, -1)
        s = torch.where(sc.repeat_interleave(32, -1) > 0, s, torch.inf)
    elif fmt.family == "nvfp4":
        sv = q.scales.view(torch.float8_e4m3fn).float() * 2.0**k
        sc = sv.clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)
        s = (sc.view(torch.float8_e4m3fn).float() * q.outer_scale).repeat_interleave(16, -1)
        s = torch.where(s > 0, s, torch.inf)
    else:
        sc = q.scales * 2.0**k
        s = sc
    y = (x / s).float()
    if fmt.family == "fp8":
        codes = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        return with_(q, payload=codes, scales=sc)
    codes = torch.from_numpy(np.clip(y.numpy(), -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)
    return with_(q, payload=pack_nibbles(codes), scales=sc)


# --------------------------------------------------------------------------------------------------- breaks
@dataclass
class Broken:
    tensors: dict  # {name: QTensor | tensor}: what examine() is given
    reference: dict | None = None  # {name: fp32 tensor}: the original, when the break needs it
    options: dict = field(default_factory=dict)  # examine() keyword options
    tensor: str | None = None  # the tensor the finding must name (None: any)
    noop: bool = False  # the break left the bytes as they were (e.g. two recipes that agree on this data)


@dataclass(frozen=True)
class Break:
    name: str
    code: str
    formats: tuple[str, ...]
    severities: tuple
    make: Callable
    needs: str = "bytes"


def _k(cache):
    return next(n for n in cache if n.endswith(".k"))


def _fnuz(cache, fmt, sev, gen):
    name = _k(cache)
    x = cache[name] * sev
    out = dict(quantize(cache, fmt))
    out[name] = fnuz_cache(x, fmt)
    ref = {name: x} if fmt == "fp8" and sev < 100 else None  # unit scale without saturation: only a reference shows
    return Broken(out, ref, tensor=name)


def _fn_as_fnuz(cache, fmt, sev, gen):
    scaled = {n: x * sev for n, x in cache.items()}
    out = quantize(scaled, fmt)
    # a unit-scale cache of larger values has no -0 codes left: then only the reference shows it
    return Broken(out, scaled if fmt == "fp8" and sev > 1 else None, {"fp8_element": "fnuz"})


def _half(dtype_written, dtype_read):
    def make(cache, fmt, sev, gen):
        name = _k(cache)
        x = cache[name] * sev
        out = {n: v.to(dtype_read) for n, v in cache.items()}
        out[name] = x.to(dtype_written).view(dtype_read)
        return Broken(out, tensor=name)
    return make


def _unit(cache, fmt, sev, gen):
    f = get_format(fmt)
    name = _k(cache)
    x = cache[name] * sev
    q = f.quantize(x)
    if f.family == "fp8":
        codes = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        ones = torch.ones_like(q.scales)
        q = with_(q, payload=codes, scales=ones)
    else:
        codes = torch.from_numpy(np.clip(x.numpy(), -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)
        unit = 0x38 if f.family == "nvfp4" else 127
        q = with_(q, payload=pack_nibbles(codes), scales=torch.full_like(q.scales, unit), outer_scale=1.0)
    out = dict(quantize(cache, fmt))
    out[name] = q
    return Broken(out, tensor=name)


# (writer rule, declared rule) pairs the bytes show (the declared rule never tops a block out at what was written)
MX_BYTES_PAIRS = {"mxfp4-floor": "ceil", "mxfp4-even": "ceil", "mxfp4-ceil": "rceil", "mxfp4-rceil": "floor"}


def _rule(cache, fmt, sev, gen):
    name = _k(cache)
    written = get_format(fmt)
    declared = get_format("mxfp4", scale_rule=MX_BYTES_PAIRS[fmt]) if sev == "bytes" else None
    q = written.quantize(cache[name])
    if declared is None:  # reference mode: declared rceil (the default) for a floor / even / ceil writer
        declared = get_format("mxfp4-rceil") if written.scale_rule.name != "RCEIL" else get_format("mxfp4-floor")
    out = dict(quantize(cache, declared.label))
    out[name] = with_(q, fmt=declared)
    return Broken(out, {name: cache[name]} if sev == "reference" else None, tensor=name)


def _nv_recipe(cache, fmt, sev, gen):
    name = _k(cache)
    written = get_format("nvfp4", recipe=sev)
    declared = get_format("nvfp4-rcp") if sev != "rcp" else get_format("nvfp4-div")
    out = dict(quantize(cache, declared.label))
    clean = out[name]
    out[name] = with_(written.quantize(cache[name]), fmt=declared)
    same = torch.equal(clean.payload, out[name].payload) and torch.equal(clean.scales, out[name].scales)
    return Broken(out, {name: cache[name]}, tensor=name, noop=same)


def _nibbles(cache, fmt, sev, gen):
    name = _k(cache)
    out = dict(quantize(cache, fmt))
    out[name] = with_(out[name], payload=swap_nibbles(out[name].payload))
    return Broken(out, {name: cache[name]}, tensor=name)


def _kv(cache, fmt, sev, gen):
    out = dict(quantize(cache, fmt))
    k = _k(cache)
    v = k[:-1] + "v"
    out[k], out[v] = out[v], out[k]
    ref = {k: cache[k], v: cache[v]} if sev == "reference" else None
    return Broken(out, ref, tensor=k)


def _head_major(cache, fmt, sev, gen):
    name = _k(cache)
    x = cache[name]
    hm = x.transpose(0, 1).contiguous().reshape(x.shape)
    out = dict(quantize(cache, fmt))
    out[name] = get_format(fmt).quantize(hm)
    return Broken(out, {name: x} if sev == "reference" else None, tensor=name)


def _misaligned(cache, fmt, sev, gen):
    name = _k(cache)
    out = dict(quantize(cache, fmt))
    q = out[name]
    sc = q.scales
    if sev == "token":  # whole-token shift: the zero block's scale moves off it
        moved = sc.roll(1, 0)
    elif sev == "bytes":  # a fraction of a row
        moved = sc.reshape(-1).view(torch.uint8).roll(3).view(sc.dtype).reshape(sc.shape)
    else:  # TRT-LLM's 4-token interleave applied where the reader expects linear scales
        t, h, w = sc.shape
        # per (page, head) out[(t//4)*4*S + s*4 + t%4] = in[t*S + s] (pages hold a multiple of 4 tokens)
        moved = sc.reshape(t // 4, 4, h, w).permute(0, 2, 3, 1).reshape(t // 4, h, 4, w).permute(0, 2, 1, 3)
        moved = moved.reshape(t, h, w)
    out[name] = with_(q, scales=moved)
    # with fewer than 4 blocks a row (mxfp4 at D = 64) a token's scales say too little about their neighbours'
    # for the bytes to show an interleave: then the reference does
    blind = sev == "interleave" and sc.shape[-1] < 4
    return Broken(out, {name: cache[name]} if sev == "reference" or blind else None, tensor=name)


def _topk(cache, fmt, sev, gen):
    t, k, block = 512, 8, 32
    rows = []
    for p in range(2 * t):
        p //= 2
        valid = p // block + 1
        n = min(k, valid)
        ids = torch.sort(torch.randperm(valid, generator=gen)[:n]).values
        rows.append(torch.cat([ids, torch.full((k - n,), -1)]))
    ids = torch.stack(rows).reshape(t, 2, k).to(torch.int32)
    bad = ids.clone()
    r = 300
    if sev == "unsorted":
        bad[r, 0, :2] = bad[r, 0, :2].flip(0)
    elif sev == "duplicate":
        bad[r, 0, 1] = bad[r, 0, 0]
    elif sev == "causal":
        bad[40, 0, 0] = 9
    elif sev == "padding":
        bad[20, 0] = torch.tensor([0, -1, 0, -1, -1, -1, -1, -1])  # -1 before a valid id
    elif sev == "head-major":  # [2, T, k] bytes read as [T, 2, k]
        bad = ids.transpose(0, 1).contiguous().reshape(t, 2, k)
    return Broken({"topk_ids": bad}, options={"topk_block": block}, tensor="topk_ids")
    return Broken({"topk_ids": bad}, options={"topk_block": block}, tensor="topk_ids")


def _pages(cache, fmt, sev, gen):
    name = _k(cache)
    out = dict(quantize(cache, fmt))
    q = out[name]
    page = 16
    a, b = 2 * page, 3 * page
    if q.fmt.family == "bf16":
        payload = q.payload.clone()
        payload[a:b] = payload[:page] if sev == "stale" else 0
        out[name] = with_(q, payload=payload)
    else:
        payload = q.payload.clone()
        scales = q.scales.clone() if q.scales is not None and q.scales.dim() > 0 else q.scales
        if sev == "stale":
            payload[a:b] = payload[:page]
            if scales is not None and scales.dim() > 0:
                scales[a:b] = scales[:page]
        else:
            payload[a:b] = 0
            if scales is not None and scales.dim() > 0:
                scales[a:b] = 0
        out[name] = with_(q, payload=payload, scales=scales)
    return Broken(out, tensor=name)


def _nonfinite(cache, fmt, sev, gen):
    name = _k(cache)
    out = dict(quantize(cache, fmt))
    q = out[name]
    f = q.fmt
    n = sev
    if f.family == "bf16":
        p = q.payload.clone().reshape(-1)
        p[torch.randperm(p.numel(), generator=gen)[:n]] = float("nan")
        out[name] = with_(q, payload=p.reshape(q.payload.shape))
    elif f.family == "fp8":
        p = q.payload.clone().reshape(-1)
        p[torch.randperm(p.numel(), generator=gen)[:n]] = 0x7F
        p[torch.randperm(p.numel(), generator=gen)[:4]] = 0x80  # the -0 an FN writer makes: NaN, not FNUZ
        out[name] = with_(q, payload=p.reshape(q.payload.shape))
    else:
        s = q.scales.clone().reshape(-1)
        s[torch.randperm(s.numel(), generator=gen)[:n]] = 0xFF
        out[name] = with_(q, scales=s.reshape(q.scales.shape))
    return Broken(out, tensor=name)


def _clip(cache, fmt, sev, gen):
    name = _k(cache)
    out = dict(quantize(cache, fmt))
    if fmt == "fp8":  # unit scale: data that needed a scale; severity 1, 2, 3: 0.5 %, 2 %, 8 % of values above 448
        x = cache[name]
        x = x / torch.quantile(x.abs().reshape(-1)[:1 << 20], 1 - 0.005 * 4 ** (sev - 1)) * 448
        out[name] = get_format("fp8").quantize(x)
        return Broken(out, tensor=name)
    out[name] = scaled_writer(cache[name], fmt, -sev)
    return Broken(out, {name: cache[name]} if sev == 1 else None, tensor=name)


def _flush(cache, fmt, sev, gen):
    name = _k(cache)
    out = dict(quantize(cache, fmt))
    out[name] = scaled_writer(cache[name], fmt, sev)
    return Broken(out, {name: cache[name]} if sev == 1 else None, tensor=name)


BREAKS: tuple[Break, ...] = (
    Break("fnuz-as-fn", "fp8-fnuz-as-fn", FP8, (1.0, 1000.0), _fnuz),
    Break("fn-as-fnuz", "fp8-fn-as-fnuz", FP8, (1.0, 30.0), _fn_as_fnuz),
    Break("fp16-as-bf16", "fp16-as-bf16", ("bf16",), (1.0, 0.01, 10.0), _half(torch.float16, torch.bfloat16)),
    Break("bf16-as-fp16", "bf16-as-fp16", ("bf16",), (1.0, 0.01, 10.0), _half(torch.bfloat16, torch.float16)),
    Break("unit-scale", "unit-scale-fallback", FP8_SCALED + FP4, (1.0, 20.0), _unit),
    Break("mx-rule", "scale-rule-mismatch", ("mxfp4-floor", "mxfp4-even", "mxfp4-ceil", "mxfp4-rceil"),
          ("bytes", "reference"), _rule),
    Break("nv-recipe", "scale-rule-mismatch", ("nvfp4",), ("div", "unrounded"), _nv_recipe, "reference"),
    Break("nibbles", "nibble-order-swapped", FP4, (None,), _nibbles, "reference"),
    Break("kv", "kv-swapped", FORMATS, ("bytes", "reference"), _kv),
    Break("head-major", "wrong-geometry", FORMATS, ("bytes", "reference"), _head_major, "heads"),
    Break("misaligned", "scales-misaligned", FP4, ("token", "bytes", "interleave", "reference"), _misaligned),
    Break("topk", "topk-contract", ("bf16",), ("unsorted", "duplicate", "causal", "padding"), _topk),
    Break("topk-head-major", "wrong-geometry", ("bf16",), ("head-major",), _topk),
    Break("pages", "stale-or-missing-pages", FORMATS, ("zero", "stale"), _pages),
    Break("non-finite", "non-finite-codes", ("bf16", "fp8", "fp8-token", "nvfp4", "mxfp4-rceil"), (5, 50), _nonfinite),
    Break("clip", "clipping", ("fp8",) + BLOCK_SCALED, (1, 2, 3), _clip),
    Break("flush", "flush-to-zero", BLOCK_SCALED, (1, 2, 3), _flush),
)


def cases():
    """Every (break, format, severity) of the matrix."""
    for b in BREAKS:
        for fmt in b.formats:
            for sev in b.severities:
                yield b, fmt, sev

