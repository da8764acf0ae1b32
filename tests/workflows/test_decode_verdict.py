"""`kvtool decode`'s verdict: the noise floor, the bootstrap intervals and comparisons, llama.cpp's statistics,
the multi-document corpus, rotation as a cache option, and the short-context warning (tiny-llama: each run takes
well under a second)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.errors import InputError
from kvtool.models.corpus import documents
from kvtool.workflows import decode_stats
from kvtool.workflows.decode import DecodeOptions, block_masked_attention, resolve_specs, run_decode

runner = CliRunner()
TINY = dict(model="tiny-llama", tokens=96, gen_tokens=4, speed_reference=False, resamples=200)


def _run(kv, index=("fp4",), **kw):
    warnings = []
    r = run_decode(DecodeOptions(kv=list(kv), index=list(index), **{**TINY, **kw}), warn=warnings.append)
    return r, warnings


# ------------------------------------------------------------------------------------------------ noise floor
def test_noise_floor_is_the_baseline_under_another_summation_order():
    r, _ = _run(["nvfp4"], batch=2)
    f = r.floor
    assert f is not None and f.label == "floor: bf16 / bf16" and "split-K" in r.floor_change
    assert len(f.buckets) == len(r.candidates[0].buckets) and f.overall.positions == 2 * 96
    # another fp32 order: not bit-identical to the baseline, but orders of magnitude below a 4-bit cache
    assert 0.0 < f.overall.kl_mean < 1e-6 * r.candidates[0].overall.kl_mean
    assert f.overall.top1_pct == 100.0 and f.generation.first_divergence is None
    none, _ = _run(["nvfp4"], floor=False)
    assert none.floor is None and all(c.b != "floor" for c in none.confidence["comparisons"])


def test_split_attention_equals_one_pass_up_to_rounding():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 7, 16, generator=g), torch.randn(40, 2, 16, generator=g),
               torch.randn(40, 2, 16, generator=g))
    pos = torch.arange(33, 40)
    ids = torch.tensor([0, 2, -1])[None, None].expand(2, 7, 3)
    for block_ids in (None, ids):
        one = block_masked_attention(q, k, v, pos, block_ids, 8)
        two = block_masked_attention(q, k, v, pos, block_ids, 8, split=True)
        torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ intervals
def _values(kl, agree=None, seed=0):
    kl = np.asarray(kl, dtype=float)
    rng = np.random.default_rng(seed)
    nll_b = rng.uniform(1, 3, kl.shape)
    return {"kl": kl, "agree": np.ones_like(kl) if agree is None else agree, "dp": np.zeros_like(kl),
            "has": np.ones_like(kl), "nll_base": nll_b, "nll": nll_b + 0.01 * kl}


def test_bootstrap_intervals_contain_the_point_and_pair_the_configurations():
    rng = np.random.default_rng(0)
    kl = rng.exponential(0.1, (3, 128))
    vals = {"a": _values(kl), "same": _values(kl.copy()), "worse": _values(kl + 0.05), "floor": _values(kl * 1e-4)}
    conf = decode_stats.bootstrap(vals, [(0, 64), (64, 128)], floor="floor", resamples=300)
    assert "3 documents" in conf.basis
    for label, iv in conf.overall.items():
        for m, x in iv.items():
            assert x.lo <= x.value <= x.hi, (label, m)
        assert iv["kl_mean"].value == pytest.approx(vals[label]["kl"].mean())
    assert len(conf.buckets["a"]) == 2 and conf.buckets["a"][0]["kl_mean"].value == pytest.approx(kl[:, :64].mean())
    pairs = {(c.a, c.b): c for c in conf.comparisons}
    assert set(pairs) == {("a", "floor"), ("same", "floor"), ("worse", "floor"), ("a", "same"), ("a", "worse"),
                          ("same", "worse")}
    assert not pairs[("a", "same")].distinguishable                    # identical values: a difference of 0
    assert pairs[("a", "worse")].distinguishable and "kl_mean" in pairs[("a", "worse")].differs_on
    assert pairs[("a", "floor")].distinguishable
    one = decode_stats.bootstrap({"a": _values(kl[:1])}, [(0, 128)], resamples=100)
    assert "1 document" in one.basis and one.comparisons == []


def test_decode_report_carries_intervals_and_comparisons():
    r, _ = _run(["nvfp4", "mxfp4"], batch=2)
    conf = r.confidence
    assert conf["level"] == 0.95 and conf["resamples"] == 200 and "2 documents" in conf["basis"]
    labels = [(c.a, c.b) for c in conf["comparisons"]]
    assert labels == [("nvfp4 / nvfp4", "floor: bf16 / bf16"), ("mxfp4 / nvfp4", "floor: bf16 / bf16"),
                      ("nvfp4 / nvfp4", "mxfp4 / nvfp4")]
    for c in r.candidates + [r.floor]:
        assert set(c.intervals) == set(decode_stats.METRICS) and len(c.bucket_intervals) == len(c.buckets)
        assert c.intervals["kl_mean"].value == pytest.approx(c.overall.kl_mean)
        assert c.intervals["ppl_ratio"].value == pytest.approx(c.overall.ppl_ratio)
    assert all(c.distinguishable for c in conf["comparisons"][:2])  # a 4-bit cache is far above the floor


# ---------------------------------------------------------------------------------------- llama.cpp's statistics
LLAMA_NAMES = ["Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))",
               "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)", "Mean    KLD", "Maximum KLD", "99.9%   KLD",
               "99.0%   KLD", "95.0%   KLD", "90.0%   KLD", "Median  KLD", "10.0%   KLD", " 5.0%   KLD",
               " 1.0%   KLD", " 0.1%   KLD", "Minimum KLD", "Mean    Δp", "Maximum Δp", "99.9%   Δp", "99.0%   Δp",
               "95.0%   Δp", "90.0%   Δp", "75.0%   Δp", "Median  Δp", "25.0%   Δp", "10.0%   Δp", " 5.0%   Δp",
               " 1.0%   Δp", " 0.1%   Δp", "Minimum Δp", "RMS Δp", "Same top p"]


def test_llama_stats_match_their_definitions():
    rng = np.random.default_rng(3)
    v = _values(rng.exponential(0.1, (2, 50)), agree=(rng.random((2, 50)) > 0.2).astype(float))
    v["dp"] = rng.normal(0, 0.05, (2, 50))
    v["has"][:, -1] = 0.0  # the last position has no next token: not scored (its dp is 0 by construction)
    v["dp"][:, -1] = 0.0
    s = decode_stats.llama_stats(v)
    assert list(s) == LLAMA_NAMES
    m = v["has"].astype(bool)
    kl, dp = v["kl"][m], v["dp"][m]
    assert s["Mean    KLD"][0] == pytest.approx(kl.mean())
    assert s["Mean    KLD"][1] == pytest.approx(kl.std() / math.sqrt(len(kl) - 1))
    assert s["Maximum KLD"] == pytest.approx(kl.max()) and s["Minimum KLD"] == pytest.approx(kl.min())
    assert s["Median  KLD"] == pytest.approx(np.median(kl))
    assert s["99.0%   KLD"] == pytest.approx(np.quantile(kl, 0.99))  # linear interpolation at f * (n - 1)
    assert s[" 5.0%   KLD"] == pytest.approx(np.quantile(kl, 0.05))
    assert s["Mean    Δp"][0] == pytest.approx(100 * dp.mean()) and s["RMS Δp"][0] == pytest.approx(
        100 * math.sqrt((dp ** 2).mean()))
    assert s["75.0%   Δp"] == pytest.approx(100 * np.quantile(dp, 0.75))
    assert s["Same top p"][0] == pytest.approx(100 * v["agree"][m].mean())
    nll, nll_b = v["nll"][m], v["nll_base"][m]
    assert s["Mean PPL(Q)"][0] == pytest.approx(math.exp(nll.mean()))
    assert s["Mean PPL(Q)/PPL(base)"][0] == pytest.approx(math.exp(nll.mean() - nll_b.mean()))
    lines = decode_stats.llama_lines(s)
    assert "====== KL divergence statistics ======" in lines and any(x.startswith("Same top p: ") for x in lines)
    assert any(x.startswith("Median  KLD: ") for x in lines) and any(x.startswith(" 0.1%   Δp: ") for x in lines)


def test_decode_llama_stats_agree_with_kvtool_metrics():
    r, _ = _run(["nvfp4"])
    c = r.candidates[0]
    s = c.llama_cpp
    assert list(s) == LLAMA_NAMES
    # kvtool's KL mean counts the last position (no next token) too; llama.cpp's only scored ones
    assert s["Same top p"][0] == pytest.approx(100 * np.mean(c.series["top1_pct"][:-1]) / 100, rel=1e-9)
    assert s["RMS Δp"][0] == pytest.approx(100 * c.overall.dp_rms, rel=1e-9)
    assert s["Mean PPL(Q)/PPL(base)"][0] == pytest.approx(c.overall.ppl_ratio, rel=1e-9)
    assert r.floor.llama_cpp["Mean    KLD"][0] < 1e-6 * s["Mean    KLD"][0]


# --------------------------------------------------------------------------------------------- corpus, warnings
def test_corpus_documents_are_distinct_and_the_first_is_the_classic_default():
    from kvtool.models.corpus import default_corpus

    docs = documents(4, 3000)
    assert [n for n, _ in docs][:2] == ["stdlib-mixed", "doctest"] and docs[0][1] == default_corpus(3000)
    assert all(len(t) == 3000 for _, t in docs) and len({t for _, t in docs}) == 4
    with pytest.raises(InputError):
        documents(100)


def test_short_context_warns_that_the_index_format_cannot_matter():
    cheap = dict(gen_tokens=0, floor=False, resamples=0)
    r, warnings = _run(["nvfp4"], tokens=48, **cheap)  # top-4 of 16-token blocks: every block selected up to 64
    assert any("too short for the index format" in w for w in warnings) and r.warnings == warnings
    _, quiet = _run(["nvfp4"], tokens=80, **cheap)
    assert not any("too short" in w for w in quiet)
    _, dense = _run(["nvfp4"], tokens=48, sparse=False, **cheap)
    assert not any("too short" in w for w in dense)


# ------------------------------------------------------------------------------------------------- rotation
def test_rotation_in_labels_and_the_rotate_option():
    _, cands = resolve_specs(DecodeOptions(kv=["nvfp4,nvfp4+rot"], index=["fp4,fp4+rot16"]))
    assert [c.label for c in cands] == ["nvfp4 / nvfp4", "nvfp4 / nvfp4+rot16", "nvfp4+rot / nvfp4",
                                        "nvfp4+rot / nvfp4+rot16"]
    _, rotated = resolve_specs(DecodeOptions(kv=["mxfp4"], index=["fp8"], rotate=16))
    assert [c.label for c in rotated] == ["mxfp4+rot16 / fp8+rot16"]


def test_rotated_bf16_index_keeps_the_selection_and_rotation_reaches_the_cache():
    """bf16+rot rounds in the rotated domain: its error is bf16-sized, orders below nvfp4's; a rotated nvfp4 cache
    differs from the plain one (the rotation really reaches the stored codes)."""
    r, _ = _run(["bf16+rot", "nvfp4", "nvfp4+rot"], ["bf16+rot"], tokens=80, batch=2)
    bf, nv, nvr = r.candidates
    assert bf.overall.kl_mean < 0.05 * nv.overall.kl_mean
    assert all(lm.topk.recall > 0.9 for lm in bf.layers)
    assert nvr.overall.kl_mean != nv.overall.kl_mean and nvr.kv["rotation"] == "hadamard"


# ------------------------------------------------------------------------------------------------------- CLI
def test_cli_json_carries_floor_intervals_and_llama_names(tmp_path):
    result = runner.invoke(app, ["decode", "--model", "tiny-llama", "--kv", "nvfp4,nvfp4+rot", "--index",
                                 "fp4,fp4+rot", "--tokens", "40", "--gen-tokens", "3", "--resamples", "100",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["floor"]["label"] == "floor: bf16 / bf16" and report["floor_change"]
    assert report["confidence"]["resamples"] == 100 and len(report["confidence"]["comparisons"]) == 4 + 6
    c = report["candidates"][3]
    assert c["label"] == "nvfp4+rot / nvfp4+rot" and c["kv"]["rotation"] == "hadamard"
    assert set(c["intervals"]["kl_mean"]) == {"value", "lo", "hi"} and len(c["bucket_intervals"]) == 1
    assert list(c["llama_cpp"]) == LLAMA_NAMES
    assert any("too short" in w for w in report["warnings"])  # 40 tokens < top-4 x 16


def test_cli_text_report_shows_the_floor_the_verdict_and_llama_block(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "d.png"
    result = runner.invoke(app, ["decode", "--model", "tiny-llama", "--kv", "nvfp4", "--index", "fp4", "--tokens",
                                 "80", "--gen-tokens", "3", "--resamples", "100", "--rotate", "hadamard:16",
                                 "--plot", str(png)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "floor: bf16 / bf16" in out and "nvfp4+rot16" in out and "Same top p:" in out
    assert "distinguishable at 95%" in out and png.stat().st_size > 10_000


@pytest.mark.parametrize("args", [["--rotate", "walsh"], ["--rotate", "hadamard:12"], ["--resamples", "-1"],
                                  ["--kv", "nvfp4+rot5"]])
def test_cli_bad_verdict_options_exit_2_with_one_line(args):
    result = runner.invoke(app, ["decode", "--model", "tiny-llama", "--tokens", "40", *args])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------------- lockstep
def test_lockstep_group_forward_equals_each_decoder_on_its_own():
    from kvtool.formats import get_format
    from kvtool.indexer import IndexerConfig
    from kvtool.models.base import load_model
    from kvtool.workflows.decode import Decoder, forward_group
    from kvtool.workflows.decode_cache import CacheSpec, ConfigCache, PlainCache

    model = load_model("tiny-llama")
    c = model.config
    sel = IndexerConfig(16, 2, 0, 1)

    def decoders():
        specs = [CacheSpec(get_format("bf16"), get_format("bf16")), CacheSpec(get_format("nvfp4+rot"),
                                                                              get_format("fp8"))]
        decs = [Decoder(model, ConfigCache(s, c.n_layers, c.n_kv_heads, c.head_dim, c.index_dim, 2, 48, 16), sel)
                for s in specs]
        return decs + [Decoder(model, PlainCache(c.n_layers, c.n_kv_heads, c.head_dim, 2, 48), None)]

    g = torch.Generator().manual_seed(4)
    prompt, steps = torch.randint(0, c.vocab_size, (2, 40), generator=g), torch.randint(0, 64, (2, 3), generator=g)
    alone, group = decoders(), decoders()
    with torch.no_grad():
        ref = [torch.cat([d.prefill(prompt, 16)] + [d.forward(steps[:, j:j + 1]) for j in range(3)], 1)
               for d in alone]
        got = [torch.cat(x, 1) for x in zip(*([forward_group(group, [prompt[:, i:i + 16]] * 3)
                                                for i in range(0, 40, 16)]
                                               + [forward_group(group, [steps[:, j:j + 1]] * 3) for j in range(3)]))]
    for a, b in zip(ref, got):
        assert torch.equal(b[:, :40], a[:, :40])  # prefill chunks: the same row blocking, the same bits here
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)  # one-token steps: another gemm path (~1e-4)


def test_lockstep_free_run_gives_the_same_generations_and_times_every_configuration():
    kw = dict(tokens=40, gen_tokens=6, speed_reference=True, resamples=0)
    a, _ = _run(["nvfp4", "mxfp4"], **kw)
    b, _ = _run(["nvfp4", "mxfp4"], lockstep=False, **kw)
    for x, y in zip([a.baseline] + a.candidates + [a.floor], [b.baseline] + b.candidates + [b.floor]):
        assert x.generation.tokens == y.generation.tokens
    assert all(c.tokens_per_s > 0 for c in [a.baseline] + a.candidates) and a.bf16_dense_tokens_per_s > 0
    assert a.floor.tokens_per_s is None


def test_demo_bench_times_the_phases_and_states_the_goal():
    from kvtool.bench.decode import run_demo_bench

    r = run_demo_bench(model="tiny-llama", tokens=40, gen_tokens=4, resamples=50)
    assert [row.name for row in r.rows] == ["model load + first chunk", "teacher-forced", "free run (lockstep)",
                                            "timed steps", "report (bootstrap, statistics)", "whole run"]
    assert all(row.time_us >= 0 for row in r.rows) and r.rows[-1].time_us >= max(x.time_us for x in r.rows[:-1])
    x = r.extra
    assert x["cpu_s"] > 0 and x["wall_s"] > 0 and "(goal <= 30 s)" in x["goals"][0]
    assert set(x["tokens_per_s"]) == {"nvfp4 / nvfp4", "bf16 dense (plain)"}
