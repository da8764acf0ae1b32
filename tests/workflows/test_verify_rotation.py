"""Rotated formats (`+rot`) in verify-topk / verify-attn: kvtool's kernels read the stored codes (x R), so the
workflows hand them the rotated query bf16(q R) and un-rotate the attention output; the reference is fed the same
query taken back by R^T, so check (a) stays a check of the kernel's arithmetic (fp32 order), not of the bf16
rounding of q R. Without that, the rotated rows miss by the query's rounding (seen: score error 0.26 and attention
max_rel 4.4e-3 against 1.3e-4 and 1.8e-4 with it)."""

from __future__ import annotations

from kvtool.workflows.verify_attn import verify_attn_synthetic
from kvtool.workflows.verify_topk import verify_topk_synthetic


def test_rotated_index_scores_equal_the_reference_to_fp32_order(device):
    report = verify_topk_synthetic(["nvfp4+rot", "mxfp4+rot32"], batch=1, context_lens="4096", device=device)
    assert report.backend != "torch" and report.verdict == "PASS", report
    for row in report.overall:
        assert row.format.endswith(("+rot", "+rot32")) and row.passed
        assert row.max_score_err <= 1e-3 < row.tie_tol, row  # fp32 order, far under the tie bound


def test_rotated_attention_un_rotates_the_output(device):
    report = verify_attn_synthetic(["nvfp4+rot", "fp8+rot"], batch=1, context_lens="1024", device=device)
    assert report.verdict == "PASS", report
    for row in report.overall:
        assert row.vs_dequant.max_rel <= 5e-4, row  # a missing un-rotation would leave O(1) errors
        assert row.vs_original.max_rel < 1.0



def test_kernel_paths_refuse_engine_recipes(device):
    """kvtool's kernels decode the SPEC codecs; an engine recipe's bytes decode otherwise, so the check refuses to
    run them rather than report a difference that is the recipe's (the torch backend runs every recipe)."""
    import pytest

    from kvtool.errors import FormatError

    with pytest.raises(FormatError, match="engine recipe"):
        verify_topk_synthetic(["nvfp4@vllm.ref_nvfp4"], batch=1, context_lens="256", device=device)
    with pytest.raises(FormatError, match="engine recipe"):
        verify_attn_synthetic(["nvfp4@vllm.ref_nvfp4"], batch=1, context_lens="256", device=device)
    assert verify_topk_synthetic(["nvfp4@vllm.ref_nvfp4"], batch=1, context_lens="256", device=device,
                                 backend="torch").verdict.startswith("SKIPPED")
