"""Launch variants of the portable index scorer in causal prefill and decode beside vLLM's kernels.

Issue 32: kvtool's bf16 prefill score + top-k was 0.61x vLLM's at 32K x 4 heads. This times, on the same data as
`kvtool bench index`, the default launch and fixed launch variants (query tile, blocks per program, warps, stages,
query-major dots, decode once, the select pass's rows per program), the split into block scores alone + the select
pass, beside vLLM's score kernel alone and score + top-k; decode variants (blocks per program, in-kernel top-k,
query-major) at the batch x context of `--decode`. CUDA only.
`PYTHONPATH=. KVTOOL_CACHE_DIR=.kvtool-cache python3 bench/sweep_index_prefill.py [--contexts 4096,32768]
[--formats bf16,fp8,nvfp4,mxfp4] [--decode 64x150000] [--variants "default,qm q32 w4 s3"]`; prints one line per case
(us per call, CUDA-graph replay; prefill variants marked "(DIFFERS)" where their top-k is not the default's) and
writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvtool.bench.common import time_fn
from kvtool.bench.index import GEOMETRY, _Decode
from kvtool.indexer import IndexerConfig
from kvtool.kernels import index_score as isc
from kvtool.kernels.topk import select_from_block_scores

PREFILL_VARIANTS = (
    ("default", {}),
    ("q16 ch32 w4 s3", dict(q_tile=16, chunk_blocks=32, num_warps=4, num_stages=3, prefetch=False)),
    ("q16 ch256 w4 s5", dict(q_tile=16, chunk_blocks=256, num_warps=4, num_stages=5, prefetch=False)),
    ("q16 ch32 w8 s3", dict(q_tile=16, chunk_blocks=32, num_warps=8, num_stages=3, prefetch=False)),
    ("q32 ch32 w4 s3", dict(q_tile=32, chunk_blocks=32, num_warps=4, num_stages=3, prefetch=False)),
    ("q32 ch32 w8 s3", dict(q_tile=32, chunk_blocks=32, num_warps=8, num_stages=3, prefetch=False)),
    ("q32 ch256 w8 s3", dict(q_tile=32, chunk_blocks=256, num_warps=8, num_stages=3, prefetch=False)),
    ("q64 ch32 w8 s3", dict(q_tile=64, chunk_blocks=32, num_warps=8, num_stages=3, prefetch=False)),
    ("q16 ch8 w4 s3", dict(q_tile=16, chunk_blocks=8, num_warps=4, num_stages=3, prefetch=False)),
    ("q16 ch32 w4 s2", dict(q_tile=16, chunk_blocks=32, num_warps=4, num_stages=2, prefetch=False)),
    # query-major dots (kernels/index_tiles.tile_dot) and the prefill select variants (kernels/topk.py)
    ("qm q32 w4 s3", dict(q_major=True, q_tile=32, num_warps=4, num_stages=3, prefetch=False)),
    ("qm q16 w4 s3", dict(q_major=True, q_tile=16, num_warps=4, num_stages=3, prefetch=False)),
    ("qm q32 w8 s3", dict(q_major=True, q_tile=32, num_warps=8, num_stages=3, prefetch=False)),
    ("qm q64 w8 s3", dict(q_major=True, q_tile=64, num_warps=8, num_stages=3, prefetch=False)),
    ("qm q32 w4 s2", dict(q_major=True, q_tile=32, num_warps=4, num_stages=2, prefetch=False)),
    ("qm q32 w4 s4", dict(q_major=True, q_tile=32, num_warps=4, num_stages=4, prefetch=False)),
    ("qm q32 ch256 w4 s3", dict(q_major=True, q_tile=32, chunk_blocks=256, num_warps=4, num_stages=3,
                                prefetch=False)),
    ("qm q16 ch256 w4 s5", dict(q_major=True, q_tile=16, chunk_blocks=256, num_warps=4, num_stages=5,
                                prefetch=False)),
    ("in-kernel decode", dict(decode_once=False)),
    ("qm q32 ch8 w4 s3", dict(q_major=True, q_tile=32, chunk_blocks=8, num_warps=4, num_stages=3, prefetch=False)),
    ("qm q32 ch32 w4 s3", dict(q_major=True, q_tile=32, chunk_blocks=32, num_warps=4, num_stages=3, prefetch=False)),
    ("decode once qm q32 w4 s4", dict(decode_once=True, q_major=True, q_tile=32, num_warps=4, num_stages=4,
                                      prefetch=False)),
    ("select packed", dict(select="packed")),
    ("select packedR2", dict(select="packedR2")),
    ("select packedR4", dict(select="packedR4")),
    ("select packedR8", dict(select="packedR8")),
    ("select split128", dict(select="split128")),
    ("qm q32 w4 s3 packedR4", dict(q_major=True, q_tile=32, num_warps=4, num_stages=3, prefetch=False,
                                   select="packedR4")),
)
DECODE_VARIANTS = (
    ("default", {}),
    ("ch1 w4 s3", dict(chunk_blocks=1, num_warps=4, num_stages=3, prefetch=False)),
    ("ch1 w4 s2", dict(chunk_blocks=1, num_warps=4, num_stages=2, prefetch=False)),
    ("ch2 w4 s5", dict(chunk_blocks=2, num_warps=4, num_stages=5, prefetch=False)),
    ("ch1 w8 s3", dict(chunk_blocks=1, num_warps=8, num_stages=3, prefetch=False)),
    ("ch1 w2 s3", dict(chunk_blocks=1, num_warps=2, num_stages=3, prefetch=False)),
    ("in-kernel topk ch16", dict(in_kernel_topk=True, chunk_blocks=16)),
    ("in-kernel topk ch32", dict(in_kernel_topk=True, chunk_blocks=32)),
    ("in-kernel topk ch64", dict(in_kernel_topk=True, chunk_blocks=64)),
    ("ch16", dict(chunk_blocks=16)),
    ("ch64", dict(chunk_blocks=64)),
    ("qm ch32 w4 s3", dict(q_major=True, chunk_blocks=32, num_warps=4, num_stages=3, prefetch=False)),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--formats", default="bf16,fp8,nvfp4,mxfp4")
    ap.add_argument("--decode", default="1x32768,1x150000")
    ap.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from kvtool.engines.vllm_m3 import VllmM3, bench_index_decode, bench_index_prefill

    vllm = VllmM3()
    cfg = IndexerConfig()
    gen = torch.Generator().manual_seed(0)
    rows = []

    def rec(group, name, fn):
        try:
            us = time_fn(fn, "cuda", cuda_graph=True) * 1e6
        except Exception as exc:  # a variant the kernel refuses: say so and go on
            print(f"{group:24s} {name:28s} ERROR {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return
        rows.append(dict(group=group, name=name, us=us))
        print(f"{group:24s} {name:28s} {us:10.1f} us", flush=True)

    hi, d = GEOMETRY["index_heads"], GEOMETRY["head_dim"]
    wanted = [v for v in args.variants.split(",") if v]
    for spec in [s for s in args.decode.split(",") if s]:
        b, n = (int(x) for x in spec.split("x"))
        for name in [f for f in args.formats.split(",") if f]:
            step = _Decode(name, b, n, 4, "cuda", gen, cfg)
            group = f"decode b{b}x{n} {step.fmt.label}"
            for vname, opts in [v for v in DECODE_VARIANTS if not wanted or v[0] in wanted]:
                rec(group, vname, step.topk(**opts))
            if not vllm.unsupported("index", step.fmt, device="cuda"):
                fns = [bench_index_decode(vllm, step.iq, c, step.table, step.ctx, cfg, n) for c in step.caches]
                rec(group, "vllm", lambda fns=fns: [f() for f in fns])
    for n in [int(c) for c in args.contexts.split(",") if c]:
        for name in [f for f in args.formats.split(",") if f]:
            one = _Decode(name, 1, n, 1, "cuda", gen, cfg)
            iq = torch.randn(1, n, hi, d, generator=gen).to(torch.bfloat16).cuda()
            cache, table, ctx = one.caches[0], one.table, one.ctx
            group = f"prefill {n} {one.fmt.label}"
            ref = isc.prefill_topk(iq, cache, table, ctx, cfg, max_context=n)
            for vname, opts in [v for v in PREFILL_VARIANTS if not wanted or v[0] in wanted]:
                try:
                    got = isc.prefill_topk(iq, cache, table, ctx, cfg, max_context=n, **opts)
                    same = bool(torch.equal(got, ref))
                except Exception as exc:
                    print(f"{group:24s} {vname:28s} ERROR {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                rec(group, vname + ("" if same else " (DIFFERS)"),
                    lambda o=opts: isc.prefill_topk(iq, cache, table, ctx, cfg, max_context=n, **o))
            rec(group, "block scores only",
                lambda: isc.prefill_block_scores(iq, cache, table, ctx, cfg, max_context=n))
            bsc = isc.prefill_block_scores(iq, cache, table, ctx, cfg, max_context=n)
            pos = torch.arange(n, device="cuda", dtype=torch.int32)[None]
            rec(group, "select only",
                lambda: select_from_block_scores(bsc, pos, cfg.block_size, cfg.topk, higher_id=True))
            for sel in ("packedR2", "packedR4", "packedR8"):
                rec(group, f"select only {sel}",
                    lambda sel=sel: select_from_block_scores(bsc, pos, cfg.block_size, cfg.topk, higher_id=True,
                                                             variant=sel))
            if not vllm.unsupported("index", one.fmt, device="cuda"):
                rec(group, "vllm score+topk", bench_index_prefill(vllm, iq, cache, table, ctx, cfg))
                rec(group, "vllm score only", bench_index_prefill(vllm, iq, cache, table, ctx, cfg, score_only=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
