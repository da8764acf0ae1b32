"""Offline resource use of the portable sparse-attention decode kernel (`kernels/sparse_attn.py`), no GPU needed:
the launch `sparse_decode` makes at batch B of `kvtool bench attn`'s M3 shape, with the given options, compiled by
Triton for cuda:90 and assembled by the ptxas Triton ships with `-v`.

    python3 bench/ptxas_attn.py bf16 --batch 128 [--opt tile_tokens=128 --opt num_splits=2 --opt maxnreg=168]

Prints the launch (tile, grid), registers, spills and shared memory, and the programs per SM those allow (65536
registers and 227 KB of shared memory per H100 / H200 SM, 4 warps of 32 threads a program unless num_warps says
otherwise), which is what decides how many splits fit in one wave. Must run without TRITON_INTERPRET (the kernels
would import as interpreter objects).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

SM_REGISTERS, SM_SHARED = 65536, 227 * 1024


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def resources(fmt: str, batch: int, options: dict) -> dict:
    """{grid, warps, registers, spill_bytes, shared, per_sm} of the decode launch for `fmt` at `batch`."""
    import torch
    import triton

    import kernel_capture as kcap
    from kvtool.bench.attn import _Step

    target = kcap.TARGETS["cuda:90"]
    step = _Step(fmt, batch, 2048, 1, "cpu", torch.Generator().manual_seed(0))
    launches = kcap.capture(step.kernel(**options), target)
    launch = next(ln for ln in launches if ln.name.endswith("_sparse_attn_kernel"))
    comp = kcap.compile_kernel(launch, target)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    maxnreg = launch.options.get("maxnreg") or launch.kwargs.get("maxnreg")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(comp.asm["ptx"])
        cmd = [ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.cubin")]
        if maxnreg:
            cmd[2:2] = ["--maxrregcount", str(maxnreg)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    warps = comp.metadata.num_warps
    shared = comp.metadata.shared
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in units of 256
    per_sm = min(SM_REGISTERS // (per_warp * warps), SM_SHARED // max(1, shared), 32)
    return {"grid": tuple(launch.grid), "warps": warps, "stages": comp.metadata.num_stages, "registers": regs,
            "spill_bytes": spills, "shared": shared, "per_sm": per_sm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("format", help="a kvtool format label, e.g. bf16, fp8, nvfp4")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                    help="a sparse_decode option (tile_tokens, num_splits, num_warps, num_stages, maxnreg, ...)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        ap.error("run without TRITON_INTERPRET (the kernels must compile for the GPU)")
    options = {}
    for item in args.opt:
        name, sep, value = item.partition("=")
        if not sep or not name:
            ap.error(f"--opt takes NAME=VALUE, got {item!r}")
        options[name] = _value(value)
    r = resources(args.format, args.batch, options)
    print(f"{args.format} batch {args.batch} {options or 'default'}: grid {r['grid']}, {r['warps']} warps, "
          f"{r['stages']} stages, {r['registers']} registers, {r['spill_bytes']} spill bytes, "
          f"{r['shared']} B shared -> {r['per_sm']} programs per SM")


if __name__ == "__main__":
    main()
