"""Engines tier, layouts: kvtool's engine presets against the engines' own writers and views, and hand-computed offsets.

- `ds32-indexer-shuffled`: vLLM's ROCm DeepSeek V3.2 indexer writer (`_indexer_k_quant_and_cache_kernel`, a Triton
  kernel run in the interpreter). The interpreter's fp32 -> e4m3 cast is wrong (it drops the rounding carry and
  misrounds ties), so the kernel writes into an fp32 buffer of the same element layout: that checks its scale, its
  quotient x / s and every offset; the GPU's final cast (cvt.rn.satfinite) is the SPEC's e4m3 encode.
- `vllm-m3-nvfp4-sm100`: vLLM's fmha_sm100 `nvfp4_head_slot_views` applied to the buffer kvtool writes.
- `sglang-page1` with the kvfp4 format: SGLang's own quantizer bytes decoded through the preset.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.engines import oracles
from kvtool.engines.wheels import EngineUnavailable
from kvtool.formats import e4m3_encode, get_format
from kvtool.layouts import get_preset
from kvtool.layouts.engine import decode, encode, make_geometry

D = 128


def _oracle(fn):
    try:
        return fn()
    except EngineUnavailable as err:
        pytest.skip(f"engine oracle unavailable: {err}")


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 128] fp32 index keys: per-row magnitudes 2**-20 .. 2**10, a zero row, rows under the 1e-4 amax floor, and
    rows whose max sits at and just above 448 * 2**k (the ue8m0 log2 edge)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g) * torch.exp2(torch.empty(n, 1).uniform_(-20, 10, generator=g))
    x[0] = 0.0
    x[1] *= 1e-6 / x[1].abs().max()
    for i, k in enumerate(range(-8, 4)):
        row = 2 + i
        if row < n:
            top = torch.tensor(448.0 * 2.0**k)  # scale s = amax / 448 at 2**k, or one ulp above
            x[row] *= 0.5 * float(top) / x[row].abs().max()
            x[row, 7] = float(torch.nextafter(top, torch.tensor(1e9))) if i % 2 else float(top)
    return x.contiguous()


def _geometry(preset: str, label: str, page: int, heads: int, tokens: int):
    p = get_preset(preset)
    return p, make_geometry(p, get_format(label), page, heads, D, tokens)


# ------------------------------------------------------------------------------------ DS V3.2 indexer, shuffled
def test_ds32_shuffled_offsets_by_hand():
    """P = 64, D = 128: token t, byte d at (t//16)*2048 + (d//16)*256 + (t%16)*16 + d%16; scales after P * 128."""
    preset, geo = _geometry("ds32-indexer-shuffled", "fp8-ds", 64, 1, 70)
    q = geo.fmt.quantize(_keys(70).unsqueeze(1))
    raw = encode(preset, {"x": q}, geo)["indexer_k_cache"]
    assert raw.numel() == 2 * (64 * 128 + 64 * 4)
    payload = q.payload.view(torch.uint8)
    assert torch.equal(raw[80:96], payload[5, 0, 0:16])  # t = 5: tile 0, row 5
    assert torch.equal(raw[336:352], payload[5, 0, 16:32])  # next 16 bytes: one 16 x 16 tile further (+256)
    assert torch.equal(raw[2048 + 80 + 7 * 256:2048 + 96 + 7 * 256], payload[21, 0, 112:128])  # t = 21: tile row 1
    assert torch.equal(raw[8192 + 20:8192 + 24], q.scales[5, 0].contiguous().view(torch.uint8))
    page1 = 8448  # token 69 = page 1, t = 5
    assert torch.equal(raw[page1 + 80:page1 + 96], payload[69, 0, 0:16])
    assert torch.equal(raw[page1 + 8192 + 20:page1 + 8192 + 24], q.scales[69, 0].contiguous().view(torch.uint8))
    back = decode(preset, {"indexer_k_cache": raw}, geo)["x"]
    assert torch.equal(back.payload.view(torch.uint8), payload) and torch.equal(back.scales, q.scales)


def test_ds32_ue8m0_edge_rows_differ_from_the_exact_power_of_two():
    """The key rows at 448 * 2**k plus one ulp: the fp32 log2 rounds to k (scale 2**k, codes saturate), the exact
    rule gives 2**(k+1). The writer test below runs on these rows, so it separates the two rules."""
    x = _keys(16)
    engine = get_format("@vllm.indexer_k_cache_ue8m0").quantize(x).scales
    exact = get_format("fp8-ds-pow2").quantize(x).scales
    differ = (engine != exact).reshape(-1).nonzero().reshape(-1).tolist()
    assert differ and all(r >= 2 and r % 2 == 1 for r in differ), differ


def test_ds32_page_of_one_token_is_linear():
    preset, geo = _geometry("ds32-indexer-shuffled", "fp8-ds", 1, 1, 3)
    q = geo.fmt.quantize(_keys(3).unsqueeze(1))
    raw = encode(preset, {"x": q}, geo)["indexer_k_cache"]
    assert torch.equal(raw[132:260], q.payload.view(torch.uint8)[1, 0])  # token 1: [128 payload][4 scale] per token


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("recipe", ["vllm.indexer_k_cache", "vllm.indexer_k_cache_ue8m0"])
def test_ds32_indexer_writer_matches_vllm_kernel(page: int, recipe: str):
    """vLLM's Triton writer and kvtool (recipe + ds32-indexer-shuffled) give the same scales, quotients and offsets."""
    ns = _oracle(oracles.vllm_indexer_writer)
    n = 40 if page > 1 else 12
    x = _keys(n, seed=page)
    pages = -(-n // page) + 1
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(9))[:n]  # scattered slots
    values = torch.full((pages, page * D), float("nan"))
    scales = torch.full((pages, page), float("nan"))
    ns._indexer_k_quant_and_cache_kernel[(n,)](
        x, values, scales, slots, scales.stride(0), values.stride(0), page, n, D,
        LAYOUT="NORMAL" if page == 1 else "SHUFFLE", BLOCK_TILE_SIZE=16, HEAD_TILE_SIZE=16, IS_FNUZ=False,
        USE_UE8M0=recipe.endswith("ue8m0"))
    # kvtool: quantize the rows, put row i at slot slots[i], lay the pages out with the preset
    fmt = get_format(f"@{recipe}")
    q = fmt.quantize(x)
    order = torch.full((pages * page,), -1, dtype=torch.long)
    order[slots] = torch.arange(n)
    filled = order >= 0
    rows = torch.zeros(pages * page, D // 1, dtype=torch.uint8)
    rows[filled] = q.payload.view(torch.uint8)[order[filled]]
    row_scales = torch.ones(pages * page, 1)
    row_scales[filled] = q.scales[order[filled]]
    cache = type(q)(fmt, rows.unsqueeze(1), row_scales.unsqueeze(1), 1.0, (pages * page, 1, D))
    preset, geo = _geometry("ds32-indexer-shuffled", fmt.label, page, 1, pages * page)
    raw = encode(preset, {"x": cache}, geo)["indexer_k_cache"].reshape(pages, -1)
    kv_payload, kv_scales = raw[:, :page * D], raw[:, page * D:].contiguous().view(torch.float32)
    written = ~torch.isnan(values)
    stored = ~torch.isnan(scales)
    assert torch.equal(kv_scales[stored].view(torch.int32), scales[stored].view(torch.int32))
    assert torch.equal(kv_payload[written], e4m3_encode(values[written]))
    assert int(written.sum()) == n * D


# -------------------------------------------------------------------------------------- M3 SM100 NVFP4 page
def _marked_nvfp4(n: int, h: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    fmt = get_format("nvfp4")
    payload = torch.randint(0, 256, (n, h, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 127, (n, h, 8), dtype=torch.uint8, generator=g)
    return type(fmt.quantize(torch.zeros(1, 16)))(fmt, payload, scales, 1.0, (n, h, D))


def test_m3_sm100_page_offsets_by_hand():
    """P = 128, H = 2: per page and head [K data 8192 | K scale 1024 | V data 8192 | V scale 1024] = 18432 B."""
    k, v = _marked_nvfp4(130, 2, 1), _marked_nvfp4(130, 2, 2)
    preset, geo = _geometry("vllm-m3-nvfp4-sm100", "nvfp4", 128, 2, 130)
    raw = encode(preset, {"k": k, "v": v}, geo)["kv_cache"]
    assert raw.numel() == 2 * 2 * 18432
    h1 = 18432  # token 5, head 1
    assert torch.equal(raw[h1 + 320:h1 + 384], k.payload[5, 1])
    assert torch.equal(raw[h1 + 8192 + 40:h1 + 8192 + 48], k.scales[5, 1])
    assert torch.equal(raw[h1 + 9216 + 320:h1 + 9216 + 384], v.payload[5, 1])
    assert torch.equal(raw[h1 + 9216 + 8192 + 40:h1 + 9216 + 8192 + 48], v.scales[5, 1])
    p1 = 36864  # token 129 = page 1, t = 1, head 0
    assert torch.equal(raw[p1 + 64:p1 + 128], k.payload[129, 0])
    assert torch.equal(raw[p1 + 9216 + 8192 + 8:p1 + 9216 + 8192 + 16], v.scales[129, 0])


def test_m3_sm100_page_matches_vllm_views():
    ns = _oracle(oracles.vllm_m3_nvfp4_page)
    hkv, n = 3, 200
    k, v = _marked_nvfp4(n, hkv, 3), _marked_nvfp4(n, hkv, 4)
    preset, geo = _geometry("vllm-m3-nvfp4-sm100", "nvfp4", 128, hkv, n)
    cache = encode(preset, {"k": k, "v": v}, geo)["kv_cache"].reshape(geo.pages, 2 * hkv, 128, 72)
    k_data, k_scale, v_data, v_scale = ns.nvfp4_head_slot_views(cache[:, 0::2], cache[:, 1::2])
    for ours, theirs in ((k.payload, k_data), (k.scales, k_scale), (v.payload, v_data), (v.scales, v_scale)):
        flat = theirs.permute(0, 2, 1, 3).reshape(geo.pages * 128, hkv, -1)[:n]  # [pages, H, P, nb] -> [N, H, nb]
        assert torch.equal(flat, ours)


# ------------------------------------------------------------------------------------------ SGLang FP4 KV pool
def test_sglang_kvfp4_pool_bytes_decode_through_sglang_page1():
    """SGLang's own bytes (k_buffer [m, H, D/2], k_scale_buffer [m, H * D/16]) read as kvfp4 give SGLang's values;
    read as nvfp4 they would not (E8M0 bytes taken as E4M3)."""
    util = _oracle(oracles.sglang_kvfp4).FP4MXBlock16KVQuantizeUtil
    m, h = 9, 2
    x = torch.randn(m, h, D, generator=torch.Generator().manual_seed(5)) * 300
    x[3, 1, :16] = torch.tensor([-896.0] + [1.0] * 15)
    packed, sf = util.batched_quantize(x.clone())  # B = m tokens, M = h heads
    theirs = util.batched_dequantize(packed, sf, dtype=torch.float32)
    regions = {"k_buffer": packed.reshape(-1), "v_buffer": packed.reshape(-1),
               "k_scale_buffer": sf.reshape(-1), "v_scale_buffer": sf.reshape(-1)}
    preset = get_preset("sglang-page1")
    geo = make_geometry(preset, get_format("kvfp4@sglang.kvfp4"), 1, h, D, m)
    ours = decode(preset, regions, geo)["k"].dequantize()
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert float(ours[3, 1, 0]) == -1024.0  # 896 / 2**8 = 3.5 rounds away to 4 under SGLang's ties-up rule
    as_nv = decode(preset, regions, make_geometry(preset, get_format("nvfp4"), 1, h, D, m))["k"].dequantize()
    assert float(as_nv[3, 1, 0]) != float(theirs[3, 1, 0])
