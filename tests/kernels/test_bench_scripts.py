"""The committed bench scripts that run without a GPU: `bench/sass_index_gluon.py` (offline sm_90 SASS of the Gluon
index scorer, in a child process without TRITON_INTERPRET, as kernel_capture's workers), the argument checks of
`bench/sweep_rows.py` (its rows run only at the GPU sweep shapes) and `bench/profile_kernels.py`'s small attention
cases (kvtool's and vLLM's kernel) in the interpreter."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, interpret: bool = False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_sass_index_gluon_reports_the_kernel_and_its_loop(fmt, tmp_path):
    out = tmp_path / "k.sass"
    r = _run(["bench/sass_index_gluon.py", fmt, "--sass", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    head = re.match(rf"{fmt}: (\d+) instructions, REG:(\d+) STACK:\d+ LOCAL:\d+, spill instructions \d+", r.stdout)
    assert head, r.stdout
    loops = [int(n) for n in re.findall(r"^loop [0-9a-f]+-[0-9a-f]+: (\d+) instructions", r.stdout, re.M)]
    # the main loop (one 128-token tile: the E2M1 decode alone is ~176 instructions) is in the kernel's SASS
    assert loops and 176 < max(loops) < int(head.group(1)), r.stdout
    assert "HMMA" in out.read_text()


def test_sass_index_gluon_refuses_the_interpreter():
    r = _run(["bench/sass_index_gluon.py", "nvfp4"], interpret=True)
    assert r.returncode != 0 and "TRITON_INTERPRET" in r.stderr


def test_sweep_rows_rejects_unknown_rows():
    r = _run(["bench/sweep_rows.py", "index", "ch8,no such row", "--", "--device", "cpu"], interpret=True)
    assert r.returncode != 0 and "unknown sweep rows ['no such row']" in r.stderr
    r = _run(["bench/sweep_rows.py", "attn", "pdl=0,ch8", "--", "--device", "cpu"], interpret=True)
    assert r.returncode != 0 and "unknown sweep rows ['ch8']" in r.stderr
    for args in (["index", "ch8"], ["nothing", "ch8", "--"]):  # no "--", an unknown bench: the usage
        r = _run(["bench/sweep_rows.py", *args], interpret=True)
        assert r.returncode != 0 and "sweep_rows.py" in r.stderr


def test_profile_kernels_attn_small_runs_kvtool_and_vllm():
    r = _run(["bench/profile_kernels.py", "attn", "bf16", "--small", "--batch", "3"], interpret=True)
    assert r.returncode == 0 and "profiled: attn bf16 (small) batch 3" in r.stdout, r.stderr[-2000:]
    r = _run(["bench/profile_kernels.py", "store", "nvfp4", "--small", "--batch", "3"], interpret=True)
    assert r.returncode != 0 and "apply to attn only" in r.stderr
    from kvtool.engines.vllm_m3 import load_ops
    from kvtool.engines.wheels import EngineUnavailable

    try:
        load_ops()
    except EngineUnavailable as err:
        pytest.skip(str(err))
    r = _run(["bench/profile_kernels.py", "attn", "bf16", "--small", "--batch", "3", "--peer", "vllm"],
             interpret=True)
    assert r.returncode == 0 and "peer vllm" in r.stdout, r.stderr[-2000:]


def test_timeline_attn_summary_splits_a_step_into_kernels_and_gaps(tmp_path):
    """Two layers of (main kernel, merge) from an nsys GPU trace: durations, the gaps between consecutive kernels
    (negative where PDL overlapped them) and the time a layer."""
    rows = [("Start (ns)", "Duration (ns)", "Name"), ("0", "500", "[CUDA memcpy Host-to-Device]"),
            ("1000", "38000", "_sparse_attn_kernel"), ("38500", "4500", "_combine_kernel"),
            ("43500", "38000", "_sparse_attn_kernel"), ("81000", "4000", "_combine_kernel")]
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    r = _run(["bench/timeline_attn.py", "summary", str(path), "--last", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["_sparse_attn_kernel", "38.00"]  # the first kernel has no gap before it
    assert lines[2].split() == ["_combine_kernel", "4.50", "-0.50"]  # it started before the main kernel ended
    assert lines[3].split() == ["_sparse_attn_kernel", "38.00", "0.50"]
    assert "4 kernels, 84.00 us from the first start to the last end, 42.00 us a layer" in r.stdout
    empty = tmp_path / "empty.csv"
    empty.write_text("Start (ns),Duration (ns),Name\n")
    r = _run(["bench/timeline_attn.py", "summary", str(empty)])
    assert r.returncode != 0 and "no kernel rows" in r.stderr


def test_ptxas_attn_counts_the_programs_per_sm_launch_plan_assumes():
    """`launch_plan`'s bf16 rules rest on the compiled kernel's residency on an H100 / H200 SM: 64-token tiles fit
    `RESIDENT` (4) programs, and 128-token tiles (the one-split launch at two programs per SM) fit 2. A kernel change
    that moves either breaks the rule's premise, and this test says so."""
    from kvtool.kernels.sparse_attn import RESIDENT

    line = re.compile(r"grid \((\d+), 1, (\d+)\), (\d+) warps, \d+ stages, (\d+) registers, (\d+) spill bytes, "
                      r"(\d+) B shared -> (\d+) programs per SM")
    r = _run(["bench/ptxas_attn.py", "bf16", "--batch", "128"])
    assert r.returncode == 0, r.stderr[-2000:]
    m = line.search(r.stdout)
    assert m and m.group(1, 2, 3) == ("128", "4", "4") and int(m.group(7)) == RESIDENT, r.stdout
    r = _run(["bench/ptxas_attn.py", "bf16", "--batch", "256"])
    m = line.search(r.stdout)
    assert r.returncode == 0 and m and m.group(1, 2) == ("256", "1") and int(m.group(7)) == 2, r.stdout + r.stderr
    assert m.group(5) == "0"  # no spills
    r = _run(["bench/ptxas_attn.py", "bf16", "--opt", "tile_tokens"])
    assert r.returncode == 2 and "NAME=VALUE" in r.stderr
    r = _run(["bench/ptxas_attn.py", "bf16"], interpret=True)
    assert r.returncode == 2 and "TRITON_INTERPRET" in r.stderr
