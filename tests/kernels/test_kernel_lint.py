"""Static checks on kernels/ for traps that the Triton interpreter does not catch but the GPU compiler does.

Module-level constants used inside @triton.jit code must be `NAME = tl.constexpr(value)`; an annotation
(`NAME: tl.constexpr = value`) runs fine in the interpreter and fails to compile on the GPU ("Cannot access global
variable"). Seen on the H200 on 2026-11-29.
"""

import ast
from pathlib import Path

import pytest

KERNEL_FILES = sorted((Path(__file__).resolve().parents[2] / "kernels").glob("*.py"))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_no_annotated_module_constexpr(path):
    tree = ast.parse(path.read_text())
    bad = [node.target.id for node in tree.body
           if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
           and "constexpr" in ast.unparse(node.annotation)]
    assert not bad, f"{path.name}: use NAME = tl.constexpr(value) at module level, not an annotation: {bad}"
