"""`kvtool decode`: compare KV-cache and index-cache formats end to end on a real model (or an M3-shaped one).

Every configuration (a K/V format and an index format) runs the same model over its own paged caches
(`ConfigCache`): each step stores the new K, V and index key (quantize-on-write), selects blocks M3-style from the
index query against its own index cache (sparse mode), and attends over its own K/V cache. The baseline (bf16 K/V and
bf16 index by default) runs beside them in lockstep:

1. Teacher-forced: the baseline's token stream (the prompt, then the baseline's greedy continuation up to `tokens`)
   feeds every configuration; per position KL(p_base || p), top-1 agreement, delta-p of the stream's next token and the
   perplexity ratio (`decode_metrics`), and per layer the block selection and attention output against the baseline's.
2. Free-running: from the end of the prompt (each cache rewound there: later writes overwrite the teacher-forced
   tokens), each configuration generates `gen_tokens` greedily on its own; the first divergence from the baseline's
   generation and the token agreement are reported (texts side by side for smollm2). The generation runs every
   configuration in lockstep (`forward_group`: one pass over the weights per step for all of them); then each takes
   a few more timed steps on its own: tokens/s per configuration (batch / median step time), beside a plain bf16
   dense decode of the same model stepped in turn with them (so a load spike on a shared machine hits every
   configuration alike).
3. The verdict (`decode_stats`): the noise floor (the baseline again with split-K attention, a harmless change of
   summation order) read beside every metric, per position bucket; bootstrap intervals over documents and blocks of
   positions, paired between configurations (which ones are not distinguishable); llama.cpp's `--kl-divergence`
   statistics under its names.
With the default corpus the prompt fills all `tokens` positions; a user prompt (without --tokens) is teacher-forced
together with the baseline's continuation of `gen_tokens` tokens.

On CPU the caches keep an fp32 shadow of the dequantized tokens (decoded once at store: cached tokens never change),
so attention sees exactly the dequantized cache at about bf16 speed; on CUDA the Triton kernels read the paged bytes
(`--backend`), with a warning and the torch path where a kernel is missing.

The loop is gpt-fast-shaped (`Decoder.prefill`, `decode_one`, `decode_n`, `generate`). The prompt is prefilled in
chunks with per-query selections (each query sees exactly the tokens up to its own position, as in a token-by-token
run; a test compares the two).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvtool.attention import all_blocks_selection
from kvtool.backend import resolve_backend, resolve_device, triton_available
from kvtool.errors import FormatError, InputError, KvtoolError
from kvtool.formats import get_format
from kvtool.indexer import IndexerConfig, reference_block_scores, select_topk
from kvtool.models.base import CausalLM, load_model
from kvtool.workflows.decode_cache import CacheSpec, ConfigCache, PlainCache, attend_triton, select_triton
from kvtool.workflows.decode_metrics import (BaseChunk, BucketMetrics, LayerAccumulator, LayerMetrics, StreamMetrics,
                                             agreement_pct, bucket_edges, first_divergence)
from kvtool.workflows import decode_stats

__all__ = [
    "ConfigReport", "DEFAULT_PRESET", "DecodeOptions", "DecodeReport", "Decoder", "Generation", "PRESETS",
    "ProgressEvent", "StepTrace", "block_masked_attention", "forward_group", "resolve_specs", "run_decode"
]

# Per-model defaults (kwargs of DecodeOptions fields left None): small enough for a 2-core CPU in a few minutes.
PRESETS = {
    "smollm2": dict(tokens=1024, gen_tokens=32),  # top-8 of 64-token blocks is a choice from position 512 on
    "synthetic-m3": dict(tokens=2560, gen_tokens=16, layers=4),  # top-16 of 128-token blocks: a choice from 2048
    "tiny-llama": dict(tokens=96, gen_tokens=16),
}
DEFAULT_PRESET = dict(tokens=256, gen_tokens=32)


@dataclass
class DecodeOptions:
    """What `kvtool decode` runs. Format names / labels as in `kvtool quantize`; `format_opts` (scale_rule, recipe,
    outer_scale, fp8_scale) apply to every candidate format they fit. None = the model's preset / config default."""

    kv: list[str]
    index: list[str]
    baseline_kv: str = "bf16"
    baseline_index: str = "bf16"
    format_opts: dict = field(default_factory=dict)
    model: str = "smollm2"
    prompt: str | None = None
    tokens: int | None = None
    gen_tokens: int | None = None
    seed: int = 0
    device: str = "cpu"
    batch: int = 1
    sparse: bool = True
    block_size: int | None = None
    topk: int | None = None
    local_blocks: int | None = None
    init_blocks: int | None = None
    layers: int | None = None  # truncate the model (synthetic models; None = preset)
    mem_gb: float = 8.0
    chunk: int = 128
    speed_reference: bool = True
    backend: str = "auto"  # 'auto' (triton on cuda, torch on cpu) | 'torch' | 'triton'
    floor: bool = True  # run the noise floor: the baseline again under a harmless change (split-K attention)
    rotate: int | None = None  # Hadamard rotation added to every candidate format (kvtool.formats.rotation)
    resamples: int = 1000  # bootstrap resamples (0: no intervals)
    lockstep: bool = True  # free run in lockstep (weights read once per step), then `timed_steps` timed steps each
    timed_steps: int = 8


@dataclass
class Generation:
    """Free-running greedy generation of sequence 0 (and agreement over the batch)."""

    tokens: list[int]
    text: str | None
    first_divergence: int | None  # vs the baseline's generation; None = identical
    agreement_pct: float  # % of generated positions equal to the baseline's, over the batch


@dataclass
class ConfigReport:
    label: str
    kv: dict
    index: dict | None
    bytes_per_token: int  # all layers, K + V + index
    tokens_in_mem: int  # tokens that fit in mem_gb GiB
    capacity_vs_baseline: float
    tokens_per_s: float | None  # free-running decode, batch tokens per second
    speed_vs_bf16: float | None  # tokens_per_s / the plain bf16 dense run's
    overall: BucketMetrics | None  # None for the baseline itself
    buckets: list[BucketMetrics]
    layers: list[LayerMetrics]
    generation: Generation | None
    series: dict  # per position: kl, top1_pct, dp (batch means)
    llama_cpp: dict = field(default_factory=dict)  # llama.cpp --kl-divergence statistics under its names
    intervals: dict = field(default_factory=dict)  # metric -> Interval (bootstrap, overall)
    bucket_intervals: list = field(default_factory=list)  # per bucket: metric -> Interval


@dataclass
class DecodeReport:
    model: dict
    device: str
    mode: str  # 'sparse' | 'dense'
    selection: dict | None  # block_size, topk, init_blocks, local_blocks
    batch: int
    tokens: int  # teacher-forced positions
    prompt_tokens: int
    gen_tokens: int
    seed: int
    mem_gb: float
    paths: dict  # 'store' / 'index' / 'attention': which implementation ran
    prompt_tail: str | None
    baseline: ConfigReport
    candidates: list[ConfigReport]
    bf16_dense_tokens_per_s: float | None
    warnings: list[str]
    floor: ConfigReport | None = None  # the noise floor: the baseline against itself under a harmless change
    floor_change: str | None = None  # what the harmless change was
    confidence: dict | None = None  # bootstrap basis / level / resamples and the paired comparisons
    documents: list = field(default_factory=list)  # the names of the B texts (one per sequence)


@dataclass
class ProgressEvent:
    phase: str  # 'teacher-forced' | 'generate' | 'timed steps'
    done: int
    total: int
    running: dict  # label -> (mean KL, top-1 %) so far


# ------------------------------------------------------------------------------------------------- the decode loop
def block_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                           block_ids: torch.Tensor | None, block_size: int, split: bool = False) -> torch.Tensor:
    """`sparse_attention_ref` (block_ids given) or `dense_attention_ref` (None) computed as dense attention under a
    token mask: the fast CPU path of the decode loop at small contexts (equal up to fp32 summation order; a test
    compares them). q [Hq, T, D], k / v [S, Hkv, D] fp32, q_pos [T], block_ids [Hkv, T, K] int (-1 padded, never a
    block twice) -> fp32 [Hq, T, D]; a query that sees no token gets zeros. `split`: the keys in two halves, each
    with its own max and sum, merged after (flash-decoding's split-K order): the same math in another fp32
    summation order, the noise floor's harmless change."""
    hq, T, D = q.shape
    S, hkv, _ = k.shape
    visible = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]        # visible: [T, S]
    mask = visible.expand(hkv, T, S)                                              # mask: [Hkv, T, S]
    if block_ids is not None:
        nb = -(-S // block_size)
        sel = torch.zeros(hkv, T, nb + 1, dtype=torch.bool, device=q.device)
        sel.scatter_(2, torch.where(block_ids < 0, nb, block_ids.long()).clamp(max=nb), True)
        mask = sel[..., :nb].repeat_interleave(block_size, dim=2)[..., :S] & visible
    g = hq // hkv
    qg = q.reshape(hkv, g * T, D)                                                 # qg: [Hkv, G*T, D]
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * (1.0 / math.sqrt(D))            # scores: [Hkv, G*T, S]
    scores = scores.view(hkv, g, T, S).masked_fill(~mask[:, None], -math.inf)
    if split and S > 1:
        parts = [_partial(scores[..., a:b], v[a:b]) for a, b in ((0, S // 2), (S // 2, S))]
        m = torch.maximum(parts[0][0], parts[1][0])
        w = [torch.exp(pm - m) for pm, _, _ in parts]                             # rescale each half to the max
        l = w[0] * parts[0][1] + w[1] * parts[1][1]
        out = w[0] * parts[0][2] + w[1] * parts[1][2]
    else:
        m, l, out = _partial(scores, v)
    out = out / torch.where(l > 0, l, torch.ones_like(l))                         # out: [Hkv, G, T, D]
    return out.reshape(hq, T, D)


def _partial(scores: torch.Tensor, v: torch.Tensor):
    """Unnormalized softmax-weighted sum over some keys: scores [Hkv, G, T, S'] (masked: -inf), v [S', Hkv, D] ->
    (row max m, row sum l [Hkv, G, T, 1], p @ v [Hkv, G, T, D])."""
    hkv, g, T, S = scores.shape
    m = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)  # all-masked rows -> finite m
    p = torch.exp(scores - m)                                                     # p: [Hkv, G, T, S']
    out = torch.bmm(p.view(hkv, g * T, S), v.permute(1, 0, 2)).view(hkv, g, T, -1)
    return m, p.sum(-1, keepdim=True), out


@dataclass
class StepTrace:
    """Per layer of the latest forward: block ids [B, Hi, T, K] and block scores [B, Hi, T, NB] (None in dense mode),
    attention output [B, T, Hq, D]."""

    ids: list = field(default_factory=list)
    scores: list = field(default_factory=list)
    attn: list = field(default_factory=list)


class Decoder:
    """One configuration's decode state: the model, its cache, the position, and (when `record`) the trace of the
    latest forward for the per-layer comparison. `indexer` None = dense attention."""

    def __init__(self, model: CausalLM, cache: ConfigCache | PlainCache, indexer: IndexerConfig | None,
                 kernels: dict | None = None, record: bool = False, split: bool = False):
        self.model, self.cache, self.indexer, self.record = model, cache, indexer, record
        self.split = split  # split-K attention on the torch path (the noise floor's harmless change)
        self.kernels = kernels or {}  # 'index' / 'attention' -> True where the Triton path runs
        self.pos, self.length, self.trace = 0, 0, StepTrace()
        self.step_s: list[float] = []  # wall time of each decode_one (tokens/s = batch / median)
        self.at_prompt_end: torch.Tensor | None = None  # logits [B, V] at the prompt's last position

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] at positions self.pos .. self.pos + T - 1 -> logits fp32 [B, T, V]."""
        B, T = tokens.shape
        pos = torch.arange(self.pos, self.pos + T, device=self.model.device)      # pos: [T]
        self.trace, self.length = StepTrace(), self.pos + T                      # length: context after this step
        h = self.model.embed(tokens.reshape(-1))                                  # h: [B*T, hidden]
        for layer in range(self.model.config.n_layers):
            h = self.layer(layer, h, pos, B)
        self.pos += T
        return self.model.logits(h).view(B, T, -1)

    def layer(self, layer: int, h: torch.Tensor, pos: torch.Tensor, B: int) -> torch.Tensor:
        """One decoder layer over the cache: h [B*T, hidden] -> [B*T, hidden]."""
        c, T = self.model.config, pos.shape[0]
        q, k, v = self.model.qkv(layer, h, pos.repeat(B))                         # q: [B*T, Hq, D]; k, v: [B*T, Hkv, D]
        iq = ik = None
        if self.indexer is not None:
            iq, ik = self.model.index_qk(layer, q, k, h, pos.repeat(B))           # iq: [B*T, Hi, Di]; ik: [B*T, Di]
            iq, ik = iq.view(B, T, c.index_heads, -1), ik.view(B, T, -1)
        self.cache.update(layer, pos, k.view(B, T, c.n_kv_heads, -1), v.view(B, T, c.n_kv_heads, -1), ik)
        attn = self.attend(layer, q.view(B, T, c.n_heads, -1), iq, pos)           # attn: [B, T, Hq, D]
        if self.record:
            self.trace.attn.append(attn)
        return self.model.attn_out(layer, h, attn.reshape(B * T, c.n_heads, -1))

    def attend(self, layer: int, q: torch.Tensor, iq: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        """q [B, T, Hq, D], iq [B, T, Hi, Di] -> attention output fp32 [B, T, Hq, D]: the Triton kernels over the
        paged bytes where `kernels` says so, else the torch reference per sequence over the dequantized cache."""
        if isinstance(self.cache, PlainCache):
            return self.cache.attend(layer, q, pos, self.length)
        if self.kernels.get("attention") and (self.indexer is None or self.kernels.get("index")):
            return self.attend_triton(layer, q, iq, pos)
        return self.attend_torch(layer, q, iq, pos)

    def attend_torch(self, layer: int, q: torch.Tensor, iq: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        """The torch path, per sequence over the dequantized cache (the CPU shadow, or decoded on demand)."""
        outs, ids_all, scores_all = [], [], []
        for b in range(q.shape[0]):
            k, v = self.cache.kv(layer, b, self.length)                           # k, v: [S, Hkv, D]
            ids = None
            if self.indexer is not None:
                ik = self.cache.index_keys(layer, b, self.length)                 # ik: [S, Di]
                scores = reference_block_scores(iq[b].transpose(0, 1), ik, pos, self.indexer)  # [Hi, T, NB]
                ids = select_topk(scores, pos, self.indexer)                      # ids: [Hi, T, K] int32
                ids_all.append(ids)
                scores_all.append(scores)
            block = self.indexer.block_size if self.indexer else 1
            outs.append(block_masked_attention(q[b].transpose(0, 1), k, v, pos, ids, block, self.split))
        if self.record and ids_all:
            self.trace.ids.append(torch.stack(ids_all))                           # [B, Hi, T, K]
            self.trace.scores.append(torch.stack(scores_all))                     # [B, Hi, T, NB]
        return torch.stack(outs).transpose(1, 2)                                  # [B, T, Hq, D]

    def attend_triton(self, layer: int, q: torch.Tensor, iq: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        """The CUDA path: C's scorer picks blocks from the paged index cache, D's kernel attends over the paged K/V."""
        B, T, c = q.shape[0], q.shape[1], self.model.config
        if self.indexer is None:  # dense: every block up to the query's own (one block = one page)
            block = self.cache.page_size
            ids = all_blocks_selection(pos, block, c.n_kv_heads)[None].expand(B, -1, -1, -1)  # [B, Hkv, T, NB]
        else:
            block = self.indexer.block_size
            ids, scores = select_triton(self.cache, layer, iq, pos, self.length, self.indexer, self.record)
            if self.record:                                                       # ids: [B, Hi, T, K]
                self.trace.ids.append(ids)
                self.trace.scores.append(scores)
        return attend_triton(self.cache, layer, q, pos, self.length, ids.to(torch.int32), block)  # [B, T, Hq, D]

    def prefill(self, tokens: torch.Tensor, chunk: int = 128) -> torch.Tensor:
        """tokens [B, P] from the current position, in chunks of `chunk` -> logits [B, P, V]."""
        return torch.cat([self.forward(tokens[:, i:i + chunk]) for i in range(0, tokens.shape[1], chunk)], dim=1)

    def decode_one(self, token: torch.Tensor) -> torch.Tensor:
        """token [B] -> next-token logits [B, V] (timed: tokens/s counts these steps)."""
        t0 = time.perf_counter()
        logits = self.forward(token[:, None])[:, 0]                              # [B, V]
        if logits.is_cuda:
            torch.cuda.synchronize()
        self.step_s.append(time.perf_counter() - t0)
        return logits

    def decode_n(self, token: torch.Tensor, n: int, on_step: Callable | None = None) -> torch.Tensor:
        """Greedy: feed token [B], then each argmax, n times -> the n tokens after it [B, n]."""
        out = []
        for i in range(n):
            token = self.decode_one(token).argmax(-1)                             # token: [B]
            out.append(token)
            if on_step:
                on_step(i + 1)
        return torch.stack(out, dim=1) if out else token.new_zeros(token.shape[0], 0)

    def generate(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        """prompt [B, P] -> n greedy tokens [B, n] (prefill, then decode_n)."""
        first = self.prefill(prompt)[:, -1].argmax(-1)                            # first: [B]
        return torch.cat([first[:, None], self.decode_n(first, n - 1)], dim=1) if n > 0 else prompt[:, :0]

    @property
    def tokens_per_s(self) -> float | None:
        """Batch tokens per second of the decode_one steps: batch / the median step time (robust to load spikes
        from other processes on a shared machine)."""
        return self.cache.batch / statistics.median(self.step_s) if self.step_s else None


# ----------------------------------------------------------------------------------------------------- the workflow
def resolve_specs(opts: DecodeOptions) -> tuple[CacheSpec, list[CacheSpec]]:
    """The baseline and the candidate configurations (every (kv, index) pair; index None in dense mode)."""
    kvs = [_formats(opts.kv, opts.format_opts, "--kv", opts.rotate)]
    idxs = [_formats(opts.index, opts.format_opts, "--index", opts.rotate)] if opts.sparse else [[None]]
    _check_options_used(opts.format_opts, kvs[0] + (idxs[0] if opts.sparse else []))
    base = CacheSpec(get_format(opts.baseline_kv), get_format(opts.baseline_index) if opts.sparse else None)
    cands = []
    for kv in kvs[0]:
        for idx in idxs[0]:
            spec = CacheSpec(kv, idx)
            if spec not in cands:
                cands.append(spec)
    return base, cands


def _formats(names: list[str], format_opts: dict, flag: str, rotate: int | None = None) -> list:
    names = [n.strip() for item in names for n in str(item).split(",") if n.strip()]
    if not names:
        raise FormatError(f"{flag} needs at least one format name")
    return [get_format(n, strict=False, rotation=rotate, **{k: v for k, v in format_opts.items() if v is not None})
            for n in names]


def _check_options_used(format_opts: dict, fmts: list) -> None:
    for key, value in format_opts.items():
        if value is not None and not any(key in f.spec.options for f in fmts if f is not None):
            raise FormatError(f"option --{key.replace('_', '-')} applies to none of the formats given")


def _prompt_tokens(model: CausalLM, opts: DecodeOptions, n: int) -> tuple[torch.Tensor, str | None, list[str]]:
    """The prompt [B, P] (P <= n), its tail text and the names of the B texts: the user's text, the built-in corpus
    (B documents, `corpus.documents`; the first is the classic default text), or seeded random ids for models
    without a tokenizer."""
    from kvtool.models.corpus import documents, tokenize  # noqa: PLC0415

    tok = model.tokenizer
    if opts.prompt is not None:
        if opts.batch != 1:
            raise InputError("--batch > 1 runs B documents of the built-in corpus; a --prompt runs alone")
        ids = tokenize(model, opts.prompt, n)                # no tokenizer: UTF-8 bytes folded into the vocabulary
        return ids[None], tok.decode(ids[-48:].tolist()) if tok else None, ["prompt"]
    if tok is None:
        g = torch.Generator().manual_seed(opts.seed)
        ids = torch.randint(0, model.config.vocab_size, (opts.batch, n), generator=g)
        return ids, None, [f"random-{b}" for b in range(opts.batch)]
    docs = documents(opts.batch, 8 * n)
    rows = []
    for name, text in docs:
        ids = tok.encode(text)
        if len(ids) < n:
            raise InputError(f"corpus document {name!r} gave {len(ids)} tokens, fewer than --tokens {n}")
        rows.append(ids[:n])
    prompt = torch.tensor(rows)
    return prompt, tok.decode(prompt[0, -48:].tolist()), [name for name, _ in docs]


def _paths(kernels: dict, sparse: bool) -> dict:
    """What ran, for the report: 'triton' or the torch path's description, per step."""
    torch_path = "torch (fp32 shadow of the dequantized cache)" if not kernels else "torch (dequantize on demand)"
    attn = kernels.get("attention") and (not sparse or kernels.get("index"))
    return {"store": "triton" if kernels.get("store") else "torch",
            "index": ("triton" if attn else torch_path) if sparse else "none (dense)",
            "attention": "triton" if attn else torch_path}


def _indexer(model: CausalLM, opts: DecodeOptions) -> IndexerConfig | None:
    c = model.config
    if not opts.sparse:
        return None
    if c.index_heads != c.n_kv_heads:
        raise KvtoolError(f"model {c.name}: sparse mode needs one index head per KV head ({c.index_heads} vs "
                          f"{c.n_kv_heads})")
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return IndexerConfig(pick(opts.block_size, c.block_size), pick(opts.topk, c.topk),
                         pick(opts.init_blocks, c.init_blocks), pick(opts.local_blocks, c.local_blocks))


def run_decode(opts: DecodeOptions, progress: Callable[[ProgressEvent], None] | None = None,
               warn: Callable[[str], None] | None = None, model: CausalLM | None = None) -> DecodeReport:
    """Run the comparison (module docstring) and return the report. `progress` gets a ProgressEvent per chunk or
    step, `warn` each warning (default: stderr); `model` replaces `opts.model` (any CausalLM on `opts.device`)."""
    warnings: list[str] = []

    def note(msg: str) -> None:
        warnings.append(msg)
        (warn or (lambda m: print(f"warning: {m}", file=sys.stderr)))(msg)

    preset = {**DEFAULT_PRESET, **PRESETS.get(opts.model, {})}
    cap = opts.tokens if opts.tokens is not None else preset["tokens"]
    n_gen = opts.gen_tokens if opts.gen_tokens is not None else preset["gen_tokens"]
    if cap < 2 or n_gen < 0 or opts.batch < 1 or opts.chunk < 1 or opts.mem_gb <= 0:
        raise InputError("need --tokens >= 2, --gen-tokens >= 0, --batch >= 1 and --mem-gb > 0")
    base_spec, cand_specs = resolve_specs(opts)
    device = resolve_device(opts.device)
    torch.manual_seed(opts.seed)
    layers = opts.layers if opts.layers is not None else preset.get("layers")
    if model is None:
        model = load_model(opts.model, device, **({"layers": layers} if layers is not None else {}),
                           **({"seed": opts.seed} if opts.model != "smollm2" else {}))
    indexer = _indexer(model, opts)
    prompt, prompt_tail, doc_names = _prompt_tokens(model, opts, cap)          # prompt: [B, P], P <= cap
    n_tok = cap if opts.tokens is not None or opts.prompt is None else max(prompt.shape[1] + n_gen, 2)
    if indexer is not None and n_tok <= indexer.topk * indexer.block_size:
        note(f"context too short for the index format to matter: top-{indexer.topk} of {indexer.block_size}-token "
             f"blocks selects every block up to position {indexer.topk * indexer.block_size}, and this run has "
             f"{n_tok} positions (no top-k choice; give --tokens > {indexer.topk * indexer.block_size} or a smaller "
             f"--topk)")
    backend = resolve_backend(opts.backend, device)
    kernels = triton_available(note) if backend == "triton" else {}
    paths = _paths(kernels, opts.sparse)
    c = model.config
    max_len = max(n_tok, prompt.shape[1] + n_gen + (opts.timed_steps if opts.lockstep else 0))
    page = indexer.block_size if indexer else 64

    def make(spec: CacheSpec, record: bool, floor: bool = False) -> Decoder:
        kern = {} if floor else kernels  # the floor runs the torch path: on CUDA that is another backend as well
        cache = ConfigCache(spec, c.n_layers, c.n_kv_heads, c.head_dim, c.index_dim, opts.batch, max_len, page,
                            device, shadow=not kern, store_backend="triton" if kern.get("store") else "torch")
        return Decoder(model, cache, indexer, kern, record, split=floor)

    with torch.no_grad():
        base = make(base_spec, True)
        cands = [make(s, True) for s in cand_specs]
        floor = [make(base_spec, False, floor=True)] if opts.floor else []
        stream_m = [StreamMetrics() for _ in cands + floor]
        layer_m = [LayerAccumulator(c.n_layers, indexer is not None) for _ in cands]
        _teacher_forced(base, cands + floor, prompt.to(device), n_tok, opts.chunk, stream_m, layer_m, progress)
        extra = opts.timed_steps if opts.lockstep else 0
        ref = [_bf16_reference(model, base, prompt.shape[1], n_gen + extra)] if opts.speed_reference else []
        decs = [base] + cands + floor + ref
        timed = [True] * (1 + len(cands)) + [False] * len(floor) + [True] * len(ref)
        gens = _free_run(decs, n_gen, progress, lambda: _running(cands, stream_m), timed,
                         opts.timed_steps if opts.lockstep else 0)
        ref_tps = ref[0].tokens_per_s if ref else None
    report = _report(opts, model, device, indexer, paths, prompt_tail, prompt.shape[1], n_tok, n_gen, base_spec,
                     cand_specs, base, cands, stream_m[:len(cands)], layer_m, gens[:len(cands) + 1], ref_tps,
                     warnings)
    report.documents = doc_names
    if floor:
        report.floor = _floor_report(report, base_spec, floor[0], stream_m[-1], gens[len(cands) + 1], gens[0],
                                     n_tok, model)
        report.floor_change = ("split-K attention: the context's keys in two halves, each with its own max and sum, "
                               "merged after (another fp32 summation order; torch path)")
    _confidence(report, cands, stream_m, floor, n_tok, opts)
    return report


def _teacher_forced(base: Decoder, cands: list[Decoder], prompt: torch.Tensor, n_tok: int, chunk: int,
                    stream_m: list[StreamMetrics], layer_m: list[LayerAccumulator],
                    progress: Callable | None) -> None:
    """Feed the baseline's stream (prompt, then its greedy continuation up to n_tok) to every decoder in lockstep,
    accumulating the metrics; each decoder keeps its logits at the prompt's last position (`at_prompt_end`)."""
    P = prompt.shape[1]
    pos, token_in = 0, None
    while pos < n_tok:
        toks = prompt[:, pos:pos + chunk] if pos < P else token_in[:, None]          # toks: [B, T]
        T = toks.shape[1]
        lb = base.forward(toks)                                                   # lb: [B, T, V]
        nxt = torch.full_like(toks, -1)                                           # the stream's next tokens
        nxt[:, :-1] = toks[:, 1:]
        if pos + T < P:
            nxt[:, -1] = prompt[:, pos + T]
        elif pos + T < n_tok:
            nxt[:, -1] = lb[:, -1].argmax(-1)
        bc = BaseChunk.of(lb)                                                     # shared by every comparison
        for i, (dec, sm) in enumerate(zip(cands, stream_m)):
            lc = dec.forward(toks)
            sm.update(pos, bc, lc, nxt)
            if i < len(layer_m):
                _compare_layers(layer_m[i], dec.trace, base.trace, pos, base.indexer)
            if pos < P <= pos + T:
                dec.at_prompt_end = lc[:, P - 1 - pos]
        if pos < P <= pos + T:
            base.at_prompt_end = lb[:, P - 1 - pos]
        token_in = nxt[:, -1]
        pos += T
        if progress:
            progress(ProgressEvent("teacher-forced", min(pos, n_tok), n_tok, _running(cands[:len(layer_m)],
                                                                                      stream_m)))
    for dec in [base] + cands:
        dec.record, dec.trace, dec.pos = False, StepTrace(), P  # rewind: the free run continues the prompt


def _compare_layers(acc: LayerAccumulator, trace: StepTrace, base: StepTrace, pos0: int,
                    indexer: IndexerConfig | None) -> None:
    """Per layer: selections (only rows where the selection is a choice: more valid blocks than top-k; elsewhere
    every valid block is taken by both) and attention outputs against the baseline's."""
    choice = None
    if indexer is not None and trace.ids:
        T = trace.ids[0].shape[2]
        choice = (torch.arange(pos0, pos0 + T) // indexer.block_size + 1 > indexer.topk).to(trace.ids[0].device)
    for layer, (attn, battn) in enumerate(zip(trace.attn, base.attn)):
        ids = bids = bscores = None
        if choice is not None and bool(choice.any()):
            ids, bids = trace.ids[layer][:, :, choice], base.ids[layer][:, :, choice]  # [B, Hi, T', K]
            bscores = base.scores[layer][:, :, choice]                                # [B, Hi, T', NB]
        acc.update(layer, ids, bids, bscores, attn, battn)


def _running(cands: list[Decoder], stream_m: list[StreamMetrics]) -> dict:
    return {d.cache.spec.label: sm.running() for d, sm in zip(cands, stream_m)}


def forward_group(decs: list[Decoder], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """One forward of several decoders at the same position in lockstep: tokens [B, T] each -> logits [B, T, V]
    each. The model's row-wise work (embedding, projections, MLP, LM head) runs once over every decoder's rows, so a
    decode step reads the weights once instead of once per configuration (on a CPU a one-token step is bound by
    that read); each decoder still stores into and attends over its own cache. Equal to `forward` per decoder up
    to the matmuls' row blocking (a test compares them: the same bits for prefill chunks, ~1e-4 in the logits of a
    one-token step, where more rows take another gemm path)."""
    model, n = decs[0].model, len(decs)
    B, T = tokens[0].shape
    p0 = decs[0].pos
    if any(d.pos != p0 for d in decs) or any(t.shape != tokens[0].shape for t in tokens):
        raise KvtoolError("forward_group needs every decoder at the same position with the same token shape")
    c = model.config
    pos = torch.arange(p0, p0 + T, device=model.device)
    rows = pos.repeat(n * B)
    for d in decs:
        d.trace, d.length = StepTrace(), p0 + T
    h = model.embed(torch.cat(tokens).reshape(-1))                               # h: [n*B*T, hidden]
    any_index = any(d.indexer is not None for d in decs)
    for layer in range(c.n_layers):
        q, k, v = model.qkv(layer, h, rows)                                       # q: [n*B*T, Hq, D]
        iq = ik = None
        if any_index:
            iq, ik = model.index_qk(layer, q, k, h, rows)
            iq, ik = iq.view(n, B, T, c.index_heads, -1), ik.view(n, B, T, -1)
        q, k, v = q.view(n, B, T, c.n_heads, -1), k.view(n, B, T, c.n_kv_heads, -1), v.view(n, B, T, c.n_kv_heads, -1)
        outs = []
        for i, d in enumerate(decs):
            has = d.indexer is not None
            d.cache.update(layer, pos, k[i], v[i], ik[i] if has else None)
            outs.append(d.attend(layer, q[i], iq[i] if has else None, pos))        # [B, T, Hq, D]
        h = model.attn_out(layer, h, torch.stack(outs).reshape(n * B * T, c.n_heads, -1))
    for d in decs:
        d.pos += T
    return list(model.logits(h).view(n, B, T, -1).unbind(0))


def _free_run(decs: list[Decoder], n_gen: int, progress: Callable | None, running: Callable,
              timed: list[bool] | None = None, timed_steps: int = 0) -> list[torch.Tensor]:
    """Each decoder generates n_gen greedy tokens after the prompt: [B, n_gen] each.

    `timed_steps` 0: every step of every decoder is a timed `decode_one`, interleaved (step j of every decoder, then
    step j + 1, so a load spike on a shared machine hits every one alike). Otherwise the generation runs in lockstep
    (`forward_group`, untimed: the weights read once per step for all decoders), then the decoders marked in
    `timed` take `timed_steps` more timed `decode_one` steps each, interleaved the same way (tokens/s comes from
    those; their tokens are not part of the generation)."""
    tokens = [[dec.at_prompt_end.argmax(-1)] for dec in decs]                     # per decoder: [B] per step
    for j in range(1, n_gen):
        if timed_steps:
            for toks, logits in zip(tokens, forward_group(decs, [t[-1][:, None] for t in tokens])):
                toks.append(logits[:, 0].argmax(-1))
        else:
            for dec, toks in zip(decs, tokens):
                toks.append(dec.decode_one(toks[-1]).argmax(-1))
        if progress:
            progress(ProgressEvent("generate", j + 1, n_gen, running()))
    out = [torch.stack(t, dim=1)[:, :n_gen] for t in tokens]
    if timed_steps and n_gen > 0:
        last = [t[-1] for t in tokens]
        for j in range(timed_steps):
            for i, dec in enumerate(decs):
                if timed is None or timed[i]:
                    last[i] = dec.decode_one(last[i]).argmax(-1)
            if progress:
                progress(ProgressEvent("timed steps", j + 1, timed_steps, running()))
    return out


def _bf16_reference(model: CausalLM, base: Decoder, n_prompt: int, n_gen: int) -> Decoder:
    """A plain bf16 dense decoder (PlainCache: contiguous bf16 K/V, no index) over the prompt's context: the speed
    reference, stepped beside the configurations in the free run. Only its step time is reported, so its cache is
    filled with the baseline's K/V of the prompt (bf16 values, the same context length) instead of a prefill of its
    own (a whole extra model pass over the prompt that only warmed the cache)."""
    c = model.config
    B = base.cache.batch
    plain = PlainCache(c.n_layers, c.n_kv_heads, c.head_dim, B, n_prompt + n_gen, model.device)
    for layer in range(c.n_layers):
        for b in range(B):
            k, v = base.cache.kv(layer, b, n_prompt)                              # k, v: [P, Hkv, D]
            plain.k[layer][b, :, :n_prompt] = k.transpose(0, 1).to(torch.bfloat16)
            plain.v[layer][b, :, :n_prompt] = v.transpose(0, 1).to(torch.bfloat16)
    dec = Decoder(model, plain, None)
    dec.pos, dec.at_prompt_end = n_prompt, base.at_prompt_end
    return dec


def _report(opts, model, device, indexer, paths, prompt_tail, n_prompt, n_tok, n_gen, base_spec, cand_specs, base,
            cands, stream_m, layer_m, gens, ref_tps, warnings) -> DecodeReport:
    c = model.config
    tok = model.tokenizer
    mem = opts.mem_gb * 2 ** 30
    base_bpt = base_spec.bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, c.index_dim)

    def config_report(spec, dec, gen, sm, lm) -> ConfigReport:
        bpt = spec.bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, c.index_dim)
        g0 = gen[0].tolist()
        generation = None if n_gen == 0 else Generation(
            g0, tok.decode(g0) if tok else None, first_divergence(g0, gens[0][0].tolist()),
            agreement_pct(gen.reshape(-1).tolist(), gens[0].reshape(-1).tolist()))
        tps = dec.tokens_per_s
        return ConfigReport(spec.label, spec.kv.to_meta(), spec.index.to_meta() if spec.index else None, bpt,
                            int(mem // bpt), base_bpt / bpt, tps, tps / ref_tps if tps and ref_tps else None,
                            sm.merged(0, n_tok) if sm else None, sm.buckets(n_tok) if sm else [],
                            lm.result() if lm else [], generation,
                            {"kl": sm.series_kl, "top1_pct": sm.series_top1, "dp": sm.series_dp} if sm else {})

    selection = None if indexer is None else {"block_size": indexer.block_size, "topk": indexer.topk,
                                              "init_blocks": indexer.init_blocks,
                                              "local_blocks": indexer.local_blocks, "tie_rule": indexer.tie_rule}
    return DecodeReport(
        c.to_dict(), str(device), "sparse" if indexer else "dense", selection, opts.batch, n_tok, n_prompt, n_gen,
        opts.seed, opts.mem_gb, paths, prompt_tail, config_report(base_spec, base, gens[0], None, None),
        [config_report(s, d, g, sm, lm) for s, d, g, sm, lm in zip(cand_specs, cands, gens[1:], stream_m, layer_m)],
        ref_tps, warnings)



def _floor_report(report: DecodeReport, spec: CacheSpec, dec: Decoder, sm: StreamMetrics, gen: torch.Tensor,
                  base_gen: torch.Tensor, n_tok: int, model: CausalLM) -> ConfigReport:
    """The noise floor as a ConfigReport (label `floor: bf16 / bf16`): its metrics against the baseline are what
    rounding noise alone gives (no layer metrics, no timing: it runs the torch path)."""
    tok = model.tokenizer
    g0 = gen[0].tolist()
    generation = None if report.gen_tokens == 0 else Generation(
        g0, tok.decode(g0) if tok else None, first_divergence(g0, base_gen[0].tolist()),
        agreement_pct(gen.reshape(-1).tolist(), base_gen.reshape(-1).tolist()))
    b = report.baseline
    return ConfigReport(f"floor: {spec.label}", b.kv, b.index, b.bytes_per_token, b.tokens_in_mem, 1.0, None, None,
                        sm.merged(0, n_tok), sm.buckets(n_tok), [], generation,
                        {"kl": sm.series_kl, "top1_pct": sm.series_top1, "dp": sm.series_dp})


def _confidence(report: DecodeReport, cands: list[Decoder], stream_m: list[StreamMetrics], floor: list,
                n_tok: int, opts: DecodeOptions) -> None:
    """llama.cpp's statistics per configuration, bootstrap intervals (overall and per bucket) and the paired
    comparisons (each candidate against the floor, then every pair), written into the report."""
    configs = report.candidates + ([report.floor] if report.floor else [])
    arrays = {c.label: sm.arrays() for c, sm in zip(configs, stream_m)}
    for c in configs:
        c.llama_cpp = decode_stats.llama_stats(arrays[c.label])
    if opts.resamples <= 0 or not arrays:
        return
    conf = decode_stats.bootstrap(arrays, bucket_edges(n_tok), report.floor.label if report.floor else None,
                                  resamples=opts.resamples, seed=opts.seed)
    for c in configs:
        c.intervals = conf.overall[c.label]
        c.bucket_intervals = conf.buckets[c.label]
    report.confidence = {"basis": conf.basis, "level": conf.level, "resamples": conf.resamples,
                         "block": decode_stats.BLOCK, "comparisons": conf.comparisons}
