"""vLLM 0.33.0's own MiniMax-M3 Triton kernels as a kvtool implementation (`--impl vllm`, `--peer vllm`).

The kernels are read from vLLM's published files (`vllm/models/minimax_m3/common/ops/index_topk.py` and
`sparse_attn.py`: an installed vllm==0.33.0, else the wheel fetched without dependencies by
`kvtool.engines.wheels`), never copied here. Those two files import only `vllm.platforms.current_platform`,
`vllm.triton_utils` and `vllm.utils.math_utils`; kvtool provides stub modules for those names while each file is
executed under a private module name (`importlib.util.spec_from_file_location`), then restores `sys.modules`, so the
real vllm package (and its dependencies) is never imported.

Functions run: `minimax_m3_index_decode` (decode: block scores + split-K top-k, with `score_out` to read the scores
back), `minimax_m3_index_score` + `minimax_m3_index_topk` (prefill: every query row its own one-token request at its
position), `minimax_m3_index_topk` alone (`select`: top-k over given block scores), `minimax_m3_sparse_attn_decode`
(decode) and `minimax_m3_sparse_attn` (prefill rows).

Layouts (presets `vllm-m3-index`, `vllm-m3-kv` in kvtool.layouts.presets): index keys [pages, 128, D] token-major
(kvtool's one-head paged cache holds the same bytes, viewed as such); main K/V [pages, Hkv, 128, 2 * D] with K then V
per token; fp8 scales as a scalar tensor (fp8 `tensor`) or [Hkv, pages * 128] fp32 per (head, token) (fp8 `token`),
which vLLM indexes by slot. Formats: index bf16, fp8 (unit) and fp8-tensor (the index kernel reads the keys without
any scale: ids are unaffected by one positive scale, and the adapter multiplies the returned block scores by it);
attention bf16, fp8 (unit), fp8-tensor, fp8-token. No FP4 path exists in those files. Block and page size are fixed
at 128 tokens (SPARSE_BLOCK_SIZE).

On the CPU (Triton interpreter) only bf16 can be checked, and as an fp32 stand-in: the interpreter gives garbage for
bf16 arithmetic and bf16 tl.dot, and cannot take fp8 tensors as kernel arguments (numpy has no fp8). The stand-in
passes the bf16 values as fp32 (exact): the index scores are then the same products accumulated in fp32; attention
keeps P and the decode partials in fp32 where the GPU rounds them to bf16, so the CPU checks indexing, masking,
softmax and merge, not the bf16 rounding. The autotuned top-k kernels are pinned to one config there (the
interpreter cannot benchmark). numpy >= 2.4 breaks Triton 3.6's interpreter.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import types
import warnings
from functools import lru_cache, wraps

import torch

from kvtool.backend import interpreting
from kvtool.engines.protocol import AttnCall, IndexCall, IndexOutput
from kvtool.engines.wheels import VLLM, EngineUnavailable, extract
from kvtool.errors import InputError
from kvtool.indexer import IndexerConfig, apply_forced

__all__ = ["VllmM3", "load_ops", "OPS_DIR", "FILES", "bench_index_decode", "bench_index_prefill", "bench_attn_decode"]

OPS_DIR = "vllm/models/minimax_m3/common/ops"
FILES = ("index_topk.py", "sparse_attn.py")
BLOCK = 128  # vLLM's SPARSE_BLOCK_SIZE: one sparse block == one page
_NS = "_kvtool_engine_vllm_m3"
INDEX_FORMATS = ("bf16", "fp8-unit", "fp8-tensor")
ATTN_FORMATS = ("bf16", "fp8-unit", "fp8-tensor", "fp8-token")
_FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ loading + shims
class _Platform:
    """The three `current_platform` questions the files ask, answered for the local torch device."""

    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available() and torch.version.cuda is not None

    @staticmethod
    def is_device_capability(cap) -> bool:
        return torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) == tuple(cap)

    @staticmethod
    def is_arch_support_pdl() -> bool:
        return _Platform.is_cuda() and torch.cuda.get_device_capability()[0] >= 9


def _shim_modules() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    return {
        "vllm": mod("vllm", __path__=[]),
        "vllm.platforms": mod("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": mod("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.utils": mod("vllm.utils", __path__=[]),
        "vllm.utils.math_utils": mod("vllm.utils.math_utils", round_up=lambda x, m: (x + m - 1) // m * m),
    }


@lru_cache(maxsize=None)
def load_ops() -> dict[str, types.ModuleType]:
    """{"index": index_topk module, "attn": sparse_attn module} executed from vLLM's own files with kvtool's shims.
    Raises EngineUnavailable (exit 2, one line with the command to fetch the wheel) when vLLM cannot be had."""
    root = extract(VLLM, [f"{OPS_DIR}/{f}" for f in FILES])
    shims = _shim_modules()
    saved = {name: sys.modules.get(name) for name in shims}
    out = {}
    try:
        sys.modules.update(shims)
        for key, fname in zip(("index", "attn"), FILES):
            path = root / OPS_DIR / fname
            spec = importlib.util.spec_from_file_location(f"{_NS}.{fname[:-3]}", path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # a changed file or a missing name: say so in one line
                raise EngineUnavailable(f"cannot load {path} with kvtool's shims ({type(exc).__name__}: {exc})") \
                    from None
            out[key] = module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    if interpreting():
        _pin_autotune(out["index"])
    return out


def _pin_autotune(module) -> None:
    """The interpreter cannot benchmark: leave each autotuned kernel one config (the smallest BLOCK_SIZE_K, the
    cheapest to interpret; the ids do not depend on it, see tests/engines/test_vllm_topk_defect.py)."""
    for name in ("_topk_index_kernel", "_topk_index_partial_kernel"):
        tuner = getattr(module, name).fn  # heuristics -> autotuner
        tuner.configs = [min(tuner.configs, key=lambda c: c.kwargs["BLOCK_SIZE_K"])]


def _quiet(fn):
    """Under the interpreter, numpy warns on every NaN / -inf the kernels compute on purpose (masked lanes, vLLM's
    -inf * 0): keep that noise off stderr."""
    @wraps(fn)
    def run(*args, **kwargs):
        ctx = warnings.catch_warnings() if interpreting() else contextlib.nullcontext()
        with ctx:
            if interpreting():
                warnings.simplefilter("ignore", RuntimeWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
            return fn(*args, **kwargs)

    return run


# ------------------------------------------------------------------------------------------------ layout helpers
def _standin(device: torch.device) -> bool:
    """CPU tensors run under the interpreter, where bf16 arithmetic is unreliable: pass fp32 copies instead."""
    return device.type == "cpu"


def _payload_dtype(fmt) -> torch.dtype:
    return _FP8 if fmt.is_quantized else torch.bfloat16


def index_cache_tensor(cache, standin: bool = False) -> torch.Tensor:
    """kvtool's one-head index PagedCache as vLLM's index cache [pages, 128, D] (bf16 / fp8; fp32 for the
    interpreter stand-in). The bytes are the same (preset vllm-m3-index): a view, no copy, except the stand-in."""
    x = cache.payload_plane()[:, 0].view(_payload_dtype(cache.fmt))  # [pages, P, D]
    return x.float() if standin else x


def kv_cache_tensor(k_cache, v_cache, standin: bool = False) -> torch.Tensor:
    """K and V PagedCaches as vLLM's main cache [pages, Hkv, 128, 2 * D]: per token K then V (preset vllm-m3-kv)."""
    kv = torch.cat([k_cache.payload_plane(), v_cache.payload_plane()], dim=-1).contiguous()
    kv = kv.view(_payload_dtype(k_cache.fmt))
    return kv.float() if standin else kv


def kv_scale_tensors(k_cache, v_cache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """vLLM's k_scale / v_scale: None (bf16, fp8 unit), a one-element fp32 tensor (fp8 tensor), or fp32
    [Hkv, pages * 128] per (head, token), indexed by slot (fp8 token)."""
    fmt, dev = k_cache.fmt, k_cache.data.device
    if fmt.scale_element == "fp32-tensor":
        return tuple(torch.tensor([c.fp8_tensor_scale()], dtype=torch.float32, device=dev) for c in (k_cache, v_cache))
    if fmt.scale_element == "fp32-row":
        def per_slot(c):
            s = c.scale_plane().contiguous().view(torch.float32)[..., 0]  # [pages, H, P]
            return s.permute(1, 0, 2).reshape(c.num_heads, -1).contiguous()

        return per_slot(k_cache), per_slot(v_cache)
    return None, None


def _mask_scores(score: torch.Tensor, pos: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """vLLM's score buffer [Hi, R, >= NB] holds only the blocks up to each row's position (the rest is never
    written): blocks past pos // block + 1 -> -inf, cut to NB -> fp32 [R, Hi, NB]."""
    s = score[..., :nb].float()
    if s.shape[-1] < nb:
        s = torch.nn.functional.pad(s, (0, nb - s.shape[-1]), value=-math.inf)
    valid = (pos.long() // block + 1)[None, :, None]
    s = s.masked_fill(torch.arange(nb, device=s.device)[None, None, :] >= valid, -math.inf)
    return s.transpose(0, 1)


# ------------------------------------------------------------------------------------------------------ the adapter
class VllmM3:
    """vLLM 0.33.0's MiniMax-M3 common Triton ops behind kvtool's adapter protocol (kvtool.engines.protocol)."""

    name = "vllm"
    source = (f"vllm {VLLM.version} {OPS_DIR}: minimax_m3_index_decode, minimax_m3_index_score + "
              "minimax_m3_index_topk, minimax_m3_sparse_attn_decode, minimax_m3_sparse_attn")
    precision = "bf16"  # P and the decode partials are bf16 on the GPU

    def __init__(self):
        self.ops = load_ops()

    # ------------------------------------------------------------------------------------------------- checks
    def unsupported(self, kind: str, fmt, *, block_size: int = BLOCK, page_size: int = BLOCK, head_dim: int = 128,
                    device="cpu", **_) -> str | None:
        dev = torch.device(device)
        formats = INDEX_FORMATS if kind in ("index", "select") else ATTN_FORMATS
        if kind != "select":
            if fmt.label not in formats:
                extra = "; vLLM's common ops have no FP4 path" if fmt.spec.payload_bits == 4 else ""
                return f"vLLM's M3 {kind} kernels take {', '.join(formats)}, not {fmt.label}{extra}"
            if block_size != BLOCK or page_size != BLOCK:
                return (f"vLLM's M3 kernels fix block and page at {BLOCK} tokens (got block {block_size}, page "
                        f"{page_size}; try --block-size {BLOCK})")
            if head_dim & (head_dim - 1):
                return f"vLLM's M3 kernels need a power-of-two head dim (got {head_dim})"
        if dev.type == "cpu" and not interpreting():
            return "vLLM's kernels are Triton: run on cuda, or on the CPU with TRITON_INTERPRET=1"
        if dev.type == "cpu" and kind != "select" and fmt.is_quantized:
            return ("the Triton interpreter cannot take fp8 tensors as kernel arguments (numpy has no fp8): "
                    f"{fmt.label} runs on the GPU only")
        return None

    # -------------------------------------------------------------------------------------------------- index
    @_quiet
    def index(self, call: IndexCall) -> IndexOutput:
        ops = self.ops["index"]
        cfg, cache = call.cfg, call.cache
        dev = call.iq.device
        standin = _standin(dev)
        kcache = index_cache_tensor(cache, standin)
        qdt = torch.float32 if standin else torch.bfloat16
        bsz, nq, hi, _ = call.iq.shape
        nb = -(-call.max_context // cfg.block_size)
        table = call.block_table.to(torch.int32).contiguous()
        if call.decode:
            ctx = call.context_lens.to(torch.int32).contiguous()
            idx_q = call.iq[:, 0].to(qdt).contiguous()
            score = torch.empty(hi, bsz, ops.round_up(max(nb, 1), 16), dtype=torch.float32, device=dev)
            ids = ops.minimax_m3_index_decode(idx_q, kcache, table, ctx, call.max_context, cfg.topk, cfg.init_blocks,
                                              cfg.local_blocks, hi, 1, 1, score_out=score)  # [Hi, B, topk]
            pos = ctx.long() - 1
            scores = _mask_scores(score, pos, nb, cfg.block_size)  # forced blocks already in vLLM's scores
            return IndexOutput(ids.permute(1, 0, 2)[:, None].contiguous(), _rescale(scores[:, None].contiguous(), cache))
        q_pos = call.q_pos.to(dev).long()
        b_idx, q_idx = torch.nonzero(q_pos >= 0, as_tuple=True)
        pos = q_pos[b_idx, q_idx]
        ids_out = torch.full((bsz, nq, hi, cfg.topk), -1, dtype=torch.int32, device=dev)
        scores_out = torch.full((bsz, nq, hi, nb), -math.inf, dtype=torch.float32, device=dev)
        if pos.numel():
            rows = pos.numel()
            # every query row its own one-token request at its position (kvtool's rows need not be contiguous)
            cu = torch.arange(rows + 1, dtype=torch.int32, device=dev)
            seq, prefix = (pos + 1).to(torch.int32), pos.to(torch.int32)
            idx_q = call.iq[b_idx, q_idx].to(qdt).contiguous()  # [R, Hi, D]
            table_r = table[b_idx].contiguous()
            max_seq = int(pos.max()) + 1
            raw = ops.minimax_m3_index_score(idx_q, kcache, table_r, cu, seq, prefix, 1, max_seq, hi)
            ids = ops.minimax_m3_index_topk(raw, cu, prefix, 1, cfg.topk, cfg.init_blocks, cfg.local_blocks)
            # the prefill kernel writes raw block maxima; vLLM forces init / local blocks inside its top-k
            sc = _mask_scores(raw, pos, nb, cfg.block_size)  # [R, Hi, NB]
            sc = apply_forced(sc.transpose(0, 1), pos, cfg).transpose(0, 1)
            ids_out[b_idx, q_idx] = ids.permute(1, 0, 2).to(torch.int32)
            scores_out[b_idx, q_idx] = sc
        return IndexOutput(ids_out, _rescale(scores_out, cache))

    @_quiet
    def select(self, scores: torch.Tensor, q_pos: torch.Tensor, cfg: IndexerConfig) -> torch.Tensor:
        """minimax_m3_index_topk over block scores fp32 [R, NB] at positions q_pos [R] -> int32 [R, topk]."""
        ops = self.ops["index"]
        rows, nb = scores.shape
        dev = scores.device
        buf = torch.full((1, rows, ops.round_up(max(nb, 1), 16)), -math.inf, dtype=torch.float32, device=dev)
        buf[0, :, :nb] = scores.float()
        cu = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        ids = ops.minimax_m3_index_topk(buf, cu, q_pos.to(torch.int32).to(dev), 1, cfg.topk, cfg.init_blocks,
                                        cfg.local_blocks)
        return ids[0].to(torch.int32)

    # ---------------------------------------------------------------------------------------------- attention
    @_quiet
    def attend(self, call: AttnCall) -> torch.Tensor:
        ops = self.ops["attn"]
        dev = call.q.device
        standin = _standin(dev)
        kv = kv_cache_tensor(call.k_cache, call.v_cache, standin)
        k_scale, v_scale = kv_scale_tensors(call.k_cache, call.v_cache)
        n, hq, d = call.q.shape
        hkv = call.k_cache.num_heads
        q = call.q.to(torch.float32 if standin else torch.bfloat16).contiguous()
        topk_idx = call.ids.to(torch.int32).permute(1, 0, 2).contiguous()  # [Hkv, N, topk]
        table = call.block_table.to(torch.int32)[call.q_req.long()].contiguous()
        seq = (call.q_pos.long() + 1).to(torch.int32).contiguous()
        out = torch.zeros(n, hq, d, dtype=torch.float32, device=dev)
        if call.decode:
            ops.minimax_m3_sparse_attn_decode(q, kv, topk_idx, table, seq, hkv, call.scale, out, 1, k_scale, v_scale)
            return out
        # The prefill kernel reads the first min(topk, valid blocks) ids without checking for -1.
        k = torch.clamp(call.q_pos.long() // call.block_size + 1, max=call.ids.shape[-1])
        lead = torch.arange(call.ids.shape[-1], device=call.ids.device)[None, None, :] < k[:, None, None].to(
            call.ids.device)
        if bool(((call.ids < 0) & lead).any()):
            raise InputError("vLLM's prefill attention needs min(topk, valid blocks) leading ids in each row (no -1 "
                             "among them)")
        cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        ops.minimax_m3_sparse_attn(q, kv, topk_idx, table, cu, seq, (seq - 1).contiguous(), 1, hkv, call.scale, out,
                                   k_scale, v_scale)
        return out


def _rescale(scores: torch.Tensor, cache) -> torch.Tensor:
    """fp8 `tensor` index keys: vLLM's kernel scores the stored E4M3 values without the scale; real (finite,
    unforced) block scores times the scale are what kvtool's reference computes."""
    if cache.fmt.scale_element != "fp32-tensor":
        return scores
    s = cache.fp8_tensor_scale()
    real = torch.isfinite(scores) & (scores.abs() < 1e28)
    return torch.where(real, scores * s, scores)


# ------------------------------------------------------------------------------------------- bench entry points
# `kvtool bench ... --peer vllm`: the arguments converted once, then a zero-argument call of the engine's function,
# as an engine's step runs it (ids only; no score read-back), for kvtool.bench.common.time_fn (CUDA-graph replay).
# On the CPU (interpreter, fp32 stand-ins) the rows only check the plumbing; their times mean nothing.
def bench_index_decode(impl: VllmM3, iq: torch.Tensor, cache, table: torch.Tensor, ctx: torch.Tensor,
                       cfg: IndexerConfig, max_context: int):
    """iq bf16 [B, Hi, D] -> callable running minimax_m3_index_decode (block ids [Hi, B, topk])."""
    ops, standin = impl.ops["index"], _standin(iq.device)
    kcache = index_cache_tensor(cache, standin)
    q = iq.to(torch.float32 if standin else torch.bfloat16).contiguous()
    table, ctx = table.to(torch.int32).contiguous(), ctx.to(torch.int32).contiguous()
    hi = q.shape[1]
    return _quiet(lambda: ops.minimax_m3_index_decode(q, kcache, table, ctx, max_context, cfg.topk, cfg.init_blocks,
                                                      cfg.local_blocks, hi, 1, 1))


def bench_index_prefill(impl: VllmM3, iq: torch.Tensor, cache, table: torch.Tensor, ctx: torch.Tensor,
                        cfg: IndexerConfig, score_only: bool = False):
    """One request, every position a query: iq bf16 [1, Q, Hi, D] (the last Q positions of ctx[0]) -> callable
    running minimax_m3_index_score then minimax_m3_index_topk, as vLLM's prefill does (score_only: the first alone,
    to split the time)."""
    ops, standin = impl.ops["index"], _standin(iq.device)
    kcache = index_cache_tensor(cache, standin)
    q = iq[0].to(torch.float32 if standin else torch.bfloat16).contiguous()
    n, nq, hi = int(ctx[0]), q.shape[0], q.shape[1]
    dev = q.device
    cu = torch.tensor([0, nq], dtype=torch.int32, device=dev)
    seq = torch.tensor([n], dtype=torch.int32, device=dev)
    prefix = torch.tensor([n - nq], dtype=torch.int32, device=dev)
    table = table.to(torch.int32).contiguous()

    @_quiet
    def run():
        score = ops.minimax_m3_index_score(q, kcache, table, cu, seq, prefix, nq, n, hi)
        if score_only:
            return score
        return ops.minimax_m3_index_topk(score, cu, prefix, nq, cfg.topk, cfg.init_blocks, cfg.local_blocks)

    return run


def bench_attn_decode(impl: VllmM3, q: torch.Tensor, k_cache, v_cache, table: torch.Tensor, ctx: torch.Tensor,
                      ids: torch.Tensor, block_size: int):
    """q bf16 [B, Hq, D], ids [B, Hkv, topk] -> callable running minimax_m3_sparse_attn_decode (bf16 output)."""
    ops = impl.ops["attn"]
    if block_size != BLOCK or k_cache.page_size != BLOCK:
        raise InputError(f"vLLM's M3 kernels fix block and page at {BLOCK} tokens")
    standin = _standin(q.device)
    kv = kv_cache_tensor(k_cache, v_cache, standin)
    k_scale, v_scale = kv_scale_tensors(k_cache, v_cache)
    q = q.to(torch.float32 if standin else torch.bfloat16).contiguous()
    topk_idx = ids.to(torch.int32).permute(1, 0, 2).contiguous()
    table, seq = table.to(torch.int32).contiguous(), ctx.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    hkv, scale = k_cache.num_heads, 1.0 / math.sqrt(q.shape[-1])
    return _quiet(lambda: ops.minimax_m3_sparse_attn_decode(q, kv, topk_idx, table, seq, hkv, scale, out, 1, k_scale,
                                                            v_scale))
