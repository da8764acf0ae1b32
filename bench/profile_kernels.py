"""One profiled launch of a default kernel at its issue's goal shape, for Nsight Compute.

    PYTHONPATH=. python3 bench/profile_kernels.py store|index|attn FORMAT [--small] [--batch N] [--peer vllm]
    ncu --nvtx --nvtx-include "profile/" --set full -o store_nvfp4 python3 bench/profile_kernels.py store nvfp4

Shapes (the goals of issues 3-5, with the inputs the benchmarks build): `store` 256M elements bf16 [T, 1, 128] into
shuffled 128-token pages (`kernels/store.py`, validation off, as engines call it); `index` one layer of the decode
score + top-k at batch 64 x 150K (the scorer and the select pass); `attn` one layer of the sparse decode at batch 256,
M3's TP4 shape (`--batch` another batch; `--peer vllm` runs vLLM 0.33.0's decode kernel and merge on the same
inputs instead, through `kvtool.engines.vllm_m3`, for a profile side by side). Every kernel runs twice first
(compile, autotune, warm caches), then once inside the NVTX range
`profile`, so `--nvtx-include "profile/"` keeps exactly the launches of one call. `--small` shrinks the shapes (a
smoke run; under TRITON_INTERPRET=1 it also runs on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from kvtool.backend import interpreting
from kvtool.formats import get_format


def store_case(fmt_name: str, small: bool, device: str, batch=None, peer=None):
    from kvtool.bench.quant import _Setup
    from kvtool.kernels.store import store

    s = _Setup(get_format(fmt_name), (1 << 14) if small else (256 << 20), 1, device, seed=1)
    return lambda: store(s.cache, s.x, s.slots, validate=False)


def index_case(fmt_name: str, small: bool, device: str, batch=None, peer=None):
    from kvtool.bench.index import _Decode
    from kvtool.indexer import IndexerConfig

    batch, context = (2, 1000) if small else (64, 150_000)
    case = _Decode(fmt_name, batch, context, 1, device, torch.Generator().manual_seed(0), IndexerConfig())
    return case.topk()


def attn_case(fmt_name: str, small: bool, device: str, batch=None, peer=None):
    from kvtool.bench.attn import GEOMETRY, _Step
    from kvtool.kernels.sparse_attn import sparse_decode

    rows, context = (2, 3000) if small else (256, 8000)
    st = _Step(fmt_name, batch or rows, context, 1, device, torch.Generator().manual_seed(0))
    if peer:
        from kvtool.engines.protocol import resolve_impl

        return st.engine(resolve_impl(peer, "attend"))
    return lambda: sparse_decode(st.q, st.k[0], st.v[0], st.table, st.ctx, st.ids[0], GEOMETRY["block_size"])


CASES = {"store": store_case, "index": index_case, "attn": attn_case}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=sorted(CASES))
    ap.add_argument("format", help="a kvtool format label, e.g. nvfp4, mxfp4, fp8, bf16")
    ap.add_argument("--small", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--batch", type=int, default=None, help="attn: the decode batch (default 256)")
    ap.add_argument("--peer", default=None, help="attn: an engine's kernel instead of kvtool's (vllm)")
    args = ap.parse_args()
    if (args.batch or args.peer) and args.kernel != "attn":
        ap.error("--batch and --peer apply to attn only")
    cuda = torch.cuda.is_available()
    if not cuda and not interpreting():
        raise SystemExit("profile_kernels: needs a CUDA device (or TRITON_INTERPRET=1 with --small)")
    run = CASES[args.kernel](args.format, args.small, "cuda" if cuda else "cpu", args.batch, args.peer)
    for _ in range(2):
        run()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    nvtx = torch.cuda.nvtx.range("profile") if cuda else contextlib.nullcontext()
    with nvtx:
        run()
        sync()
    print(f"profiled: {args.kernel} {args.format}{' (small)' if args.small else ''}"
          f"{f' batch {args.batch}' if args.batch else ''}{f' peer {args.peer}' if args.peer else ''}")


if __name__ == "__main__":
    main()
