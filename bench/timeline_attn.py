"""The sparse-attention decode step as the benchmark replays it (a CUDA graph of several layers), as a timeline of
its kernels: when each starts and ends on the GPU, per layer.

    PYTHONPATH=. python3 bench/timeline_attn.py run bf16 --batch 128 --layers 2 [--peer vllm] --csv attn128.csv
    python3 bench/timeline_attn.py summary attn128.csv --last 4

`run` builds `kvtool bench attn`'s inputs (`kvtool.bench.attn._Step`: M3's TP4 shape, 8000-token contexts), captures
the step (kvtool's `sparse_decode`, or with `--peer` the engine's decode kernel and merge) in one CUDA graph,
replays it `--replays` times under torch.profiler (CUPTI kernel records, graph-launched kernels included) and
writes each GPU kernel's start, duration and name to `--csv` (the columns of `nsys stats -r cuda_gpu_trace`, whose
CSV `summary` reads as well). `summary` prints, for the kernels of the last `--last` layers, each kernel's duration
and the gap from the end of the kernel before it to its start (negative: the two overlapped, as programmatic
dependent launch allows), so that a step's time splits into kernels and the gaps between them.
"""

from __future__ import annotations

import argparse
import csv


def run(args) -> None:
    import torch

    from kvtool.bench.attn import _Step

    step = _Step(args.format, args.batch, 8000, args.layers, "cuda", torch.Generator().manual_seed(0))
    if args.peer:
        from kvtool.engines.protocol import resolve_impl

        fn = step.engine(resolve_impl(args.peer, "attend"))
    else:
        fn = step.kernel()
    for _ in range(2):  # compile, warm caches
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.start_ns(), e.duration_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                     if e.device_type() == torch.autograd.DeviceType.CUDA and not e.name().startswith("Memcpy"))
    with open(args.csv, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Start (ns)", "Duration (ns)", "Name"])
        out.writerows(kernels)
    print(f"replayed: {args.format} batch {args.batch} x {args.layers} layers x {args.replays}"
          f"{f' peer {args.peer}' if args.peer else ''}: {len(kernels)} kernels -> {args.csv}")


def summary(args) -> None:
    with open(args.csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("Name") and not r["Name"].startswith("[CUDA mem")]
    if not rows:
        raise SystemExit(f"timeline_attn: no kernel rows in {args.csv}")
    start_key = next(k for k in rows[0] if k.startswith("Start"))
    dur_key = next(k for k in rows[0] if k.startswith("Duration"))
    kernels = sorted(((int(r[start_key]), int(r[dur_key]), r["Name"]) for r in rows), key=lambda k: k[0])
    names = sorted({k[2] for k in kernels})
    per_layer = max(1, len(names))
    tail = kernels[-args.last * per_layer:]
    prev_end = None
    print(f"{'kernel':<40} {'us':>8} {'gap us':>8}")
    for start, dur, name in tail:
        gap = "" if prev_end is None else f"{(start - prev_end) / 1e3:8.2f}"
        print(f"{name[:40]:<40} {dur / 1e3:8.2f} {gap:>8}")
        prev_end = start + dur
    span = (tail[-1][0] + tail[-1][1] - tail[0][0]) / 1e3
    print(f"{len(tail)} kernels, {span:.2f} us from the first start to the last end, "
          f"{span / max(1, len(tail) // per_layer):.2f} us a layer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="replay the step's CUDA graph and record its kernels")
    r.add_argument("format", help="a kvtool format label, e.g. bf16, fp8")
    r.add_argument("--batch", type=int, default=128)
    r.add_argument("--layers", type=int, default=2)
    r.add_argument("--replays", type=int, default=20)
    r.add_argument("--peer", default=None, help="an engine's decode kernel instead of kvtool's (vllm)")
    r.add_argument("--csv", default="attn_timeline.csv", help="where the kernel records go")
    s = sub.add_parser("summary", help="kernels and gaps from run's CSV (or `nsys stats -r cuda_gpu_trace -f csv`)")
    s.add_argument("csv")
    s.add_argument("--last", type=int, default=4, help="layers to print, from the end")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else summary(args)


if __name__ == "__main__":
    main()
