"""Backend choice in one place (STYLE 17): `backend="auto" | "torch" | "triton"`.

`auto` picks Triton for CUDA tensors and the torch reference for CPU tensors. `triton` on CPU tensors only works under
the Triton interpreter (TRITON_INTERPRET=1, as in the tests). Both paths return the same types and, where the SPEC says
so, the same bytes.
"""

from __future__ import annotations

import torch

from kvtool.errors import KvtoolError
from kvtool.formats import rotation as _rotation
from kvtool.kernels import platform as _platform  # plain torch: no Triton import

__all__ = [
    "BACKENDS", "dequantize", "gather_dequantize", "interpreting", "quantize", "resolve_backend",
    "resolve_check_backend", "resolve_device", "store", "triton_available", "triton_index_block_scores",
    "triton_index_topk", "triton_select_topk", "triton_sparse_decode", "triton_sparse_prefill", "triton_uses_gluon"
]

BACKENDS = ("auto", "torch", "triton")


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1: CPU tensors, as in the tests): the flag
    `kvtool.kernels.platform` read once at import, the one the kernels were specialized on."""
    return _platform.INTERPRET


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Return "torch" or "triton" for work on `device`."""
    if backend not in BACKENDS:
        raise KvtoolError(f"unknown backend {backend!r} (choose {'|'.join(BACKENDS)})")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        return "triton" if on_cuda else "torch"
    if backend == "triton" and not on_cuda and not interpreting():
        raise KvtoolError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for the interpreter)")
    return backend


def resolve_check_backend(backend: str, device: torch.device) -> tuple[str, str]:
    """The backend of a kernel check (verify-topk, verify-attn) and its report label: as resolve_backend, except that
    under the interpreter on CPU `auto` checks the kernel ("triton-interpreter"), since checking it is the point."""
    if backend == "auto" and device.type == "cpu" and interpreting():
        backend = "triton"
    resolved = resolve_backend(backend, device)
    return resolved, ("triton-interpreter" if resolved == "triton" and device.type == "cpu" else resolved)


def resolve_device(device: str) -> torch.device:
    """Validate a --device value; `cuda` without a GPU is a one-line error, not a traceback."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):  # torch's message for `tpu` is a multi-line list of every device type
        raise KvtoolError(f"unsupported device {device!r} (choose cpu|cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvtoolError("--device cuda was asked for, but torch sees no CUDA device on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise KvtoolError(f"unsupported device {device!r} (choose cpu|cuda)")
    return dev


# ------------------------------------------------------------------------------------------ store / (de)quantize
# Each pair below returns the same types and, per the SPEC, the same bytes / values on both backends. The Triton
# modules are imported lazily: importing kvtool must not pay for (or need) Triton's compiler.
def store(cache, x: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "auto", *, validate: bool = True) -> None:
    """Quantize x [N, H, D] (bf16 / fp16 / fp32) into `cache` (a PagedCache) at `slot_mapping` [N] (int32 / int64,
    -1 skips the token). torch: `cache.store`; triton: `kernels.store.store` (`validate=False` skips its finite and
    slot-range checks, which cost a pass and a host sync)."""
    if resolve_backend(backend, x.device) == "torch":
        return cache.store(x, slot_mapping)
    cache.fmt.require_kvtool_codec("the Triton store kernel")
    from kvtool.kernels.store import store as triton_store

    if cache.fmt.rotation is not None:  # the kernels know no rotation: they quantize the rotated values (codes = x R)
        x = _rotation.rotate(x, cache.fmt.rotation)
    return triton_store(cache, x, slot_mapping, validate=validate)


def gather_dequantize(cache, slots: torch.Tensor, dtype: torch.dtype = torch.float32, backend: str = "auto"
                      ) -> torch.Tensor:
    """Decoded values [N, H, D] in `dtype` (fp32 / bf16; fp16 on triton) of the cache tokens at `slots` [N]."""
    if resolve_backend(backend, cache.data.device) == "torch":
        return cache.dequantize(slots, dtype)
    cache.fmt.require_kvtool_codec("the Triton dequantize kernel")
    from kvtool.kernels.dequant import gather_dequantize as triton_gather

    if cache.fmt.rotation is not None:  # the kernel decodes the rotated domain; R^T brings it back
        return _rotation.unrotate(triton_gather(cache, slots, torch.float32), cache.fmt.rotation).to(dtype)
    return triton_gather(cache, slots, dtype)


def _triton(module: str, what: str):
    """`kvtool.kernels.<module>`, or a one-line error saying why the Triton path cannot run here."""
    import importlib

    try:
        return importlib.import_module(f"kvtool.kernels.{module}")
    except ImportError as err:
        raise KvtoolError(f"the Triton {what} kernel is not available ({err}); use --device cpu") from None


def quantize(fmt, x: torch.Tensor, tensor_amax: torch.Tensor | None = None, backend: str = "auto", *,
             name: str = "tensor", check_finite: bool = True):
    """`fmt.quantize(x, tensor_amax=...)` -> QTensor, on either backend (x [..., D], rows along the last dim).
    `check_finite` rejects NaN / Inf input with a message naming `name` and the first bad index."""
    if resolve_backend(backend, x.device) == "torch":
        return fmt.quantize(x, tensor_amax=tensor_amax, name=name, check_finite=check_finite)
    fmt.require_kvtool_codec("the Triton quantize kernel")
    if check_finite:
        from kvtool.formats import require_finite

        require_finite(x, name)  # here, so that the message names the tensor
    quant = _triton("quant", "quantize")
    if fmt.rotation is not None:
        x = _rotation.rotate(x, fmt.rotation)
    return quant.triton_quantize(fmt, x, tensor_amax, check_finite=False)


def dequantize(q, dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """`q.dequantize(dtype)` -> [..., D] values, on either backend."""
    if resolve_backend(backend, q.payload.device) == "torch":
        return q.dequantize(dtype)
    q.fmt.require_kvtool_codec("the Triton dequantize kernel")
    triton_dequantize = _triton("quant", "dequantize").triton_dequantize
    if q.fmt.rotation is not None:
        return _rotation.unrotate(triton_dequantize(q, torch.float32), q.fmt.rotation).to(dtype)
    return triton_dequantize(q, dtype)


# --------------------------------------------------------------------- index scoring / top-k / sparse attention
# The Triton paths of the indexer and of sparse attention. Their torch paths are the references of the cache-semantics
# layer (`indexer.paged_reference`, `attention.paged_sparse_*_ref`), which sits above this module, so the caller picks
# between the two by `resolve_backend` / `resolve_check_backend` and calls one of these for "triton". Like `store`,
# each refuses an engine recipe's format (the kernels decode the SPEC codecs) and handles rotation here: the caches
# hold the codes of x R, so the query is rotated ((q R) . (k R) = q . k) and attention's output comes back through R^T.
# `dtype` is the query dtype the kernel gets, cast after the rotation (None: the query's own).
def _kernel_query(q: torch.Tensor, rotation: int | None, dtype: torch.dtype | None) -> torch.Tensor:
    dtype = dtype or q.dtype
    return (q if rotation is None else _rotation.rotate(q, rotation)).to(dtype)  # rotate: fp32 x R


def _index_launch(iq: torch.Tensor, cache, q_pos, dtype):
    """(kernel query, decode?) for the index scorer: the decode kernel for one query per request at the default
    position (q_pos None), the prefill kernel otherwise."""
    cache.fmt.require_kvtool_codec("the Triton index scorer")
    return _kernel_query(iq, cache.fmt.rotation, dtype), iq.shape[1] == 1 and q_pos is None


def triton_index_topk(iq: torch.Tensor, cache, block_table: torch.Tensor, context_lens: torch.Tensor, cfg,
                      q_pos: torch.Tensor | None = None, *, dtype: torch.dtype | None = None, **launch) -> torch.Tensor:
    """The Triton index scorer's block selection: iq [B, Q, Hi, Di] against the paged index-key cache (`block_table`
    [B, max_pages], `context_lens` [B] int32; q_pos [B, Q] int32, None = the last Q positions) -> block ids int32
    [B, Q, Hi, topk]. `launch`: `kvtool.kernels.index_score.LAUNCH_OPTIONS` (and `max_context`)."""
    from kvtool.kernels import index_score

    kq, decode = _index_launch(iq, cache, q_pos, dtype)
    if decode:
        return index_score.decode_topk(kq[:, 0], cache, block_table, context_lens, cfg, **launch)[:, None]
    return index_score.prefill_topk(kq, cache, block_table, context_lens, cfg, q_pos=q_pos, **launch)


def triton_index_block_scores(iq: torch.Tensor, cache, block_table: torch.Tensor, context_lens: torch.Tensor, cfg,
                              q_pos: torch.Tensor | None = None, *, dtype: torch.dtype | None = None, **launch
                              ) -> torch.Tensor:
    """The Triton index scorer's block scores, arguments as `triton_index_topk` -> fp32 [B, Q, Hi, NB]."""
    from kvtool.kernels import index_score

    kq, decode = _index_launch(iq, cache, q_pos, dtype)
    if decode:
        return index_score.decode_block_scores(kq[:, 0], cache, block_table, context_lens, cfg, **launch)[:, None]
    return index_score.prefill_block_scores(kq, cache, block_table, context_lens, cfg, q_pos=q_pos, **launch)


def triton_select_topk(scores: torch.Tensor, pos: torch.Tensor, block_size: int, topk: int,
                       higher_id: bool = True) -> torch.Tensor:
    """The Triton top-k over given block scores (`kvtool.kernels.topk.select_from_block_scores`): scores fp32
    [B, R, H, NB] (forced blocks already applied), pos int32 [B, R] -> ids int32 [B, R, H, topk]."""
    from kvtool.kernels.topk import select_from_block_scores

    return select_from_block_scores(scores, pos, block_size, topk, higher_id=higher_id)


def _attention(launch, q, k_cache, v_cache, dtype, args, kernel_options) -> torch.Tensor:
    k_cache.fmt.require_kvtool_codec("the Triton sparse-attention kernel")
    v_cache.fmt.require_kvtool_codec("the Triton sparse-attention kernel")
    rot = k_cache.fmt.rotation
    if v_cache.fmt.rotation != rot:  # one rotation of q serves both: the output comes back through the same R
        raise KvtoolError(f"sparse attention: K and V caches must share one rotation, got {rot} and "
                          f"{v_cache.fmt.rotation}")
    out = launch(_kernel_query(q, rot, dtype), k_cache, v_cache, *args, **kernel_options)
    return out if rot is None else _rotation.unrotate(out, rot).to(out.dtype)


def triton_sparse_decode(q: torch.Tensor, k_cache, v_cache, block_table: torch.Tensor, context_lens: torch.Tensor,
                         block_ids: torch.Tensor, block_size: int, scale: float | None = None, *,
                         dtype: torch.dtype | None = None, **kernel_options) -> torch.Tensor:
    """The Triton sparse attention of a decode step (`kvtool.kernels.sparse_attn.sparse_decode`, same arguments and
    options: `out_dtype`, `gluon`, ...): q [B, Hq, D], one query per request at context_lens[b] - 1; block_ids int32
    [B, Hkv, topk] -> [B, Hq, D] in out_dtype (bf16 unless asked)."""
    from kvtool.kernels.sparse_attn import sparse_decode

    return _attention(sparse_decode, q, k_cache, v_cache, dtype,
                      (block_table, context_lens, block_ids, block_size, scale), kernel_options)


def triton_sparse_prefill(q: torch.Tensor, k_cache, v_cache, block_table: torch.Tensor, q_req: torch.Tensor,
                          q_pos: torch.Tensor, block_ids: torch.Tensor, block_size: int, scale: float | None = None, *,
                          dtype: torch.dtype | None = None, **kernel_options) -> torch.Tensor:
    """The Triton sparse attention of prefill rows (`kvtool.kernels.sparse_attn.sparse_prefill`, same arguments):
    q [N, Hq, D] of request q_req [N] at position q_pos [N] (int32); block_ids int32 [N, Hkv, topk] -> [N, Hq, D]."""
    from kvtool.kernels.sparse_attn import sparse_prefill

    return _attention(sparse_prefill, q, k_cache, v_cache, dtype,
                      (block_table, q_req, q_pos, block_ids, block_size, scale), kernel_options)


def triton_uses_gluon(q: torch.Tensor, k_cache, v_cache, block_size: int) -> bool:
    """Whether `triton_sparse_decode`'s default launch takes the Gluon fast path for these arguments."""
    from kvtool.kernels.sparse_attn import uses_gluon

    return uses_gluon(q, k_cache, v_cache, block_size)


def triton_available(warn) -> dict:
    """Which Triton paths import ({"store", "index", "attention"} -> bool); `warn(message)` names each missing one
    (its step then runs the torch path)."""
    import importlib

    found = {}
    for key, module in (("store", "kvtool.kernels.store"), ("index", "kvtool.kernels.index_score"),
                        ("attention", "kvtool.kernels.sparse_attn")):
        try:
            importlib.import_module(module)
            found[key] = True
        except ImportError as err:
            warn(f"the {key} kernel ({module}) is missing ({err}); that step falls back to the torch path")
            found[key] = False
    return found
