"""The library API (kvtool/api.py): load / save / verify / convert with logical shapes, bit-exact round trips against
the CLI's own files, and the README's Python section run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtool
from kvtool.errors import FormatError, InputError, KvtoolError
from kvtool.formats import QTensor, get_format

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures" / "synthetic_cache.safetensors"


def test_load_plain_file_gives_tensors_with_their_shapes():
    caches = kvtool.load(FIX)
    assert list(caches) == ["layers.0.index_k", "layers.0.k", "layers.0.v"]
    assert caches["layers.0.k"].shape == (256, 2, 128) and caches["layers.0.k"].dtype == torch.bfloat16
    assert list(kvtool.load(FIX, include=["*.k"])) == ["layers.0.k"]


@pytest.mark.parametrize("label", ["mxfp4-floor", "nvfp4-rcp-auto", "fp8-token", "fp8-tensor", "bf16"])
def test_save_then_load_is_the_codec_bit_for_bit(label, tmp_path):
    x = {"k": torch.randn(64, 2, 128) * 3, "idx": torch.randn(64, 128).bfloat16()}
    path = kvtool.save(tmp_path / "c.safetensors", x, fmt=label)
    assert path == (tmp_path / "c.safetensors").resolve() or path == tmp_path / "c.safetensors"
    back = kvtool.load(path)
    fmt = get_format(label)
    for name, t in x.items():
        q = back[name]
        assert isinstance(q, QTensor) and q.shape == tuple(t.shape) and q.fmt == fmt
        ref = fmt.quantize(t)
        assert torch.equal(q.payload, ref.payload) and q.payload.shape[:-1] == t.shape[:-1]
        assert (q.scales is None) == (ref.scales is None)
        if q.scales is not None:
            assert torch.equal(q.scales.reshape(ref.scales.shape), ref.scales)
        assert q.extra["dtype"] == t.dtype
        assert torch.equal(q.dequantize(torch.float32), ref.dequantize(torch.float32))
    dq = kvtool.load(path, dequantize=torch.bfloat16)["k"]
    assert dq.shape == (64, 2, 128) and dq.dtype == torch.bfloat16
    assert all(status == "ok" for status in kvtool.verify(path).values())


def test_saving_loaded_qtensors_keeps_their_bytes_and_passthrough_tensors(tmp_path):
    first = kvtool.save(tmp_path / "a.safetensors", {"k": torch.randn(32, 64), "ids": torch.arange(32)},
                        fmt="mxfp4")
    loaded = kvtool.load(first)
    assert loaded["ids"].dtype == torch.int64 and torch.equal(loaded["ids"], torch.arange(32))
    second = kvtool.save(tmp_path / "b.safetensors", loaded)
    again = kvtool.load(second)
    assert torch.equal(again["k"].payload, loaded["k"].payload) and torch.equal(again["k"].scales, loaded["k"].scales)
    plain = kvtool.save(tmp_path / "p.safetensors", {"x": torch.randn(4, 16)})  # no fmt: stored unchanged
    assert not isinstance(kvtool.load(plain)["x"], QTensor)


def test_the_cli_and_the_api_write_the_same_tensors(tmp_path):
    from cli_helpers import kv

    assert kv("quantize", FIX, "-o", tmp_path / "cli.safetensors", "--to", "nvfp4").exit_code == 0
    cli = kvtool.load(tmp_path / "cli.safetensors")
    api = kvtool.load(kvtool.save(tmp_path / "api.safetensors", kvtool.load(FIX), fmt="nvfp4"))
    for name in cli:
        assert torch.equal(cli[name].payload, api[name].payload) and torch.equal(cli[name].scales, api[name].scales)


def test_errors_are_kvtool_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        kvtool.load(tmp_path / "missing.safetensors")
    with pytest.raises(InputError, match="floating torch dtype"):
        kvtool.load(FIX, dequantize=torch.int8)
    with pytest.raises(KvtoolError):
        kvtool.save(tmp_path / "x.safetensors", {"k": torch.randn(4, 100)}, fmt="mxfp4")  # 100 % 32 != 0
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(InputError, match="not a torch.Tensor"):
        kvtool.save(tmp_path / "x.safetensors", {"k": [1, 2]})
    q = get_format("nvfp4").quantize(torch.randn(2, 16))
    with pytest.raises(FormatError, match="floating dtype"):
        q.dequantize(torch.int8)


def test_import_kvtool_is_light_and_lists_its_api():
    assert {"load", "save", "verify", "convert"} <= set(kvtool.__all__) and "load" in dir(kvtool)
    with pytest.raises(AttributeError):
        kvtool.nosuch  # noqa: B018


def test_the_readme_python_section_runs(tmp_path):
    """The README's runnable ```python blocks (those that start with an import: the format and cache-file examples),
    run as written from the repository root."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if b.startswith(("import ", "from "))]
    assert any("kvtool.load" in b for b in blocks) and any("kvtool.save" in b for b in blocks)
    code = "\n".join(b for b in blocks)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_public_module_declares_all():
    """Every public kvtool module (kernels/ is kvtool.kernels) says what it exports (`__all__`), and every exported
    name exists there (parsed, not imported: kernels and engines need no Triton or wheel for this)."""
    import ast

    missing, unknown = [], []
    for path in sorted(p for folder in ("kvtool", "kernels") for p in (ROOT / folder).rglob("*.py")):
        if path.name == "__main__.py" or (path.name.startswith("_") and path.name != "__init__.py"):
            continue
        tree = ast.parse(path.read_text())
        exported = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)), None)
        defined = {n.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                   for n in ast.walk(node) if isinstance(n, ast.Name)}
        defined |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {a.asname or a.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
        has_public = bool({n for n in defined if not n.startswith("_")})
        rel = str(path.relative_to(ROOT))
        if exported is None:
            if has_public and path.name != "__init__.py":
                missing.append(rel)
            continue
        names = [e.value for e in exported.elts]
        if "__getattr__" in defined:  # a module that exports lazily (kvtool: load, save, ...) checks on import
            continue
        unknown += [f"{rel}: {n}" for n in names if n not in defined and n != "__version__"]
    assert not missing, f"modules without __all__: {missing}"
    assert not unknown, f"__all__ names not defined: {unknown}"
