"""verify-topk and `kvtool bench index` over the index-scorer kernels (moved out of tests/kernels/test_kernels_index.py,
which keeps the kernel tests): the workflow runs the kernel and passes, fails on a wrong selection, reads the capture
fixture and files; the CLI's arguments and exit codes; the bench's eager peers and plumbing."""

from pathlib import Path

import torch
from typer.testing import CliRunner

from conftest import DEVICE
from index_helpers import make_cache, queries
from kvtool.cli import app
from kvtool.indexer import IndexerConfig, paged_reference
from kvtool.workflows import verify_topk as vt

# ---------------------------------------------------------------------------------------------------- verify-topk

CAPTURE = Path(__file__).resolve().parents[2] / "fixtures" / "smollm2_capture.safetensors"
SMALL = IndexerConfig(block_size=32, topk=4)
FIXED = {"prefetch": False}  # one launch, no autotuning (the GPU compiles each variant once per constexpr set)


def test_verify_topk_synthetic_runs_the_kernel_and_passes():
    r = vt.verify_topk_synthetic(["bf16", "fp8", "nvfp4", "mxfp4-floor"], batch=2, context_lens="300,1000", cfg=SMALL,
                                 page_size=16, device=DEVICE, launch=FIXED)
    assert r.backend in ("triton", "triton-interpreter") and r.passed
    assert [row.format for row in r.layers] == ["bf16", "fp8-unit", "nvfp4-rcp", "mxfp4-floor"]
    for row in r.layers:
        assert row.rows == 2 * 4 and row.vs_dequant.tie_aware_pct == 100.0 and row.max_score_err <= row.tie_tol
    assert r.layers[0].vs_original.exact_pct == 100.0  # bf16 keys stored in bf16: the original itself


def test_verify_topk_fails_on_a_wrong_selection(monkeypatch):
    from kvtool.kernels import index_score as K

    real = K.decode_topk

    def off_by_one(iq, cache, table, ctx, cfg, **kw):
        ids = real(iq, cache, table, ctx, cfg, **kw)
        return torch.where(ids > 0, ids - 1, ids)  # shifts every selection: never a tie

    monkeypatch.setattr(K, "decode_topk", off_by_one)
    r = vt.verify_topk_synthetic(["nvfp4"], batch=2, context_lens="700", cfg=SMALL, page_size=32, device=DEVICE,
                                 launch=FIXED)
    assert not r.passed and r.layers[0].vs_dequant.tie_aware_pct < 100.0


def test_verify_topk_capture_fixture():
    r = vt.verify_topk_capture(CAPTURE, ["bf16", "nvfp4"], layers=[1], max_queries=24, block_size=16, topk=4,
                               device=DEVICE, launch=FIXED)
    assert r.passed and r.config["block_size"] == 16 and len(r.layers) == 2
    bf16, nv = r.layers
    assert bf16.rows == 24 * 3 and bf16.vs_original.recall == 1.0
    assert 0.5 < nv.vs_original.recall <= 1.0 and nv.vs_original.rel_score_err >= 0.0


def test_verify_topk_files_plain_and_prequantized(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(20)
    keys = (torch.randn(300, 128, generator=g) * torch.exp(torch.randn(128, generator=g))).to(torch.bfloat16)
    save_file({"l.index_k": keys}, str(tmp_path / "k.safetensors"))
    save_file({"l.index_q": torch.randn(300, 4, 128, generator=g).to(torch.bfloat16)}, str(tmp_path / "q.safetensors"))
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "k.safetensors"), "-o", str(tmp_path / "kq.safetensors"),
                                   "--to", "mxfp4"])
    assert res.exit_code == 0, res.output
    plain = vt.verify_topk_files(tmp_path / "k.safetensors", tmp_path / "q.safetensors", ["fp8", "mxfp4"],
                                 max_queries=12, block_size=32, topk=4, device=DEVICE, launch=FIXED)
    assert plain.passed and [row.layer for row in plain.layers] == ["l", "l"]
    pre = vt.verify_topk_files(tmp_path / "kq.safetensors", tmp_path / "q.safetensors", ["nvfp4"], max_queries=12,
                               block_size=32, topk=4, device=DEVICE, launch=FIXED)
    assert pre.passed and pre.formats == ["mxfp4-rceil"] and pre.layers[0].vs_original is None
    # the pre-quantized cache holds exactly the bytes the in-memory quantization wrote: same selections
    assert pre.layers[0].vs_dequant.rows == plain.layers[1].vs_dequant.rows


def test_cli_verify_topk_arguments_and_exit_codes(monkeypatch):
    seen = {}

    def fake(names, **kw):
        seen.update(names=names, **kw)
        report = vt.VerifyTopkReport("x", "cpu", "torch", {}, names, kw["min_recall"])
        report.passed = kw["min_recall"] is None
        return report

    monkeypatch.setattr(vt, "verify_topk_synthetic", fake)
    run = CliRunner().invoke
    res = run(app, ["verify-topk", "--synthetic", "--formats", "nvfp4,mxfp4-floor", "--batch", "3", "--context-lens",
                    "5,6,7", "--block-size", "64", "--topk", "8", "--tie-rule", "lower-id", "--json"])
    assert res.exit_code == 0, res.output
    assert seen["names"] == ["nvfp4", "mxfp4-floor"] and seen["batch"] == 3 and seen["context_lens"] == "5,6,7"
    assert seen["cfg"] == IndexerConfig(64, 8, tie_rule="lower-id") and seen["page_size"] == 64
    assert run(app, ["verify-topk", "--synthetic", "--min-recall", "0.9"]).exit_code == 1
    assert run(app, ["verify-topk", "--synthetic", str(CAPTURE)]).exit_code == 2  # file and --synthetic
    assert run(app, ["verify-topk", "--synthetic", "--tie-rule", "random"]).exit_code == 2


def test_cli_verify_topk_min_recall_gates_on_the_torch_path():
    args = ["verify-topk", str(CAPTURE), "--layers", "2", "--max-queries", "16", "--block-size", "16", "--topk", "4",
            "--formats", "nvfp4", "--backend", "torch", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    import json

    report = json.loads(res.stdout)
    assert report["backend"] == "torch" and len(report["layers"]) == 1 and len(report["overall"]) == 1
    recall = report["layers"][0]["vs_original"]["recall"]
    assert CliRunner().invoke(app, args + ["--min-recall", str(min(recall + 0.01, 1.01))]).exit_code == 1


# ---------------------------------------------------------------------------------------------------------- bench
def test_bench_eager_peers_match_the_reference():
    from kvtool.bench.index import eager_decode_topk, eager_prefill_topk

    ctx = [300, 77]
    cache, table, cl, _ = make_cache("nvfp4", ctx, page=16, seed=21)
    iq = queries(2, 4, 128, seed=22)
    cfg = IndexerConfig(32, 4)
    ref_ids, ref_scores = paged_reference(iq[:, None], cache, table, cl, cfg)
    assert torch.equal(eager_decode_topk(iq, cache, table, cl, cfg, 300).cpu(), ref_ids[:, 0].cpu())
    one = make_cache("fp8", [300], page=16, seed=23)
    iq4 = queries(1, 4, 128, seed=24, q=300)
    ref_ids, _ = paged_reference(iq4, one[0], one[1], one[2], cfg)
    assert torch.equal(eager_prefill_topk(iq4, one[0], one[1], one[2], cfg, chunk=128).cpu(), ref_ids.cpu())


def test_bench_index_cli_plumbing():
    import json

    res = CliRunner().invoke(app, ["bench", "index", "--device", "cpu", "--batches", "1", "--contexts", "200",
                                   "--prefill", "", "--formats", "mxfp4", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    names = [r["name"] for r in report["rows"]]
    assert "torch eager mxfp4-rceil" in names
    if __import__("os").environ.get("TRITON_INTERPRET") == "1":  # kernel rows on a CPU device need the interpreter
        assert {"triton score mxfp4-rceil", "triton score+topk mxfp4-rceil"} <= set(names)
    row = report["rows"][0]
    assert row["bytes_moved"] >= 200 * 68 and row["time_us"] > 0
