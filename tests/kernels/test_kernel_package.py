"""`kernels/` is installed as `kvtool.kernels` by pyproject's package-dir mapping; a source tree run without installing
(PYTHONPATH=. from the repository root, as bench/gpu_run.sh runs on the GPU device) must resolve it the same way."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_resolve_from_a_source_tree_without_the_install_finder():
    # -S: no site processing, so no editable-install finder (.pth) is loaded; the site-packages folders go on sys.path
    # by hand for torch and triton only.
    code = ("import sys; sys.path += sys.argv[1:]; import kvtool, kvtool.kernels.store as s; "
            "assert not any('editable' in m for m in sys.modules), sorted(m for m in sys.modules if 'editable' in m); "
            "print(s.__file__); print(kvtool.kernels.__file__)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-S", "-c", code, *site.getsitepackages()], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    store_file, pkg_file = out.stdout.split()
    assert Path(store_file) == ROOT / "kernels" / "store.py"
    assert Path(pkg_file) == ROOT / "kernels" / "__init__.py"


def test_kernels_resolve_in_this_environment():
    import kvtool.kernels.store as s

    assert Path(s.__file__).resolve() == ROOT / "kernels" / "store.py"
    assert not (ROOT / "kvtool" / "kernels").exists()  # the mapping, not a symlink, makes the package
