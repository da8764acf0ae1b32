"""The sparse-attention Triton kernels (kernels/sparse_attn.py) against the torch reference on the dequantized paged
cache: every format, decode and prefill, split and non-split, ragged selections with -1 holes, the query's own
partial block, one-token contexts, page / block / tile geometries, non-finite guards, argument checks. Small shapes
run in the interpreter on CPU; the `gpu` tests run M3's TP4 shape (GQA 16, D 128, 128-token blocks, top-16, contexts
up to 150K) on the GPU.

The pool starts as 0xFF bytes (NaN in bf16 / fp8 / E4M3 scales, Inf as an E8M0 scale), so a kernel that reads
anything outside the visible selection produces NaN and fails. Kernels run with an fp32 output here (the bf16 output
rounding has its own test), so the tolerance is fp32 accumulation noise plus the rounding of P for the P.V dot.
"""

import math

import pytest
import torch

from conftest import DEVICE, HAS_CUDA
from kvtool.attention import paged_sparse_decode_ref, paged_sparse_prefill_ref, random_block_selection
from kvtool.errors import KernelArgumentError
from kvtool.formats import all_formats, get_format
from kvtool.kernels.platform import INTERPRET
from kvtool.kernels.sparse_attn import launch_plan, pairs_whole_pages, sparse_decode, sparse_prefill
from kvtool.metrics import value_metrics
from kvtool.paged import PagedCache
from kvtool.workflows.verify_attn import build_paged, synthetic_kv

# fp32 accumulation noise plus P rounded once to fp16 (2^-12 per probability; quantized formats) or split into bf16
# hi + lo parts (bf16); the verify-attn goal is 2e-3
TOL_MAX_REL = 1e-3


def make_decode(fmt, lens, hq=4, hkv=2, d=64, page=16, bs=32, topk=3, seed=0, holes=True):
    g = torch.Generator().manual_seed(seed)
    ks = [synthetic_kv(n, hkv, d, g) for n in lens]
    vs = [synthetic_kv(n, hkv, d, g, outliers=False) for n in lens]
    kc, vc, table = build_paged(get_format(fmt), ks, vs, page, DEVICE, g)
    q = torch.randn(len(lens), hq, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ids = random_block_selection(ctx.long() - 1, bs, topk, hkv, g, holes=holes).transpose(0, 1).contiguous()
    return q, kc, vc, table, ctx, ids


def graph_chain(q, layer, n=6):
    """n layers chained (each one's output is the next one's query), run once to compile, then captured in one
    CUDA graph and replayed: the replay's output."""
    def chain():
        x = q
        for _ in range(n):
            x = layer(x)
        return x
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def check_close(out, ref, tol=TOL_MAX_REL):
    assert out.shape == ref.shape and torch.isfinite(out).all()
    m = value_metrics(out.float(), ref.float())
    assert m.max_rel <= tol and m.rel_l2 <= tol, m


FORMATS = [f.label for f in all_formats()]


@pytest.mark.parametrize("splits", [1, 3], ids=["nosplit", "split3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_every_format(fmt, splits):
    lens = [1, 17, 40, 70]  # one token; partial own blocks; a full page boundary inside a block
    q, kc, vc, table, ctx, ids = make_decode(fmt, lens)
    out = sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=splits, out_dtype=torch.float32)
    check_close(out, paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8-token", "mxfp4-floor"])
@pytest.mark.parametrize("geo", [(32, 32, 16), (32, 64, 32), (16, 64, 16)], ids=["bs=p,t<p", "bs=2p", "bs=4p"])
def test_geometries_gqa8_d128(fmt, geo):
    page, bs, tile = geo
    q, kc, vc, table, ctx, ids = make_decode(fmt, [3, 64, 150], hq=8, hkv=1, d=128, page=page, bs=bs, topk=2)
    out = sparse_decode(q, kc, vc, table, ctx, ids, bs, num_splits=2, tile_tokens=tile, out_dtype=torch.float32)
    check_close(out, paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, bs))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-rcp-auto"])
def test_gqa16_tp4_head_shape(fmt):
    q, kc, vc, table, ctx, ids = make_decode(fmt, [1, 100, 129], hq=16, hkv=1, d=128, page=32, bs=32, topk=4)
    out = sparse_decode(q, kc, vc, table, ctx, ids, 32, out_dtype=torch.float32)
    check_close(out, paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32))


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "fp8-tensor", "nvfp4", "mxfp4"])
def test_prefill_rows_with_own_selections(fmt, splits):
    g = torch.Generator().manual_seed(5)
    lens, hq, hkv, d = [40, 70], 4, 2, 64
    ks = [synthetic_kv(n, hkv, d, g) for n in lens]
    vs = [synthetic_kv(n, hkv, d, g) for n in lens]
    kc, vc, table = build_paged(get_format(fmt), ks, vs, 16, DEVICE, g)
    q_req = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.int32, device=DEVICE)
    q_pos = torch.tensor([0, 5, 16, 31, 39, 32, 50, 69], dtype=torch.int32, device=DEVICE)
    q = torch.randn(8, hq, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = random_block_selection(q_pos.long(), 16, 3, hkv, g, holes=True).transpose(0, 1).contiguous()
    out = sparse_prefill(q, kc, vc, table, q_req, q_pos, ids, 16, num_splits=splits, out_dtype=torch.float32)
    check_close(out, paged_sparse_prefill_ref(q, kc, vc, table, q_req, q_pos, ids, 16))


@pytest.mark.parametrize("splits", [1, 4])
def test_bf16_output_is_the_rounded_fp32_output(splits):
    q, kc, vc, table, ctx, ids = make_decode("nvfp4", [9, 70])
    f32 = sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=splits, out_dtype=torch.float32)
    b16 = sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=splits)
    assert b16.dtype == torch.bfloat16
    # within one bf16 ulp (the interpreter truncates, the GPU rounds to nearest)
    ulp = torch.exp2(torch.floor(torch.log2(f32.abs().clamp(min=1e-30))) - 7)
    assert ((b16.float() - f32).abs() <= ulp).all()


@pytest.mark.parametrize("fmt", ["fp8", "fp8-token", "fp8-tensor"])
def test_native_fp8_conversion_equals_portable_decode(fmt):
    q, kc, vc, table, ctx, ids = make_decode(fmt, [33, 64])
    a = sparse_decode(q, kc, vc, table, ctx, ids, 32, native_fp8=True, out_dtype=torch.float32)
    b = sparse_decode(q, kc, vc, table, ctx, ids, 32, native_fp8=False, out_dtype=torch.float32)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["fp8-token", "mxfp4", "bf16"])
def test_p_rounding_variants(fmt):
    """P.V with P rounded once (fp16 dots: 2^-12, bf16: 2^-9 per probability) or as hi + lo parts (two dots): both
    close, the split measurably closer. Default: one rounding for fp16 dots (quantized formats), the split for bf16."""
    q, kc, vc, table, ctx, ids = make_decode(fmt, [50, 64, 9])
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32)
    one = sparse_decode(q, kc, vc, table, ctx, ids, 32, precise_p=False, out_dtype=torch.float32)
    two = sparse_decode(q, kc, vc, table, ctx, ids, 32, precise_p=True, out_dtype=torch.float32)
    default = sparse_decode(q, kc, vc, table, ctx, ids, 32, out_dtype=torch.float32)
    check_close(one, ref, 8e-3)
    check_close(two, ref, 1e-4)
    assert value_metrics(one, ref).rel_l2 > 4 * value_metrics(two, ref).rel_l2
    assert torch.equal(default, two if fmt == "bf16" else one)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4-floor", "fp8-token", "bf16"])
def test_prefetch_and_pipeliner_loops_agree(fmt):
    """The three loops (2: loads of tile i + 1 and lookups of tile i + 2 during tile i; 1: lookups one tile ahead;
    0: none) walk the same tiles in the same order, so they agree; with splits 3 over 7 tiles the last split is
    short (nothing past a split's end is loaded or counted). E2M1 also in PAIRED column order."""
    q, kc, vc, table, ctx, ids = make_decode(fmt, [3, 40, 70])
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32)
    for splits in (1, 3):
        outs = [sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=splits, prefetch=pf, out_dtype=torch.float32)
                for pf in (2, 1, 0)]
        if fmt in ("nvfp4", "mxfp4-floor"):
            for paired in (True, "k"):  # K and V tiles, or K tiles only, in PAIRED column order
                outs.append(sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=splits, paired=paired,
                                          out_dtype=torch.float32))
        for out in outs:
            check_close(out, ref)
            assert value_metrics(out, outs[0]).max_rel <= 1e-6


def test_launch_plan_caps_warps_at_tile_over_8():
    """Warps never exceed tile / 8 (the H200 miscompiled the E2M1 decode of 16-token tiles with 4 warps)."""
    cpu = torch.device("cpu")
    assert launch_plan(4, 1, 16, 128, 128, cpu, 1, 16, 4)[3] == 2
    assert launch_plan(4, 1, 16, 128, 128, cpu, 1, 32, 8)[3] == 4
    assert launch_plan(4, 1, 16, 128, 128, cpu, 1, 64, None)[3] == 4
    assert launch_plan(4, 1, 16, 128, 128, cpu, 1, 128, 8)[3] == 8
    t, splits, per, _ = launch_plan(4, 1, 16, 128, 128, cpu, 3, 64, 4)
    assert (t, splits, per) == (64, 3, 11)  # 32 tiles in 3 splits of 11, 11, 10
    with pytest.raises(KernelArgumentError):
        launch_plan(4, 1, 16, 128, 128, cpu, 1, 64, 3)


def test_launch_plan_gpu_defaults():
    """The H200-tuned defaults at M3's shape (132 SMs, top-16 x 128 tokens = 32 tiles of 64): quantized formats
    with enough tiles for 4 resident programs per SM get 2 warps and one wave of splits, small batches 4 warps and
    about two programs per SM; bf16 4 warps and the largest power-of-two splits within 4 programs per SM, or one
    split of whole pages at two programs per SM. Explicit options win."""
    cpu = torch.device("cpu")
    plan = lambda rows, q=True, **kw: launch_plan(rows, 1, 16, 128, 128, cpu, quantized=q, sms=132,  # noqa: E731
                                                  tile_tokens=kw.pop("tile_tokens", 64), **kw)
    assert plan(256) == (64, 2, 16, 2)
    assert plan(64) == (64, 8, 4, 2)
    assert plan(16) == (64, 16, 2, 4)  # 16 x 32 tiles < 4 x 132: the 4-warp plan (17 splits of 2 tiles -> 16)
    assert plan(1) == (64, 32, 1, 4)
    assert plan(256, q=False) == (64, 2, 16, 4)  # a given tile: the power-of-two rule
    assert plan(64, q=False) == (64, 8, 4, 4)  # 4 x 132 / 64 = 8.25 -> 8
    assert plan(96, q=False) == (64, 4, 8, 4)  # 5.5 -> 4, not 5 or 6
    assert plan(128, q=False) == (64, 4, 8, 4)
    assert plan(132, q=False) == (64, 4, 8, 4)  # as many rows as SMs: four per SM
    assert plan(160, q=False) == (64, 2, 16, 4)
    assert plan(320, q=False) == (64, 1, 32, 4)  # 1.65 -> 1
    assert plan(600, q=False) == (64, 1, 32, 4)  # past one wave: still one split
    assert plan(16, q=False) == (64, 32, 1, 4)  # 33 -> 32, capped at the tiles
    # bf16 at two programs per SM (to within 1/8): one split of whole pages, unless a tile or splits are given
    whole = lambda rows, **kw: launch_plan(rows, 1, 16, 128, 128, cpu, quantized=False, sms=132, **kw)  # noqa: E731
    assert whole(256) == (128, 1, 16, 4)
    assert whole(248) == whole(264) == (128, 1, 16, 4)
    assert whole(247)[1] == 2 and whole(265)[1] == 1  # split tiles (64 tokens on the GPU, pages interpreted)
    assert launch_plan(128, 2, 16, 128, 128, cpu, quantized=False, sms=132) == (128, 1, 16, 4)  # rows x KV heads
    given = whole(256, num_splits=2)  # given splits: the default tile (64 on the GPU, pages interpreted)
    assert given[:2] == (128 if INTERPRET else 64, 2)
    assert whole(256, tile_tokens=64) == (64, 2, 16, 4)
    assert launch_plan(256, 1, 16, 128, 64, cpu, quantized=False, sms=132)[:2] == (64, 1)  # pages of 64: the page
    assert not pairs_whole_pages(247, 132) and pairs_whole_pages(248, 132) and not pairs_whole_pages(265, 132)
    assert launch_plan(256, 1, 16, 128, 128, cpu, quantized=True, sms=132)[1] == 2  # quantized: never one split
    assert plan(256, num_warps=4, num_splits=3) == (64, 3, 11, 4)
    assert launch_plan(256, 1, 16, 128, 128, cpu, tile_tokens=64, quantized=True)[1:] == (1, 32, 4)  # off GPU


def test_empty_selection_and_excess_splits():
    q, kc, vc, table, ctx, ids = make_decode("mxfp4", [20, 50, 64])
    ids[0] = -1  # nothing selected
    ids[1, :, :] = torch.tensor([3, -1, -1], dtype=torch.int32)  # only a block after the query (tokens 96..127)
    out = sparse_decode(q, kc, vc, table, ctx, ids, 32, out_dtype=torch.float32)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    many = sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=100, out_dtype=torch.float32)  # > tiles
    assert torch.equal(many[:2], torch.zeros_like(many[:2]))
    check_close(many, paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32))


def test_scale_argument():
    q, kc, vc, table, ctx, ids = make_decode("fp8-token", [45, 60])
    out = sparse_decode(q, kc, vc, table, ctx, ids, 32, scale=0.3, out_dtype=torch.float32)
    check_close(out, paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32, scale=0.3))


def _poke_bf16(cache: PagedCache, table, req: int, token: int, head: int, dim: int, value: float) -> None:
    page = int(table[req, token // cache.page_size])
    cache.payload_plane()[page, head, token % cache.page_size].view(torch.bfloat16)[dim] = value


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy notes the Inf - Inf on purpose
def test_nonfinite_guards():
    """Garbage after the context (the pool is 0xFF = NaN) and Inf in unselected blocks never leak; Inf in a visible
    selected K gives NaN for the query heads whose score is +Inf, exactly like the reference."""
    q, kc, vc, table, ctx, ids = make_decode("bf16", [40, 70], hkv=1, holes=False)
    ids[:] = torch.tensor([[[1, 0, -1]], [[2, 0, -1]]], dtype=torch.int32, device=ids.device)
    tail = kc.payload_plane()[int(table[0, 40 // 16]), 0, 40 % 16].view(torch.bfloat16)
    assert torch.isnan(tail).all()  # the poison is really there, right after request 0's last token
    base = sparse_decode(q, kc, vc, table, ctx, ids, 32, out_dtype=torch.float32)
    assert torch.isfinite(base).all()
    _poke_bf16(kc, table, 1, 40, 0, 5, float("inf"))  # request 1, block 1: not selected
    _poke_bf16(vc, table, 1, 45, 0, 0, float("nan"))
    assert torch.equal(sparse_decode(q, kc, vc, table, ctx, ids, 32, out_dtype=torch.float32), base)
    _poke_bf16(kc, table, 0, 33, 0, 5, float("inf"))  # request 0, block 1: selected and visible
    for splits in (1, 2):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=splits, out_dtype=torch.float32)
        ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out[0]).any()
        check_close(out[1], base[1])  # request 1 untouched (summation order differs with splits)
        finite = ~torch.isnan(ref)
        check_close(out[finite], ref[finite])


def test_argument_errors():
    q, kc, vc, table, ctx, ids = make_decode("nvfp4", [20, 30])
    with pytest.raises(KernelArgumentError):
        sparse_decode(q.float(), kc, vc, table, ctx, ids, 32)
    with pytest.raises(KernelArgumentError):
        sparse_decode(q, kc, vc, table, ctx, ids, 24)  # not a multiple of the page size
    with pytest.raises(KernelArgumentError):
        sparse_decode(q, kc, vc, table, ctx, ids.long(), 32)
    with pytest.raises(KernelArgumentError):
        sparse_decode(q, kc, vc, table, ctx[:1], ids, 32)
    other = PagedCache.allocate(get_format("mxfp4"), kc.num_pages, 16, 2, 64, device=DEVICE)
    with pytest.raises(KernelArgumentError):
        sparse_decode(q, kc, other, table, ctx, ids, 32)
    with pytest.raises(KernelArgumentError):
        sparse_decode(q[:, :3], kc, vc, table, ctx, ids, 32)  # 3 query heads for 2 KV heads
    with pytest.raises(KernelArgumentError):
        sparse_decode(q, kc, vc, table, ctx, ids, 32, out_dtype=torch.float16)
    with pytest.raises(KernelArgumentError):
        sparse_decode(q, kc, vc, table, ctx, ids, 32, paired="v")  # True, False or "k"


def test_gluon_path_is_refused_where_it_cannot_run():
    """gluon=True (the NVIDIA fast path, kernels/sparse_attn_gluon.py) is an error off CUDA >= 8.9, for other
    formats or shapes and beside a portable-kernel option; gluon=False is the portable kernel (the default off CUDA)."""
    q, kc, vc, table, ctx, ids = make_decode("nvfp4", [20, 30])
    with pytest.raises(KernelArgumentError, match="gluon=True"):
        sparse_decode(q, kc, vc, table, ctx, ids, 32, gluon=True)
    with pytest.raises(KernelArgumentError, match="portable"):
        sparse_decode(q, kc, vc, table, ctx, ids, 32, gluon=True, num_warps=2)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32)
    check_close(sparse_decode(q, kc, vc, table, ctx, ids, 32, gluon=False, out_dtype=torch.float32), ref)


def test_split_counters(monkeypatch):
    """The fused split merge's arrival counters (host side): zeros, kept and grown per device; never created while
    a CUDA graph is being captured (the launch then takes the combine kernel), reused if they exist."""
    from kvtool.kernels import sparse_attn_gluon as G

    monkeypatch.setattr(G, "_COUNTERS", {})
    cpu = torch.device("cpu")
    a = G.split_counters(cpu, 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and int(a.abs().sum()) == 0
    assert G.split_counters(cpu, 10) is a
    assert G.split_counters(cpu, 5000).numel() >= 5000
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert G.split_counters(cuda, 64) is None
    G._COUNTERS[cuda] = a
    assert G.split_counters(cuda, 64) is a


def test_gluon_dispatch_rules(monkeypatch):
    """Where the default launch takes the Gluon fast path, with the device condition patched to hold (the shape and
    format rules and the batch thresholds are host code, checked here on CPU; the kernel itself is compiled for
    sm_90 by test_kernel_compile and run by the GPU tests below)."""
    from kvtool.kernels import sparse_attn as SA
    from kvtool.kernels import sparse_attn_gluon as G

    monkeypatch.setattr(G, "device_ok", lambda device: True)
    monkeypatch.setattr(G, "num_sms", lambda device: 132)

    def caches(fmt, d=128, page=128, hkv=1):
        f = get_format(fmt)
        return [PagedCache.allocate(f, 2, page, hkv, d, device=DEVICE) for _ in range(2)]

    def uses(fmt, rows, hq=16, d=128, page=128, hkv=1, block=128):
        k, v = caches(fmt, d, page, hkv)
        return SA.uses_gluon(torch.zeros(rows, hq, d, dtype=torch.bfloat16), k, v, block)

    assert uses("nvfp4", 16) and not uses("nvfp4", 15) and uses("nvfp4-rcp-auto", 256)
    assert uses("mxfp4", 16) and not uses("mxfp4", 15) and uses("mxfp4-floor", 200)
    assert uses("nvfp4", 8, hq=32, hkv=2)  # 8 requests x 2 KV heads = 16 programs, 16 query heads each
    for fmt in ("bf16", "fp8-unit", "fp8-token"):
        assert not uses(fmt, 256)
    assert not uses("nvfp4", 256, d=64) and not uses("nvfp4", 256, hq=32)  # head dim, > 16 query heads per KV head
    assert not uses("nvfp4", 256, page=64, block=128) and not uses("nvfp4", 256, page=128, block=256)
    k, v = caches("nvfp4")
    q = torch.zeros(256, 16, 128, dtype=torch.bfloat16)
    assert not SA._use_gluon(q, k, v, 128, None, {"num_warps": 2})  # a portable option keeps the portable kernel
    # a softmax scale <= 0 keeps the portable kernel (the fast path folds the scale in after the row maximum)
    monkeypatch.setattr(G, "sparse_decode", lambda *a, **kw: pytest.fail("the fast path took a scale <= 0"))
    q16 = q[:16]  # the smallest batch the default launch would take the fast path at
    assert SA._use_gluon(q16, k, v, 128, None, {})
    ids = torch.full((16, 1, 16), -1, dtype=torch.int32)
    table = torch.zeros(16, 1, dtype=torch.int32)
    ctx = torch.ones(16, dtype=torch.int32)
    out = SA.sparse_decode(q16, k, v, table, ctx, ids, 128, scale=-0.5)
    assert torch.equal(out, torch.zeros_like(out))  # nothing selected: zeros, from the portable kernel
    with pytest.raises(KernelArgumentError, match="positive softmax scale"):
        SA.sparse_decode(q16, k, v, table, ctx, ids, 128, scale=0.0, gluon=True)
    assert SA._use_gluon(q[:8], k, v, 128, True, {})  # forced below the threshold
    with pytest.raises(KernelArgumentError, match="portable"):
        SA._use_gluon(q, k, v, 128, True, {"paired": True})
    k8, v8 = caches("fp8-unit")
    with pytest.raises(KernelArgumentError, match="nvfp4 or mxfp4"):
        SA._use_gluon(q, k8, v8, 128, True, {})
    # about two programs per SM, at least 256 of the 2048 selected tokens (M3's top-16 x 128) per split, whatever
    # the tile; a launch plan: (tokens per tile, tiles, splits), no empty trailing split
    cpu = torch.device("cpu")
    for tile in (64, 128):
        assert [G.default_splits(r, 1, 2048 // tile, cpu, tile) for r in (256, 128, 64, 16, 1)] == [1, 2, 4, 8, 8]
    assert G.default_splits(1, 1, 3, cpu, 64) == 1  # fewer tokens than a split's least
    assert G.plan(64, 1, 16, cpu) == (G.DEFAULT_TOKENS_PER_TILE, 16 * 128 // G.DEFAULT_TOKENS_PER_TILE, 4)
    assert G.plan(1, 1, 16, cpu, num_splits=5)[2] == (4 if G.DEFAULT_TOKENS_PER_TILE == 128 else 5)  # 4 a split


def test_gluon_launch_options(monkeypatch):
    """The Gluon launch's options (host side, device condition patched): gluon_tile (tokens per tile, one of the
    kernel's TILE_SIZES) and fused_combine (a bool) reach the launcher only when given, and only with gluon=True."""
    from kvtool.kernels import sparse_attn as SA
    from kvtool.kernels import sparse_attn_gluon as G

    monkeypatch.setattr(G, "device_ok", lambda device: True)
    monkeypatch.setattr(G, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert G.plan(64, 1, 16, cpu, tokens_per_tile=64) == (64, 32, 4)
    assert G.plan(64, 1, 16, cpu, tokens_per_tile=128) == (128, 16, 4)
    assert G.plan(1, 1, 16, cpu, num_splits=5, tokens_per_tile=64)[2] == 5  # 32 tiles: 7, 7, 7, 7, 4
    k, v = [PagedCache.allocate(get_format("nvfp4"), 2, 128, 1, 128, device=DEVICE) for _ in range(2)]
    q = torch.zeros(64, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    table = torch.zeros(64, 1, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(64, dtype=torch.int32, device=DEVICE)
    ids = torch.full((64, 1, 16), -1, dtype=torch.int32, device=DEVICE)
    for bad in (32, 256, True):
        with pytest.raises(KernelArgumentError, match="tokens per tile"):
            G.plan(64, 1, 16, cpu, tokens_per_tile=bad)
        with pytest.raises(KernelArgumentError, match="tokens per tile"):  # before any launch
            SA.sparse_decode(q, k, v, table, ctx, ids, 128, gluon=True, gluon_tile=bad)
    with pytest.raises(KernelArgumentError, match="fused_combine"):
        SA.sparse_decode(q, k, v, table, ctx, ids, 128, gluon=True, fused_combine=1)
    for given in ({"gluon_tile": 64}, {"fused_combine": False}):
        for gluon in (None, False):
            with pytest.raises(KernelArgumentError, match="pass gluon=True"):
                SA.sparse_decode(q, k, v, table, ctx, ids, 128, gluon=gluon, **given)
    seen = []
    monkeypatch.setattr(G, "sparse_decode", lambda *a, **kw: seen.append(kw) or torch.zeros_like(q))
    SA.sparse_decode(q, k, v, table, ctx, ids, 128)
    SA.sparse_decode(q, k, v, table, ctx, ids, 128, gluon=True, gluon_tile=64, fused_combine=False)
    assert seen == [{}, {"tokens_per_tile": 64, "fused_combine": False}]


# --------------------------------------------------------------------------------------------- GPU, real sizes
M3 = {"hq": 16, "hkv": 1, "d": 128, "page": 128, "bs": 128, "topk": 16}
GPU_FORMATS = ["bf16", "fp8", "fp8-tensor", "fp8-token", "nvfp4", "nvfp4-rcp-auto", "mxfp4"]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1], ids=["auto-split", "nosplit"])
@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_gpu_m3_decode_long_contexts(fmt, splits):
    lens = [1, 127, 128, 129, 4097, 32768, 65536, 150000]
    q, kc, vc, table, ctx, ids = make_decode(fmt, lens, M3["hq"], M3["hkv"], M3["d"], M3["page"], M3["bs"],
                                             M3["topk"], seed=11, holes=True)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    out = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, out_dtype=torch.float32)
    check_close(out, ref, 2e-3)
    b16 = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits)
    assert value_metrics(b16.float(), ref).max_rel <= 2.0**-8 + 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8-token"])
def test_gpu_m3_batch256_split_equals_nosplit(fmt):
    g = torch.Generator().manual_seed(3)
    lens = [int(n) for n in torch.randint(1, 20000, (256,), generator=g)]
    q, kc, vc, table, ctx, ids = make_decode(fmt, lens, M3["hq"], M3["hkv"], M3["d"], M3["page"], M3["bs"],
                                             M3["topk"], seed=3)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    for splits in (None, 1, 4):
        check_close(sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, out_dtype=torch.float32),
                    ref, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8-token", "bf16"])
def test_gpu_m3_prefill(fmt):
    g = torch.Generator().manual_seed(4)
    n = 4096
    ks, vs = [synthetic_kv(n, 1, 128, g)], [synthetic_kv(n, 1, 128, g)]
    kc, vc, table = build_paged(get_format(fmt), ks, vs, 128, DEVICE, g)
    q_pos = torch.randint(0, n, (512,), generator=g).to(torch.int32).to(DEVICE)
    q_req = torch.zeros_like(q_pos)
    q = torch.randn(512, 16, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = random_block_selection(q_pos.long(), 128, 16, 1, g).transpose(0, 1).contiguous()
    out = sparse_prefill(q, kc, vc, table, q_req, q_pos, ids, 128, out_dtype=torch.float32)
    check_close(out, paged_sparse_prefill_ref(q, kc, vc, table, q_req, q_pos, ids, 128), 2e-3)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    q, kc, vc, table, ctx, ids = make_decode("nvfp4", [300, 5000, 70000, 9], M3["hq"], M3["hkv"], M3["d"],
                                             M3["page"], M3["bs"], M3["topk"], seed=8)
    eager = sparse_decode(q, kc, vc, table, ctx, ids, 128)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_decode(q, kc, vc, table, ctx, ids, 128)  # warm-up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert math.isfinite(float(out.float().abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fmt,gluon", [("nvfp4", True), ("mxfp4", True), ("nvfp4", False), ("fp8", False)],
                         ids=["nvfp4-gluon", "mxfp4-gluon", "nvfp4-portable", "fp8-portable"])
def test_gpu_pdl_chain_equals_plain_launches(fmt, gluon, splits, monkeypatch):
    """Programmatic dependent launch (platform.LAUNCH_PDL): six layers whose query is the output of the layer
    before, back to back in one CUDA graph, equal the same chain launched without PDL bit for bit. A launch that read
    its query before the kernel before had finished (griddepcontrol.wait after a load) would see a stale one."""
    from kvtool.kernels import platform

    lens = [300, 5000, 20000, 9, 129, 1000] * 6  # 36 rows: the portable kernel takes PDL up to one program an SM
    q, kc, vc, table, ctx, ids = make_decode(fmt, lens, M3["hq"], M3["hkv"], M3["d"], M3["page"], M3["bs"],
                                             M3["topk"], seed=10)

    outs = {}
    for pdl in (False, True):
        monkeypatch.setattr(platform, "LAUNCH_PDL", pdl)
        outs[pdl] = graph_chain(q, lambda x: sparse_decode(x, kc, vc, table, ctx, ids, 128, num_splits=splits,
                                                           gluon=gluon))
    assert torch.equal(outs[True], outs[False])
    assert torch.isfinite(outs[True].float()).all() and outs[True].float().abs().max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gpu_pdl_modes_chain_at_large_grids(fmt):
    """The portable kernel's PDL modes (sparse_attn.PDL_MODES) at grids of several programs an SM (64 rows, where
    the default releases the next launch after the loop or not at all): six chained layers in one CUDA graph give the
    same output bit for bit with the next launch released late, late by the kernel and early by the combine, early
    (at the start) or without PDL, for one split (no combine) and the default."""
    lens = [300, 5000, 20000, 9, 129, 1000, 32768, 2048] * 8
    q, kc, vc, table, ctx, ids = make_decode(fmt, lens, M3["hq"], M3["hkv"], M3["d"], M3["page"], M3["bs"],
                                             M3["topk"], seed=11)
    for splits in (1, None):
        outs = {mode: graph_chain(q, lambda x, mode=mode: sparse_decode(x, kc, vc, table, ctx, ids, 128,
                                                                        num_splits=splits, gluon=False, pdl=mode))
                for mode in ("late", "late-main", "early", False)}
        assert all(torch.equal(outs[m], outs[False]) for m in ("late", "late-main", "early")), splits
        assert torch.isfinite(outs[False].float()).all() and outs[False].float().abs().max() > 0


def test_pdl_option_is_checked():
    q, kc, vc, table, ctx, ids = make_decode("bf16", [40], 4, 1, 64, 16, 16, 2, seed=12)
    with pytest.raises(KernelArgumentError, match="pdl"):
        sparse_decode(q, kc, vc, table, ctx, ids, 16, pdl="sometimes")
    want = sparse_decode(q, kc, vc, table, ctx, ids, 16)
    for mode in ("late", "late-main", "early", False):  # no PDL off CUDA: the same launch
        assert torch.equal(sparse_decode(q, kc, vc, table, ctx, ids, 16, pdl=mode), want)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 1), (16, 2), (8, 2), (5, 1)], ids=["g16", "g8x2", "g4x2", "g5"])
@pytest.mark.parametrize("fmt", ["nvfp4-rcp", "nvfp4-rcp-auto", "nvfp4-div", "mxfp4-rceil", "mxfp4-floor"])
def test_gpu_decode_gluon(fmt, heads):
    """The Gluon FP4 decode (forced) against the reference and the portable kernel: contexts around the 64-token
    tile and 128-token page edges up to 150K (the pool's 0xFF bytes after each context are NaN scales: never read),
    -1 holes in the selections, GQA groups of 16, 8, 4 and 5 (padded) query heads, every split count (1 writes the
    output itself, more merge in the last split's program; 100 > tiles), bf16 output = the rounded fp32 output."""
    hq, hkv = heads
    lens = [1, 63, 64, 65, 127, 128, 129, 4097, 150000]
    q, kc, vc, table, ctx, ids = make_decode(fmt, lens, hq, hkv, 128, 128, 128, 16, seed=21)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    port = sparse_decode(q, kc, vc, table, ctx, ids, 128, gluon=False, out_dtype=torch.float32)
    for splits in (None, 1, 3, 32, 100):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True, out_dtype=torch.float32)
        check_close(out, ref, 2e-3)
        check_close(out, port, 2e-3)
    one = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=1, gluon=True, out_dtype=torch.float32)
    assert torch.equal(sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=1, gluon=True), one.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 1), (5, 1)], ids=["g16", "g5"])
@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("fmt", ["nvfp4-rcp", "mxfp4-rceil"])
def test_gpu_decode_gluon_each_tile(fmt, tile, heads):
    """The Gluon decode at both tile sizes (gluon_tile: a page, or half a page) against the reference and the portable
    kernel, at the page-edge contexts (short ones select fewer than 16 blocks: -1 slots), split counts 1, 3 and the
    default."""
    hq, hkv = heads
    lens = [1, 63, 64, 65, 127, 128, 129, 4097, 150000]
    q, kc, vc, table, ctx, ids = make_decode(fmt, lens, hq, hkv, 128, 128, 128, 16, seed=25)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    port = sparse_decode(q, kc, vc, table, ctx, ids, 128, gluon=False, out_dtype=torch.float32)
    for splits in (None, 1, 3):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True, gluon_tile=tile,
                            out_dtype=torch.float32)
        check_close(out, ref, 2e-3)
        check_close(out, port, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_decode_gluon_fused_merge(fmt):
    """Split decodes merge in their last program (fused_combine, the default): equal to the combine-kernel launch up
    to summation order, the arrival counters back at zero after every launch (so a second launch and CUDA-graph
    replays give the same output), rows with nothing visible still zeros, a GQA group of 5."""
    from kvtool.kernels import sparse_attn_gluon as attn_gluon

    g = torch.Generator().manual_seed(24)
    lens = [1, 200, 4097] + [int(n) for n in torch.randint(1, 20000, (61,), generator=g)]
    for hq, hkv in ((16, 1), (10, 2)):
        q, kc, vc, table, ctx, ids = make_decode(fmt, lens, hq, hkv, 128, 128, 128, 16, seed=24)
        ids[5] = -1
        ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
        for splits in (2, 3, 16):
            two_launches = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True,
                                         fused_combine=False, out_dtype=torch.float32)
            fused = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True,
                                  fused_combine=True, out_dtype=torch.float32)
            counters = attn_gluon.split_counters(q.device, len(lens) * hkv)
            assert int(counters.abs().sum()) == 0, "arrival counters not reset"
            check_close(fused, two_launches, 1e-5)
            check_close(fused, ref, 2e-3)
            assert torch.equal(fused[5], torch.zeros_like(fused[5]))
            again = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True,
                                  out_dtype=torch.float32)
            assert torch.equal(again, fused)
        out = torch.empty_like(fused)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=3, gluon=True,
                                    out_dtype=torch.float32))
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            check_close(out, ref, 2e-3)


@pytest.mark.gpu
def test_gpu_decode_gluon_dead_tiles():
    """Rows with nothing selected give zeros; a selected block wholly after the query, a -1 page in the block table
    and a block whose second half lies after the query are skipped exactly as the portable kernel skips them; a
    selection with no slots at all (top-k 0) gives zeros. At 64 requests (>= attn_gluon.MIN_PROGRAMS) the default launch
    is this kernel."""
    g = torch.Generator().manual_seed(22)
    lens = [300, 5000, 70, 9000] + [int(n) for n in torch.randint(1, 12000, (60,), generator=g)]
    q, kc, vc, table, ctx, ids = make_decode("nvfp4", lens, 16, 1, 128, 128, 128, 16, seed=22)
    ids[0] = -1
    ids[1, 0, :3] = torch.tensor([39, 45, -1], dtype=torch.int32)  # 39: tokens 4992..5119 (query at 4999); 45: after
    table[3, int(ids[3, 0][ids[3, 0] >= 0][0])] = -1
    port = sparse_decode(q, kc, vc, table, ctx, ids, 128, gluon=False, out_dtype=torch.float32)
    assert torch.equal(port[0], torch.zeros_like(port[0]))
    for splits in (None, 1, 4):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True, out_dtype=torch.float32)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        check_close(out, port, 2e-3)
        default = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, out_dtype=torch.float32)
        assert torch.equal(default, out)
    empty = ids[:, :, :0].contiguous()  # no selection slots at all (top-k 0): zeros on both paths
    for fast in (False, True):
        out = sparse_decode(q, kc, vc, table, ctx, empty, 128, gluon=fast, out_dtype=torch.float32)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.gpu
def test_gpu_gluon_refuses_other_formats():
    q, kc, vc, table, ctx, ids = make_decode("fp8-token", [300, 900], 16, 1, 128, 128, 128, 4, seed=23)
    with pytest.raises(KernelArgumentError, match="gluon=True"):
        sparse_decode(q, kc, vc, table, ctx, ids, 128, gluon=True)


@pytest.mark.gpu
def test_gpu_gluon_mxfp4_scales_far_apart():
    """The Gluon mxfp4 path with E8M0 V scales across the exponent range (as test_mxfp4_v_scales_far_apart): every V
    token near 2**-100, near 2**100, per-token magnitudes 2**[-30, 30]; K blocks of one token 2**[-6, 6] apart."""
    g = torch.Generator().manual_seed(11)
    lens, d = [300, 300, 300], 128
    ks = [synthetic_kv(n, 1, d, g).float() * torch.exp2(torch.randint(-6, 7, (1, 1, d), generator=g).float())
          for n in lens]
    vs = [synthetic_kv(n, 1, d, g, outliers=False).float() for n in lens]
    vs[0] = vs[0] * 2.0**-100
    vs[1] = vs[1] * 2.0**100
    vs[2] = vs[2] * torch.exp2(torch.randint(-30, 31, (300, 1, 1), generator=g).float())
    kc, vc, table = build_paged(get_format("mxfp4"), [k.to(torch.bfloat16) for k in ks],
                                [v.to(torch.bfloat16) for v in vs], 128, DEVICE, g)
    q = torch.randn(3, 16, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ids = random_block_selection(ctx.long() - 1, 128, 4, 1, g, holes=False).transpose(0, 1).contiguous()
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    for splits in (1, 2):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True, out_dtype=torch.float32)
        for b in range(3):
            check_close(out[b], ref[b])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_gluon_scores_jump_between_tiles(fmt):
    """The Gluon decode's stale softmax reference (attn_gluon.TAU: no rescale while no score passes the running max
    by more than TAU in log2 units): K blocks whose scores grow from one selected block to the next, slowly at first
    (stale tiles, p up to 2**TAU) then by far more than TAU (a rescale on every tile); the same blocks in falling
    order (only the first tile rescales); one query head whose scores alone jump (the CTA-wide rescale leaves the
    other heads' sums as they were); a row whose first selected block lies wholly after the query. Against the
    reference and the portable kernel, split 1 and 3."""
    g = torch.Generator().manual_seed(12)
    n, d = 16 * 128, 128
    grow = torch.exp2(torch.arange(16).float() * 0.75).repeat_interleave(128)[:, None, None]  # block b: 2**(0.75 b)
    ks = [synthetic_kv(n, 1, d, g, outliers=False).float() * grow for _ in range(4)]
    vs = [synthetic_kv(n, 1, d, g, outliers=False) for _ in range(4)]
    kc, vc, table = build_paged(get_format(fmt), [k.to(torch.bfloat16) for k in ks], vs, 128, DEVICE, g)
    # scores (log2 units) of rows 0, 1 reach ~450 at the last block: jumps of ~2 at first, ~180 at the end (larger
    # scores make the outcome hinge on fp32 rounding of near-ties, in any kernel)
    q = torch.randn(4, 16, d, generator=g) * 0.05
    q[2] *= 0.02
    q[2, 7] *= 20.0  # head 7 of row 2 alone jumps (by up to ~64), the others move by < TAU a block
    q = q.to(torch.bfloat16).to(DEVICE)
    ctx = torch.tensor([n, n, n, n - 200], dtype=torch.int32, device=DEVICE)
    up = torch.arange(16, dtype=torch.int32)
    ids = torch.stack([up, up.flip(0), up, torch.cat([up[15:], up[:15]])])[:, None, :].contiguous().to(DEVICE)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    port = sparse_decode(q, kc, vc, table, ctx, ids, 128, gluon=False, out_dtype=torch.float32)
    for splits in (1, 3):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128, num_splits=splits, gluon=True, out_dtype=torch.float32)
        for b in range(4):
            check_close(out[b], ref[b])
            check_close(out[b], port[b])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "bf16"])
def test_gpu_tiles_and_warps(fmt):
    """Tile sizes, warp counts (capped at tile / 8), the three loops and both E2M1 column orders on the H200, which
    once gave garbage for E2M1 with 16-token tiles (now decoded 32 wide, half masked); bf16's loops and tiles too."""
    q, kc, vc, table, ctx, ids = make_decode(fmt, [5, 300, 1000, 4000], M3["hq"], M3["hkv"], M3["d"], M3["page"],
                                             M3["bs"], 8, seed=12)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    configs = [(16, 4, 0, False), (16, 4, 1, False), (16, 4, 2, False), (16, 8, 1, True), (32, 4, 1, False),
               (64, 8, 1, False), (64, 4, 1, True), (128, 4, 1, False), (128, 8, 2, False)]
    for tile, warps, prefetch, paired in configs:
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128, tile_tokens=tile, num_warps=warps, prefetch=prefetch,
                            paired=paired, out_dtype=torch.float32)
        m = value_metrics(out, ref)
        assert m.max_rel <= 2e-3, (tile, warps, prefetch, paired, m)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8-token", "fp8"])
def test_gpu_warp_variants(fmt):
    """The launch variants measured for the H200 defaults at M3's shape: 2 warps per program (the default for
    quantized formats at batch >= 17) with 1, default and 8 splits, 4 warps, 32-token tiles with 2 or 1 warps, PAIRED
    K only or K and V, lazy sums and the joint max off, 4 and 5 pipeline stages (two or three tiles' copies in
    flight; the default 3: one), 32-token tiles with a 128-register cap and 4 stages."""
    q, kc, vc, table, ctx, ids = make_decode(fmt, [5, 300, 1000, 4000, 20000], M3["hq"], M3["hkv"], M3["d"],
                                             M3["page"], M3["bs"], M3["topk"], seed=13)
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 128)
    configs = [dict(num_warps=2), dict(num_warps=4), dict(num_warps=2, num_splits=8), dict(num_warps=2, num_splits=1),
               dict(tile_tokens=32, num_warps=2), dict(tile_tokens=32, num_warps=1),
               dict(lazy_l=False, joint_max=False), dict(num_stages=4), dict(num_stages=5),
               dict(tile_tokens=32, num_warps=2, maxnreg=128, num_splits=4, num_stages=4)]
    if fmt in ("nvfp4", "mxfp4"):
        configs += [dict(num_warps=2, paired=True), dict(num_warps=2, paired="k"), dict(paired="k")]
    for cfg in configs:
        out = sparse_decode(q, kc, vc, table, ctx, ids, 128, out_dtype=torch.float32, **cfg)
        m = value_metrics(out, ref)
        assert m.max_rel <= 2e-3 and m.rel_l2 <= 2e-3, (cfg, m)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4-floor", "fp8-token", "bf16"])
def test_lazy_sum_and_joint_max_agree(fmt):
    """Softmax denominators summed per tile (lazy_l=False) or per column and once after the loop (True) give the same
    output to fp32 rounding; for E8M0 V scales the joint max (V's exponents through the softmax max) and the tile max
    of the V factors round P differently, so both are checked against the reference and against each other."""
    q, kc, vc, table, ctx, ids = make_decode(fmt, [3, 40, 70])
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 32)
    for splits in (1, 3):
        run = lambda **kw: sparse_decode(q, kc, vc, table, ctx, ids, 32, num_splits=splits,  # noqa: E731
                                         out_dtype=torch.float32, **kw)
        outs = {(lz, jm): run(lazy_l=lz, joint_max=jm) for lz in (False, True) for jm in (False, True)}
        for out in outs.values():
            check_close(out, ref)
        assert value_metrics(outs[True, False], outs[False, False]).max_rel <= 1e-6
        assert value_metrics(outs[True, True], outs[False, True]).max_rel <= 1e-6
        if fmt != "mxfp4-floor":  # joint_max only changes E8M0 launches
            assert torch.equal(outs[True, True], outs[True, False])


@pytest.mark.parametrize("joint", [False, True])
def test_mxfp4_v_scales_far_apart(joint):
    """E8M0 V scales across the exponent range: one request with every V token near 2**-100, one near 2**100, one with
    per-token magnitudes 2**[-30, 30] (each token's factor goes into P; the joint max keeps P <= 1 and moves acc to the
    softmax's reference after the loop, 2**(mv - m) up to 2**127). Checked per request."""
    g = torch.Generator().manual_seed(11)
    lens, hkv, d = [64, 64, 64], 1, 64
    ks = [synthetic_kv(n, hkv, d, g) for n in lens]
    vs = [synthetic_kv(n, hkv, d, g, outliers=False).float() for n in lens]
    vs[0] = vs[0] * 2.0**-100
    vs[1] = vs[1] * 2.0**100
    vs[2] = vs[2] * torch.exp2(torch.randint(-30, 31, (64, 1, 1), generator=g).float())
    kc, vc, table = build_paged(get_format("mxfp4"), ks, [v.to(torch.bfloat16) for v in vs], 16, DEVICE, g)
    q = torch.randn(3, 4, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ids = random_block_selection(ctx.long() - 1, 16, 3, hkv, g, holes=False).transpose(0, 1).contiguous()
    ref = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 16)
    for splits in (1, 2):
        out = sparse_decode(q, kc, vc, table, ctx, ids, 16, num_splits=splits, joint_max=joint, out_dtype=torch.float32)
        for b in range(3):
            check_close(out[b], ref[b])


def test_bench_goals_compare_per_layer():
    """`kvtool bench attn` runs each format for enough layers to exceed L2 (8 nvfp4 layers vs 5 fp8 layers at batch
    64), so "nvfp4 faster than fp8" compares time per layer, not per case."""
    from kvtool.bench.attn import _goals
    from kvtool.bench.common import BenchReport, BenchRow

    rows = [BenchRow("batch 64", "triton nvfp4-rcp", 200.0, 1, 1.0, 0.3),  # 25 us per layer (8 layers)
            BenchRow("batch 64", "triton fp8-unit", 150.0, 1, 1.0, 0.5),  # 30 us per layer (5 layers)
            BenchRow("batch 256", "triton nvfp4-rcp", 100.0, 1, 1.0, 0.71)]
    rep = BenchReport("t", "d", "", "", "", 1.0, rows)
    goals = {g["goal"]: g for g in _goals(rep, (64, 256), {"batch 64 nvfp4-rcp": 8, "batch 64 fp8-unit": 5})}
    g = goals["nvfp4 faster than fp8-unit per layer at batch 64"]
    assert g["met"] and g["value"] == 1.2
    assert goals["nvfp4-rcp >= 70 % of copy at batch 256"]["met"]
