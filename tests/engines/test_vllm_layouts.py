"""The vLLM adapter's on-device cache conversion (kvtool.engines.vllm_m3) equals the generic layout engine on the
presets vllm-m3-index / vllm-m3-kv byte for byte (no vLLM needed)."""

import torch

from kvtool.engines.vllm_m3 import index_cache_tensor, kv_cache_tensor, kv_scale_tensors
from kvtool.formats import get_format
from kvtool.layouts.engine import encode, make_geometry
from kvtool.layouts.presets import get_preset
from kvtool.workflows.verify_attn import build_paged, synthetic_kv
from kvtool.workflows.verify_topk import build_index_cache, synthetic_index_keys


def _whole_pool(cache):
    """Every slot of the pool in slot order, as the QTensor the layout engine encodes (engine page i = pool page i)."""
    return cache.gather(torch.arange(cache.num_slots))


def test_index_cache_is_the_preset_bytes():
    gen = torch.Generator().manual_seed(3)
    for name in ("bf16", "fp8"):
        fmt = get_format(name)
        cache, _, _ = build_index_cache(fmt, [synthetic_index_keys(n, 64, gen) for n in (200, 130)], 128, "cpu", gen)
        preset = get_preset("vllm-m3-index")
        geo = make_geometry(preset, fmt, 128, 1, 64, cache.num_slots)
        want = encode(preset, {"x": _whole_pool(cache)}, geo)["index_kv_cache"]
        got = index_cache_tensor(cache).contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(got, want)


def test_kv_cache_and_scales_are_the_preset_bytes():
    gen = torch.Generator().manual_seed(4)
    for name in ("bf16", "fp8", "fp8-token"):
        fmt = get_format(name)
        ks = [synthetic_kv(n, 2, 64, gen) for n in (200, 77)]
        vs = [synthetic_kv(n, 2, 64, gen, outliers=False) for n in (200, 77)]
        kc, vc, _ = build_paged(fmt, ks, vs, 128, "cpu", gen)
        preset = get_preset("vllm-m3-kv")
        geo = make_geometry(preset, fmt, 128, 2, 64, kc.num_slots)
        regions = encode(preset, {"k": _whole_pool(kc), "v": _whole_pool(vc)}, geo)
        got = kv_cache_tensor(kc, vc).contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(got, regions["kv_cache"])
        k_scale, v_scale = kv_scale_tensors(kc, vc)
        if fmt.scale_element == "fp32-row":  # [Hkv, slots] head-major; the preset holds [pages, Hkv, 128]
            for s, region in ((k_scale, "k_scale"), (v_scale, "v_scale")):
                page_major = s.reshape(2, kc.num_pages, 128).permute(1, 0, 2).contiguous()
                assert torch.equal(page_major.view(torch.uint8).reshape(-1), regions[region])
        else:
            assert k_scale is None and "k_scale" not in regions
