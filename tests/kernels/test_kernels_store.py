"""Store (quantize-on-write into a paged cache), gather-dequantize and whole-tensor quantize / dequantize kernels
against the torch references (`PagedCache.store` / `.dequantize`, `Format.quantize`, `QTensor.dequantize`).

Bytes are compared over the WHOLE cache buffer (pre-filled with the same random garbage on both sides, so a stray or a
missing write shows), values bit for bit through `.view(torch.int32)` / `.view(torch.int16)`. Every format of
`all_formats()` (every recipe, rule, outer scale and fp8 scale option), bf16 / fp16 / fp32 inputs, H = 1 (index cache)
and H > 1, ragged slot mappings with -1 and runs that cross page boundaries, a head dim that is not a power of two,
strided inputs, and the shared edge-case table. Under the interpreter the sizes are small; the `gpu`-marked tests rerun
the checks at real sizes on fresh random data (the unmarked tests run on the GPU too, at their small sizes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from edge_cases import edge_case_tensor

from kvtool import backend
from kvtool.errors import InputError, KernelArgumentError, LayoutError
from kvtool.formats import Format, all_formats, get_format
from kvtool.formats.elements import e2m1_encode
from kvtool.kernels import codecs as kc
from kvtool.kernels.dequant import gather_dequantize
from kvtool.kernels.quant import triton_dequantize, triton_quantize
from kvtool.kernels.store import store
from kvtool.paged import PagedCache

# Zero / saturated scales make the nvfp4 helpers divide by 0 on lanes that `tl.where` then discards (interpreter warns).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SEED = int(np.random.SeedSequence().entropy % 2**31)
FORMATS = all_formats()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------------------------- inputs
def spread_values(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values whose per-row magnitudes span 1e-6 .. 1e3, with heavy tails and a few exact zeros / -0."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(*shape[:-1], 1, generator=g) * 9 - 6)
    x = torch.randn(*shape, generator=g) / torch.rand(*shape, generator=g).clamp_min(0.05) * mag
    x[..., :3] = torch.tensor([0.0, -0.0, 1.0])
    if dtype == torch.float16:  # keep fp16 finite and mostly normal
        x = x / x.abs().amax().clamp_min(1.0) * 6e4
    return x.to(dtype)


def slot_mapping(n: int, num_slots: int, page_size: int, seed: int) -> torch.Tensor:
    """[n] int64: a run of consecutive slots that starts mid-page (crosses page boundaries), then scattered slots, with
    about one token in five skipped (-1). No slot is used twice."""
    g = torch.Generator().manual_seed(seed)
    run = min(n // 2, num_slots // 2)
    start = page_size // 2 + 1
    perm = torch.randperm(num_slots - start - run, generator=g)[: n - run] + start + run
    slots = torch.cat([torch.arange(start, start + run), perm]).long()
    slots[torch.rand(n, generator=g) < 0.2] = -1
    return slots


def fresh_caches(fmt: Format, pages: int, page_size: int, heads: int, dim: int, device: str, seed: int):
    """Two identical caches (reference, kernel) whose bytes start as random garbage."""
    ref = PagedCache.allocate(fmt, pages, page_size, heads, dim, device=device)
    g = torch.Generator().manual_seed(seed + 7)
    ref.data.copy_(torch.randint(0, 256, ref.data.shape, generator=g, dtype=torch.uint8))
    ker = PagedCache(fmt, page_size, heads, dim, ref.data.clone())
    return ref, ker


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of the same dtype (NaN == NaN when the bits match)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view).cpu(), b.contiguous().view(view).cpu())


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """same_bits, except that a NaN equals any NaN (NaN payload and sign bits are not part of the format: a garbage
    scale byte decodes to NaN, and torch and a kernel may carry different NaN bits through the scale products)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na.cpu(), nb.cpu()) and same_bits(a.masked_fill(na, 0), b.masked_fill(nb, 0))


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    diff = (a.contiguous().view(view) != b.contiguous().view(view)).reshape(-1).nonzero()
    if not len(diff):
        return "equal"
    i = int(diff[0])
    return f"{len(diff)} differ, first at flat {i}: {a.reshape(-1)[i].item()} vs {b.reshape(-1)[i].item()}"


# ------------------------------------------------------------------------------------------------------ checks
def check_store(fmt: Format, x: torch.Tensor, slots: torch.Tensor, pages: int, page_size: int, seed: int,
                validate: bool = True, variant: dict | None = None) -> None:
    """Kernel store (with the launch `variant`) == torch store over the whole buffer; gather-dequantize == torch
    dequantize, fp32 and bf16."""
    n, heads, dim = x.shape
    ref, ker = fresh_caches(fmt, pages, page_size, heads, dim, x.device.type, seed)
    ref.store(x, slots)
    store(ker, x, slots, validate=validate, variant=variant)
    assert ref.tensor_amax == ker.tensor_amax
    assert torch.equal(ker.data.cpu(), ref.data.cpu()), \
        f"{fmt.label} seed {seed}: cache bytes {first_diff(ker.data, ref.data)}"
    kept = slots[slots >= 0]
    for dtype in (torch.float32, torch.bfloat16):
        got, want = gather_dequantize(ker, kept, dtype), ref.dequantize(kept, dtype)
        assert same_bits(got, want), f"{fmt.label} seed {seed} {dtype}: values {first_diff(got, want)}"


def check_planes(fmt: Format, x: torch.Tensor, tensor_amax: torch.Tensor | None = None,
                 variant: dict | None = None) -> None:
    """triton_quantize (with the store's launch `variant`) == fmt.quantize (payload, scales, outer scale, types);
    triton_dequantize == q.dequantize."""
    want = fmt.quantize(x, tensor_amax=tensor_amax)
    got = triton_quantize(fmt, x, tensor_amax, variant=variant)
    assert got.shape == want.shape and got.outer_scale == want.outer_scale
    assert same_bits(got.payload, want.payload), f"{fmt.label}: payload {first_diff(got.payload, want.payload)}"
    if want.scales is None:
        assert got.scales is None
    else:
        assert same_bits(got.scales, want.scales), f"{fmt.label}: scales {first_diff(got.scales, want.scales)}"
        assert got.scales.device == want.scales.device
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        dv, rv = triton_dequantize(want, dtype), want.dequantize(dtype)
        assert same_bits(dv, rv), f"{fmt.label} {dtype}: dequantized {first_diff(dv, rv)}"


# ------------------------------------------------------------------------------ interpreter sizes (and GPU, small)
# (input dtype, heads, head dim): the index cache (H = 1, D = 128), a K/V cache (H = 4), and a head dim that is not a
# power of two (96: padded tiles with column masks).
SHAPES = [("bf16", 1, 128), ("fp16", 4, 64), ("fp32", 2, 96)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
@pytest.mark.parametrize("dtype,heads,dim", SHAPES, ids=[f"{d}-H{h}-D{k}" for d, h, k in SHAPES])
def test_store_matches_torch(fmt, dtype, heads, dim, device):
    seed = SEED + heads * 1000 + dim
    pages, page_size = 3, 16  # one page size for the small tests (fewer GPU compiles), 128 for the large
    x = spread_values((23, heads, dim), seed, DTYPES[dtype]).to(device)
    slots = slot_mapping(23, pages * page_size, page_size, seed).to(device)
    check_store(fmt, x, slots, pages, page_size, seed)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_store_edge_cases(fmt, device):
    """The shared edge-case table as tokens of a two-head cache (rows paired), slots shuffled over 16-token pages."""
    x = edge_case_tensor(128)
    x = x[: x.shape[0] // 2 * 2].reshape(-1, 2, 128).to(device)
    n = x.shape[0]
    pages = (n + 15) // 16 + 1
    slots = torch.randperm(pages * 16, generator=torch.Generator().manual_seed(SEED))[:n].to(device)
    check_store(fmt, x, slots, pages, 16, SEED)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_quantize_dequantize_planes(fmt, device):
    """Whole-tensor quantize of [2, 5, D] random rows plus the edge table, with and without a given tensor amax."""
    x = spread_values((2, 5, 128), SEED + 3, torch.float32).to(device)
    check_planes(fmt, x)
    check_planes(fmt, edge_case_tensor(128).to(device))
    if fmt.needs_tensor_amax:
        check_planes(fmt, x.to(torch.bfloat16), tensor_amax=torch.tensor(1234.5))


def test_strided_input_and_int32_slots(device):
    """x as a view into a fused qkv buffer (token and head strides, last dim contiguous) and int32 slot ids."""
    fmt = get_format("nvfp4")
    qkv = spread_values((19, 3, 2 * 64), SEED + 5, torch.bfloat16).to(device)
    x = qkv[:, :, 64:]
    assert not x.is_contiguous()
    slots = slot_mapping(19, 2 * 16, 16, SEED + 5).to(torch.int32).to(device)
    check_store(fmt, x, slots, 2, 16, SEED + 5)


@pytest.mark.parametrize("label", ["mxfp4-floor", "nvfp4-rcp-auto"])
def test_unaligned_pages_use_byte_payload(label, device):
    """Pages whose payload rows do not start on 4-byte boundaries (3-token pages of D = 96 mxfp4: 153 bytes per page
    and head; nvfp4 with an odd page size) take the byte path of both kernels instead of int32 words: same bytes."""
    fmt = get_format(label)
    from kvtool.kernels.store import word_aligned

    page = 3 if fmt.family == "mxfp4" else 5
    cache = PagedCache.allocate(fmt, 4, page, 2, 96, device=device)
    assert not word_aligned(cache.data, fmt.payload_bytes(96), cache.data.stride(0), cache.data.stride(1))
    x = spread_values((9, 2, 96), SEED + 21, torch.bfloat16).to(device)
    check_store(fmt, x, slot_mapping(9, 4 * page, page, SEED + 21).to(device), 4, page, SEED + 21)


def test_gather_into_given_output(device):
    """gather_dequantize(out=...) writes the values into the caller's buffer (engines, CUDA graphs) and checks it."""
    fmt = get_format("nvfp4")
    x = spread_values((7, 2, 64), SEED + 22, torch.bfloat16).to(device)
    ref, ker = fresh_caches(fmt, 2, 8, 2, 64, device, SEED + 22)
    slots = torch.arange(7, device=device)
    ref.store(x, slots)
    store(ker, x, slots)
    out = torch.full((7, 2, 64), 7.0, dtype=torch.bfloat16, device=device)
    got = gather_dequantize(ker, slots, torch.bfloat16, out=out)
    assert got is out and same_bits(out, ref.dequantize(slots, torch.bfloat16))
    for bad in (torch.empty(7, 2, 64, device=device), torch.empty(6, 2, 64, dtype=torch.bfloat16, device=device),
                torch.empty(7, 2, 128, dtype=torch.bfloat16, device=device)[..., ::2]):
        with pytest.raises(KernelArgumentError, match="out must be"):
            gather_dequantize(ker, slots, torch.bfloat16, out=bad)


def test_nvfp4_huge_outer_scale(device):
    """nvfp4 `auto` on a tensor whose amax is near the fp32 maximum: 2**14 * g_dec overflows fp32, so the decode
    multiplies by 2**14 and g_dec separately (G_FOLD off); values still equal the torch path's."""
    fmt = get_format("nvfp4-auto")
    x = spread_values((4, 128), SEED + 23, torch.float32)
    x = (x / x.abs().amax() * 3.0e38).to(device)
    q = fmt.quantize(x)
    assert q.outer_scale * 16384.0 > float(torch.finfo(torch.float32).max)
    check_planes(fmt, x)


def test_all_tokens_skipped(device):
    fmt = get_format("fp8", fp8_scale="tensor")
    x = spread_values((5, 1, 64), SEED + 6, torch.float32).to(device)
    ref, ker = fresh_caches(fmt, 2, 4, 1, 64, device, SEED + 6)
    slots = torch.full((5,), -1, dtype=torch.int64, device=device)
    ref.store(x, slots)
    store(ker, x, slots)
    assert torch.equal(ker.data.cpu(), ref.data.cpu()) and ker.tensor_amax == ref.tensor_amax


def test_backend_dispatch(device, monkeypatch):
    """`auto` takes the kernels on CUDA and the torch reference on CPU; `triton` and `torch` agree either way."""
    fmt = get_format("mxfp4")
    x = spread_values((9, 2, 64), SEED + 8, torch.bfloat16).to(device)
    slots = slot_mapping(9, 16, 4, SEED + 8).to(device)
    ref, ker = fresh_caches(fmt, 4, 4, 2, 64, device, SEED + 8)
    backend.store(ref, x, slots, backend="torch")
    backend.store(ker, x, slots, backend="triton")
    assert torch.equal(ker.data.cpu(), ref.data.cpu())
    kept = slots[slots >= 0]
    assert same_bits(backend.gather_dequantize(ker, kept, torch.bfloat16, backend="triton"),
                     backend.gather_dequantize(ref, kept, torch.bfloat16, backend="torch"))
    q = backend.quantize(fmt, x, backend="triton")
    assert same_bits(q.payload, backend.quantize(fmt, x, backend="torch").payload)
    assert same_bits(backend.dequantize(q, backend="triton"), backend.dequantize(q, backend="torch"))

    import kvtool.kernels.store as store_mod

    calls = []
    monkeypatch.setattr(store_mod, "store", lambda *a, **k: calls.append(1))
    backend.store(ref, x, slots, backend="auto")
    assert len(calls) == (1 if torch.device(device).type == "cuda" else 0)


def test_paged_cache_backend_methods(device):
    """PagedCache.store_ / dequantize_ (the backend-choosing twins) give the reference's bytes and values."""
    fmt = get_format("nvfp4-auto")
    x = spread_values((11, 2, 64), SEED + 9, torch.float32).to(device)
    slots = slot_mapping(11, 32, 16, SEED + 9).to(device)
    ref, ker = fresh_caches(fmt, 2, 16, 2, 64, device, SEED + 9)
    ref.store_(x, slots, backend="torch")
    ker.store_(x, slots, backend="triton")
    assert torch.equal(ker.data.cpu(), ref.data.cpu())
    kept = slots[slots >= 0]
    assert same_bits(ker.dequantize_(kept, backend="triton"), ref.dequantize_(kept, backend="torch"))


def test_launcher_checks(device):
    fmt = get_format("nvfp4")
    cache = PagedCache.allocate(fmt, 2, 4, 2, 32, device=device)
    x = torch.randn(3, 2, 32, device=device)
    slots = torch.tensor([0, 1, -1], device=device)
    with pytest.raises(KernelArgumentError, match="dtype"):
        store(cache, x.to(torch.int32), slots)
    with pytest.raises(KernelArgumentError, match="must be"):
        store(cache, torch.randn(3, 3, 32, device=device), slots)
    with pytest.raises(KernelArgumentError, match="contiguous"):
        store(cache, torch.randn(3, 2, 64, device=device)[..., ::2], slots)
    with pytest.raises(KernelArgumentError, match="int32 or int64"):
        store(cache, x, slots.float())
    with pytest.raises(KernelArgumentError, match=r"\[3\]"):
        store(cache, x, slots[:2])
    with pytest.raises(KernelArgumentError, match="output dtype"):
        gather_dequantize(cache, slots[:2], torch.int32)
    with pytest.raises(KernelArgumentError, match="payload"):
        q = fmt.quantize(torch.randn(4, 32))
        q.payload = q.payload[:, :-1]
        triton_dequantize(q)


def test_validation_like_torch(device):
    """With `validate`, non-finite input and out-of-range slots fail as in the torch path, and nothing is written."""
    fmt = get_format("mxfp4")
    cache = PagedCache.allocate(fmt, 2, 4, 1, 32, device=device)
    before = cache.data.clone()
    x = torch.randn(3, 1, 32, device=device)
    x[1, 0, 5] = float("nan")
    with pytest.raises(InputError, match="non-finite"):
        store(cache, x, torch.tensor([0, 1, 2], device=device))
    with pytest.raises(LayoutError, match="slot ids"):
        store(cache, torch.randn(3, 1, 32, device=device), torch.tensor([0, 8, 2], device=device))
    assert torch.equal(cache.data, before)
    with pytest.raises(InputError, match="non-finite"):
        triton_quantize(fmt, x)
    # a skipped token may hold anything: the torch path drops it before quantizing, and so does the kernel
    check_store(fmt, x, torch.tensor([0, -1, 2], device=device), 2, 4, SEED)


def test_comparison_can_fail(device):
    """The byte comparison sees a rule difference (floor vs rceil on the edge table): it is not vacuous."""
    x = edge_case_tensor(128)[:, None, :].to(device)
    slots = torch.arange(x.shape[0], device=device)
    pages = (x.shape[0] + 15) // 16
    ref, _ = fresh_caches(get_format("mxfp4-rceil"), pages, 16, 1, 128, device, SEED)
    _, ker = fresh_caches(get_format("mxfp4-floor"), pages, 16, 1, 128, device, SEED)
    ref.store(x, slots)
    store(ker, x, slots)
    assert not torch.equal(ker.data.cpu(), ref.data.cpu())


@triton.jit
def _e2m1_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # fp32 in, codes out, element count, elements / program
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, kc.e2m1_encode(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_e2m1_encode_dense_sweep(device):
    """The fma/min E2M1 encoder of kernels/codecs.py (written for the store kernels) against the torch encoder: every
    13th fp32 pattern from 2**-4 to 16, both signs, and three ulps around every tie."""
    base = torch.arange((127 - 4) << 23, (127 + 4) << 23, 13, dtype=torch.int64)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0]).view(torch.int32).long()
    near = (ties[:, None] + torch.arange(-3, 4)[None, :]).reshape(-1)
    v = torch.cat([base, near]).to(torch.int32).view(torch.float32)
    v = torch.cat([v, -v, torch.tensor([0.0, -0.0, float("inf"), 3e38])]).to(device)
    out = torch.empty(v.shape, dtype=torch.uint8, device=device)
    block = 1 << 16 if torch.device(device).type == "cpu" else 1024  # the interpreter likes big programs, a GPU not
    _e2m1_kernel[(triton.cdiv(v.numel(), block),)](v, out, v.numel(), BLOCK=block)
    assert same_bits(out, e2m1_encode(v)), first_diff(out, e2m1_encode(v))


# --------------------------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_store_gpu_large(fmt, device):
    """64K tokens x 4 heads x 128 (32M elements) of fresh bf16 data into 128-token pages, 20 % of tokens skipped;
    then the index-cache shape (H = 1) with fp32 input."""
    seed = SEED + 11
    n, pages, page_size = 1 << 16, (1 << 16) * 5 // 4 // 128, 128
    x = spread_values((n, 4, 128), seed, torch.bfloat16).to(device)
    slots = slot_mapping(n, pages * page_size, page_size, seed).to(device)
    check_store(fmt, x, slots, pages, page_size, seed, validate=False)
    x1 = spread_values((n, 1, 128), seed + 1, torch.float32).to(device)
    check_store(fmt, x1, slots, pages, page_size, seed + 1, validate=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_quantize_gpu_large(fmt, device):
    """Whole-tensor quantize / dequantize of 16M fresh elements (fp16 and bf16 inputs)."""
    check_planes(fmt, spread_values((1 << 17, 128), SEED + 12, torch.bfloat16).to(device))
    check_planes(fmt, spread_values((1 << 15, 4, 128), SEED + 13, torch.float16).to(device))


FP4_FORMATS = [f for f in FORMATS if f.spec.payload_bits == 4]


FP4_VARIANTS = {"fast-codec": {"FAST": True, "MUL_PACK": False}, "codec": {"FAST": False, "MUL_PACK": False},
                "mul-pack": {"MUL_PACK": True}}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(FP4_VARIANTS))
@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=lambda f: f.label)
def test_store_gpu_fp4_codecs(fmt, variant, device):
    """Every 4-bit encode path (kernels/store.py FAST_CODECS / MUL_PACK pick the defaults) through the public store
    at real sizes: head dims 64 and 256, bf16 into 128-token pages, 20 % of tokens skipped."""
    seed = SEED + 21
    n, pages, page_size = 1 << 15, (1 << 15) * 5 // 4 // 128, 128
    slots = slot_mapping(n, pages * page_size, page_size, seed).to(device)
    for dim in (64, 256):
        x = spread_values((n, 2, dim), seed + dim, torch.bfloat16).to(device)
        check_store(fmt, x, slots, pages, page_size, seed, validate=False, variant=FP4_VARIANTS[variant])


# (tokens, heads): 1 row, a partial tile, ragged, H > 1; and 5 heads, which the H200's programs (132 SMs x 8 or 16)
# do not divide: each program's walk over (token tile, head) carries from the last head to the next token tile
GLUON_CASES = ((1, 1), (65, 1), (10007, 1), (3001, 3), (20000, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["default"] + list(FP4_VARIANTS))
@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=lambda f: f.label)
def test_store_gluon_gpu(fmt, variant, device, monkeypatch):
    """The Hopper TMA store (kernels/store_gluon.py) against the torch store and against the portable kernel, with
    each codec form: bf16 rows of 128, token counts that are not multiples of the 64-row tile, a head slice of a
    wider tensor (strided tokens), 20 % of tokens skipped, runs across page boundaries; the edge-case table; and
    whole-tensor quantize (planes). A spy checks that the fast path ran."""
    from kvtool.kernels import store_gluon

    if not store_gluon.device_ok(torch.device(device)):
        pytest.skip("the Gluon store needs a CUDA GPU with compute capability >= 9.0 (TMA)")
    ran = []
    real = store_gluon.launch
    monkeypatch.setattr(store_gluon, "launch", lambda *a, **k: (ran.append(1), real(*a, **k)))
    base = FP4_VARIANTS.get(variant, {})
    page_size = 128
    for i, (n, heads) in enumerate(GLUON_CASES):
        seed = SEED + 41 + i
        x = spread_values((n, heads + 2, 128), seed, torch.bfloat16).to(device)[:, 1:1 + heads]
        pages = n * 5 // 4 // page_size + 2
        slots = slot_mapping(n, pages * page_size, page_size, seed).to(device)
        count = len(ran)
        check_store(fmt, x, slots, pages, page_size, seed, validate=False, variant=base)
        assert len(ran) == count + 1, "the Gluon store did not run"
        _, portable = fresh_caches(fmt, pages, page_size, heads, 128, device, seed)
        _, fast = fresh_caches(fmt, pages, page_size, heads, 128, device, seed)
        store(portable, x, slots, validate=False, gluon=False, variant=base)
        store(fast, x, slots, validate=False, variant=base)
        assert torch.equal(fast.data, portable.data), f"{fmt.label} {n}x{heads}: {first_diff(fast.data, portable.data)}"
    edge = edge_case_tensor(128).to(torch.bfloat16).to(device)
    edge = edge[: edge.shape[0] // 2 * 2].reshape(-1, 2, 128)
    pages = edge.shape[0] // page_size + 2
    slots = torch.randperm(pages * page_size, generator=torch.Generator().manual_seed(SEED))[:edge.shape[0]]
    check_store(fmt, edge, slots.to(device), pages, page_size, SEED, validate=False, variant=base)
    check_planes(fmt, spread_values((4099, 128), SEED + 45, torch.bfloat16).to(device), variant=base)
    assert len(ran) == len(GLUON_CASES) * 2 + 2


def test_store_gluon_switch(device):
    """store(gluon=True) is a clear error where the fast path cannot run (no GPU here, fp32 input, a config);
    gluon=False always runs the portable kernel."""
    fmt = get_format("mxfp4")
    x = spread_values((9, 1, 128), SEED + 51, torch.float32).to(device)
    slots = torch.arange(9, device=device)
    _, cache = fresh_caches(fmt, 1, 16, 1, 128, device, SEED)
    with pytest.raises(KernelArgumentError, match="gluon=True"):
        store(cache, x, slots, gluon=True)
    with pytest.raises(KernelArgumentError, match="gluon=True"):
        store(cache, x.to(torch.bfloat16), slots, gluon=True, config=(4, 4))
    ref, _ = fresh_caches(fmt, 1, 16, 1, 128, device, SEED)
    ref.store(x, slots)
    store(cache, x, slots, gluon=False)
    assert torch.equal(cache.data.cpu(), ref.data.cpu())


def test_store_gluon_rcp_table_memo(monkeypatch):
    """The Gluon store's reciprocal tables (host side): one per (device, g_dec), kept; none created while a CUDA
    graph is being captured (the kernel then divides), reused if it exists."""
    from kvtool.kernels import store_gluon

    tables = store_gluon.RcpTables(limit=3)
    cpu = torch.device("cpu")
    t = tables.get(cpu, 0.5)
    assert t.shape == (256,) and t[1].item() == 1.0 / (2.0**-9 * 0.5)
    assert tables.get(cpu, 0.5) is t and tables.get(cpu, 2.0) is not t
    tables.get(cpu, 4.0)
    tables.get(cpu, 8.0)  # past the limit: starts over
    assert list(tables.tables) == [(cpu, 8.0)]
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tables.get(cuda, 1.0) is None
    tables.tables[(cuda, 1.0)] = t
    assert tables.get(cuda, 1.0) is t


def test_store_gluon_dispatch(monkeypatch):
    """Where the Gluon store applies (CPU: the device rule stubbed in): bf16, D = 128, 4-bit block formats, heads
    contiguous and 16-byte aligned token rows, word-aligned payload rows; everything else runs the portable kernel."""
    from kvtool.kernels import store_gluon

    monkeypatch.setattr(store_gluon, "device_ok", lambda device: True)
    nv, mx, fp8 = get_format("nvfp4"), get_format("mxfp4"), get_format("fp8-unit")
    x = torch.zeros(10, 3, 128, dtype=torch.bfloat16)
    assert store_gluon.applies(x, nv, True) and store_gluon.applies(x, mx, True)
    assert not store_gluon.applies(x, fp8, True)  # not a 4-bit block format
    assert not store_gluon.applies(x, nv, False)  # payload rows not word-aligned
    assert not store_gluon.applies(x.float(), nv, True)  # fp32 input
    assert not store_gluon.applies(x.half(), mx, True)
    assert not store_gluon.applies(torch.zeros(10, 3, 64, dtype=torch.bfloat16), nv, True)  # D != 128
    wide = torch.zeros(10, 6, 128, dtype=torch.bfloat16)
    assert store_gluon.applies(wide[:, 1:4], nv, True)  # a head slice: strided tokens, contiguous heads
    assert not store_gluon.applies(wide[:, ::2], nv, True)  # heads not contiguous
    odd = torch.zeros(10 * 129 + 8, dtype=torch.bfloat16)[8:].view(10, 1, 129)[:, :, :128]
    assert not store_gluon.applies(odd, nv, True)  # token rows not 16-byte aligned
    monkeypatch.setattr(store_gluon, "device_ok", lambda device: False)
    assert not store_gluon.applies(x, nv, True)


# gather-dequantize launch variants checked beside the default: the cache hints off, other tiles (config)
DEQUANT_VARIANTS = (({"STREAM": False}, None), ({}, (32, 4)), ({"STREAM": False}, (64, 8)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4_FORMATS, ids=lambda f: f.label)
def test_dequant_random_bytes_gpu(fmt, device):
    """The gather-dequantize against the torch path, bit for bit, on caches whose untouched slots hold random bytes
    (every code, NaN scale codes: any NaN matches) read in a shuffled order with stored tokens: token counts off the tile, 1-5 heads,
    fp32 / bf16 / fp16 output, the default launch (FP4_WORDS_CONFIG, streaming stores) and DEQUANT_VARIANTS."""
    from kvtool.kernels import dequant as dequant_mod

    page_size = 128
    for i, (n, heads) in enumerate(GLUON_CASES):
        seed = SEED + 61 + i
        pages = n * 5 // 4 // page_size + 2
        ref, ker = fresh_caches(fmt, pages, page_size, heads, 128, device, seed)
        x = spread_values((n, heads, 128), seed, torch.bfloat16).to(device)
        slots = slot_mapping(n, pages * page_size, page_size, seed).to(device)
        ref.store(x, slots)
        ker.data.copy_(ref.data)
        ker.tensor_amax = ref.tensor_amax
        read = torch.randperm(pages * page_size, generator=torch.Generator().manual_seed(seed))[:n].to(device)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got, want = gather_dequantize(ker, read, dtype), ref.dequantize(read, dtype)
            assert same_values(got, want), f"{fmt.label} {n}x{heads} {dtype}: {first_diff(got, want)}"
        _, g_dec = dequant_mod.cache_scales(ker)
        for variant, config in DEQUANT_VARIANTS:
            out = torch.full_like(want, float("nan"))
            dequant_mod.launch_dequant(ker.data, None, read, out, fmt, page_size=page_size,
                                       page_stride=ker.data.stride(0), head_stride=ker.data.stride(1), g_dec=g_dec,
                                       config=config, variant=variant)
            assert same_values(out, want), f"{fmt.label} {n}x{heads} {variant} {config}: {first_diff(out, want)}"


@pytest.mark.parametrize("label", ["mxfp4", "nvfp4-rcp-auto"])
def test_dequant_launch_variants(label, device):
    """Interpreter sizes (and the GPU): every DEQUANT_VARIANTS launch, and the cache hints forced on, give the torch
    path's values (the hints are the CUDA default for FP4 word rows; here they must change nothing)."""
    from kvtool.kernels import dequant as dequant_mod

    fmt = get_format(label)
    ref, ker = fresh_caches(fmt, 3, 16, 2, 128, device, SEED + 71)
    x = spread_values((30, 2, 128), SEED + 71, torch.float32).to(device)
    slots = slot_mapping(30, 48, 16, SEED + 71).to(device)
    ref.store(x, slots)
    ker.data.copy_(ref.data)
    ker.tensor_amax = ref.tensor_amax
    read = torch.randperm(48, generator=torch.Generator().manual_seed(SEED))[:30].to(device)
    want = ref.dequantize(read, torch.float32)
    _, g_dec = dequant_mod.cache_scales(ker)
    for variant, config in DEQUANT_VARIANTS + (({"STREAM": True}, None),):
        out = torch.full_like(want, float("nan"))
        dequant_mod.launch_dequant(ker.data, None, read, out, fmt, page_size=16, page_stride=ker.data.stride(0),
                                   head_stride=ker.data.stride(1), g_dec=g_dec, config=config, variant=variant)
        assert same_values(out, want), f"{label} {variant} {config}: {first_diff(out, want)}"


def test_store_both_codecs(device):
    """Interpreter sizes: the codec FAST_CODECS does not pick for each 4-bit family, and the encode MUL_PACK does
    not pick, through the public store's `variant`."""
    from kvtool.kernels import store as store_mod

    for label in ("mxfp4-rceil", "mxfp4-floor", "nvfp4-rcp-auto", "nvfp4-unrounded"):
        fmt = get_format(label)
        for variant in ({"FAST": not store_mod.FAST_CODECS[fmt.scale_element], "MUL_PACK": False},
                        {"MUL_PACK": not store_mod.MUL_PACK[fmt.scale_element]}):
            x = spread_values((40, 2, 64), SEED + 31, torch.bfloat16).to(device)
            slots = slot_mapping(40, 3 * 32, 32, SEED + 31).to(device)
            check_store(fmt, x, slots, 3, 32, SEED + 31, variant=variant)


def test_store_variant_keys(device):
    """A launch variant is checked against store.VARIANTS: an unknown key (a typo, or a kernel constexpr that is no
    variant) is a one-line KernelArgumentError naming it, before anything is written; None and {} are the defaults."""
    from kvtool.kernels import store as store_mod

    fmt = get_format("mxfp4")
    x = spread_values((9, 1, 128), SEED + 52, torch.bfloat16).to(device)
    slots = torch.arange(9, device=device)
    _, cache = fresh_caches(fmt, 1, 16, 1, 128, device, SEED)
    before = cache.data.clone()
    for bad in ({"FAST_CODEC": True}, {"WORDS": False}, {"GLUON": False}):
        with pytest.raises(KernelArgumentError, match=f"unknown variant keys \\['{next(iter(bad))}'\\]"):
            store(cache, x, slots, variant=bad)
        with pytest.raises(KernelArgumentError, match="unknown variant keys"):
            triton_quantize(fmt, x[:, 0], variant=bad)
    assert torch.equal(cache.data, before) and cache.tensor_amax is None
    with pytest.raises(KernelArgumentError, match="mapping"):
        store_mod.check_variant([("FAST", True)])
    assert store_mod.check_variant(None) == {} and set(store_mod.VARIANTS) >= {"FAST", "MUL_PACK", "GLUON_ROWS"}
    check_store(fmt, x, slots, 1, 16, SEED, variant={})
    check_store(fmt, x, slots, 1, 16, SEED, variant={"GLUON_ROWS": 32})  # ignored where the portable kernel runs


# ------------------------------------------------------------------------------------------------ bench plumbing
def test_bench_quant_parsing_and_goals():
    from kvtool.bench.common import BenchReport, BenchRow
    from kvtool.bench.quant import goals, parse_configs, parse_sizes

    assert parse_sizes("64M, 1G,16k") == [64 << 20, 1 << 30, 16 << 10]
    assert parse_configs("32x4,64X8") == [(32, 4), (64, 8)]
    for bad in ("64Q", "", "12"):
        with pytest.raises(InputError):
            parse_sizes(bad)
    with pytest.raises(InputError):
        parse_configs("24x4")
    report = BenchReport("quant", "dev", "t", "tr", "d", 4000.0, extra={"elements": {"64M": 64 << 20, "1M": 1 << 20}})
    for group, name, t, frac in (("64M nvfp4-rcp", "store", 50.0, 0.9), ("64M nvfp4-rcp", "eager quantize", 2000.0,
                                 0.01), ("64M nvfp4-rcp", "dequant", 60.0, 0.8), ("1M mxfp4-rceil", "store", 9.0, 0.1),
                                ("64M fp8-unit", "store", 9.0, 0.1)):
        report.rows.append(BenchRow(group, name, t, 1, 1.0, frac))
    got = {g["goal"]: (round(g["value"], 3), g["met"]) for g in goals(report)}
    assert got == {"64M nvfp4-rcp store >= 85% of copy": (0.9, True), "64M nvfp4-rcp store >= 20x eager": (40.0, True),
                   "64M nvfp4-rcp dequant >= 85% of copy": (0.8, False)}


def test_bench_quant_smoke(device):
    """A tiny run of the whole benchmark (kernels under the interpreter on CPU)."""
    from kvtool.bench.quant import run_quant_bench

    report = run_quant_bench([4096], ("mxfp4",), device=device, configs=[(4, 2)])
    names = [r.name for r in report.rows]
    graph = []
    if torch.device(device).type == "cuda":
        from kvtool.kernels import store_gluon

        fast = store_gluon.device_ok(torch.device(device))  # the default store is the Gluon one: portable row too
        graph = ["store [graph]", *(["store [graph, portable]"] if fast else []), "dequant [graph]"]
    assert names[:4 + len(graph)] == [*graph, "store", "dequant", "store [4x2]", "dequant [4x2]"]
    assert "eager quantize" in names
    assert all(r.time_us > 0 and r.bytes_moved > 0 for r in report.rows)
