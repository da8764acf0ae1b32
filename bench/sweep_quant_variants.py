"""H200 sweep of store / dequant kernel variants (layout, fast block codecs, register cap, tile configs): each variant
is checked byte-for-byte against the torch reference on the same data, then timed by CUDA-graph replay (kernel time).
Usage: PYTHONPATH=. python bench/sweep_quant_variants.py [elements[,elements...]] [formats] [store|dequant|host|all]
  > $OUT/sweep.txt   (defaults: 256M, mxfp4,nvfp4, store)
"""

import math
import signal
import sys
import time

import torch

from kvtool.bench.common import copy_bandwidth, time_fn
from kvtool.formats import get_format
from kvtool.kernels.dequant import launch_dequant
from kvtool.kernels.store import cache_scales, launch_config, launch_store, store
from kvtool.kernels.dequant import gather_dequantize
from kvtool.paged import PagedCache

DIM, PAGE = 128, 128
sizes = [int(float(v)) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [256 << 20]
labels = sys.argv[2].split(",") if len(sys.argv) > 2 else ["mxfp4", "nvfp4"]
parts = sys.argv[3] if len(sys.argv) > 3 else "store"
dev = "cuda"
copy = copy_bandwidth(dev)
print(f"copy {copy:.0f} GB/s", flush=True)

# (variant, config, gluon) per scale element, as launch_store takes them (variant keys: kernels/store.py VARIANTS):
# the current defaults (first row of each list) against the launch variants the store keeps; a config "x0.5" / "x2"
# scales the default rows per program. gluon=False: the portable kernel where the Hopper TMA path
# (kernels/store_gluon.py) is the default; GLUON_*: its tile rows, programs per SM and warps, and the nvfp4 packed amax
# / reciprocal table. Variants measured no gain and removed (lane-split block loads, persistent programs):
# docs/kernels/store.md.
GL = [(dict(), None, False), (dict(GLUON_PACKED_AMAX=False, GLUON_RCP_LUT=False), None, None),
      (dict(GLUON_ROWS=32, GLUON_PROGRAMS=8, GLUON_WARPS=4), None, None)]
STORE = {
    "e8m0": [(dict(), None, None)] + GL,
    "e4m3": [(dict(), None, None)] + GL,
}
if parts not in ("store", "all"):
    STORE = {}
# dequant: the default (kernels/dequant.py FP4_WORDS_CONFIG: 16 x 2 tiles, streaming stores) against the former
# default (32 x 4, no cache hints) and neighbours
DEQ = ([(dict(), None), (dict(STREAM=False), (32, 4)), (dict(), (32, 4)), (dict(STREAM=False), None),
        (dict(), (8, 1)), (dict(), (8, 2)), (dict(), (32, 2))] if parts in ("dequant", "all") else [])
HOST = parts in ("host", "all")

TABLE: dict = {}  # (format, variant, config) -> {elements: (fraction of copy, bytes ok)}
signal.signal(signal.SIGTERM, lambda *a: print_table(*a))
for n_el, label in [(n, lb) for n in sizes for lb in labels]:
    fmt = get_format(label)
    tokens = n_el // DIM
    g = torch.Generator(device=dev).manual_seed(1)
    x = (torch.randn(tokens, 1, DIM, device=dev, generator=g)
         * torch.exp2(torch.randint(-8, 8, (tokens, 1, 1), device=dev, generator=g).float())).to(torch.bfloat16)
    x[:5, 0, :32] = 0.0
    x[1, 0, 3] = -0.0
    pages = math.ceil(tokens / PAGE)
    perm = torch.randperm(pages, device=dev, generator=g)
    t = torch.arange(tokens, device=dev)
    slots = perm[t // PAGE] * PAGE + t % PAGE
    ref = PagedCache.allocate(fmt, pages, PAGE, 1, DIM, device=dev)
    ref.store(x, slots)
    want = ref.dequantize(slots, torch.bfloat16) if DEQ else None
    rows = tokens
    st_bytes = x.numel() * 2 + slots.numel() * 8 + rows * fmt.bytes_per_token(DIM)
    dq_bytes = rows * fmt.bytes_per_token(DIM) + slots.numel() * 8 + x.numel() * 2
    cache = PagedCache.allocate(fmt, pages, PAGE, 1, DIM, device=dev)
    _, g_dec = cache_scales(ref)
    kw = dict(page_size=PAGE, page_stride=cache.data.stride(0), head_stride=cache.data.stride(1), g_dec=g_dec)
    # a copy moving the store's bytes (read + write), graph-timed like the store: the size-matched ceiling
    src = torch.empty(st_bytes // 2, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    same = st_bytes / time_fn(lambda: dst.copy_(src), dev, cuda_graph=True) / 1e9
    del src, dst
    print(f"== {n_el / 2**20:.0f}M {fmt.label}: store {st_bytes / 1e6:.0f} MB, dequant {dq_bytes / 1e6:.0f} MB; "
          f"same-bytes copy {same:.0f} GB/s ({same / copy:.1%} of the 1 GiB copy)", flush=True)
    for var, cfg, gluon in STORE.get(fmt.scale_element, []):
        name = str(var) if gluon is None else f"{var} gluon={gluon}"
        if isinstance(cfg, str):  # rows per program scaled from the default config
            rows, warps = launch_config(DIM, fmt.spec.payload_bits, None, fmt.block or 32)
            cfg = (max(1, int(rows * float(cfg[1:]))), warps)
        t0 = time.time()
        try:
            cache.data.zero_()
            fn = lambda: launch_store(x, slots, cache.data, None, fmt, config=cfg, variant=var, gluon=gluon,  # noqa: E731
                                      **kw)
            fn()
            torch.cuda.synchronize()
            ok = torch.equal(cache.data, ref.data)
            sec = time_fn(fn, dev, cuda_graph=True)
            TABLE.setdefault((fmt.label, name, str(cfg)), {})[n_el] = (st_bytes / sec / 1e9 / copy, ok)
            print(f"store   {fmt.label:12s} {name:40s} {str(cfg):>8s}  {'OK ' if ok else 'BAD'} "
                  f"{sec * 1e6:8.1f} us {st_bytes / sec / 1e9:6.0f} GB/s {st_bytes / sec / 1e9 / copy:6.1%} "
                  f"[{st_bytes / sec / 1e9 / same:6.1%} of same-bytes copy] (compile+check {time.time() - t0:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001
            TABLE.setdefault((fmt.label, name, str(cfg)), {})[n_el] = (float("nan"), False)
            print(f"store   {fmt.label} {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    out = torch.empty(tokens, 1, DIM, dtype=torch.bfloat16, device=dev)
    for var, cfg in DEQ:
        t0 = time.time()
        try:
            out.zero_()
            fn = lambda: launch_dequant(ref.data, None, slots, out, fmt, config=cfg, variant=var, **kw)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            ok = torch.equal(out.view(torch.int16), want.view(torch.int16))
            sec = time_fn(fn, dev, cuda_graph=True)
            TABLE.setdefault((fmt.label, "dequant " + str(var), str(cfg)), {})[n_el] = (dq_bytes / sec / 1e9 / copy, ok)
            print(f"dequant {fmt.label:12s} {str(var):40s} {str(cfg):>8s}  {'OK ' if ok else 'BAD'} "
                  f"{sec * 1e6:8.1f} us {dq_bytes / sec / 1e9:6.0f} GB/s {dq_bytes / sec / 1e9 / copy:6.1%} "
                  f"(compile+check {time.time() - t0:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"dequant {fmt.label} {var} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    # host cost: the public entry points launched eagerly vs the same in a CUDA graph
    f1 = lambda: store(ref, x, slots, validate=False)  # noqa: E731
    f2 = lambda: gather_dequantize(ref, slots, torch.bfloat16, validate=False, out=out)  # noqa: E731
    for name, f in (("store()", f1), ("gather_dequantize()", f2)) if HOST else ():
        e, gr = time_fn(f, dev), time_fn(f, dev, cuda_graph=True)
        print(f"host    {fmt.label:12s} {name:22s} eager {e * 1e6:8.1f} us, graph {gr * 1e6:8.1f} us", flush=True)
    del x, slots, ref, cache, want, out
    torch.cuda.empty_cache()


def print_table(*_):
    """The compact table: % of the copy bandwidth per size, '!' where the bytes differ from the torch store (also
    printed when `timeout` stops the sweep, with the sizes done so far)."""
    if TABLE:
        print("\n% of copy         " + "".join(f"{n / 2**20:>9.0f}M " for n in sizes))
        for (label, var, cfg), row in TABLE.items():
            cells = "".join(f"{row[n][0]:>9.1%}{' ' if row[n][1] else '!'} " if n in row else f"{'-':>11s}"
                            for n in sizes)
            print(f"{label:12s} {var + ('' if cfg == 'None' else ' ' + cfg):42s}{cells}")
        print("(! = bytes differ from the torch store or the launch failed)", flush=True)
    if _:
        sys.exit(124)


print_table()
