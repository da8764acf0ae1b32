"""vLLM 0.33.0's own MiniMax-M3 Triton kernels (kvtool.engines.vllm_m3) against kvtool's references, on the CPU
under the Triton interpreter at small shapes (bf16 as an fp32 stand-in; fp8 cannot be passed to the interpreter and
is reported SKIPPED with that reason), and vLLM's top-k defect on -inf block scores (issue 29)."""

import math

import pytest
import torch

from kvtool.engines.wheels import EngineUnavailable
from kvtool.indexer import IndexerConfig
from kvtool.workflows.verify_attn import verify_attn_synthetic
from kvtool.workflows.verify_topk import edge_scores, verify_topk_scores, verify_topk_synthetic


@pytest.fixture(scope="module")
def vllm():
    from kvtool.engines.vllm_m3 import VllmM3

    try:
        return VllmM3()
    except EngineUnavailable as exc:
        pytest.skip(f"vLLM 0.33.0 not obtainable here: {exc}")


def _rows(report, impl):
    return [r for r in report.layers if r.impl == impl]


def test_index_decode_matches_reference(vllm, device):
    # ragged contexts (partial last block, a single block) through minimax_m3_index_decode; kvtool's own kernel is
    # not run here (backend torch: its row is SKIPPED), the engine's is
    r = verify_topk_synthetic(["bf16", "fp8"], batch=2, context_lens="129,700", device=device, backend="torch",
                              impls=[vllm])
    (bf16, fp8) = _rows(r, "vllm")
    assert bf16.verdict == "PASS" and bf16.checks.defect == 0 and bf16.checks.order_bad == 0
    assert bf16.vs_dequant.tie_aware_pct == 100.0 and bf16.max_score_err < 1e-3
    if device == "cpu":
        assert fp8.verdict.startswith("SKIPPED") and "interpreter" in fp8.verdict
    else:
        assert fp8.verdict == "PASS" and fp8.checks.defect == 0
    assert _rows(r, "kvtool")[0].verdict.startswith("SKIPPED: no kernel ran")
    assert r.verdict == "PASS"


def test_attention_decode_and_prefill_match_reference(vllm, device):
    from kvtool.engines.protocol import AttnCall
    from kvtool.attention import paged_sparse_prefill_ref, random_block_selection
    from kvtool.formats import get_format
    from kvtool.workflows.verify_attn import build_paged, synthetic_kv

    r = verify_attn_synthetic(["bf16", "nvfp4"], batch=2, context_lens="300,129", device=device, backend="torch",
                              impls=[vllm])
    bf16, fp4 = _rows(r, "vllm")
    # the CPU stand-in keeps P and the partials in fp32; on the GPU vLLM rounds them to bf16
    bound = 1e-4 if device == "cpu" else 2e-3 + 2.0 ** -8
    assert bf16.verdict == "PASS" and bf16.vs_dequant.max_rel < bound
    assert fp4.verdict.startswith("SKIPPED") and "no FP4 path" in fp4.verdict
    # the prefill kernel (minimax_m3_sparse_attn), each row its own one-token request, GQA 4 over 2 KV heads
    gen = torch.Generator().manual_seed(1)
    lens = [200, 300]
    ks = [synthetic_kv(n, 2, 64, gen) for n in lens]
    vs = [synthetic_kv(n, 2, 64, gen, outliers=False) for n in lens]
    kc, vc, table = build_paged(get_format("bf16"), ks, vs, 128, device, gen)
    q_req, q_pos = torch.tensor([0, 1, 1]), torch.tensor([199, 5, 299])
    ids = random_block_selection(q_pos, 128, 2, 2, gen).transpose(0, 1).contiguous()
    q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16)
    ref = paged_sparse_prefill_ref(q, kc, vc, table, q_req, q_pos, ids, 128)
    out = vllm.attend(AttnCall(q.to(device), kc, vc, table, q_req.to(device), q_pos.to(device), ids.to(device), 128,
                               False, 64 ** -0.5))
    assert float((out.cpu() - ref.cpu()).abs().max() / ref.abs().max()) < bound


def test_vllm_topk_drops_a_finite_block_next_to_neg_inf(vllm, device):
    # Issue 29: 16 valid blocks scored 1..16, block 3 at -inf. On the H200 vLLM returns
    # [14, 15, 13, 12, 11, 10, 9, 8, 1, 6, 5, 4, 7, 0, 3, -1]; the interpreter gives the same set (the last two swap):
    # -inf * 0 = NaN in its compare-and-swap loses finite block 2.
    cfg = IndexerConfig(local_blocks=0)
    scores, pos, names = edge_scores(cfg)
    ids = vllm.select(scores[:1].to(device), pos[:1].to(device), cfg)[0].tolist()
    assert ids[:13] == [14, 15, 13, 12, 11, 10, 9, 8, 1, 6, 5, 4, 7] and ids[-1] == -1
    assert 2 not in ids and set(ids[13:15]) == {0, 3}
    r = verify_topk_scores(cfg=cfg, device=device, backend="torch", impls=[vllm])
    (row,) = _rows(r, "vllm")
    assert row.verdict == "FAIL" and r.verdict == "FAIL"
    assert row.checks.defect >= 1 and row.checks.consistent == []
    assert any("finite block 2 (score 3) dropped while block 3 (score -inf) kept" in e for e in row.checks.evidence)
    # a NaN block left out for padding is a NaN-policy difference, not a finite defect
    assert row.checks.nonfinite >= 1
    assert any("NaN / -inf blocks differ" in e for e in row.checks.evidence)
    assert not any(math.isnan(x) for x in [row.rows])
