"""How much of a bf16 decode attention step is the split merge: `python3 bench/probe_attn_combine.py` (CUDA).

For M3's TP4 decode shape at batches 16 / 64 / 256 (the `kvtool bench attn` inputs and layer counts), times by
CUDA-graph replay: the default `sparse_decode` step, and the combine kernel alone on partials of the default launch's
shape (fp32 acc [rows x Hq x splits, D] and (m, l)), as many launches as the step has layers. The difference bounds
what a cheaper merge could save (issue 32: kvtool's bf16 step against vLLM's, docs/kernels/sparse_attn.md).
"""
from __future__ import annotations

import argparse

import torch
import triton

from kvtool.bench.attn import GEOMETRY, _Step, layers_for
from kvtool.bench.common import time_fn
from kvtool.kernels.sparse_attn import _combine_kernel, launch_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--warps", default="4",
                    help="warps per merge program to time, comma list (the share column: the first)")
    args = ap.parse_args()
    g, dev = GEOMETRY, "cuda"
    gen = torch.Generator().manual_seed(0)
    warps = [int(w) for w in args.warps.split(",")]
    print(f"batch | layers | splits | step us | combine alone us, warps {' / '.join(map(str, warps))} | share")
    for batch in (int(b) for b in args.batches.split(",")):
        _, splits, _, _ = launch_plan(batch, g["num_kv_heads"], g["topk"], g["block_size"], g["page_size"],
                                      torch.device(dev))
        if splits < 2:
            continue  # one split: no merge
        layers = layers_for(batch, args.context, "bf16", dev)
        step = _Step("bf16", batch, args.context, layers, dev, gen)
        n = batch * g["num_q_heads"]
        parts = [torch.randn(n * splits, g["head_dim"], device=dev) for _ in range(layers)]
        mls = [torch.stack([torch.randn(n * splits, device=dev), torch.rand(n * splits, device=dev) + 0.5], -1)
               for _ in range(layers)]
        outs = [torch.empty(n, g["head_dim"], dtype=torch.bfloat16, device=dev) for _ in range(layers)]

        def combine(w):
            for part, ml, out in zip(parts, mls, outs):
                _combine_kernel[(n,)](part, ml, out, 1.0, splits, BLOCK_S=triton.next_power_of_2(splits),
                                      D=g["head_dim"], num_warps=w)

        t_step = time_fn(step.kernel(), dev, cuda_graph=True) * 1e6
        t_comb = [time_fn(lambda w=w: combine(w), dev, cuda_graph=True) * 1e6 for w in warps]
        print(f"{batch} | {layers} | {splits} | {t_step:.1f} | {' / '.join(f'{t:.1f}' for t in t_comb)} | "
              f"{t_comb[0] / t_step:.1%}")


if __name__ == "__main__":
    main()
