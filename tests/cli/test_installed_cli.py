"""The installed console script end to end (what users type), when the package is installed in this interpreter's
environment (CI installs it with `pip install -e .`): quantize -> inspect --verify -> dequantize -> diff, and one bad
input. Skips with the reason when no `kvtool` script sits beside the interpreter."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "synthetic_cache.safetensors"
SCRIPT = Path(sys.executable).parent / "kvtool"
if not SCRIPT.exists():
    SCRIPT = Path(shutil.which("kvtool") or "")

pytestmark = pytest.mark.skipif(not SCRIPT.name or not SCRIPT.exists(),
                                reason="the kvtool console script is not installed in this environment")


def kvtool(*args, cwd):
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_installed_command_round_trip(tmp_path):
    q, back = tmp_path / "q.safetensors", tmp_path / "back.safetensors"
    r = kvtool("quantize", FIXTURE, "-o", q, "--to", "nvfp4", "--recipe", "div", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = kvtool("inspect", q, "--verify", "--json", cwd=tmp_path)
    assert r.returncode == 0 and '"nvfp4-div"' in r.stdout, r.stderr
    r = kvtool("dequantize", q, "-o", back, cwd=tmp_path)
    assert r.returncode == 0 and back.exists(), r.stderr
    r = kvtool("diff", q, FIXTURE, "--max-rel-l2", "1e-9", cwd=tmp_path)
    assert r.returncode == 1, r.stdout  # nvfp4 is lossy: a zero-error gate must fail


def test_installed_command_bad_input(tmp_path):
    out = tmp_path / "x.safetensors"
    r = kvtool("quantize", FIXTURE, "-o", out, "--to", "nvfp5", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()
