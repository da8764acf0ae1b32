"""Engine layout presets as data (SPEC section 5): which byte planes an engine's cache buffer holds, in what order.

A cache of one logical tensor (`x`, or `k` and `v` for paired presets) has, per format, a *payload* plane
(D * bits / 8 bytes per token and head) and, for formats with per-token scales, a *scale* plane (D / block bytes of
E4M3 / E8M0, or 4 bytes of fp32 for fp8 `token`). Canonically a plane is a uint8 tensor [pages, H, P, nbytes].

A preset lays those planes out in one or more *regions* (the engine's buffer tensors: `kv_cache`, `k_scale`, ...).
Inside a region the bytes are the nesting of four axes, outermost first: `page`, `plane` (the region's planes, in
order, each a different width), `head`, `token` (offset inside the page), then the plane's bytes. For example
`("page", "head", "plane", "token")` is "per page, per head: [P x payload][P x scale]" (kvtool.paged.PagedCache and
vLLM's MXFP4 page) and `("page", "plane", "head", "token")` is "per page: [K_data | K_scale | V_data | V_scale], each
head-major" (vLLM's NVFP4 KV). A plane may carry a *rule*: a byte permutation inside each (page, head) block of
P x nbytes bytes (TRT-LLM's 4-token V-scale interleave, ATOM's SHUFFLE). One generic engine (kvtool.layouts.engine)
maps planes <-> bytes for every preset; nothing here is code per engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvtool.errors import LayoutError

__all__ = [
    "ALL_FAMILIES", "ATOM_X", "AXES", "DS32_TILE", "LayoutPreset", "PAGE_HND", "PAGE_NHD", "PER_HEAD_PAGE", "PRESETS",
    "Plane", "RULES", "Region", "Rule", "TOKEN_MAJOR", "get_preset"
]

PAYLOAD, SCALE = "payload", "scale"
AXES = ("page", "head", "token")


# ------------------------------------------------------------------------------------------------------ byte rules
@dataclass(frozen=True)
class Rule:
    """A byte permutation inside each (page, head) block of a plane: `forward(block [..., P, nb]) -> [..., P, nb]`
    (engine order; the returned shape only counts bytes), `inverse` undoes it; `check(P, nb)` names what the rule
    needs (None when it applies)."""

    name: str
    formula: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    inverse: Callable[[torch.Tensor], torch.Tensor]
    check: Callable[[int, int], "str | None"]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _trtllm_v4(x: torch.Tensor) -> torch.Tensor:
    # out[(t//4)*4*S + s*4 + t%4] = in[t*S + s]: [P/4, 4, S] -> [P/4, S, 4]
    *lead, p, s = x.shape
    return x.reshape(*lead, p // 4, 4, s).transpose(-1, -2).reshape(*lead, p, s)


def _trtllm_v4_inverse(x: torch.Tensor) -> torch.Tensor:
    *lead, p, s = x.shape
    return x.reshape(*lead, p // 4, s, 4).transpose(-1, -2).reshape(*lead, p, s)


# ATOM SHUFFLE (x = 16 bytes, one FP8 element per byte): K [D/16, P, 16], V [P/16, D, 16] per (page, head).
ATOM_X = 16


def _shuffle_k(x: torch.Tensor) -> torch.Tensor:
    *lead, p, nb = x.shape
    return x.reshape(*lead, p, nb // ATOM_X, ATOM_X).transpose(-3, -2).reshape(*lead, p, nb)


def _shuffle_k_inverse(x: torch.Tensor) -> torch.Tensor:
    *lead, p, nb = x.shape
    return x.reshape(*lead, nb // ATOM_X, p, ATOM_X).transpose(-3, -2).reshape(*lead, p, nb)


def _shuffle_v(x: torch.Tensor) -> torch.Tensor:
    *lead, p, nb = x.shape
    return x.reshape(*lead, p // ATOM_X, ATOM_X, nb).transpose(-1, -2).reshape(*lead, p, nb)


def _shuffle_v_inverse(x: torch.Tensor) -> torch.Tensor:
    *lead, p, nb = x.shape
    return x.reshape(*lead, p // ATOM_X, nb, ATOM_X).transpose(-1, -2).reshape(*lead, p, nb)


# vLLM's ROCm DeepSeek V3.2 indexer writer (SHUFFLE, any P > 1): [P, D] -> [P/16, D/16, 16 tokens, 16 bytes];
# a page of one token is stored linear (the writer's NORMAL layout).
DS32_TILE = 16


def _ds32_shuffle(x: torch.Tensor) -> torch.Tensor:
    *lead, p, nb = x.shape
    if p == 1:
        return x
    t = DS32_TILE
    return x.reshape(*lead, p // t, t, nb // t, t).transpose(-3, -2).reshape(*lead, p, nb)


def _ds32_shuffle_inverse(x: torch.Tensor) -> torch.Tensor:
    *lead, p, nb = x.shape
    if p == 1:
        return x
    t = DS32_TILE
    return x.reshape(*lead, p // t, nb // t, t, t).transpose(-3, -2).reshape(*lead, p, nb)


def _ds32_check(p: int, nb: int) -> "str | None":
    if (p != 1 and p % DS32_TILE) or nb % DS32_TILE:
        return "the DS V3.2 indexer shuffle needs page == 1 or page % 16 == 0, and payload bytes % 16 == 0"
    return None


def _needs(p_mult: int = 1, nb_mult: int = 1, what: str = "") -> Callable[[int, int], "str | None"]:
    def check(p: int, nb: int) -> "str | None":
        if p % p_mult or nb % nb_mult:
            return what
        return None

    return check


RULES: dict[str, Rule] = {
    "linear": Rule("linear", "token-major rows", _identity, _identity, _needs()),
    "trtllm-v4": Rule(
        "trtllm-v4", "out[(t//4)*4*S + s*4 + t%4] = in[t*S + s]", _trtllm_v4, _trtllm_v4_inverse,
        _needs(4, 1, "the TRT-LLM 4-token scale interleave needs page % 4 == 0")),
    "atom-shuffle-k": Rule(
        "atom-shuffle-k", "[P, D] -> [D/16, P, 16] (off = (d//16)*16*P + t*16 + d%16)", _shuffle_k, _shuffle_k_inverse,
        _needs(1, ATOM_X, "the ATOM K SHUFFLE needs payload bytes % 16 == 0")),
    "atom-shuffle-v": Rule(
        "atom-shuffle-v", "[P, D] -> [P/16, D, 16] (off = (t//16)*16*D + d*16 + t%16)", _shuffle_v, _shuffle_v_inverse,
        _needs(ATOM_X, 1, "the ATOM V SHUFFLE needs page % 16 == 0")),
    "ds32-shuffle": Rule(
        "ds32-shuffle", "[P, D] -> [P/16, D/16, 16, 16] (off = (t//16)*16*D + (d//16)*256 + (t%16)*16 + d%16; "
        "P = 1 linear)", _ds32_shuffle, _ds32_shuffle_inverse, _ds32_check),
}


# ------------------------------------------------------------------------------------------------ preset records
@dataclass(frozen=True)
class Plane:
    """One plane of one logical tensor inside a region: `tensor` ('x' | 'k' | 'v'), `part` (payload | scale), `rule`."""

    tensor: str
    part: str
    rule: str = "linear"


@dataclass(frozen=True)
class Region:
    """One engine buffer tensor: its `name` (also the suffix of its name in a .safetensors / .pt dump), its planes in
    byte order, and the nesting `order` of (page, plane, head, token), outermost first; `page` must come first."""

    name: str
    planes: tuple[Plane, ...]
    order: tuple[str, ...]

    def __post_init__(self):
        if sorted(self.order) != sorted(AXES + ("plane",)) or self.order[0] != "page":
            raise ValueError(f"region {self.name}: order must start with 'page' and hold page/plane/head/token")
        for plane in self.planes:
            if plane.rule not in RULES:
                raise ValueError(f"region {self.name}: unknown rule {plane.rule}")
            if plane.rule != "linear" and self.order[-1] != "token":
                raise ValueError(f"region {self.name}: a byte rule needs each (page, head) block contiguous")


@dataclass(frozen=True)
class LayoutPreset:
    """A named engine layout. `families`: format families it holds; `default_format`: label used when neither the
    geometry nor the file names one (None: must be given); `page_size`: default P (`page_fixed`: the only P);
    `tensors`: logical tensor names (('k', 'v') for K/V pairs); `regions`: the buffers in file order (a raw .bin
    concatenates them); `source`: where the byte map was read (repository + path)."""

    name: str
    families: tuple[str, ...]
    default_format: "str | None"
    page_size: int
    page_fixed: bool
    tensors: tuple[str, ...]
    regions: tuple[Region, ...]
    source: str
    note: str = ""

    @property
    def paired(self) -> bool:
        return len(self.tensors) > 1


TOKEN_MAJOR = ("page", "token", "head", "plane")  # with P = 1: [slots, H, nbytes]
PER_HEAD_PAGE = ("page", "head", "plane", "token")  # per page and head: [P x payload][P x scale]
PAGE_HND = ("page", "plane", "head", "token")  # per page: [plane0: H x P][plane1: H x P]...
PAGE_NHD = ("page", "plane", "token", "head")  # per page: [plane0: P x H][plane1: P x H]...

ALL_FAMILIES = ("bf16", "fp8", "nvfp4", "mxfp4", "kvfp4")


def _kv_planes(v_scale_rule: str = "linear") -> tuple[Plane, ...]:
    return (Plane("k", PAYLOAD), Plane("k", SCALE), Plane("v", PAYLOAD), Plane("v", SCALE, v_scale_rule))


PRESETS: dict[str, LayoutPreset] = {p.name: p for p in (
    LayoutPreset(
        "planes", ALL_FAMILIES, None, 1, True, ("x",),
        (Region("payload", (Plane("x", PAYLOAD),), TOKEN_MAJOR), Region("scales", (Plane("x", SCALE),), TOKEN_MAJOR)),
        "kvtool (SPEC section 5)",
        "kvtool's own: payload [N, H, D*bits/8] uint8 and scales [N, H, D/block] (or fp32 [N, H, 1]) as separate "
        "tensors, token-major"),
    LayoutPreset(
        "paged", ALL_FAMILIES, None, 128, False, ("x",),
        (Region("data", (Plane("x", PAYLOAD), Plane("x", SCALE)), PER_HEAD_PAGE),),
        "kvtool.paged.PagedCache (SPEC section 5)",
        "PagedCache.data [num_pages, H, page_bytes]; whole-tensor scales (fp8 tensor, nvfp4 auto) live outside it"),
    LayoutPreset(
        "vllm-mxfp4-page", ("mxfp4",), "mxfp4", 128, False, ("x",),
        (Region("cache", (Plane("x", PAYLOAD), Plane("x", SCALE)), PER_HEAD_PAGE),),
        "SPEC section 5 (vLLM MXFP4 page); vllm-project/vllm tests/kernels/attention/test_minimax_m3.py (index cache "
        "[num_pages, 128, head_dim], one page per 128-token sparse block)",
        "per page and head [128 x 64 B payload][128 x 4 B E8M0] = 8704 B at D = 128"),
    LayoutPreset(
        "vllm-nvfp4-kv", ("nvfp4",), "nvfp4", 16, False, ("k", "v"),
        (Region("kv_cache", _kv_planes(), PAGE_HND),),
        "vllm-project/vllm vllm/utils/torch_utils.py (nvfp4_split_data_scale, create_kv_caches_with_random_flash: "
        "'Per page layout: [K_data | K_scale | V_data | V_scale]', HND inside each part)",
        "scales linear (the SM120 fa2/XQA reader); vLLM's SM100 store kernel swizzles V scales: use trtllm-nvfp4-kv"),
    LayoutPreset(
        "trtllm-nvfp4-kv", ("nvfp4",), "nvfp4", 32, False, ("k", "v"),
        (Region("kv_cache", _kv_planes("trtllm-v4"), PAGE_HND),),
        "SPEC section 5; vllm-project/vllm csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu (swizzle_scale_offset: "
        "the SM100 trtllm-gen reader's V-scale swizzle, K scales linear)",
        "as vllm-nvfp4-kv, V scales interleaved in groups of 4 tokens per (page, head)"),
    LayoutPreset(
        "ds32-indexer-fp8", ("fp8",), "fp8-ds", 64, False, ("x",),
        (Region("indexer_k_cache", (Plane("x", PAYLOAD), Plane("x", SCALE)), PAGE_NHD),),
        "vllm-project/vllm csrc/cache_kernels.cu + vllm/v1/attention/ops/rocm_aiter_mla_sparse.py "
        "(indexer_k_quant_and_cache: per block [P x 128 e4m3][P x fp32 scale])",
        "DeepSeek V3.2 lightning-indexer key cache, one head (MQA)"),
    LayoutPreset(
        "ds32-indexer-shuffled", ("fp8",), "fp8-ds", 64, False, ("x",),
        (Region("indexer_k_cache", (Plane("x", PAYLOAD, "ds32-shuffle"), Plane("x", SCALE)), PAGE_HND),),
        "vllm-project/vllm vllm/v1/attention/ops/rocm_aiter_mla_sparse.py (indexer_k_quant_and_cache_triton, "
        "LAYOUT SHUFFLE for block_size > 1, BLOCK_TILE_SIZE = HEAD_TILE_SIZE = 16)",
        "DeepSeek V3.2 indexer keys as vLLM's ROCm writer stores them: per block [P x 128 e4m3, shuffled as "
        "[P/16, D/16, 16, 16]][P x fp32 scale]; P = 1 is linear"),
    LayoutPreset(
        "vllm-m3-nvfp4-sm100", ("nvfp4",), "nvfp4", 128, True, ("k", "v"),
        (Region("kv_cache", _kv_planes(), PER_HEAD_PAGE),),
        "vllm-project/vllm vllm/third_party/fmha_sm100/nvfp4_kv.py (nvfp4_head_slot_views: uint8 [pages, 2 * Hkv, "
        "128, 72], slot 2h = head h's K, 2h + 1 its V, each [128 x 64 data][128 x 8 E4M3 scales])",
        "MiniMax-M3 SM100 NVFP4 KV: per page and head [K data | K scale | V data | V scale] (9216 B each part pair)"),
    LayoutPreset(
        "sglang-page1", ALL_FAMILIES, None, 1, True, ("k", "v"),
        (Region("k_buffer", (Plane("k", PAYLOAD),), TOKEN_MAJOR),
         Region("v_buffer", (Plane("v", PAYLOAD),), TOKEN_MAJOR),
         Region("k_scale_buffer", (Plane("k", SCALE),), TOKEN_MAJOR),
         Region("v_scale_buffer", (Plane("v", SCALE),), TOKEN_MAJOR)),
        "sgl-project/sglang python/sglang/srt/mem_cache/memory_pool.py (MHATokenToKVPool k_buffer [size + page, H, "
        "D]; MHATokenToKVPoolFP4 k_buffer [m, H, D/2], k_scale_buffer [m, H*D/16])",
        "token index = SGLang slot index (slot 0 is SGLang's padding slot)"),
    LayoutPreset(
        "atom-index", ("fp8", "bf16"), "fp8", 128, False, ("x",),
        (Region("index_cache", (Plane("x", PAYLOAD),), TOKEN_MAJOR),),
        "ROCm/ATOM atom/model_ops/minimax_m3/index_topk.py + sparse_attn.py (index cache (num_blocks, 128, "
        "idx_head_dim), written flat: index_cache + slot * idx_head_dim)",
        "MiniMax-M3 index keys, unit-scale FP8 (or bf16), one head, 128-token pages"),
    LayoutPreset(
        "atom-kv", ("fp8",), "fp8-token", 16, True, ("k", "v"),
        (Region("k_cache", (Plane("k", PAYLOAD, "atom-shuffle-k"),), PER_HEAD_PAGE),
         Region("v_cache", (Plane("v", PAYLOAD, "atom-shuffle-v"),), PER_HEAD_PAGE),
         Region("k_scale", (Plane("k", SCALE),), PER_HEAD_PAGE),
         Region("v_scale", (Plane("v", SCALE),), PER_HEAD_PAGE)),
        "ROCm/ATOM atom/model_ops/minimax_m3/sparse_attn.py (page-16 SHUFFLE K [nb, nkv, D/16, 16, 16], V [nb, nkv, "
        "1, D, 16]; per-token fp32 scales [pages, nkv, 16] for pa_fwd_asm pertokenFp8)",
        "MiniMax-M3 main K/V, per-token FP8 scales"),
    LayoutPreset(
        "vllm-m3-index", ("bf16", "fp8"), "bf16", 128, True, ("x",),
        (Region("index_kv_cache", (Plane("x", PAYLOAD),), TOKEN_MAJOR),),
        "vllm-project/vllm vllm/models/minimax_m3/common/ops/index_topk.py (index-K cache (num_blocks, 128, "
        "idx_head_dim), single head, one 128-token page per sparse block; read without any scale)",
        "MiniMax-M3 index keys for vLLM's common Triton ops (kvtool.engines.vllm_m3)"),
    LayoutPreset(
        "vllm-m3-kv", ("bf16", "fp8"), "bf16", 128, True, ("k", "v"),
        (Region("kv_cache", (Plane("k", PAYLOAD), Plane("v", PAYLOAD)), ("page", "head", "token", "plane")),
         Region("k_scale", (Plane("k", SCALE),), PER_HEAD_PAGE),
         Region("v_scale", (Plane("v", SCALE),), PER_HEAD_PAGE)),
        "vllm-project/vllm vllm/models/minimax_m3/common/ops/sparse_attn.py (main cache (num_blocks, num_kv_heads, "
        "128, 2 * head_dim): K = [..., :head_dim], V = [..., head_dim:]; k_scale / v_scale a scalar or "
        "[num_kv_heads, max_kv_tokens] fp32 indexed by slot)",
        "per token K then V; vLLM's per-token scale buffers are head-major [Hkv, slots]: a region starts at its page "
        "axis, so the preset holds them page-major and kvtool.engines.vllm_m3 transposes them"),
)}


def get_preset(layout: "str | LayoutPreset") -> LayoutPreset:
    """The preset named `layout` (case-insensitive), or LayoutError listing the names."""
    if isinstance(layout, LayoutPreset):
        return layout
    key = str(layout).strip().lower()
    if key not in PRESETS:
        raise LayoutError(f"unknown layout {layout!r} (choose {'|'.join(PRESETS)})")
    return PRESETS[key]
