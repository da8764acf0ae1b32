"""Index scorer kernels (kernels/index_score.py, kernels/topk.py) against the reference fed the dequantized cache.

Block ids are compared as sets, tie-aware: a difference must be between blocks whose reference scores are equal up to
the fp32 accumulation bound (`kvtool.indexer.accumulation_tolerance`); where scores tie exactly (zero queries, NaN,
-inf, forced blocks) the ids must be identical in order too. Block scores must match the reference's -inf / NaN
pattern exactly and its finite values within the same bound. CPU runs use the Triton interpreter at small shapes
(block size 16 or 32 where the semantics do not depend on it, plus real 128-token blocks); the `gpu` tests run the
same checks at engine sizes.
"""

import dataclasses
import math

import pytest
import torch

from kvtool.errors import KernelArgumentError
from kvtool.indexer import IndexerConfig, accumulation_tolerance, paged_keys, paged_reference, token_scores, \
    topk_metrics
from kvtool.kernels import index_score as K
from kvtool.kernels.topk import merge_candidates, select_from_block_scores
from conftest import DEVICE
from edge_cases import edge_case_tensor
from index_helpers import make_cache, queries

FORMATS = ["bf16", "fp8", "fp8-token", "fp8-tensor", "nvfp4", "nvfp4-auto", "mxfp4", "mxfp4-floor"]


# ---------------------------------------------------------------------------------------------------------- helpers
def tolerance(iq, cache, table, ctx):
    """Per row [B, (Q,) Hi] accumulation bound (kvtool.indexer.accumulation_tolerance) over the dequantized keys."""
    keys = [paged_keys(cache, table, int(n), b) for b, n in enumerate(ctx.tolist()) if n]
    ik = torch.cat(keys) if keys else torch.zeros(0, iq.shape[-1], device=iq.device)
    return accumulation_tolerance(iq, ik).cpu()


def assert_scores_match(got, ref, tol):
    """Same NaN / +-inf pattern; finite values within the per-row bound tol [...] (ref is [..., NB])."""
    assert got.shape == ref.shape
    got, ref = got.cpu(), ref.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN pattern differs"
    assert torch.equal(got == math.inf, ref == math.inf), "+inf pattern differs"
    assert torch.equal(got == -math.inf, ref == -math.inf), "-inf pattern differs"
    fin = torch.isfinite(ref)
    err = torch.where(fin, (got - ref).abs().double(), 0.0)
    bound = tol.reshape(*ref.shape[:-1], 1).expand_as(err)
    assert (err <= bound).all(), f"block score error {float((err - bound).max())} beyond the bound"


def assert_ids_match(got, ref, ref_scores, tol, exact=False):
    got, ref = got.cpu(), ref.cpu()
    assert got.shape == ref.shape and got.dtype == torch.int32
    assert torch.equal(got < 0, ref < 0), "k per row differs"
    if exact:
        assert torch.equal(got, ref)
    m = topk_metrics(got, ref, ref_scores.cpu(), tie_tol=tol)
    assert m.tie_aware_pct == 100.0, m


def check_decode(cache, table, ctx, iq, cfg, exact=False, tuned=False, **options):
    """decode_topk and decode_block_scores against the reference on the dequantized cache (options: launch options
    such as chunk_blocks and prefetch). Unit tests use a fixed launch (no autotuning on the GPU: fast to compile);
    tuned=True goes through the autotuned launch as production does."""
    if not tuned:
        options.setdefault("prefetch", False)
    ref_ids, ref_scores = paged_reference(iq[:, None], cache, table, ctx, cfg)
    tol = tolerance(iq, cache, table, ctx)
    ids = K.decode_topk(iq, cache, table, ctx, cfg, **options)
    assert_ids_match(ids, ref_ids[:, 0], ref_scores[:, 0], tol, exact)
    bs = K.decode_block_scores(iq, cache, table, ctx, cfg, **options)
    assert_scores_match(bs, ref_scores[:, 0], tol)
    return ids


# ------------------------------------------------------------------------------------------------------ top-k
@pytest.mark.parametrize("higher", [True, False], ids=["higher-id", "lower-id"])
def test_merge_candidates_matches_sort(higher):
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-2, 3, (7, 37), generator=g).float()
    keys[keys == -2] = -math.inf
    ids = torch.stack([torch.randperm(50, generator=g)[:37] for _ in range(7)]).to(torch.int32)
    ids[:, 30:] = -1
    ids[6] = -1
    got = merge_candidates(keys.to(DEVICE), ids.to(DEVICE), 5, higher_id=higher).cpu()
    for r in range(7):
        items = sorted(((k, i if higher else -i, i) for k, i in zip(keys[r].tolist(), ids[r].tolist()) if i >= 0),
                       reverse=True)
        want = [i for _, _, i in items[:5]]
        assert got[r].tolist() == want + [-1] * (5 - len(want))


def test_select_from_block_scores_matches_the_reference():
    """Whole block-score rows (the default top-k pass): ties, NaN, -inf inside and past the valid blocks, forced
    values, padding rows, k larger than the valid blocks; both tie rules against kvtool.indexer.select_topk."""
    from kvtool.indexer import select_topk

    g = torch.Generator().manual_seed(3)
    b, q, hi, nb, bs = 2, 5, 3, 37, 16
    scores = torch.randint(-3, 4, (b, q, hi, nb), generator=g).float()
    scores[scores == -3] = -math.inf
    scores[scores == 3] = math.nan
    scores[..., 0] = 1e30
    pos = torch.tensor([[0, 15, 16, 300, -1], [591, 100, -1, 40, 47]], dtype=torch.int32)
    for rule in ("higher-id", "lower-id"):
        cfg = IndexerConfig(block_size=bs, topk=6, tie_rule=rule)
        got = select_from_block_scores(scores.to(DEVICE), pos.to(DEVICE), bs, 6, rule != "lower-id").cpu()
        for i in range(b):
            for j in range(q):
                if pos[i, j] < 0:
                    assert (got[i, j] == -1).all()
                    continue
                want = select_topk(scores[i, j][:, None], pos[i, j:j + 1], cfg)[:, 0]
                assert torch.equal(got[i, j], want), (rule, i, j)



def _check_select(scores: torch.Tensor, pos: torch.Tensor, bs: int, topk: int, variant: str | None = None) -> None:
    """select_from_block_scores (launch `variant`) on `DEVICE` == kvtool.indexer.select_topk, row by row, for both
    tie rules."""
    from kvtool.indexer import select_topk

    b, q = pos.shape
    for rule in ("higher-id", "lower-id"):
        cfg = IndexerConfig(block_size=bs, topk=topk, tie_rule=rule)
        got = select_from_block_scores(scores.to(DEVICE), pos.to(DEVICE), bs, topk, rule != "lower-id",
                                       variant=variant).cpu()
        want = torch.stack([torch.stack([select_topk(scores[i, j][:, None], pos[i, j:j + 1], cfg)[:, 0]
                                         for j in range(q)]) for i in range(b)])
        want[pos < 0] = -1
        assert torch.equal(got, want), rule


# every select launch variant; "split8" (8-column segments, CPU only) makes the two-level path run at small rows
SELECT_TEST_VARIANTS = ["legacy", "flat", "packed", "split8", "split128"]


@pytest.fixture(params=SELECT_TEST_VARIANTS)
def select_variant(request, monkeypatch):
    from kvtool.kernels import topk as T

    monkeypatch.setitem(T.SELECT_VARIANTS, "split8", (True, 8, 1))
    return request.param


def test_select_variants_match_the_reference_with_ties_and_padding(select_variant):
    """Every launch variant: coarse scores (many exact ties), NaN, -inf inside the valid blocks, forced values,
    padding rows, k larger than the valid blocks, segment boundaries (41 blocks: 6 segments of 8, the last ragged)."""
    g = torch.Generator().manual_seed(11)
    nb = 41
    scores = torch.randint(-3, 4, (2, 3, 2, nb), generator=g).float()
    scores[scores == -3] = -math.inf
    scores[scores == 3] = math.nan
    scores[..., 0] = 1e30
    scores[..., 7:9] = 1e29  # forced values across a segment boundary
    pos = torch.tensor([[nb * 4 - 1, 17, 0], [-1, nb * 4 - 1, 35]], dtype=torch.int32)
    _check_select(scores, pos, 4, 9, select_variant)
    _check_select(scores, pos, 4, 16, select_variant)  # k past most rows' valid blocks: -1 padded


def test_select_unknown_variant_is_rejected():
    with pytest.raises(KernelArgumentError, match="unknown variant"):
        select_from_block_scores(torch.zeros(1, 1, 1, 4, device=DEVICE), torch.zeros(1, 1, dtype=torch.int32,
                                 device=DEVICE), 16, 2, variant="nope")


def test_select_orders_signed_zeros_subnormals_and_extremes(select_variant):
    """The packed (key, id) order: -0 ties +0 (the reference compares floats), subnormals of both signs, the
    largest finite values, +-inf, forced 1e30 / 1e29 and NaN (ranked -1e30, below -1e29 but above -inf)."""
    vals = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, 3.4e38, -3.4e38, math.inf, -math.inf, 1e30, 1e29,
                         math.nan, -1e29, -1e30, 1.0, -1.0, 1.0000001, 0.9999999])
    g = torch.Generator().manual_seed(5)
    nb = 41
    scores = vals[torch.randint(0, len(vals), (2, 3, 2, nb), generator=g)]
    scores[0, 0, 0] = -0.0
    scores[0, 0, 0, ::3] = 0.0  # a row of signed zeros only: ids decide
    scores[0, 0, 1] = -math.inf  # a row of -inf only: still selectable, by id
    pos = torch.tensor([[nb * 4 - 1, 17, 0], [-1, nb * 4 - 1, 63]], dtype=torch.int32)
    _check_select(scores, pos, 4, 9, select_variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["flat", "packed", "split128", "split256", "split512"])
@pytest.mark.parametrize("nb", [64, 1172, 2048, 2049, 16384])
def test_select_gpu_wide_rows(nb, variant):
    """M3-size rows (150K tokens = 1172 blocks, the 2048 / 2049 warp boundary, the 16384-block maximum) with many
    near-ties (scores on a coarse grid), 64 x 4 rows against the reference."""
    g = torch.Generator().manual_seed(nb)
    scores = (torch.randn(8, 1, 4, nb, generator=g) * 4).round() / 4
    scores[..., 0] = 1e30
    scores[..., -1] = 1e29
    pos = torch.randint(0, nb * 128, (8, 1), generator=g, dtype=torch.int32)
    pos[0, 0] = nb * 128 - 1
    _check_select(scores, pos, 128, 16, variant)


# --------------------------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("label", FORMATS)
def test_decode_ragged_small_blocks(label):
    """Contexts around block edges (block 32, pages of 16: a tile spans two pages), an empty row, forced init and
    local blocks, and 2-block programs so that the merge sees many candidate lists."""
    ctx = [1, 31, 32, 33, 34, 0, 129, 200]
    cache, table, cl, _ = make_cache(label, ctx, page=16)
    iq = queries(len(ctx), 4, 128)
    cfg = IndexerConfig(block_size=32, topk=4, init_blocks=1, local_blocks=2)
    ids = check_decode(cache, table, cl, iq, cfg, chunk_blocks=2)
    assert (ids[5] == -1).all()  # zero-length row
    assert (ids[0, :, 0] == 0).all() and (ids[0, :, 1:] == -1).all()


@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["pipelined", "prefetch"])
def test_decode_real_block_size(label, prefetch):
    """M3 geometry: 128-token blocks, top-16, 4 heads, D = 128, pages of 64 tokens (two tiles per block), through
    both loop variants (the compiler's pipelining, the register double buffer)."""
    ctx = [1, 127, 128, 129, 130, 513, 2100]
    cache, table, cl, _ = make_cache(label, ctx, page=64, seed=2)
    check_decode(cache, table, cl, queries(len(ctx), 4, 128, seed=3), IndexerConfig(), prefetch=prefetch)


def test_decode_token_scores():
    ctx = [3, 40, 0]
    cache, table, cl, _ = make_cache("nvfp4", ctx, page=16)
    iq = queries(3, 4, 128)
    got = K.decode_scores(iq, cache, table, cl, prefetch=True).cpu()
    assert got.shape == (3, 4, 40)
    tol = tolerance(iq, cache, table, cl)
    for b, n in enumerate(ctx):
        assert torch.isinf(got[b, :, n:]).all()
        if n:
            want = token_scores(iq[b][:, None].cpu(), paged_keys(cache, table, n, b).cpu(), [n - 1])[:, 0]
            assert ((got[b, :, :n] - want).abs() <= tol[b][:, None]).all()


@pytest.mark.parametrize("chunk", [4, 16, None], ids=["merge-orders", "program-orders", "two-pass"])
@pytest.mark.parametrize("tie_rule", ["higher-id", "lower-id"])
def test_decode_all_zero_queries_total_ties(tie_rule, chunk):
    """Every block scores 0: the tie rule alone decides, in the per-program selection (16 blocks per program, 5
    kept), in the merge (4 blocks per program, all kept), and in the default select over whole rows."""
    ctx = [70, 300, 17]
    cache, table, cl, _ = make_cache("mxfp4", ctx, page=32)
    iq = torch.zeros(3, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    cfg = IndexerConfig(block_size=16, topk=5, tie_rule=tie_rule)
    options = {"chunk_blocks": 4} if chunk is None else {"chunk_blocks": chunk, "in_kernel_topk": True}
    check_decode(cache, table, cl, iq, cfg, exact=True, **options)


@pytest.mark.parametrize("label", ["bf16", "fp8-token", "nvfp4", "mxfp4"])
def test_in_kernel_topk_candidates_and_merge(label):
    """The in-register candidate path (in_kernel_topk): many 2-block programs merged, decode and causal prefill."""
    ctx = [1, 33, 0, 129, 300]
    cache, table, cl, _ = make_cache(label, ctx, page=16, seed=30)
    cfg = IndexerConfig(block_size=16, topk=4, init_blocks=1, local_blocks=2)
    check_decode(cache, table, cl, queries(len(ctx), 4, 128, seed=31), cfg, chunk_blocks=2, in_kernel_topk=True)
    iq = queries(len(ctx), 4, 128, seed=32, q=6)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg)
    ids = K.prefill_topk(iq, cache, table, cl, cfg, q_tile=2, chunk_blocks=2, prefetch=False, in_kernel_topk=True)
    assert_ids_match(ids, ref_ids, ref_scores, tolerance(iq, cache, table, cl))


@pytest.mark.parametrize("label", ["bf16", "fp8", "fp8-token", "nvfp4", "mxfp4", "mxfp4-floor"])
def test_head_dim_64_three_heads(label):
    """A smaller index head (D = 64, the smollm2 capture's) with 3 index heads (rows padded to 4): decode and causal
    prefill at scattered positions. FP4 runs the byte decode below D = 128 (kernels.index_score.MIN_WORDS_DIM)."""
    ctx = [200, 17, 0, 90]
    cache, table, cl, _ = make_cache(label, ctx, page=16, dim=64, seed=33)
    cfg = IndexerConfig(block_size=16, topk=4)
    opts = {}
    check_decode(cache, table, cl, queries(len(ctx), 3, 64, seed=34), cfg, **opts)
    iq = queries(len(ctx), 3, 64, seed=35, q=8)
    pos = torch.tensor([[0, 15, 16, 50, 100, 150, 190, 199], [0, 1, 2, 3, 16, -1, -1, -1], [-1] * 8,
                        [89, 0, 44, 45, 46, 47, 63, 64]], dtype=torch.int32, device=DEVICE)
    tol = tolerance(iq, cache, table, cl)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg, q_pos=pos)
    assert_ids_match(K.prefill_topk(iq, cache, table, cl, cfg, q_pos=pos, prefetch=False, **opts), ref_ids, ref_scores,
                     tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, q_pos=pos, prefetch=True, **opts),
                        ref_scores, tol)


@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_decode_nonfinite_keys(label):
    """NaN and Inf reach a cache only as raw bytes (quantize refuses them): bf16 Inf/NaN values, E4M3 0x7F, NVFP4
    scale 0x7F, MXFP4 scale 255. Inf * 0 and Inf - Inf give NaN scores; NaN blocks rank last (as -1e30)."""
    ctx = [96, 64]
    cache, table, cl, slots = make_cache(label, ctx, page=16, seed=5)
    payload, scale = cache.payload_plane(), cache.scale_plane()
    for tok in (3, 40, 41, 70):  # blocks 0, 2 (two tokens) and 4 of request 0 (block size 16)
        page, off = int(slots[0][tok]) // 16, int(slots[0][tok]) % 16
        if label == "bf16":
            row = payload[page, 0, off].view(torch.bfloat16)
            row[0], row[5] = (math.inf, -math.inf) if tok != 70 else (math.nan, 1.0)
        elif label == "fp8":
            payload[page, 0, off, 7] = 0x7F
        else:
            scale[page, 0, off, 1] = 255 if label == "mxfp4" else 0xFF
    iq = queries(2, 4, 128, seed=6)
    iq[0, 1, 5] = 0  # head 1 of request 0: the inf lane meets a zero query element
    cfg = IndexerConfig(block_size=16, topk=6)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=2)


@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_decode_warp_partials(label):
    """Two-pass top-k with per-warp partial block maxima (4 parts of a 64-token tile, 2 of a 32-token one): the same
    ids as the reference; a NaN token (bf16 keys) makes only its part NaN, and the select pass must still rank the
    whole block NaN; forced blocks; every select variant reads the parts."""
    ctx = [300, 129, 0, 64]
    cache, table, cl, slots = make_cache(label, ctx, page=64, seed=21)
    if label == "bf16":
        for tok in (70, 200):  # one token of blocks 1 and 3 of request 0 (one part each)
            page, off = int(slots[0][tok]) // 64, int(slots[0][tok]) % 64
            cache.payload_plane()[page, 0, off].view(torch.bfloat16)[3] = math.nan
    iq = queries(len(ctx), 4, 128, seed=22)
    for bs, variant in ((64, None), (64, "split8"), (32, "packed")):
        cfg = IndexerConfig(block_size=bs, topk=4, init_blocks=1, local_blocks=1)
        ref_ids, ref_scores = paged_reference(iq[:, None], cache, table, cl, cfg)
        tol = tolerance(iq, cache, table, cl)
        from kvtool.kernels import topk as T

        T.SELECT_VARIANTS.setdefault("split8", (True, 8, 1))
        ids = K.decode_topk(iq, cache, table, cl, cfg, prefetch=False, warp_partials=True, select=variant)
        assert_ids_match(ids, ref_ids[:, 0], ref_scores[:, 0], tol)


def test_decode_minus_inf_blocks_are_selected_when_valid():
    """Blocks whose every score is -inf still count as valid: with fewer finite blocks than k they are selected, in
    the tie order, before any invalid block."""
    ctx = [80]
    cache, table, cl, slots = make_cache("bf16", ctx, page=16)
    for tok in range(16, 64):  # blocks 1, 2, 3 (block 16): every score is -inf for q[0] > 0
        page, off = int(slots[0][tok]) // 16, int(slots[0][tok]) % 16
        cache.payload_plane()[page, 0, off].view(torch.bfloat16)[0] = -math.inf
    iq = queries(1, 4, 128, seed=7)
    iq[..., 0] = iq[..., 0].abs() + 0.5
    for rule in ("higher-id", "lower-id"):
        ids = check_decode(cache, table, cl, iq, IndexerConfig(16, 5, tie_rule=rule), exact=True)
        assert sorted(ids[0, 0].tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("label,fp4_words", [("nvfp4", None), ("nvfp4", False), ("mxfp4", None), ("mxfp4", False),
                                             ("mxfp4-floor", None), ("fp8-token", None)])
def test_decode_edge_case_keys(label, fp4_words):
    """The shared edge-case table (ties, zero blocks, saturation, subnormal scales, tiny/huge amax) as index keys."""
    keys = edge_case_tensor(128)
    keys = keys / keys.abs().amax(-1, keepdim=True).clamp(min=1e-30)  # keep fp32 scores finite (amax up to 1e38)
    keys = keys * torch.logspace(-6, 6, keys.shape[0])[:, None]
    n = keys.shape[0]
    cache, table, cl, _ = make_cache(label, [n], page=16, keys=[keys[:, None]])
    opts = {} if fp4_words is None else {"fp4_words": fp4_words}  # False: the byte decode at D = 128
    check_decode(cache, table, cl, queries(1, 4, 128, seed=8), IndexerConfig(16, 4), chunk_blocks=2, **opts)


# ----------------------------------------------------------------------------------------- lean loop bookkeeping
def poison_unused_slots(cache, table, ctx):
    """Fill every slot past each request's context in its pages with bytes that would change any score they reach:
    payload 0x77 (large E2M1 / E4M3 / bf16 values) and NaN scale codes (E4M3 0x7F, E8M0 0xFF; fp32 row scales get
    NaN bytes 0xFF). The LEAN scorer reads whole tiles of a valid page, so these bytes enter its dots and must be
    masked out of the scores."""
    page = cache.page_size
    pay, sc = cache.payload_plane(), cache.scale_plane()
    for b, n in enumerate(ctx.tolist()):
        for p_idx in range(table.shape[1]):
            pg = int(table[b, p_idx])
            first = max(0, n - p_idx * page)
            if pg < 0 or first >= page:
                continue
            pay[pg, 0, first:] = 0x77
            if sc.numel():
                sc[pg, 0, first:] = 0xFF if cache.fmt.scale_element in ("e8m0", "fp32-row") else 0x7F


def poisoned_cache(label, ctx, page, seed):
    """make_cache with every slot past each context poisoned (`poison_unused_slots`): (cache, table, ctx, slots)."""
    cache, table, cl, slots = make_cache(label, ctx, page=page, seed=seed)
    poison_unused_slots(cache, table.cpu(), cl.cpu())
    return cache, table, cl, slots


def poisoned_prefill(label, seed):
    """A causal prefill case on a poisoned cache (contexts 70 and 33, 16-token pages and blocks, 5 queries of 4
    heads, top-3, one forced init block): (cache, table, ctx, iq, cfg, reference ids, reference scores, bound)."""
    cache, table, cl, _ = poisoned_cache(label, [70, 33], page=16, seed=seed)
    iq = queries(2, 4, 128, seed=seed + 1, q=5)
    cfg = IndexerConfig(block_size=16, topk=3, init_blocks=1, local_blocks=0)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg)
    return cache, table, cl, iq, cfg, ref_ids, ref_scores, tolerance(iq, cache, table, cl)


LEAN_CASES = {  # (page, block): tiles of whole pages (16 / 64) and tiles of a quarter page (t0 % PAGE != 0)
    "tile=page16": (16, 32), "tile=page64": (64, 64), "tile<page": (64, 16)}


@pytest.mark.parametrize("case", list(LEAN_CASES))
@pytest.mark.parametrize("label", ["bf16", "fp8", "fp8-token", "nvfp4", "mxfp4"])
def test_decode_lean(label, case):
    """LEAN loop bookkeeping (loads masked per page, token masks only on partial tiles, column scale after the block
    max): the same ids and block scores as the reference, with poisoned bytes past every context in its last page
    (without forced local blocks, so that the partial last tile decides a block), ragged contexts over tile and page
    edges, an empty row, forced blocks; both loop kinds; warp partials (64-token tiles: 4 parts) and the block max."""
    page, bs = LEAN_CASES[case]
    ctx = [1, 31, 32, 33, 0, 129, 200]
    cache, table, cl, _ = poisoned_cache(label, ctx, page=page, seed=60)
    iq = queries(len(ctx), 4, 128, seed=61)
    # no forced local blocks first: the partial last tile of each context decides its block's score
    cfg = IndexerConfig(block_size=bs, topk=4, init_blocks=0, local_blocks=0)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=2, lean=True)
    # forced blocks (written after the loop) across 2-block programs, with warp partials; then the block max
    cfg = IndexerConfig(block_size=bs, topk=4, init_blocks=2, local_blocks=3)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=2, lean=True)
    cfg = IndexerConfig(block_size=bs, topk=4, init_blocks=1, local_blocks=2)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=8, lean=True, prefetch=True, warp_partials=False)


@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_decode_not_lean(label):
    """The per-token-masked loop (lean=False, the default before LEAN) on the same poisoned, ragged cache."""
    cache, table, cl, _ = poisoned_cache(label, [1, 33, 0, 129, 200], page=64, seed=62)
    iq = queries(5, 4, 128, seed=63)
    check_decode(cache, table, cl, iq, IndexerConfig(block_size=64, topk=4, init_blocks=0, local_blocks=0),
                 chunk_blocks=2, lean=False)
    check_decode(cache, table, cl, iq, IndexerConfig(block_size=64, topk=4, init_blocks=1, local_blocks=2),
                 chunk_blocks=2, lean=False, warp_partials=True)


@pytest.mark.parametrize("label", ["fp8", "nvfp4", "mxfp4"])
def test_prefill_lean(label):
    """LEAN in prefill (per-row causal masks on every tile) with poisoned bytes past the context."""
    cache, table, cl, iq, cfg, ref_ids, ref_scores, tol = poisoned_prefill(label, seed=62)
    assert_ids_match(K.prefill_topk(iq, cache, table, cl, cfg, prefetch=False, lean=True), ref_ids, ref_scores, tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, prefetch=True, lean=True), ref_scores, tol)


# ------------------------------------------------------------------------------------- two tiles per iteration
def poison_nan_token(cache, slots, b, tok):
    """Make token tok of request b score NaN: a NaN scale code (E4M3 0x7F, E8M0 0xFF, fp32 row NaN bytes) or, for
    bf16 / fp8 without scales, a NaN payload element (bf16 NaN, E4M3 0x7F)."""
    page, off = int(slots[b][tok]) // cache.page_size, int(slots[b][tok]) % cache.page_size
    if cache.fmt.scale_element in ("e4m3", "e8m0", "fp32-row"):
        cache.scale_plane()[page, 0, off, :] = 0xFF if cache.fmt.scale_element != "e4m3" else 0x7F
    elif cache.fmt.family == "bf16":
        cache.payload_plane()[page, 0, off].view(torch.bfloat16)[3] = math.nan
    else:
        cache.payload_plane()[page, 0, off, 3] = 0x7F


@pytest.mark.parametrize("case", list(LEAN_CASES))
@pytest.mark.parametrize("label", ["bf16", "fp8", "fp8-token", "nvfp4", "mxfp4"])
def test_decode_tile_pairs(label, case):
    """tile_pairs (two tiles per loop iteration, an odd tail tile after the loop; where a tile is a block, both
    blocks written by one store): the reference's ids and block scores on the LEAN test's poisoned ragged cache
    (contexts over tile / page edges, an empty row), a NaN token inside a context, programs of 1 .. 8 tiles (odd and
    even counts, so that both the pair loop and the tail run), forced blocks, warp partials and the block max, both
    loop kinds."""
    page, bs = LEAN_CASES[case]
    ctx = [1, 31, 32, 33, 0, 129, 200]
    cache, table, cl, slots = poisoned_cache(label, ctx, page=page, seed=70)
    poison_nan_token(cache, slots, 6, 150)
    iq = queries(len(ctx), 4, 128, seed=71)
    cfg = IndexerConfig(block_size=bs, topk=4, init_blocks=0, local_blocks=0)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=4, lean=True, tile_pairs=True)
    cfg = IndexerConfig(block_size=bs, topk=4, init_blocks=2, local_blocks=3)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=8, lean=True, tile_pairs=True, warp_partials=True)
    cfg = IndexerConfig(block_size=bs, topk=4, init_blocks=1, local_blocks=2)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=2, lean=True, tile_pairs=True, prefetch=True,
                 warp_partials=False, max_registers=128)  # the register cap is a no-op in the interpreter


@pytest.mark.parametrize("label", ["fp8", "nvfp4", "mxfp4"])
def test_prefill_tile_pairs(label):
    """tile_pairs in prefill (per-row causal masks on both tiles of a pair) and without LEAN, poisoned bytes past
    the context: the reference's ids and block scores."""
    cache, table, cl, iq, cfg, ref_ids, ref_scores, tol = poisoned_prefill(label, seed=72)
    assert_ids_match(K.prefill_topk(iq, cache, table, cl, cfg, prefetch=False, lean=True, tile_pairs=True,
                                    chunk_blocks=8), ref_ids, ref_scores, tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, prefetch=False, lean=True,
                                               tile_pairs=True, chunk_blocks=4), ref_scores, tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, prefetch=False, lean=False,
                                               tile_pairs=True, chunk_blocks=8), ref_scores, tol)


@pytest.mark.parametrize("label", ["bf16", "fp8", "fp8-token", "nvfp4", "mxfp4"])
def test_prefill_q_major(label):
    """Query-major dots (q_major: Q x K^T, so a row's token maxima reduce inside a thread quad) in prefill: the
    reference's ids and block scores on the poisoned cache, with and without LEAN, with tile pairs and with the
    register double buffer; the prefill select variants (several rows per program) pick the same ids."""
    cache, table, cl, iq, cfg, ref_ids, ref_scores, tol = poisoned_prefill(label, seed=74)
    assert_ids_match(K.prefill_topk(iq, cache, table, cl, cfg, q_major=True, prefetch=False, lean=True), ref_ids,
                     ref_scores, tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, q_major=True, prefetch=True, lean=False,
                                               chunk_blocks=2), ref_scores, tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, q_major=True, prefetch=False, lean=True,
                                               tile_pairs=True, chunk_blocks=4), ref_scores, tol)
    base = K.prefill_topk(iq, cache, table, cl, cfg, prefetch=False)
    for variant in ("packedR2", "packedR4", "packedR8"):
        assert torch.equal(K.prefill_topk(iq, cache, table, cl, cfg, prefetch=False, select=variant), base), variant


@pytest.mark.parametrize("label", ["fp8", "fp8-tensor", "nvfp4", "nvfp4-auto", "mxfp4", "mxfp4-floor"])
def test_prefill_decode_once(label):
    """decode_once (the keys decoded to a bf16 copy of the chunk's pages, then the bf16 scorer; the outer / tensor
    scale multiplies the scores): the reference's ids and block scores on the poisoned cache (NaN codes and garbage
    past every context), with a -1 and an out-of-range table entry inside a context (masked like the kernel's own
    path) and a padding query row (q_pos -1)."""
    cache, table, cl, iq, cfg, ref_ids, ref_scores, tol = poisoned_prefill(label, seed=80)
    assert_ids_match(K.prefill_topk(iq, cache, table, cl, cfg, decode_once=True), ref_ids, ref_scores, tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, decode_once=True, q_major=True,
                                               prefetch=False), ref_scores, tol)
    holed = table.clone()
    holed[0, 1], holed[0, 3] = -1, cache.num_pages + 7  # tokens 16..31 and 48..63 of request 0: no page
    pos = torch.tensor([[3, 20, 40, -1, 69], [0, 8, 16, 31, 32]], dtype=torch.int32, device=iq.device)
    want = K.prefill_block_scores(iq, cache, holed, cl, cfg, q_pos=pos, prefetch=False)
    got = K.prefill_block_scores(iq, cache, holed, cl, cfg, q_pos=pos, decode_once=True)
    assert_scores_match(got, want, tol)
    assert torch.equal(K.prefill_topk(iq, cache, holed, cl, cfg, q_pos=pos, decode_once=True),
                       K.prefill_topk(iq, cache, holed, cl, cfg, q_pos=pos, prefetch=False))


def test_prefill_decode_once_default_rule(monkeypatch):
    """Where a prefill launch decodes its keys once by default (on CUDA, simulated): FP4 and unit / tensor-scaled fp8
    keys from DECODE_ONCE_MIN_QUERIES queries, unless a kernel variant option is given; never bf16 or fp8 row
    scales; the option decides when given."""
    monkeypatch.setattr(K, "_cuda_defaults", lambda device: True)
    n = K.DECODE_ONCE_MIN_QUERIES
    dev = torch.device("cpu")
    for label, fits in (("nvfp4", True), ("mxfp4", True), ("fp8", True), ("fp8-tensor", True), ("bf16", False),
                        ("fp8-token", False)):
        cache, _, _, _ = make_cache(label, [16], page=16)
        assert K._decode_once_applies(cache, n, dev, {}) is fits, label
        assert K._decode_once_applies(cache, n - 1, dev, {}) is False, label
        assert K._decode_once_applies(cache, n, dev, {"num_warps": 4}) is False, label
        assert K._decode_once_applies(cache, n, dev, {"decode_once": False}) is False, label
        if fits:
            assert K._decode_once_applies(cache, 2, dev, {"decode_once": True}) is True, label
    monkeypatch.setattr(K, "_cuda_defaults", lambda device: False)
    cache, _, _, _ = make_cache("nvfp4", [16], page=16)
    assert K._decode_once_applies(cache, n, dev, {}) is False  # not on CUDA: the kernel decodes


def test_prefill_decode_once_refuses_keys_it_cannot_copy_exactly():
    """bf16 keys need no decode and fp8 row scales do not fit a bf16 copy exactly: decode_once=True is an error."""
    for label in ("bf16", "fp8-token"):
        cache, table, cl, _ = make_cache(label, [40], page=16)
        with pytest.raises(KernelArgumentError, match="decode_once"):
            K.prefill_topk(queries(1, 4, 128, q=4), cache, table, cl, IndexerConfig(block_size=16, topk=2),
                           decode_once=True)


@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_decode_q_major(label):
    """q_major in decode (one query row per program, padded to the 16 rows a dot needs) on the LEAN test's poisoned
    ragged cache: the reference's ids and block scores."""
    cache, table, cl, _ = poisoned_cache(label, [1, 31, 32, 33, 0, 129, 200], page=16, seed=76)
    iq = queries(7, 4, 128, seed=77)
    cfg = IndexerConfig(block_size=32, topk=4, init_blocks=1, local_blocks=2)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=2, lean=True, q_major=True)


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["fp8", "nvfp4", "mxfp4"])
def test_gpu_decode_tile_pairs(label):
    """tile_pairs at engine geometry (128-token pages and blocks, 4 heads, top-16) up to 150K, poisoned bytes past
    every context, a NaN token: the autotuned launch with the default forced blocks, then the pipelined loop at 3
    and 5 stages without forced local blocks (the partial last tile decides a block), and the prefetch loop."""
    ctx = [150_000, 1, 8192, 0, 70_001, 129, 40_000, 128, 255]
    cache, table, cl, slots = poisoned_cache(label, ctx, page=128, seed=74)
    poison_nan_token(cache, slots, 0, 77_777)
    iq = queries(len(ctx), 4, 128, seed=75)
    check_decode(cache, table, cl, iq, IndexerConfig(), tuned=True, tile_pairs=True)
    cfg = IndexerConfig(init_blocks=2, local_blocks=0)
    for stages in (3, 5):
        check_decode(cache, table, cl, iq, cfg, tile_pairs=True, prefetch=False, num_stages=stages, num_warps=4)
    check_decode(cache, table, cl, iq, cfg, tile_pairs=True, prefetch=False, num_stages=3, num_warps=4,
                 max_registers=128)
    check_decode(cache, table, cl, iq, cfg, tile_pairs=True, prefetch=True, num_stages=1, num_warps=4,
                 warp_partials=False)


# ------------------------------------------------------------------------------------------ FP4 post-scaled dot
POST_VARIANTS = {"scale-in-decode": {"post_scale": False}, "post": {"post_scale": True},
                 "post-prefetch": {"post_scale": True, "prefetch": True}}


@pytest.mark.parametrize("variant", list(POST_VARIANTS))
@pytest.mark.parametrize("label", ["nvfp4", "nvfp4-auto", "mxfp4", "mxfp4-floor"])
def test_decode_post_scale_variants(label, variant):
    """The FP4 word decode with block scales on the decoded elements and with POST_SCALE (partial scores of the
    block-diagonal query, then the block scales; by default for mxfp4 at 4 heads, forced here for nvfp4 too):
    ragged contexts over page and tile edges, an empty row, forced blocks, 2-block programs merged, and one program
    over the whole context."""
    opts = POST_VARIANTS[variant]
    ctx = [1, 31, 32, 33, 0, 129, 200]
    cache, table, cl, _ = make_cache(label, ctx, page=16, seed=40)
    iq = queries(len(ctx), 4, 128, seed=41)
    cfg = IndexerConfig(block_size=32, topk=4, init_blocks=1, local_blocks=2)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=2, **opts)
    check_decode(cache, table, cl, iq, cfg, chunk_blocks=8, in_kernel_topk=True, **opts)


@pytest.mark.parametrize("label", ["nvfp4", "mxfp4"])
def test_post_scale_block_scale_extremes(label):
    """POST_SCALE multiplies fp32 partial scores by the decoded block scales: NaN scale codes (E4M3 0x7F / 0xFF, E8M0
    255) give NaN blocks, zero / subnormal E4M3 scales, E8M0 0 (2**-127) and 250 (2**123: keys up to 2**123, whose
    products with the queries stay finite in the reference)
    stay on the reference, all-zero payloads under huge scales score 0, one head and 3 heads (padding rows)."""
    ctx = [96, 48]
    g = torch.Generator().manual_seed(42)
    keys = [torch.randn(n, 1, 128, generator=g) for n in ctx]
    cache, table, cl, slots = make_cache(label, ctx, page=16, seed=43, keys=keys)
    payload, scale = cache.payload_plane(), cache.scale_plane()
    codes = {"nvfp4": [0x7F, 0xFF, 0x00, 0x01, 0x07, 0x7E], "mxfp4": [255, 0, 1, 250, 130, 127]}[label]
    for i, tok in enumerate((3, 17, 33, 50, 70, 90)):
        page, off = int(slots[0][tok]) // 16, int(slots[0][tok]) % 16
        blk = i % scale.shape[-1]
        scale[page, 0, off, blk] = codes[i]
        if codes[i] in (250, 0x7E):  # a huge block scale: the token's only nonzero payload byte in that block
            payload[page, 0, off] = 0
            payload[page, 0, off, blk * cache.fmt.block // 2] = 0x21
    page, off = int(slots[1][5]) // 16, int(slots[1][5]) % 16
    payload[page, 0, off] = 0  # an all-zero token under the largest scales
    scale[page, 0, off] = 0x7E if label == "nvfp4" else 254
    cfg = IndexerConfig(block_size=16, topk=6)
    for hi in (4, 1, 3):
        iq = queries(2, hi, 128, seed=44 + hi)
        check_decode(cache, table, cl, iq, cfg, chunk_blocks=2, post_scale=True)
    with pytest.raises(KernelArgumentError):  # prefill tiles of 16 queries x 4 heads x blocks: too many dot rows
        K.prefill_topk(queries(2, 4, 128, q=16), cache, table, cl, cfg, post_scale=True)


# -------------------------------------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_prefill_causal_chunk(label):
    ctx = [5, 70, 0, 33]
    cache, table, cl, _ = make_cache(label, ctx, page=16, seed=9)
    iq = queries(4, 4, 128, seed=10, q=8)
    cfg = IndexerConfig(block_size=16, topk=4, init_blocks=1)
    tol = tolerance(iq, cache, table, cl)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg)
    ids = K.prefill_topk(iq, cache, table, cl, cfg, q_tile=4, chunk_blocks=2, prefetch=label in ("fp8", "mxfp4"))
    assert_ids_match(ids, ref_ids, ref_scores, tol)
    assert_scores_match(K.prefill_block_scores(iq, cache, table, cl, cfg, prefetch=False), ref_scores, tol)
    pos = torch.tensor([[0, 1, 2, 3, 4, -1, -1, -1], [69, 0, 10, 50, 60, 15, 16, 17], [-1] * 8,
                        [32, 31, 30, 0, 1, 2, 3, 4]], dtype=torch.int32, device=DEVICE)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg, q_pos=pos)
    ids = K.prefill_topk(iq, cache, table, cl, cfg, q_pos=pos, prefetch=True)
    assert_ids_match(ids, ref_ids, ref_scores, tol)


def test_prefill_real_block_size():
    ctx = [700, 130]
    cache, table, cl, _ = make_cache("nvfp4", ctx, page=128, seed=11)
    iq = queries(2, 4, 128, seed=12, q=20)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, IndexerConfig())
    ids = K.prefill_topk(iq, cache, table, cl, IndexerConfig(), prefetch=False)
    assert_ids_match(ids, ref_ids, ref_scores, tolerance(iq, cache, table, cl))


# ------------------------------------------------------------------------------------------------------ arguments
def test_launcher_rejects_bad_arguments():
    cache, table, cl, _ = make_cache("nvfp4", [20], page=16)
    iq = queries(1, 4, 128)
    with pytest.raises(KernelArgumentError):
        K.decode_topk(iq.float(), cache, table, cl)
    with pytest.raises(KernelArgumentError):
        K.decode_topk(iq, cache, table.long(), cl)
    with pytest.raises(KernelArgumentError):
        K.decode_topk(iq[..., :64], cache, table, cl)
    with pytest.raises(KernelArgumentError):
        K.decode_topk(iq, cache, table, cl, IndexerConfig(block_size=24))
    with pytest.raises(KernelArgumentError):
        K.prefill_topk(iq[:, None], cache, table, cl, q_pos=torch.tensor([[20]], device=DEVICE))
    with pytest.raises(KernelArgumentError):
        K.decode_topk(iq, cache, table, cl, num_programs=3)
    odd, table2, cl2, _ = make_cache("nvfp4", [20], page=24)
    with pytest.raises(KernelArgumentError):
        K.decode_topk(iq, odd, table2, cl2)  # page size not a power of two
    small, table3, cl3, _ = make_cache("nvfp4", [20], page=16, dim=16)
    with pytest.raises(KernelArgumentError):
        K.decode_topk(queries(1, 4, 16), small, table3, cl3)  # FP4 dots need D / 2 >= 16
    mid, table4, cl4, _ = make_cache("mxfp4", [20], page=16, dim=64)
    with pytest.raises(KernelArgumentError):
        K.decode_topk(queries(1, 4, 64), mid, table4, cl4, fp4_words=True)  # word decode: D >= MIN_WORDS_DIM


# ------------------------------------------------------------------------------------------------------ GPU sizes
@pytest.mark.gpu
@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4", "fp8-token", "nvfp4-auto"])
def test_gpu_decode_long_contexts(label):
    ctx = [150_000, 1, 8192, 131_073, 0, 262_144, 4097, 129]
    cache, table, cl, _ = make_cache(label, ctx, page=128, seed=13)
    check_decode(cache, table, cl, queries(len(ctx), 4, 128, seed=14), IndexerConfig(), tuned=True)


@pytest.mark.gpu
@pytest.mark.parametrize("wp", [False, True], ids=["block-max", "warp-partials"])
@pytest.mark.parametrize("select", ["flat", "packed", "split256"])
@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_gpu_decode_select_and_partials(label, select, wp):
    """The autotuned scorer with each select variant, with and without warp partial maxima, at long contexts."""
    ctx = [150_000, 1, 8192, 131_073, 0, 4097, 129]
    cache, table, cl, _ = make_cache(label, ctx, page=128, seed=17)
    iq = queries(len(ctx), 4, 128, seed=18)
    cfg = IndexerConfig()
    ref_ids, ref_scores = paged_reference(iq[:, None], cache, table, cl, cfg)
    ids = K.decode_topk(iq, cache, table, cl, cfg, warp_partials=wp, select=select)
    assert_ids_match(ids, ref_ids[:, 0], ref_scores[:, 0], tolerance(iq, cache, table, cl))


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["bf16", "fp8", "fp8-token", "nvfp4", "nvfp4-auto", "mxfp4"])
def test_gpu_decode_lean(label):
    """LEAN at engine geometry (128-token pages and blocks, 4 heads, top-16) up to 150K, poisoned bytes past every
    context: the autotuned launch with the default forced blocks, then both fixed loop kinds without forced local
    blocks (the partial last tile decides a block), with and without warp partials."""
    ctx = [150_000, 1, 8192, 0, 70_001, 129, 40_000, 128]
    cache, table, cl, _ = poisoned_cache(label, ctx, page=128, seed=64)
    iq = queries(len(ctx), 4, 128, seed=65)
    check_decode(cache, table, cl, iq, IndexerConfig(), tuned=True, lean=True)
    cfg = IndexerConfig(init_blocks=2, local_blocks=0)
    check_decode(cache, table, cl, iq, cfg, lean=True, prefetch=False, num_stages=5, num_warps=4)
    check_decode(cache, table, cl, iq, cfg, lean=True, prefetch=True, num_stages=1, num_warps=4,
                 warp_partials=False)


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["fp8", "nvfp4", "mxfp4"])
def test_gpu_prefill_lean(label):
    ctx = [4096, 3001]
    cache, table, cl, _ = poisoned_cache(label, ctx, page=128, seed=66)
    iq = queries(2, 4, 128, seed=67, q=512)
    cfg = IndexerConfig(local_blocks=0)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg)
    ids = K.prefill_topk(iq, cache, table, cl, cfg, lean=True)
    assert_ids_match(ids, ref_ids, ref_scores, tolerance(iq, cache, table, cl))


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_gpu_decode_topk_graph_replay(label):
    """Decode top-k captured in a CUDA graph, as engines run it (positions from the context lengths inside the
    scorer, POS_CTX): replays equal the eager ids after the context lengths change in place, and the eager ids match
    the reference, at batch 64 with ragged contexts up to 64K and an empty row."""
    gen = torch.Generator().manual_seed(70)
    ctx = [int(x) for x in torch.randint(1, 65_536, (64,), generator=gen)]
    ctx[3], ctx[9] = 0, 65_536
    cache, table, cl, _ = make_cache(label, ctx, page=128, seed=71)
    iq = queries(64, 4, 128, seed=72)
    cfg = IndexerConfig()
    ref_ids, ref_scores = paged_reference(iq[:, None], cache, table, cl, cfg)
    assert_ids_match(K.decode_topk(iq, cache, table, cl, cfg), ref_ids[:, 0], ref_scores[:, 0],
                     tolerance(iq, cache, table, cl))
    lens = cl.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.decode_topk(iq, cache, table, lens, cfg)
    shorter = torch.clamp(cl - torch.randint(0, 3000, (64,), generator=gen).to(cl), min=0)
    for now in (cl, shorter, cl):
        lens.copy_(now)
        out.fill_(-7)
        graph.replay()
        assert torch.equal(out, K.decode_topk(iq, cache, table, now, cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_gpu_decode_batch64(label):
    ctx = [int(x) for x in torch.randint(1, 40_000, (64,), generator=torch.Generator().manual_seed(15))]
    cache, table, cl, _ = make_cache(label, ctx, page=64, seed=16)
    check_decode(cache, table, cl, queries(64, 4, 128, seed=17), IndexerConfig(), tuned=True)


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4", "nvfp4-auto", "mxfp4-floor"])
@pytest.mark.parametrize("page", [16, 64])
def test_gpu_head_dim_64(label, page):
    """D = 64, 3 index heads (smollm2's index geometry) at 16- and 64-token tiles: decode at batch 16 and a causal
    prefill chunk, through the autotuned launch."""
    g = torch.Generator().manual_seed(36)
    ctx = [int(x) for x in torch.randint(1, 6000, (16,), generator=g)]
    cache, table, cl, _ = make_cache(label, ctx, page=page, dim=64, seed=37)
    cfg = IndexerConfig(block_size=64, topk=8)
    check_decode(cache, table, cl, queries(16, 3, 64, seed=38), cfg, tuned=True)
    iq = queries(16, 3, 64, seed=39, q=48)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg)
    ids = K.prefill_topk(iq, cache, table, cl, cfg)
    assert_ids_match(ids, ref_ids, ref_scores, tolerance(iq, cache, table, cl))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(POST_VARIANTS))
@pytest.mark.parametrize("label", ["nvfp4", "mxfp4", "nvfp4-auto"])
def test_gpu_post_scale_variants(label, variant):
    """Every FP4 decode variant at engine geometry (128-token pages and blocks, 4 heads, top-16), batch 8 up to 150K,
    through fixed launches of both loop kinds."""
    ctx = [150_000, 1, 8192, 0, 70_001, 129, 40_000, 128]
    cache, table, cl, _ = make_cache(label, ctx, page=128, seed=46)
    opts = dict(POST_VARIANTS[variant])
    check_decode(cache, table, cl, queries(len(ctx), 4, 128, seed=47), IndexerConfig(), **opts)
    if variant != "post-prefetch":
        check_decode(cache, table, cl, queries(len(ctx), 4, 128, seed=48), IndexerConfig(), num_stages=3, **opts)


def engine_prefill(label, seed):
    """A causal prefill case at engine geometry (128-token pages and blocks, 4 heads, top-16; 512 queries into 4K and
    3001-token contexts): (cache, table, ctx, iq, cfg, reference ids, reference scores, bound)."""
    cache, table, cl, _ = make_cache(label, [4096, 3001], page=128, seed=seed)
    iq = queries(2, 4, 128, seed=seed + 1, q=512)
    cfg = IndexerConfig()
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, cfg)
    return cache, table, cl, iq, cfg, ref_ids, ref_scores, tolerance(iq, cache, table, cl)


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["bf16", "fp8", "fp8-token", "nvfp4", "mxfp4"])
def test_gpu_prefill_q_major(label):
    """Query-major prefill launches at engine geometry (128-token pages and blocks, 4 heads, top-16, 512 queries
    into 4K and 3001-token contexts): the reference's ids through 64- and 128-row tiles, 4 and 8 warps, and every
    prefill select variant; the same ids as the default launch."""
    cache, table, cl, iq, cfg, ref_ids, ref_scores, tol = engine_prefill(label, seed=78)
    base = K.prefill_topk(iq, cache, table, cl, cfg)
    assert_ids_match(base, ref_ids, ref_scores, tol)
    for q_tile, warps, stages in ((16, 4, 3), (32, 4, 3), (32, 8, 3), (32, 4, 2)):
        ids = K.prefill_topk(iq, cache, table, cl, cfg, q_major=True, q_tile=q_tile, num_warps=warps,
                             num_stages=stages, prefetch=False)
        assert_ids_match(ids, ref_ids, ref_scores, tol)
    for variant in ("packedR2", "packedR4", "packedR8"):
        assert torch.equal(K.prefill_topk(iq, cache, table, cl, cfg, select=variant), base), variant


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["fp8", "fp8-tensor", "nvfp4", "nvfp4-auto", "mxfp4", "mxfp4-floor"])
def test_gpu_prefill_decode_once(label):
    """The decode-once prefill (the CUDA default from DECODE_ONCE_MIN_QUERIES queries; forced here at 512) at
    engine geometry, and the in-kernel decode beside it: the reference's ids."""
    cache, table, cl, iq, cfg, ref_ids, ref_scores, tol = engine_prefill(label, seed=82)
    assert_ids_match(K.prefill_topk(iq, cache, table, cl, cfg, decode_once=True), ref_ids, ref_scores, tol)
    assert_ids_match(K.prefill_topk(iq, cache, table, cl, cfg, decode_once=False), ref_ids, ref_scores, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_gpu_prefill_4k(label):
    ctx = [4096, 3000]
    cache, table, cl, _ = make_cache(label, ctx, page=128, seed=18)
    iq = queries(2, 4, 128, seed=19, q=1024)
    ref_ids, ref_scores = paged_reference(iq, cache, table, cl, IndexerConfig())
    ids = K.prefill_topk(iq, cache, table, cl, IndexerConfig())  # the autotuned launch
    assert_ids_match(ids, ref_ids, ref_scores, tolerance(iq, cache, table, cl))


# ------------------------------------------------------------------------ NVIDIA fast path (kernels/index_gluon.py)
def test_gluon_path_is_refused_where_it_cannot_run():
    """gluon=True on a device or launch it does not cover is an error, not a silent fallback; gluon=False and the
    portable-kernel options keep the portable kernel (what every CPU test runs)."""
    cache, table, cl, _ = make_cache("nvfp4", [40], page=16)
    iq = queries(1, 4, 128)
    cfg = IndexerConfig(block_size=16, topk=2)
    if not K.index_gluon.device_ok(iq.device):
        with pytest.raises(KernelArgumentError, match="gluon=True"):
            K.decode_topk(iq, cache, table, cl, cfg, gluon=True)
    with pytest.raises(KernelArgumentError, match="portable kernel's options"):
        K.decode_topk(iq, cache, table, cl, cfg, gluon=True, prefetch=False)
    assert not K.index_gluon.applies(iq[:, None], cache, cfg, None)  # 16-token blocks


@pytest.mark.parametrize("label", ["nvfp4", "mxfp4"])
def test_gluon_fp4_needs_16_byte_alignment(label):
    """The FP4 tile loads are 16-byte vector loads at constant offsets from one address (`index_gluon._fetch`): a
    cache whose base is not 16-byte aligned keeps the portable kernel; the same bytes aligned take the fast path."""
    cache, _, _, _ = make_cache(label, [300], page=128)
    iq = queries(1, 4, 128)
    cfg = IndexerConfig()
    assert K.index_gluon.applies(iq[:, None], cache, cfg, None)
    n = cache.data.numel()
    moved = torch.empty(n + 16, dtype=torch.uint8)[8:8 + n].view(cache.data.shape)
    moved.copy_(cache.data)
    off = dataclasses.replace(cache, data=moved)
    assert off.data.data_ptr() % 16 == 8
    assert not K.index_gluon.applies(iq[:, None], off, cfg, None)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [128, 256])
@pytest.mark.parametrize("label", ["nvfp4", "nvfp4-auto", "mxfp4", "mxfp4-floor"])
def test_gpu_decode_gluon(label, page):
    """The Gluon FP4 decode scorer at engine geometry (4 heads, 128-token blocks, top-16) against the reference on
    the dequantized cache and against the portable kernel: ragged contexts over block and page edges (0, 1, 127,
    128, 129, ...) up to 150K, poisoned bytes past every context, a NaN token inside one, forced init / local blocks,
    blocks per program from 1 to one wave; ids tie-aware, block scores within the accumulation bound, the same
    -inf / NaN pattern as the portable kernel; the query operand's variant once."""
    ctx = [150_000, 1, 127, 128, 129, 0, 70_001, 8192, 40_000, 255, 257]
    cache, table, cl, slots = poisoned_cache(label, ctx, page=page, seed=90)
    poison_nan_token(cache, slots, 6, 33_333)
    iq = queries(len(ctx), 4, 128, seed=91)
    for cfg in (IndexerConfig(), IndexerConfig(init_blocks=2, local_blocks=0),
                IndexerConfig(init_blocks=1, local_blocks=2, tie_rule="lower-id")):
        # the default launch (a tail of short splits here), one and seven blocks a program, 48 (longer than
        # SMEM_BLOCKS: the warps' partials go to the select pass), an explicit tail, none
        for chunk, tail in ((None, None), (1, None), (7, None), (48, None), (16, 100), (32, 0)):
            options = {"gluon": True} if chunk is None else {"gluon": True, "chunk_blocks": chunk}
            if tail is not None:
                options["tail_blocks"] = tail
            check_decode(cache, table, cl, iq, cfg, tuned=True, **options)
    # the query operand in registers (the variant beside the default)
    check_decode(cache, table, cl, iq, IndexerConfig(init_blocks=1, local_blocks=2), tuned=True, gluon=True,
                 query_smem=not K.index_gluon.QUERY_SMEM)
    got = K.decode_block_scores(iq, cache, table, cl, IndexerConfig(), gluon=True)
    port = K.decode_block_scores(iq, cache, table, cl, IndexerConfig(), gluon=False)
    assert_scores_match(got, port, tolerance(iq, cache, table, cl))


@pytest.mark.parametrize("gluon", [pytest.param(True, marks=pytest.mark.gpu), False], ids=["gluon", "portable"])
def test_decode_mxfp4_scale_bytes_at_the_ends(gluon):
    """mxfp4 E8M0 block-scale bytes at the ends of their range, read by the FP4 decode scorers (the Gluon kernel's
    `mx_factors` decodes each byte in place, `kc.e8m0_from_field`): bytes 0 (2**-127), 1, 2 and 126 rotated over a
    row's four blocks, a NaN byte 255, and a request whose every key has scale byte 0 or 1, so that its accumulation
    bound is tiny and a factor of 0 for byte 0 would be far outside it."""
    ctx = [300, 129]
    cache, table, cl, slots = make_cache("mxfp4", ctx, page=128, seed=94)
    plane = cache.scale_plane()

    def set_bytes(b, tok, values):
        s = int(slots[b][tok])
        plane[s // cache.page_size, 0, s % cache.page_size, :] = torch.tensor(values, dtype=torch.uint8)

    for t in range(128):
        set_bytes(0, t, [(0, 1, 2, 126)[(t + j) % 4] for j in range(4)])
    set_bytes(0, 130, [255, 127, 127, 127])
    for t in range(129):
        set_bytes(1, t, [1, 1, 1, 1] if t == 128 else [0, 0, 0, 0])
    iq = queries(len(ctx), 4, 128, seed=95)
    check_decode(cache, table, cl, iq, IndexerConfig(topk=2), tuned=True, gluon=gluon)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 3, 8])
def test_gpu_decode_gluon_heads(heads):
    """1 .. 8 index heads (the dot's 8 columns, padded) and a query row of zeros (total ties: ids in order)."""
    ctx = [5000, 1, 300]
    cache, table, cl, _ = poisoned_cache("nvfp4", ctx, page=128, seed=92)
    iq = queries(len(ctx), heads, 128, seed=93)
    iq[1] = 0
    check_decode(cache, table, cl, iq, IndexerConfig(topk=8), tuned=True, gluon=True)


def test_gluon_splits_tile_every_row():
    """The Gluon scorer's splits (index_gluon.split_grid and the kernel's rule: split s < n_front takes blocks
    s ch .. s ch + ch - 1, later ones ch // TAIL_DIV each from n_front ch on) cover 0 .. nb - 1 once, in order, with
    at least the asked tail in short splits; the default tail (tail_blocks_for) at the benchmark's shapes on 132
    SMs: none below 4-block tail splits (where it lost on the H200), at most half a row."""
    G = K.index_gluon
    for nb in (1, 2, 5, 31, 32, 33, 256, 1172, 2048):
        for ch in (1, 2, 4, 8, 16, 32):
            for tail in (0, 1, 7, 64, 200, 5000):
                n_front, splits = G.split_grid(nb, ch, tail)
                tail_ch = ch // G.TAIL_DIV
                covered = []
                for s in range(splits):
                    first = min(s, n_front) * ch + max(s - n_front, 0) * tail_ch
                    size = ch if s < n_front else tail_ch
                    covered += range(first, min(first + size, nb))
                assert covered == list(range(nb)), (nb, ch, tail)
                assert splits == n_front or first < nb  # no split wholly past the row
                if tail and tail_ch:
                    assert nb - n_front * ch >= min(tail, nb)
    assert G.tail_blocks_for(64, 1172, 32, 132) == 200
    assert G.tail_blocks_for(16, 1172, 16, 132) == 396
    assert G.tail_blocks_for(64, 256, 16, 132) == 100
    assert G.tail_blocks_for(16, 256, 8, 132) == 0 and G.tail_blocks_for(1, 1172, 2, 132) == 0
    assert G.tail_blocks_for(1, 40, 16, 132) == 20  # half a row at most


def test_gluon_chunk_rule():
    """Blocks per program of the Gluon scorer's default launch (index_gluon.chunk_blocks_for) at the benchmark's
    decode shapes on 132 SMs: the H200 best there or within 8 % of it (the table beside the rule), and the rule's
    invariants on other shapes (a power of two <= CHUNK_BLOCKS; every SM gets FILL_PROGRAMS programs whenever the
    blocks allow it)."""
    G = K.index_gluon
    want = {(1, 8192): 1, (1, 150_000): 2, (16, 8192): 2, (16, 32768): 8, (16, 150_000): 16, (64, 8192): 8,
            (64, 32768): 16, (64, 150_000): 32}
    got = {(b, c): G.chunk_blocks_for(b, -(-c // 128), 132) for b, c in want}
    assert got == want
    for bsz in (1, 3, 64, 1000):
        for nb in (1, 7, 64, 1172, 2048):
            for sms in (8, 132, 304):
                ch = G.chunk_blocks_for(bsz, nb, sms)
                assert 1 <= ch <= G.CHUNK_BLOCKS and ch & (ch - 1) == 0
                programs = bsz * -(-nb // ch)
                assert programs >= min(G.FILL_PROGRAMS * sms, bsz * nb) or ch == 1


def test_prefill_options_fill_the_measured_launch_and_yield_to_given_options():
    """The CUDA prefill launch (PREFILL_LAUNCH): 128 dot rows for bf16 / fp8 keys, whole-context FP4 programs only
    where the top-k runs in two passes (capped at the row's blocks); any option it would set leaves the caller's
    options as given."""
    two_byte = K.prefill_options(16, 4, 256, 2, {})
    assert two_byte == {"num_warps": 4, "num_stages": 3, "prefetch": False, "q_major": True, "q_tile": 32}
    assert K.prefill_options(16, 4, 32, 2, {})["select"] == "packedR4"  # short rows: 4 per select program
    assert K.prefill_options(8, 4, 64, 2, {})["select"] == "packedR2"
    assert "select" not in K.prefill_options(16, 4, 32, 1, {})  # block scores: no select pass
    assert K.prefill_options(8, 1, 256, 1, {})["q_tile"] == 128
    assert K.prefill_options(4, 4, 32, 2, {})["chunk_blocks"] == 32  # 4K context: 32 blocks, not 256
    assert K.prefill_options(4, 4, 256, 1, {})["q_tile"] == 16
    assert "chunk_blocks" not in K.prefill_options(4, 4, 256, 2, {"in_kernel_topk": True})
    assert "chunk_blocks" not in K.prefill_options(4, 4, 256, 0, {})  # token scores
    for given in ({"q_tile": 8}, {"num_stages": 2}):
        assert K.prefill_options(16, 4, 256, 2, given) == given
    assert K.prefill_options(4, 4, 256, 2, {"chunk_blocks": 4}) == {"chunk_blocks": 4}
    assert K.prefill_options(16, 4, 256, 2, {"chunk_blocks": 4})["chunk_blocks"] == 4  # not in the bf16 plan
    assert K.prefill_options(32, 4, 256, 2, {}) == {}  # no measured plan for that width
