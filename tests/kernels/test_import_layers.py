"""The import graph of kvtool/ + kernels/ only points down the layers (tools/layers.py: formats -> kernels ->
dispatch -> cache semantics -> files and layouts -> workflows -> CLI), lazy imports included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kvtool_layers", ROOT / "tools" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


_CACHE: dict = {}


def _graph():
    if not _CACHE:
        known = layers.modules()
        _CACHE["g"] = known, {m: layers.imports(m, p, known) for m, p in known.items() if m != "kvtool"}
    return _CACHE["g"]


def test_every_module_has_a_layer():
    known, _ = _graph()
    assert [m for m in known if m != "kvtool" and layers.layer_of(m) is None] == []


def test_no_import_points_up_a_layer():
    _, graph = _graph()
    up = [(m, d) for m, deps in graph.items() for d in deps if layers.layer_of(d) > layers.layer_of(m)]
    assert up == []


def test_kernels_import_no_cache_semantics():
    """The kernels see formats (the kernel descriptor) and errors only, besides each other."""
    _, graph = _graph()
    allowed = ("kvtool.kernels", "kvtool.formats", "kvtool.errors")
    bad = {m: sorted(d for d in deps if not d.startswith(allowed))
           for m, deps in graph.items() if m.startswith("kvtool.kernels")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_checker_sees_an_upward_edge(tmp_path):
    """The checker itself can fail: an import of kvtool.paged from a kernel module is reported."""
    f = tmp_path / "k.py"
    f.write_text("def f():\n    from kvtool.paged import PagedCache\n")
    known, _ = _graph()
    deps = layers.imports("kvtool.kernels.k", f, known)
    assert "kvtool.paged" in deps and layers.layer_of("kvtool.paged") > layers.layer_of("kvtool.kernels.k")


def test_no_import_cycles():
    """No cycle between modules, and none through a package facade (an __init__ that re-exports its submodules,
    which then import their siblings directly)."""
    _, graph = _graph()
    assert layers.cycles(graph) == []


# Where a kernel module may be imported besides the kernels themselves: the dispatch module, and the benchmarks,
# which time one named kernel, launch variant or config (the Gluon path beside the portable one, a launch plan, a
# block config) and so must call it and not the dispatch that would pick one.
KERNEL_IMPORTERS = ("kvtool.kernels", "kvtool.backend", "kvtool.bench")


def test_kernels_are_reached_through_dispatch():
    _, graph = _graph()
    bad = {m: sorted(d for d in deps if d.startswith("kvtool.kernels"))
           for m, deps in graph.items() if not m.startswith(KERNEL_IMPORTERS)}
    assert {m: d for m, d in bad.items() if d} == {}
