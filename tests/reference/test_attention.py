"""The sparse / dense attention references (kvtool.attention) against an independent per-query oracle, and their edge
rules: -1 padding, the query's own partial block, GQA head mapping, empty selections, non-finite K/V, paged paths."""

import math
import os

import pytest
import torch

from kvtool.attention import (
    all_blocks_selection,
    dense_attention_ref,
    paged_sparse_decode,
    paged_sparse_decode_ref,
    paged_sparse_prefill_ref,
    random_block_selection,
    sparse_attention_ref,
)
from kvtool.errors import InputError, KernelArgumentError
from kvtool.formats import get_format
from kvtool.workflows.verify_attn import build_paged, synthetic_kv


def oracle(q, k, v, q_pos, block_ids, block_size, scale=None):
    """Per (query head, query) loop over an explicit python set of visible tokens, fp64 softmax."""
    hq, nq, d = q.shape
    hkv = k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(hq, nq, d, dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(nq):
            toks = [b * block_size + t for b in block_ids[kv, i].tolist() if b >= 0 for t in range(block_size)]
            toks = [s for s in toks if s <= int(q_pos[i]) and s < k.shape[0]]
            if not toks:
                continue
            kk, vv = k[toks, kv].double(), v[toks, kv].double()
            w = torch.softmax(kk @ q[h, i].double() * scale, 0)
            out[h, i] = w @ vv
    return out.float()


def _inputs(hq=4, hkv=2, d=32, s=70, nq=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, nq, d, generator=g)
    k = torch.randn(s, hkv, d, generator=g)
    v = torch.randn(s, hkv, d, generator=g)
    pos = torch.randint(0, s, (nq,), generator=g)
    pos[0], pos[-1] = 0, s - 1  # a one-token context and the full one
    return q, k, v, pos, g


@pytest.mark.parametrize("holes", [False, True], ids=["trailing-pad", "holes"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_sparse_matches_oracle(block_size, holes):
    q, k, v, pos, g = _inputs()
    ids = random_block_selection(pos, block_size, 3, 2, g, holes=holes)
    got = sparse_attention_ref(q, k, v, pos, ids, block_size)
    torch.testing.assert_close(got, oracle(q, k, v, pos, ids, block_size), rtol=1e-5, atol=1e-5)


def test_random_selection_rules():
    pos = torch.tensor([0, 5, 16, 17, 100, 1000])
    ids = random_block_selection(pos, 16, 4, 3, torch.Generator().manual_seed(1))
    assert ids.shape == (3, 6, 4) and ids.dtype == torch.int32
    for h in range(3):
        for i, p in enumerate(pos.tolist()):
            row = [b for b in ids[h, i].tolist() if b >= 0]
            assert len(row) == min(4, p // 16 + 1) and len(set(row)) == len(row)
            assert p // 16 in row and max(row) <= p // 16
            assert ids[h, i, len(row):].eq(-1).all()  # trailing padding without holes


def test_padding_and_order_do_not_matter():
    q, k, v, pos, g = _inputs()
    ids = random_block_selection(pos, 16, 3, 2, g)
    base = sparse_attention_ref(q, k, v, pos, ids, 16)
    padded = torch.cat([torch.full((2, 6, 2), -1, dtype=torch.int32), ids.flip(-1)], -1)
    torch.testing.assert_close(sparse_attention_ref(q, k, v, pos, padded, 16), base, rtol=1e-6, atol=1e-6)


def test_all_blocks_equal_dense_and_plain_softmax():
    q, k, v, pos, _ = _inputs(hq=8, hkv=2, s=50, nq=50)
    pos = torch.arange(50)
    dense = dense_attention_ref(q, k, v, pos)
    sparse = sparse_attention_ref(q, k, v, pos, all_blocks_selection(pos, 16, 2), 16)
    kk, vv = k.repeat_interleave(4, 1).permute(1, 0, 2), v.repeat_interleave(4, 1).permute(1, 0, 2)
    mask = torch.triu(torch.ones(50, 50, dtype=torch.bool), 1)
    plain = torch.softmax((q @ kk.transpose(1, 2) / math.sqrt(32)).masked_fill(mask, -math.inf), -1) @ vv
    torch.testing.assert_close(dense, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse, plain, rtol=1e-5, atol=1e-5)


def test_own_block_is_causal():
    """Selecting the query's own block must not reveal the tokens after it: changing them changes nothing."""
    q, k, v, pos, _ = _inputs(s=64, nq=1)
    pos = torch.tensor([37])  # block 2 of 16-token blocks holds 32..47
    ids = torch.tensor([[[2, 0]], [[2, -1]]], dtype=torch.int32)
    base = sparse_attention_ref(q, k, v, pos, ids, 16)
    k2, v2 = k.clone(), v.clone()
    k2[38:], v2[38:] = 1e4, float("nan")
    torch.testing.assert_close(sparse_attention_ref(q, k2, v2, pos, ids, 16), base, rtol=0, atol=0)


def test_gqa_head_mapping():
    """Query head h reads KV head h // G: perturbing KV head 1 changes exactly query heads 2, 3 (Hq 4, Hkv 2)."""
    q, k, v, pos, g = _inputs()
    ids = random_block_selection(pos, 16, 3, 2, g)
    base = sparse_attention_ref(q, k, v, pos, ids, 16)
    v2 = v.clone()
    v2[:, 1] += 1.0
    moved = sparse_attention_ref(q, k, v2, pos, ids, 16)
    assert torch.equal(moved[:2], base[:2])
    torch.testing.assert_close(moved[2:], base[2:] + 1.0, rtol=1e-5, atol=1e-5)


def test_empty_selection_gives_zeros():
    q, k, v, _, _ = _inputs(nq=3)
    pos = torch.tensor([5, 20, 69])
    ids = torch.tensor([[[-1, -1], [3, -1], [0, 1]]] * 2, dtype=torch.int32)  # none; a block after pos 20; ok
    out = sparse_attention_ref(q, k, v, pos, ids, 16)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert out[:, 2].abs().sum() > 0
    assert torch.equal(dense_attention_ref(q, k, v, torch.tensor([-1, 3, 4]))[:, 0], torch.zeros(4, 32))


def test_duplicate_block_counts_twice():
    """Documented rule: a block listed twice is attended twice (same as attending its tokens with weight 2)."""
    q, k, v, _, _ = _inputs(s=32, nq=1, hq=2, hkv=1)
    pos = torch.tensor([31])
    twice = sparse_attention_ref(q, k, v, pos, torch.tensor([[[0, 0, 1]]], dtype=torch.int32), 16)
    kk = torch.cat([k[:16], k[:16], k[16:]])
    vv = torch.cat([v[:16], v[:16], v[16:]])
    torch.testing.assert_close(twice, dense_attention_ref(q, kk, vv, torch.tensor([47])), rtol=1e-5, atol=1e-6)


def test_nonfinite_kv():
    """Inf / NaN outside the visible selection never leak; Inf in a visible selected K gives NaN (documented)."""
    q, k, v, _, _ = _inputs(s=48, nq=2, hq=2, hkv=1)
    pos = torch.tensor([40, 40])
    ids = torch.tensor([[[0, 2], [0, 1]]], dtype=torch.int32)
    base = sparse_attention_ref(q, k, v, pos, ids, 16)
    k2, v2 = k.clone(), v.clone()
    k2[20, 0, 3] = float("inf")  # block 1: selected by query 1 only
    v2[45, 0, 0] = float("nan")  # after both queries' position
    out = sparse_attention_ref(q, k2, v2, pos, ids, 16)
    assert torch.equal(out[:, 0], base[:, 0])
    assert (torch.isnan(out[:, 1]).all(-1) | (out[:, 1] == base[:, 1]).all(-1)).all()  # +inf score -> NaN
    assert torch.isnan(out[:, 1]).any()
    dense = dense_attention_ref(q, k, v2, pos)
    assert torch.isfinite(dense).all()


def test_reference_errors():
    q, k, v, pos, _ = _inputs()
    with pytest.raises(InputError):
        sparse_attention_ref(q, k, v, pos, torch.zeros(1, 6, 2, dtype=torch.int32), 16)
    with pytest.raises(InputError):
        sparse_attention_ref(q, k, v, pos, torch.full((2, 6, 2), -2, dtype=torch.int32), 16)
    with pytest.raises(InputError):
        dense_attention_ref(q[:3], k, v, pos)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-token", "nvfp4", "mxfp4"])
def test_paged_paths_equal_reference_on_dequantized(fmt):
    g = torch.Generator().manual_seed(3)
    lens = [1, 40, 70]
    ks = [synthetic_kv(n, 2, 32, g) for n in lens]
    vs = [synthetic_kv(n, 2, 32, g) for n in lens]
    kc, vc, table = build_paged(get_format(fmt), ks, vs, 16, "cpu", g)
    q = torch.randn(3, 4, 32, generator=g).bfloat16()
    ctx = torch.tensor(lens, dtype=torch.int32)
    ids = random_block_selection(ctx.long() - 1, 16, 3, 2, g).transpose(0, 1).contiguous()
    got = paged_sparse_decode_ref(q, kc, vc, table, ctx, ids, 16)
    for b, n in enumerate(lens):
        slots = table[b, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
        want = sparse_attention_ref(q[b:b + 1].transpose(0, 1), kc.dequantize(slots), vc.dequantize(slots),
                                    torch.tensor([n - 1]), ids[b:b + 1].transpose(0, 1), 16)
        torch.testing.assert_close(got[b], want[:, 0], rtol=0, atol=0)
    assert torch.equal(paged_sparse_decode(q, kc, vc, table, ctx, ids, 16, backend="torch"), got)
    # prefill rows of the same requests at the same positions give the same thing
    rows = paged_sparse_prefill_ref(q.roll(1, 0), kc, vc, table, torch.arange(3).roll(1), ctx.long().roll(1) - 1,
                                    ids.roll(1, 0), 16)
    torch.testing.assert_close(rows.roll(-1, 0), got, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ workflow, CLI, bench
import json  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from conftest import DEVICE  # noqa: E402
from kvtool.cli import app  # noqa: E402
from kvtool.workflows import verify_attn as va  # noqa: E402


def _tiny_capture(path, s=40, hq=4, hkv=2, d=32, seed=0):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.q": torch.randn(s, hq, d, generator=g), "layers.0.k": synthetic_kv(s, hkv, d, g),
         "layers.0.v": torch.randn(s, hkv, d, generator=g), "layers.0.index_q": torch.randn(s, hkv, d, generator=g),
         "layers.0.index_k": torch.randn(s, d, generator=g)}
    meta = {"kvtool.capture": "1", "block_size": "16", "topk": "2", "init": "0", "local": "1", "layers": "0"}
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}, str(path), metadata=meta)


def test_verify_attn_file_runs_the_kernel_on_indexer_selections(tmp_path):
    """Capture-file mode end to end with the kernel (interpreter on CPU): (a) within noise, (b) nonzero for fp4; a
    zero tolerance must fail, so the check is live."""
    path = tmp_path / "cap.safetensors"
    _tiny_capture(path)
    rep = va.verify_attn_file(path, ["nvfp4", "bf16"], max_queries=6, backend="triton", device=DEVICE)
    assert rep.backend in ("triton", "triton-interpreter") and rep.passed
    assert [r.format for r in rep.layers] == ["nvfp4-rcp", "bf16"] and rep.layers[0].queries == 6
    nv, bf = rep.layers
    assert 0 < nv.vs_dequant.max_rel < 1e-4 and nv.vs_original.rel_l2 > 10 * nv.vs_dequant.rel_l2
    assert bf.vs_original.max_rel < 1e-4  # bf16 K/V are the original: (a) and (b) coincide
    strict = va.verify_attn_file(path, ["nvfp4"], max_queries=3, backend="triton", tolerance=0.0, device=DEVICE)
    assert not strict.passed and not strict.overall[0].passed


def test_verify_attn_synthetic_torch_path_and_cli_json():
    res = CliRunner().invoke(app, ["verify-attn", "--synthetic", "--batch", "2", "--context-lens", "1,300",
                                   "--formats", "nvfp4,fp8-token", "--backend", "torch", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["geometry"]["context_lens"] == [1, 300] and rep["geometry"]["num_q_heads"] == 16
    assert [r["format"] for r in rep["overall"]] == ["nvfp4-rcp", "fp8-token"]
    assert rep["overall"][0]["vs_original"]["rel_l2"] > rep["overall"][1]["vs_original"]["rel_l2"] > 0
    bad = CliRunner().invoke(app, ["verify-attn", "--synthetic", "--batch", "2", "--context-lens", "1,2,3",
                                   "--backend", "torch"])
    assert bad.exit_code == 2 and "--context-lens" in bad.output


def test_verify_attn_synthetic_runs_the_decode_kernel(monkeypatch, tmp_path):
    """The synthetic step goes through the decode kernel (the interpreter's portable kernel on CPU); `kernel` picks
    the launch and each row says which ran. The Gluon fast path is stubbed in (device check patched, the kernel
    replaced by the reference: it cannot run here) to check that "auto" takes it where the default launch does."""
    from kvtool.kernels import sparse_attn_gluon as G

    rep = va.verify_attn_synthetic(["nvfp4", "mxfp4"], batch=2, context_lens="300", backend="triton", device=DEVICE)
    assert rep.passed and [r.kernel for r in rep.layers] == ["decode portable"] * 2
    assert va.verify_attn_synthetic(["nvfp4"], batch=2, context_lens="5", backend="torch").layers[0].kernel == "torch"
    if not G.device_ok(torch.device(DEVICE)):  # off CUDA >= 8.9 the fast path is an error, not a silent fallback
        with pytest.raises(KernelArgumentError, match="gluon=True"):
            va.verify_attn_synthetic(["nvfp4"], batch=2, context_lens="300", backend="triton", kernel="gluon",
                                     device=DEVICE)
    with pytest.raises(InputError, match="kernel must be"):
        va.verify_attn_synthetic(["nvfp4"], kernel="fast")
    path = tmp_path / "cap.safetensors"
    _tiny_capture(path)
    with pytest.raises(InputError, match="prefill"):
        va.verify_attn_file(path, ["nvfp4"], kernel="gluon")
    calls = []

    def fake_gluon(q, k_cache, v_cache, table, ctx, ids, qk_scale, v_scalar, splits, out_dtype, combine):
        calls.append(k_cache.fmt.label)
        return paged_sparse_decode_ref(q, k_cache, v_cache, table, ctx, ids, 128).to(out_dtype)

    monkeypatch.setattr(G, "device_ok", lambda device: True)
    monkeypatch.setattr(G, "sparse_decode", fake_gluon)
    rep = va.verify_attn_synthetic(["nvfp4", "mxfp4"], batch=64, context_lens="200", backend="triton", device=DEVICE)
    assert [r.kernel for r in rep.layers] == ["decode gluon", "decode gluon"]  # both from 16 requests
    assert calls == ["nvfp4-rcp", "mxfp4-rceil"] and rep.passed
    rep = va.verify_attn_synthetic(["nvfp4"], batch=4, context_lens="200", backend="triton", device=DEVICE)
    assert [r.kernel for r in rep.layers] == ["decode portable"] and len(calls) == 2  # below the threshold
    rep = va.verify_attn_synthetic(["mxfp4"], batch=2, context_lens="200", backend="triton", kernel="gluon",
                                   device=DEVICE)
    assert [r.kernel for r in rep.layers] == ["decode gluon"] and calls[-1] == "mxfp4-rceil"


def test_verify_attn_cli_arguments(monkeypatch, tmp_path):
    seen = {}

    def spy(names, **kw):
        seen.update(kw, names=names)
        return va.VerifyAttnReport("s", "cpu", "torch", {}, "random", 2e-3, names, passed=False)

    monkeypatch.setattr(va, "verify_attn_synthetic", spy)
    res = CliRunner().invoke(app, ["verify-attn", "--synthetic", "--formats", "nvfp4, mxfp4-floor", "--batch", "3",
                                   "--context-lens", "5", "--seed", "7", "--tolerance", "0.01"])
    assert res.exit_code == 1, res.output  # the report did not pass
    assert seen["names"] == ["nvfp4", "mxfp4-floor"] and seen["batch"] == 3 and seen["context_lens"] == "5"
    assert seen["seed"] == 7 and seen["tolerance"] == 0.01 and seen["device"] == "cpu" and seen["kernel"] == "auto"
    res = CliRunner().invoke(app, ["verify-attn", "--synthetic", "--kernel", "portable"])
    assert seen["kernel"] == "portable"
    both = CliRunner().invoke(app, ["verify-attn", str(tmp_path / "x.safetensors"), "--synthetic"])
    assert both.exit_code == 2 and "not both" in both.output


def test_bench_attn_plumbing_on_cpu():
    """Tiny CPU run: rows, byte accounting, and the eager peer equals the reference. The kernel row runs only under
    the interpreter (device "cpu" on a CUDA machine has no kernel to run: the row is left out, with a note)."""
    from kvtool.bench.attn import _Step, eager_sparse_decode, run_attn_bench

    rep = run_attn_bench(batches=(1,), formats=("nvfp4",), context=300, device="cpu")
    names = [r.name for r in rep.rows]
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert names == ["triton nvfp4-rcp"] * interp + ["torch eager nvfp4-rcp", "torch SDPA (pre-gathered bf16)"]
    assert ("note" in rep.extra) != interp
    # 300 visible tokens x (K + V) x 72 B, q and output 16 x 128 bf16 each, 16 ids, 1 context length
    assert rep.rows[-2].bytes_moved == 300 * 2 * 72 + 2 * 16 * 128 * 2 + 16 * 4 + 4
    step = _Step("mxfp4", 2, 700, 1, "cpu", torch.Generator().manual_seed(0))
    got = eager_sparse_decode(step.q, step.k[0], step.v[0], step.table, step.ctx, step.ids[0], 128)
    want = paged_sparse_decode_ref(step.q, step.k[0], step.v[0], step.table, step.ctx, step.ids[0], 128)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # the fixed-cost probes of the sweep: the first k selected blocks kept, the rest -1; k = 0 moves only q, ids, out
    io = 2 * 2 * 16 * 128 * 2 + 2 * 16 * 4 + 2 * 4
    empty = step.probe_ids(0)
    assert (empty[0] == -1).all() and step.selection_bytes(empty) == io
    one = step.probe_ids(1)
    assert torch.equal(one[0][..., 0], step.ids[0][..., 0]) and (one[0][..., 1:] == -1).all()
    assert io < step.selection_bytes(one) <= io + 2 * 2 * 128 * 2 * 68
    assert step.selection_bytes(step.ids) == step.bytes
    out = eager_sparse_decode(step.q, step.k[0], step.v[0], step.table, step.ctx, empty[0], 128)
    assert not out.float().any()  # nothing visible: zeros
