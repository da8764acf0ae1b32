"""The adapter protocol's checks catch broken implementations with a clear report (no engine needed: the broken
adapters below wrap kvtool's reference), and a run with no kernel says SKIPPED, not PASS."""

import json

import torch

from kvtool.engines.protocol import IndexOutput, resolve_impl
from kvtool.indexer import IndexerConfig, paged_reference
from kvtool.workflows.verify_attn import verify_attn_synthetic
from kvtool.workflows.verify_topk import verify_topk_synthetic


class _Broken:
    """The reference selection, damaged by `how`."""

    precision = "fp32"

    def __init__(self, how):
        self.name, self.source, self.how = f"broken-{how}", "test", how

    def unsupported(self, kind, fmt, **geometry):
        return None

    def index(self, call):
        cfg = call.cfg if self.how != "tie" else IndexerConfig(call.cfg.block_size, call.cfg.topk, tie_rule="lower-id")
        ids, scores = paged_reference(call.iq, call.cache, call.block_table, call.context_lens, cfg, call.q_pos)
        if self.how == "head-major":  # [Hi, rows, topk] memory handed back as [B, Q, Hi, topk]
            b, q, h, k = ids.shape
            ids = ids.reshape(b * q, h, k).transpose(0, 1).contiguous().reshape(b, q, h, k)
        elif self.how == "ascending":  # the right set, sorted by block id instead of by rank
            ids = torch.where(ids < 0, 1 << 30, ids).sort(-1).values
            ids = torch.where(ids == 1 << 30, -1, ids).to(torch.int32)
        return IndexOutput(ids, scores)


def _run(how):
    # context 1600 x batch 3: 13 blocks for 16 slots in some rows, exact ties (duplicated blocks, an all-zero query)
    r = verify_topk_synthetic(["bf16"], batch=3, context_lens="1600,2000,3000", backend="torch", impls=[_Broken(how)])
    return r, [row for row in r.layers if row.impl != "kvtool"][0]


def test_wrong_tie_order_is_named():
    r, row = _run("tie")
    assert "higher-id/low" not in row.checks.consistent and "lower-id/low" in row.checks.consistent
    assert row.checks.defect == 0


def test_head_major_ids_are_a_defect_with_a_diagnosis():
    r, row = _run("head-major")
    assert row.verdict == "FAIL" and r.verdict == "FAIL" and row.checks.defect > 0
    assert any("head-major" in d for d in row.checks.diagnosis)
    assert row.checks.evidence and "got [" in row.checks.evidence[0]


def test_ascending_ids_are_out_of_rank_order():
    r, row = _run("ascending")
    assert row.verdict == "FAIL" and row.checks.defect == 0 and row.checks.order_bad > 0
    assert any("ascending block ids" in e for e in row.checks.evidence)


def test_no_kernel_is_skipped_not_pass():
    from kvtool.cli.common import to_json

    r = verify_topk_synthetic(["bf16"], batch=2, context_lens="300", backend="torch")
    assert r.verdict == "SKIPPED: no kernel ran" and all(x.verdict.startswith("SKIPPED") for x in r.layers)
    a = verify_attn_synthetic(["bf16"], batch=2, context_lens="300", backend="torch")
    assert a.verdict == "SKIPPED: no kernel ran"
    assert json.loads(to_json(a))["verdict"] == "SKIPPED: no kernel ran"


def test_plain_function_impl():
    impl = resolve_impl("kvtool.indexer:select_blocks", "index")
    assert impl.unsupported("attend", None) is not None and impl.unsupported("index", None) is None
