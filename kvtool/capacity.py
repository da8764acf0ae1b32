"""`kvtool capacity`: KV + index cache bytes per pool block and blocks per pool (SPEC section 4).

One pool block holds `block_tokens` tokens of every pool layer on one rank:

    block_bytes = block_tokens * [(L - S) * kv_dense + S * (kv_sparse + idx)]

L = pool layers, S = sparse layers (they carry the index cache), per token and rank:
    kv_sparse = 2 (K and V) * kv_heads_per_rank * KV format bytes_per_token(head_dim)
    kv_dense  = the same for the dense layers' KV format (no index cache)
    idx       = index format bytes_per_token(index_dim) (one shared index key per token, replicated on every rank)
kv_heads_per_rank = ceil(kv_heads / tp) (a rank holds at least one KV head: GQA heads replicate when tp > kv_heads).

Format defaults follow ATOM: a KV `fp8` means per-(token, head) fp32 scales (`fp8-token`, 132 B at D = 128); an index
`fp8` is the plain cast (`fp8-unit`, 128 B). A label such as `fp8-unit` for the KV overrides that. The dense layers'
KV format (`kv_dense="auto"`) is the sparse KV format when it has at least FP8's bytes, else `fp8-token`: engines keep
the dense layers in FP8 when the sparse layers go to FP4 (TRT-LLM's hybrid NVFP4 cache, and the published ATOM
numbers below need it).

Presets are data (`PRESETS`), each with the published block sizes it must reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtool.errors import InputError
from kvtool.formats import Format, get_format

__all__ = [
    "BASELINE", "CapacityReport", "CapacityRow", "GIB", "INDEX_DEFAULTS", "KV_DEFAULTS", "PRESETS", "TABLE_INDEX",
    "TABLE_KV", "block_bytes", "capacity", "index_format", "kv_format"
]

KV_DEFAULTS = {"fp8_scale": "token"}     # ATOM's main KV cache: fp8 with per-token scales
INDEX_DEFAULTS = {"fp8_scale": "unit"}   # M3's index cache: plain fp8 cast
TABLE_KV = ("bf16", "fp8", "nvfp4", "mxfp4")
TABLE_INDEX = ("bf16", "fp8", "nvfp4", "mxfp4")
BASELINE = ("fp8", "fp8")
GIB = 1 << 30

PRESETS: dict[str, dict] = {
    "minimax-m3": dict(
        pool_layers=60, sparse_layers=57, kv_heads=4, head_dim=128, index_dim=128, block_tokens=128, tp=4,
        note="60 layers: 0..2 dense, 3..59 sparse; TP4 = one KV head per rank",
        published={"fp8-token+fp8-unit": 2_961_408, "fp8-token+nvfp4-rcp": 2_552_832,
                   "nvfp4-rcp+nvfp4-rcp": 1_677_312}),
    "minimax-m3.1-flash": dict(
        pool_layers=65, sparse_layers=60, kv_heads=4, head_dim=128, index_dim=128, block_tokens=128, tp=4,
        note="L = 65 pool layers, S = 60 sparse, inferred from the published block sizes (ATOM, TP4); published "
             "57,011 vs 99,130 blocks (FP8+FP8 vs NVFP4+FP4) imply pools 0.04% apart (181.27 vs 181.19 GB)",
        published={"fp8-token+fp8-unit": 3_179_520, "fp8-token+nvfp4-rcp": 2_749_440,
                   "nvfp4-rcp+nvfp4-rcp": 1_827_840}),
    "smollm2": dict(
        pool_layers=30, sparse_layers=30, kv_heads=3, head_dim=64, index_dim=64, block_tokens=64, tp=1,
        note="SmolLM2-135M with kvtool's indexer on every layer (all sparse); 64-token blocks as its selection",
        published={}),
}


@dataclass
class CapacityRow:
    """One (KV, index) format pair. Bytes per token are per rank and per layer; block_bytes per pool block."""

    kv: str
    index: str
    kv_dense: str
    kv_sparse_bytes: int
    kv_dense_bytes: int
    index_bytes: int
    block_bytes: int
    bytes_per_token: int
    vs_baseline: float          # baseline block bytes / this block bytes (capacity multiplier vs FP8 KV + FP8 index)
    blocks: int | None          # whole blocks in the pool (None when no pool size was given)
    tokens: int | None
    published_block_bytes: int | None
    selected: bool


@dataclass
class CapacityReport:
    model: str
    tp: int
    pool_layers: int
    sparse_layers: int
    dense_layers: int
    kv_heads_per_rank: int
    head_dim: int
    index_dim: int
    block_tokens: int
    pool_bytes: int | None
    note: str
    selected: CapacityRow
    rows: list[CapacityRow] = field(default_factory=list)


def kv_format(name: str) -> Format:
    """A KV format name with ATOM's defaults (`fp8` -> `fp8-token`); labels override."""
    return get_format(name, strict=False, **KV_DEFAULTS)


def index_format(name: str) -> Format:
    """An index format name with M3's defaults (`fp8` -> `fp8-unit`); labels override."""
    return get_format(name, strict=False, **INDEX_DEFAULTS)


def _dense_format(kv: Format, kv_dense: str, head_dim: int) -> Format:
    if kv_dense != "auto":
        return kv_format(kv_dense)
    fp8 = kv_format("fp8")
    return kv if kv.bytes_per_token(head_dim) >= fp8.bytes_per_token(head_dim) else fp8


def block_bytes(preset: dict, kv: Format, index: Format, dense: Format, tp: int) -> tuple[int, int, int, int]:
    """(block_bytes, kv_sparse, kv_dense, idx) for one preset at `tp` ranks (module docstring formula)."""
    heads = math.ceil(preset["kv_heads"] / tp)
    kv_sparse = 2 * heads * kv.bytes_per_token(preset["head_dim"])
    kv_dense = 2 * heads * dense.bytes_per_token(preset["head_dim"])
    idx = index.bytes_per_token(preset["index_dim"])
    L, S = preset["pool_layers"], preset["sparse_layers"]
    return preset["block_tokens"] * ((L - S) * kv_dense + S * (kv_sparse + idx)), kv_sparse, kv_dense, idx


def capacity(model: str, kv: str = "fp8", index: str = "fp8", *, tp: int | None = None, pool_gb: float | None = None,
             blocks: int | None = None, kv_dense: str = "auto") -> CapacityReport:
    """Bytes per block for `kv` + `index` on `model` (a PRESETS key) and for every pair of TABLE_KV x TABLE_INDEX.

    Pool size (optional): `pool_gb` GiB (2^30 bytes, as engines log it), or `blocks` = the pool holding that many
    blocks of the selected pair; every row then gets its whole blocks and tokens in that same pool.
    """
    if model not in PRESETS:
        raise InputError(f"unknown model {model!r} for capacity (choose {'|'.join(PRESETS)})")
    preset = PRESETS[model]
    tp = preset["tp"] if tp is None else tp
    if tp < 1:
        raise InputError(f"--tp must be >= 1, got {tp}")
    if pool_gb is not None and blocks is not None:
        raise InputError("give --pool-gb or --blocks, not both")
    if (pool_gb is not None and not pool_gb > 0) or (blocks is not None and blocks < 1):
        raise InputError("the pool size must be positive")
    for name in (kv, index):
        for fmt in (kv_format(name), index_format(name)):
            for dim in (preset["head_dim"], preset["index_dim"]):
                fmt.check_dim(dim, name)
    base = block_bytes(preset, kv_format(BASELINE[0]), index_format(BASELINE[1]),
                       _dense_format(kv_format(BASELINE[0]), kv_dense, preset["head_dim"]), tp)[0]

    def row(kv_name: str, index_name: str, selected: bool, pool: int | None) -> CapacityRow:
        k, i = kv_format(kv_name), index_format(index_name)
        d = _dense_format(k, kv_dense, preset["head_dim"])
        total, kv_s, kv_d, idx = block_bytes(preset, k, i, d, tp)
        n = None if pool is None else pool // total
        published = preset["published"].get(f"{k.label}+{i.label}") if tp == preset["tp"] else None
        return CapacityRow(kv=k.label, index=i.label, kv_dense=d.label, kv_sparse_bytes=kv_s, kv_dense_bytes=kv_d,
                           index_bytes=idx, block_bytes=total, bytes_per_token=total // preset["block_tokens"],
                           vs_baseline=round(base / total, 4), blocks=n,
                           tokens=None if n is None else n * preset["block_tokens"],
                           published_block_bytes=published, selected=selected)

    chosen = row(kv, index, True, None)
    pool = round(pool_gb * GIB) if pool_gb is not None else (blocks * chosen.block_bytes if blocks else None)
    chosen = row(kv, index, True, pool)
    rows = []
    for k in TABLE_KV:
        for i in TABLE_INDEX:
            r = row(k, i, False, pool)
            r.selected = (r.kv, r.index, r.kv_dense) == (chosen.kv, chosen.index, chosen.kv_dense)
            rows.append(r)
    if not any(r.selected for r in rows):
        rows.append(chosen)
    L, S = preset["pool_layers"], preset["sparse_layers"]
    return CapacityReport(model=model, tp=tp, pool_layers=L, sparse_layers=S, dense_layers=L - S,
                          kv_heads_per_rank=math.ceil(preset["kv_heads"] / tp), head_dim=preset["head_dim"],
                          index_dim=preset["index_dim"], block_tokens=preset["block_tokens"], pool_bytes=pool,
                          note=preset["note"], selected=chosen, rows=rows)
