"""Every default kernel launch compiles for the H200 (cuda:90 -> cubin) and for AMD gfx950 (hip:gfx950 -> hsaco).

CI has no GPU, so kernels only run in Triton's interpreter there, which accepts code the real compilers reject (an
annotated module constexpr, a layout a backend cannot lower, a vendor-only op outside its capability check). Each
case calls a public entry point on CPU tensors at a production shape; `kernel_capture` records every kernel launch it
makes (as the launcher would make it on that target: INTERPRET off, the target's native-fp8 rule and SM count),
specializes the recorded arguments with Triton's own binder and compiles them offline (every autotune config of an
autotuned launch). A case passes when it launched at least one kernel and every launch compiled to a non-empty
binary. Compiling is not running: a gfx950 pass is no statement about results on that GPU.

The compiles run in one worker process per target (see kernel_capture: the pytest process has TRITON_INTERPRET=1 on
CPU machines); both workers get every request at the start and work concurrently; identical specializations compile
once (memo), and Triton's cache makes warm runs fast.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernel_capture
from kvtool.formats import get_format
from kvtool.paged import PagedCache

STORE_FORMATS = ("bf16", "fp8-unit", "fp8-token", "nvfp4-rcp-auto", "mxfp4-rceil", "mxfp4-floor")
SCORE_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")  # format defaults: fp8-unit, nvfp4-rcp, mxfp4-rceil
D, PAGE = 128, 128
INDEX = {"heads": 4, "block": 128, "topk": 16}  # M3 indexer geometry (kvtool/bench/index.py)
ATTN = {"hq": 16, "hkv": 1, "block": 128, "topk": 16}  # M3 TP4 attention geometry (kvtool/bench/attn.py)

# (case, target) -> reason: launches that do not compile, with the compiler's one-line message. None today.
XFAIL: dict[tuple[str, str], str] = {}


def _cache(fmt, pages: int = 8, heads: int = 1) -> PagedCache:
    return PagedCache.allocate(fmt, pages, PAGE, heads, D, tensor_amax=3.0 if fmt.needs_tensor_amax else None)


# ----------------------------------------------------------------------------- store / quantize / dequantize
def _store(name):
    def make():
        from kvtool.kernels import store as S

        cache = _cache(get_format(name))
        x = torch.randn(300, 1, D).to(torch.bfloat16)
        slots = torch.randperm(cache.num_slots)[:300]
        return lambda: S.store(cache, x, slots)
    return make


def _store_f32(name):
    """fp32 input: the portable store on every target (bf16 rows of 128 take the Gluon store on CUDA)."""
    def make():
        from kvtool.kernels import store as S

        cache = _cache(get_format(name), heads=2)
        x = torch.randn(300, 2, D)
        slots = torch.randperm(cache.num_slots)[:300]
        return lambda: S.store(cache, x, slots)
    return make


def _quantize(name):
    def make():
        from kvtool.kernels import quant as Q

        x = torch.randn(300, D).to(torch.bfloat16)
        return lambda: Q.triton_quantize(get_format(name), x)
    return make


def _gather(name):
    def make():
        from kvtool.kernels import dequant as DQ

        cache = _cache(get_format(name))
        slots = torch.randperm(cache.num_slots)[:300]
        return lambda: DQ.gather_dequantize(cache, slots, torch.bfloat16)
    return make


def _dequantize(name):
    def make():
        from kvtool.kernels import quant as Q

        q = get_format(name).quantize(torch.randn(300, D))
        return lambda: Q.triton_dequantize(q)  # fp32 out (the default)
    return make


# ---------------------------------------------------------------------------------------------- index scorer
def _index_inputs(name, batch: int, context: int):
    from kvtool.indexer import IndexerConfig

    cfg = IndexerConfig(block_size=INDEX["block"], topk=INDEX["topk"])
    cache = _cache(get_format(name))
    pages = -(-context // PAGE)
    table = torch.randint(0, cache.num_pages, (batch, pages), dtype=torch.int32)
    ctx = torch.full((batch,), context, dtype=torch.int32)
    return cfg, cache, table, ctx


def _index_decode(name, entry: str, **options):
    """batch 64 x 150K tokens (the benchmark's decode shape)."""
    def make():
        from kvtool.kernels import index_score as IS

        cfg, cache, table, ctx = _index_inputs(name, 64, 150_000)
        iq = torch.randn(64, INDEX["heads"], D).to(torch.bfloat16)
        fn = getattr(IS, entry)
        return lambda: fn(iq, cache, table, ctx, cfg, **options)
    return make


def _index_prefill(name):
    """one request, 4K queries over its 4K tokens (causal)."""
    def make():
        from kvtool.kernels import index_score as IS

        cfg, cache, table, ctx = _index_inputs(name, 1, 4096)
        iq = torch.randn(1, 4096, INDEX["heads"], D).to(torch.bfloat16)
        return lambda: IS.prefill_topk(iq, cache, table, ctx, cfg)
    return make


# ------------------------------------------------------------------------------------------ sparse attention
def _attn_inputs(name, rows: int, context: int = 16384):
    k, v = _cache(get_format(name), heads=ATTN["hkv"]), _cache(get_format(name), heads=ATTN["hkv"])
    pages = context // PAGE
    table = torch.randint(0, k.num_pages, (rows, pages), dtype=torch.int32)
    nb = context // ATTN["block"]
    ids = torch.stack([torch.randperm(nb)[:ATTN["topk"]] for _ in range(rows)]).to(torch.int32)
    ids = ids[:, None, :].expand(rows, ATTN["hkv"], ATTN["topk"]).contiguous()
    q = torch.randn(rows, ATTN["hq"], D).to(torch.bfloat16)
    return q, k, v, table, ids


def _attn_decode(name, batch: int, **options):
    """Default launch plan on the target: batch 64 fills the GPU with splits (+ the combine kernel), batch 544 with
    one split; batch 4 (too few tiles) runs 4-warp programs with splits. `options`: sparse_decode keywords."""
    def make():
        from kvtool.kernels import sparse_attn as SA

        q, k, v, table, ids = _attn_inputs(name, batch)
        ctx = torch.full((batch,), 16384, dtype=torch.int32)
        return lambda: SA.sparse_decode(q, k, v, table, ctx, ids, ATTN["block"], **options)
    return make


def _attn_prefill(name):
    """1024 query rows of one request at the end of a 16K context."""
    def make():
        from kvtool.kernels import sparse_attn as SA

        q, k, v, table, ids = _attn_inputs(name, 1024)
        table = table[:1].contiguous()
        req = torch.zeros(1024, dtype=torch.int32)
        pos = torch.arange(16384 - 1024, 16384, dtype=torch.int32)
        return lambda: SA.sparse_prefill(q, k, v, table, req, pos, ids, ATTN["block"])
    return make


CASES = {}
for _f in STORE_FORMATS:
    CASES[f"store/{_f}"] = _store(_f)
    CASES[f"store-f32/{_f}"] = _store_f32(_f)
    CASES[f"quantize/{_f}"] = _quantize(_f)
    CASES[f"gather-bf16/{_f}"] = _gather(_f)
    CASES[f"dequantize-fp32/{_f}"] = _dequantize(_f)
for _f in SCORE_FORMATS:
    CASES[f"index-decode-topk/{_f}"] = _index_decode(_f, "decode_topk")
    CASES[f"index-decode-blocks/{_f}"] = _index_decode(_f, "decode_block_scores")
    CASES[f"index-prefill-topk/{_f}"] = _index_prefill(_f)
    CASES[f"attn-decode-splits/{_f}"] = _attn_decode(_f, 64)
    CASES[f"attn-decode-nosplit/{_f}"] = _attn_decode(_f, 544)
    CASES[f"attn-decode-small/{_f}"] = _attn_decode(_f, 4)
    CASES[f"attn-prefill/{_f}"] = _attn_prefill(_f)
# the topk.py kernels no default launch uses: the in-kernel top-k's merge, the split select's packed merge
CASES["index-decode-topk-inkernel/nvfp4"] = _index_decode("nvfp4", "decode_topk", in_kernel_topk=True)
CASES["index-decode-topk-split256/nvfp4"] = _index_decode("nvfp4", "decode_topk", select="split256")
# the Gluon scorer forced (gluon=True) and its refusal on ROCm
CASES["index-decode-topk-gluon/nvfp4"] = _index_decode("nvfp4", "decode_topk", gluon=True)
XFAIL[("index-decode-topk-gluon/nvfp4", "hip:gfx950")] = "gluon=True is refused off CUDA (KernelArgumentError)"
# its splits longer than SMEM_BLOCKS: the warps' partial maxima go to the select pass (no shared-memory block scores)
CASES["index-decode-topk-gluon-chunk48/mxfp4"] = _index_decode("mxfp4", "decode_topk", gluon=True, chunk_blocks=48)
XFAIL[("index-decode-topk-gluon-chunk48/mxfp4", "hip:gfx950")] = "gluon=True is refused off CUDA (KernelArgumentError)"
# the Gluon attention forced (gluon=True) and its refusal on ROCm
for _f in ("nvfp4", "mxfp4"):
    CASES[f"attn-decode-gluon/{_f}"] = _attn_decode(_f, 64, gluon=True)
    XFAIL[(f"attn-decode-gluon/{_f}", "hip:gfx950")] = "gluon=True is refused off CUDA (KernelArgumentError)"
# attention's portable (integer) e4m3 decode, which its default launch skips on both targets (see NATIVE_FP8 below)
PORTABLE_FP8 = ("attn-decode-splits-portable/fp8", "attn-decode-splits-portable/nvfp4")
for _case in PORTABLE_FP8:
    CASES[_case] = _attn_decode(_case.split("/")[1], 64, native_fp8=False)

# what each group must launch (by kernel object name; a tuple: one of these), checked on every target. The index
# scorer: autotuned, or its fixed launch (FP4 top-k on CUDA: index_score.FP4_PAIR_LAUNCH)
SCORER = ("index_score._tuned_kernel", "index_score._index_score_kernel", "index_gluon.decode_block_parts_kernel")
# sparse-attention decode: the portable kernel, or (FP4 on CUDA) the Gluon fast path (kernels/sparse_attn_gluon.py)
ATTN_DECODE = ("sparse_attn._sparse_attn_kernel", "sparse_attn_gluon.decode_kernel")
# the store: the portable kernel, or (bf16 rows of 128 into FP4 on CUDA) the Gluon TMA store (kernels/store_gluon.py)
STORE = ("store._store_kernel", "store_gluon.store_tma_kernel")
EXPECT = {
    "store": {STORE}, "quantize": {STORE}, "store-f32": {"store._store_kernel"},
    "gather-bf16": {"dequant._dequant_kernel"}, "dequantize-fp32": {"dequant._dequant_kernel"},
    "index-decode-topk": {SCORER, "topk._select_kernel"},
    "index-decode-blocks": {SCORER},
    "index-prefill-topk": {SCORER, "topk._select_kernel"},
    # (the Gluon kernel merges its splits itself: the combine launch is the portable kernel's)
    "attn-decode-splits": {ATTN_DECODE},
    "attn-decode-splits-portable": {"sparse_attn._sparse_attn_kernel", "sparse_attn._combine_kernel"},
    "attn-decode-nosplit": {ATTN_DECODE},
    "attn-decode-small": {ATTN_DECODE, "sparse_attn._combine_kernel"},
    "attn-decode-gluon": {"sparse_attn_gluon.decode_kernel"},
    "attn-prefill": {"sparse_attn._sparse_attn_kernel"},
    "index-decode-topk-inkernel": {"index_score._tuned_kernel", "topk._merge_kernel"},
    "index-decode-topk-split256": {SCORER, "topk._select_kernel", "topk._merge_packed_kernel"},
    "index-decode-topk-gluon": {"index_gluon.decode_block_parts_kernel", "topk._select_kernel"},
    "index-decode-topk-gluon-chunk48": {"index_gluon.decode_block_parts_kernel", "topk._select_kernel"},
}


# NATIVE_FP8 each launcher passes on the target's device: every kernel uses store.native_fp8 (CUDA builds only,
# capability >= 8.9), so the hardware fp8 conversion is off on gfx950 and the portable integer decode compiles there.
NATIVE_FP8 = {"cuda:90": {"store": True, "dequant": True, "index_score": True, "sparse_attn": True},
              "hip:gfx950": {"store": False, "dequant": False, "index_score": False, "sparse_attn": False}}

# what each group must not launch: the one-split attention launches have no combine pass
ABSENT = {"attn-decode-nosplit": {"sparse_attn._combine_kernel"}, "attn-prefill": {"sparse_attn._combine_kernel"}}


@pytest.fixture(scope="module")
def workers(request):
    """One compile worker per target, each sent every selected request at once (they compile while tests wait)."""
    ws = {t: kernel_capture.Worker(os.path.abspath(__file__)) for t in kernel_capture.TARGETS}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "case" in params:
            ws[params["target"]].submit(params["case"], params["target"])
    yield ws
    for w in ws.values():
        w.close()


def _params():
    for t in kernel_capture.TARGETS:
        for case in CASES:
            reason = XFAIL.get((case, t))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            yield pytest.param(t, case, id=f"{t}-{case}", marks=marks)


@pytest.mark.parametrize("target,case", list(_params()))
def test_default_launch_compiles(workers, target, case):
    r = workers[target].result(case, target)
    assert r["ok"], f"{case} on {target}: {r['error']}\n{r.get('trace', '')}"
    assert r["launches"], f"{case}: no kernel launch was captured"
    group = case.split("/")[0]
    got = set(r["launches"])
    missing = {e for e in EXPECT[group] if not (set(e) if isinstance(e, tuple) else {e}) & got}
    assert not missing, f"{case}: expected launches {sorted(missing)} not captured (got {r['launches']})"
    extra = ABSENT.get(group, set()) & set(r["launches"])
    assert not extra, f"{case}: unexpected launches {sorted(extra)}"
    for c in r["compiled"]:
        assert c["binary_bytes"] > 0, f"{case}: {c['name']} [{c['variant']}] compiled to an empty binary"
    for sw in r["switches"]:
        module = sw["name"].split(".")[0]
        if sw["native_fp8"] is not None:
            want = False if case in PORTABLE_FP8 else NATIVE_FP8[target][module]
            assert sw["native_fp8"] == want, f"{case}: {sw}"
        assert not sw["fp32_dots"], f"{case}: the interpreter's fp32 dots in a compiled launch: {sw}"
        # sparse attention caps registers at 128 for fp16-dot (quantized) 4-warp programs, on CUDA only
        capped = target == "cuda:90" and sw["name"] == "sparse_attn._sparse_attn_kernel" \
            and not case.endswith("/bf16") and sw["num_warps"] == 4
        assert sw["maxnreg"] == (128 if capped else None), f"{case}: {sw}"
    # programmatic dependent launch, CUDA only: the Gluon decode always (its merge: mode 1); the portable attention
    # kernel and its merge releasing the next launch at the start for grids of at most one program per SM, else in
    # decode by tiles per program (sparse_attn.PDL_LATE_TILES) and not at all in prefill
    from kvtool.kernels import sparse_attn as SA

    combine_pdl = None
    for sw in r["switches"]:
        if sw["name"] == "sparse_attn_gluon.decode_kernel":
            pdl = combine_pdl = target == "cuda:90"
        elif sw["name"] == "sparse_attn._sparse_attn_kernel":
            late = next((m for most, m in SA.PDL_LATE_TILES if sw["tiles"] <= most), False)
            small = sw["programs"] <= kernel_capture.TARGETS[target].sms
            mode = False if target != "cuda:90" else "early" if small else \
                late if group.startswith("attn-decode") else False
            pdl, combine_pdl = SA.PDL_MODES[mode]
        elif sw["name"] == "sparse_attn._combine_kernel":
            pdl = combine_pdl
        else:
            continue
        assert sw["pdl"] == pdl and sw["launch_pdl"] == (True if pdl else None), f"{case}: {sw}"
    # every autotune config of the autotuned scorer compiled (the launcher's GPU configs, not the interpreter's one)
    if "index_score._tuned_kernel" in r["launches"]:
        assert len([c for c in r["compiled"] if c["name"] == "index_score._tuned_kernel"]) >= 2
