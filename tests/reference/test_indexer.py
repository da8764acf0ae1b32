"""The M3 indexer reference (kvtool.indexer) against hand-worked cases and a brute-force Python selector, and the
top-k metrics against hand-computed values. Everything here is plain torch on the CPU."""

import math

import pytest
import torch

from kvtool.errors import InputError
from kvtool.formats import get_format
from kvtool.indexer import (
    INIT_SCORE,
    LOCAL_SCORE,
    IndexerConfig,
    block_scores,
    paged_reference,
    select_blocks,
    select_topk,
    token_scores,
    topk_metrics,
)
from kvtool.paged import PagedCache, contiguous_slots

INF = math.inf
INIT32 = float(torch.tensor(INIT_SCORE))  # the fp32 values the forced blocks carry
LOCAL32 = float(torch.tensor(LOCAL_SCORE))


def brute_topk(bscores: torch.Tensor, q_pos, cfg: IndexerConfig) -> list[list[list[int]]]:
    """Python sort of (rank key, tie id) tuples per row: the SPEC order written the slow, obvious way."""
    out = []
    for h in range(bscores.shape[0]):
        rows = []
        for q, p in enumerate(q_pos):
            valid = p // cfg.block_size + 1
            k = min(cfg.topk, valid)
            items = []
            for i, v in enumerate(bscores[h, q].tolist()[:valid]):
                key = -1e30 if math.isnan(v) else v
                items.append((key, i if cfg.tie_rule != "lower-id" else -i, i))
            items.sort(reverse=True)
            rows.append([i for _, _, i in items[:k]] + [-1] * (cfg.topk - k))
        out.append(rows)
    return out


def test_token_scores_causal_and_masked_nan_does_not_leak():
    iq = torch.tensor([[[1.0, 2.0], [0.5, -1.0]]])  # [Hi=1, Q=2, D=2]
    ik = torch.tensor([[1.0, 1.0], [2.0, 0.0], [math.nan, 1.0]])
    z = token_scores(iq, ik, [0, 2])
    assert z.dtype == torch.float32 and z.shape == (1, 2, 3)
    assert z[0, 0].tolist() == [3.0, -INF, -INF]  # s > p is -inf, also for the NaN key
    assert z[0, 1, :2].tolist() == [-0.5, 1.0] and math.isnan(z[0, 1, 2])


def test_block_scores_pooling_nan_masking_and_forced():
    cfg = IndexerConfig(block_size=2, topk=4, init_blocks=1, local_blocks=1)
    z = torch.tensor([[[5.0, 1.0, math.nan, 2.0, 3.0, 7.0, 4.0, 0.0]]])  # [1, 1, 8]
    b = block_scores(z, [7], cfg)
    assert b[0, 0, 0] == INIT32 and math.isnan(b[0, 0, 1]) and b[0, 0, 2] == 7.0 and b[0, 0, 3] == LOCAL32
    # position 4: valid blocks 3; block 3 is fully masked (-inf), block 2 is local
    z2 = torch.tensor([[[5.0, 1.0, 2.0, 2.0, 3.0, -INF, -INF, -INF]]])
    b2 = block_scores(z2, [4], cfg)
    assert b2[0, 0].tolist() == [INIT32, 2.0, LOCAL32, -INF]
    # one valid block that is both init and local: local wins
    b3 = block_scores(torch.zeros(1, 1, 4), [1], cfg)
    assert b3[0, 0].tolist() == [LOCAL32, -INF]


def test_select_topk_known_answers():
    cfg = IndexerConfig(block_size=1, topk=3, local_blocks=0)
    b = torch.tensor([[[1.0, math.nan, 3.0, 3.0, -INF, 2.0]]])
    assert select_topk(b, [5], cfg).tolist() == [[[3, 2, 5]]]
    assert select_topk(b, [5], IndexerConfig(1, 3, local_blocks=0, tie_rule="lower-id")).tolist() == [[[2, 3, 5]]]
    # NaN ranks below every finite score but above -inf
    b2 = torch.tensor([[[-INF, math.nan, -5.0]]])
    assert select_topk(b2, [2], cfg).tolist() == [[[2, 1, 0]]]
    # k = min(topk, valid blocks), only valid blocks, padded with -1
    assert select_topk(b, [1], cfg).tolist() == [[[0, 1, -1]]]
    # a valid -inf block beats an invalid block of equal (-inf) score under either tie rule
    b3 = torch.tensor([[[-INF, 9.0, -INF, -INF]]])
    assert select_topk(b3, [1], cfg).tolist() == [[[1, 0, -1]]]
    assert select_topk(b3, [1], IndexerConfig(1, 3, local_blocks=0, tie_rule="lower-id")).tolist() == [[[1, 0, -1]]]


@pytest.mark.parametrize("tie_rule", ["higher-id", "lower-id"])
@pytest.mark.parametrize("seed", range(4))
def test_select_topk_matches_brute_force_with_many_ties(tie_rule, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = IndexerConfig(block_size=4, topk=5, init_blocks=seed % 2, local_blocks=1 + seed % 2, tie_rule=tie_rule)
    nb = 11
    q_pos = torch.randint(0, nb * 4, (6,), generator=g)
    raw = torch.randint(-3, 3, (2, 6, nb), generator=g).float()  # integers: ties everywhere
    raw[raw == -3] = math.nan
    raw[raw == 2] = -INF
    from kvtool.indexer import apply_forced
    b = apply_forced(raw, q_pos, cfg)
    assert select_topk(b, q_pos, cfg).tolist() == brute_topk(b, q_pos.tolist(), cfg)


def test_tie_rule_any_selects_a_top_set():
    g = torch.Generator().manual_seed(0)
    b = torch.randint(0, 3, (1, 8, 20), generator=g).float()
    pos = torch.full((8,), 19 * 3)
    cfg = IndexerConfig(block_size=3, topk=6, local_blocks=0, tie_rule="any")
    ids = select_topk(b, pos, cfg)
    ref = select_topk(b, pos, IndexerConfig(3, 6, local_blocks=0))
    m = topk_metrics(ids, ref, b)
    assert m.tie_aware_pct == 100.0


def test_select_blocks_m3_defaults_end_to_end():
    cfg = IndexerConfig()
    assert (cfg.block_size, cfg.topk, cfg.init_blocks, cfg.local_blocks) == (128, 16, 0, 1)
    g = torch.Generator().manual_seed(1)
    s = 128 * 20 + 5
    ik = torch.randn(s, 128, generator=g)
    iq = torch.randn(4, 3, 128, generator=g)
    pos = torch.tensor([0, 128 * 10, s - 1])
    ids = select_blocks(iq, ik, pos, cfg)
    assert ids.shape == (4, 3, 16) and ids.dtype == torch.int32
    assert (ids[:, 0, 1:] == -1).all() and (ids[:, 0, 0] == 0).all()  # one valid block: only the local one
    assert (ids[:, 1, 11:] == -1).all() and (ids[:, 1, 0] == 10).all()  # 11 valid blocks, local first
    assert (ids[:, 2] >= 0).all() and (ids[:, 2, 0] == 20).all()
    # the non-forced picks of the last row are the 15 best block maxima of blocks 0..19
    z = (iq[:, 2] @ ik.t())[:, : 20 * 128].view(4, 20, 128).amax(-1)
    best = z.topk(15, dim=-1).indices.sort(-1).values
    assert torch.equal(ids[:, 2, 1:].long().sort(-1).values, best)


def test_config_and_position_errors():
    with pytest.raises(InputError):
        IndexerConfig(tie_rule="random")
    with pytest.raises(InputError):
        IndexerConfig(block_size=0)
    with pytest.raises(InputError):
        block_scores(torch.zeros(1, 1, 4), [4], IndexerConfig(2))
    with pytest.raises(InputError):
        token_scores(torch.zeros(1, 2, 4), torch.zeros(3, 4), [0])


def test_topk_metrics_hand_computed():
    ref_scores = torch.tensor([[5.0, 4.0, 4.0, 1.0, LOCAL_SCORE]])  # block 4 is forced
    ref = torch.tensor([[4, 0, 1]])
    # same set in another order: exact
    m = topk_metrics(torch.tensor([[1, 4, 0]]), ref, ref_scores)
    assert (m.exact_pct, m.tie_aware_pct, m.recall, m.rel_score_err) == (100.0, 100.0, 1.0, 0.0)
    # 2 instead of 1: equal reference scores -> a tie
    m = topk_metrics(torch.tensor([[4, 0, 2]]), ref, ref_scores)
    assert (m.exact_pct, m.tie_aware_pct) == (0.0, 100.0)
    assert m.recall == pytest.approx(2 / 3) and m.rel_score_err == 0.0
    # 3 instead of 1: not a tie; score error |(5 + 1) - (5 + 4)| / (5 + 4)
    m = topk_metrics(torch.tensor([[4, 0, 3]]), ref, ref_scores)
    assert (m.exact_pct, m.tie_aware_pct) == (0.0, 0.0)
    assert m.rel_score_err == pytest.approx(3 / 9) and m.rel_score_err_max == pytest.approx(3 / 9)
    # ... unless the tolerance covers the gap
    assert topk_metrics(torch.tensor([[4, 0, 3]]), ref, ref_scores, tie_tol=3.0).tie_aware_pct == 100.0
    # a missing id (-1) is never a tie
    assert topk_metrics(torch.tensor([[4, 0, -1]]), ref, ref_scores).tie_aware_pct == 0.0
    # two rows: averages
    m = topk_metrics(torch.tensor([[4, 0, 1], [4, 0, 3]]), ref.repeat(2, 1), ref_scores.repeat(2, 1))
    assert (m.rows, m.exact_pct, m.tie_aware_pct) == (2, 50.0, 50.0)


def test_paged_reference_matches_contiguous_reference():
    cfg = IndexerConfig(block_size=8, topk=4)
    ctx = [0, 5, 40]
    table, slots = contiguous_slots(ctx, 16)
    table = table.flip(0).contiguous()  # requests own pages in another order than their index
    slots = slots[::-1]
    ctx = ctx[::-1]
    cache = PagedCache.allocate(get_format("nvfp4"), int(table.max()) + 1, 16, 1, 32)
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(n, 1, 32, generator=g) for n in ctx]
    for k, s in zip(keys, slots):
        cache.store(k, s)
    iq = torch.randn(3, 2, 4, 32, generator=g)
    ids, scores = paged_reference(iq, cache, table, torch.tensor(ctx), cfg)
    assert ids.shape == (3, 2, 4, 4) and scores.shape == (3, 2, 4, 5)
    for b, n in enumerate(ctx):
        if n == 0:
            assert (ids[b] == -1).all() and torch.isinf(scores[b]).all()
            continue
        ik = cache.dequantize(slots[b])[:, 0]
        pos = torch.tensor([n - 2, n - 1])
        want = select_blocks(iq[b].transpose(0, 1), ik, pos, cfg)
        assert torch.equal(ids[b].transpose(0, 1), want)
