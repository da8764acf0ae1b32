"""The adapter protocol: an engine's own index scorer / top-k or sparse-attention kernel, run by `verify-topk`,
`verify-attn` and `bench --peer` on the same data as kvtool's kernels and compared with the same references.

An implementation receives kvtool's inputs (the paged cache as `kvtool.paged.PagedCache`, block table, context
lengths, queries, selection) and converts them to its engine's layout itself (the shipped adapters go through the
layout presets, `kvtool.layouts.presets`); it returns kvtool's output shapes:

- `index(IndexCall) -> IndexOutput`: block ids int32 [B, Q, Hi, topk] in descending rank order (-1 padded) and, when
  the kernel exposes them, block scores fp32 [B, Q, Hi, NB] as ranked (forced init / local blocks at 1e30 / 1e29,
  blocks past the query's valid blocks -inf).
- `select(scores, q_pos, cfg) -> ids`: top-k alone over given block scores fp32 [R, NB] at positions q_pos [R]
  (blocks past q_pos // block_size + 1 invalid) -> int32 [R, topk]; forced blocks applied by the implementation.
- `attend(AttnCall) -> out [N, Hq, D]` (fp32 or bf16): sparse attention of N query rows over their selected blocks.

`unsupported(kind, fmt, **geometry) -> str | None` says why a case cannot run (a format the kernel has no path for, a
block size it fixes); such rows are reported as SKIPPED with that reason, never as PASS. `precision` is the precision
of the attention output path ("fp32", or "bf16" when the kernel rounds P or partial outputs to bf16: its error
against the dequantized reference is then held to the tolerance plus the bf16 rounding bound 2^-8).

`--impl NAME` takes a registered adapter (`IMPLS`); `--impl module:attr` imports `attr` from `module`: an object with
the methods above, a zero-argument factory returning one, or a plain function `fn(call)` used as `index` (verify-topk)
or `attend` (verify-attn).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from kvtool.errors import InputError
from kvtool.indexer import IndexerConfig

# An engine's kernel reads its cache as stored and knows nothing of kvtool's rotation option (kvtool.formats.rotation):
# the workflows skip it, with this reason, on a rotated format.
ROTATION_SKIP = "the engine's kernel takes no rotation (a +rot format's codes hold x R)"

__all__ = ["IndexCall", "IndexOutput", "AttnCall", "EngineImpl", "IMPLS", "ROTATION_SKIP", "resolve_impl", "FunctionImpl"]


@dataclass
class IndexCall:
    """One index scoring step. iq bf16 [B, Q, Hi, D]; cache: the index PagedCache (H = 1); block_table int32
    [B, max_pages]; context_lens int32 [B]; q_pos int32 [B, Q] absolute positions (negative: padding row), or None
    for a decode step (Q = 1, the query at context_lens - 1); max_context: NB = ceil(max_context / block_size)."""

    iq: torch.Tensor
    cache: Any  # kvtool.paged.PagedCache
    block_table: torch.Tensor
    context_lens: torch.Tensor
    q_pos: torch.Tensor | None
    cfg: IndexerConfig
    max_context: int

    @property
    def decode(self) -> bool:
        return self.q_pos is None


@dataclass
class IndexOutput:
    ids: torch.Tensor  # int32 [B, Q, Hi, topk], descending rank order, -1 padded
    scores: torch.Tensor | None = None  # fp32 [B, Q, Hi, NB] as ranked, or None when the kernel does not expose them


@dataclass
class AttnCall:
    """N query rows of sparse attention. q bf16 [N, Hq, D]; k_cache / v_cache PagedCache [pages, Hkv, P, ...];
    block_table int32 [B, max_pages]; q_req int32 [N] (each row's request); q_pos int32 [N] (tokens s <= q_pos are
    visible); ids int32 [N, Hkv, topk] (-1 padded); decode: row b is request b at its last position (one decode step);
    scale: the softmax scale (1 / sqrt(D))."""

    q: torch.Tensor
    k_cache: Any
    v_cache: Any
    block_table: torch.Tensor
    q_req: torch.Tensor
    q_pos: torch.Tensor
    ids: torch.Tensor
    block_size: int
    decode: bool
    scale: float


@runtime_checkable
class EngineImpl(Protocol):
    """What an engine adapter provides (any of index / select / attend; `unsupported` and `precision` always)."""

    name: str  # short name shown in reports ("vllm")
    source: str  # engine, version and functions ("vllm 0.33.0 minimax_m3_index_decode ...")
    precision: str  # "fp32" | "bf16" (attention output path)

    def unsupported(self, kind: str, fmt, **geometry) -> str | None: ...


class FunctionImpl:
    """A plain function `fn(call)` as an implementation of one kind ("index" or "attend")."""

    precision = "fp32"

    def __init__(self, fn: Callable, kind: str, spec: str):
        self.name, self.source, self._fn, self._kind = spec, spec, fn, kind
        setattr(self, kind, fn)

    def unsupported(self, kind: str, fmt, **geometry) -> str | None:
        return None if kind == self._kind else f"{self.name} is a plain function for {self._kind} only"


# Registered adapters: name -> "module:factory" (data, not code per engine).
IMPLS = {"vllm": "kvtool.engines.vllm_m3:VllmM3"}


def resolve_impl(spec: str, kind: str) -> Any:
    """An implementation object for `spec` (a name in IMPLS or `module:attr`) that can run `kind` ("index" or
    "attend"); InputError (or EngineUnavailable) with one line otherwise."""
    target = IMPLS.get(spec.strip().lower(), spec.strip())
    if ":" not in target:
        raise InputError(f"unknown --impl {spec!r} (choose {'|'.join(IMPLS)} or module:function)")
    mod_name, attr = target.split(":", 1)
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"--impl {spec}: cannot import {target} ({exc})") from None
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, kind) and _takes_no_args(obj)):
        obj = obj()
    if hasattr(obj, kind):
        for name, default in (("name", spec), ("source", target), ("precision", "fp32")):
            if not hasattr(obj, name):
                setattr(obj, name, default)
        if not hasattr(obj, "unsupported"):
            obj.unsupported = lambda kind, fmt, **geometry: None
        return obj
    if callable(obj):
        return FunctionImpl(obj, kind, spec)
    raise InputError(f"--impl {spec}: {target} has no {kind}() method and is not callable")


def _takes_no_args(fn) -> bool:
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in sig.parameters.values())
