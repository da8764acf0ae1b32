"""Offline sm_90 SASS of the Gluon index decode scorer (`kernels/index_gluon.py`), no GPU needed: the default launch
of `decode_topk(..., gluon=True)` at batch 64 x 150K, 4 heads (tests/kernels/test_kernel_compile.py's case), compiled
by Triton for cuda:90 and read back with the cuobjdump Triton ships.

    python3 bench/sass_index_gluon.py mxfp4 [--chunk 48] [--maxnreg 96] [--sass out.sass]

Prints the kernel's registers, stack and spill instructions, its instruction mix, and each loop (a backward branch)
with its length and mix: the main `for blk` loop is the long one, one 128-token tile an iteration. Must run without
TRITON_INTERPRET (the kernels would import as interpreter objects).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "kernels")]

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def compile_sass(fmt: str, chunk: int | None, maxnreg: int | None) -> tuple[str, str]:
    """(SASS text, resource usage text) of the scorer's default launch for format `fmt`."""
    import triton

    import kernel_capture as kcap
    import test_kernel_compile as cases

    target = kcap.TARGETS["cuda:90"]
    options = {"chunk_blocks": chunk} if chunk else {}
    launches = kcap.capture(cases._index_decode(fmt, "decode_topk", gluon=True, **options)(), target)
    launch = next(ln for ln in launches if ln.name.endswith("decode_block_parts_kernel"))
    comp = kcap.compile_kernel(launch, target, **({"maxnreg": maxnreg} if maxnreg else {}))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(comp.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, res


def mix(ops) -> str:
    return " ".join(f"{k}:{v}" for k, v in collections.Counter(o.split(".")[0] for o in ops).most_common(16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("format", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--chunk", type=int, help="blocks per program (chunk_blocks; > 32: partials to global memory)")
    ap.add_argument("--maxnreg", type=int, help="register cap instead of index_gluon.MAXNREG's")
    ap.add_argument("--sass", help="also write the SASS here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the kernels must import as compilable JIT functions")
    sass, res = compile_sass(args.format, args.chunk, args.maxnreg)
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    ins = [(int(a, 16), op, rest) for a, op, rest in INSTR.findall(sass)]
    ops = [op for _, op, _ in ins]
    usage = " ".join(re.findall(r"(?:REG|STACK|LOCAL):\d+", res))
    print(f"{args.format}: {len(ops)} instructions, {usage}, spill instructions "
          f"{sum(o.startswith(('STL', 'LDL')) for o in ops)}")
    print("  " + mix(ops))
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            print(f"loop {target.group(1)}-{addr:x}: {len(body)} instructions, BAR "
                  f"{sum(o.startswith('BAR') for o in body)}, moves {sum(o.startswith('IMAD.MOV') for o in body)}")
            print("  " + mix(body))


if __name__ == "__main__":
    main()
