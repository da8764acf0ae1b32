"""The import graph of kvtool/ and kernels/ (installed as kvtool.kernels), checked against the layers.

Layers, lowest first: formats (and errors) -> kernels -> dispatch (kvtool.backend) -> cache semantics, references
and metrics -> files and layouts -> workflows (and the bench, doctor, models, engines and library API on top of
them) -> CLI. A module may import its own layer or lower ones. Every import counts, also one inside a function (a
lazy import is still a dependency). Prints the upward edges and the import cycles between modules; exit status 1 if
there is either. A package's __init__ that re-exports its submodules, which import it back, shows as a cycle through
that facade; the cycles between plain modules are listed on their own. `python tools/layers.py [--edges]`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (layer name, module prefixes), lowest first; the longest matching prefix decides
LAYERS = [
    ("formats", ["kvtool.errors", "kvtool.formats"]),
    ("kernels", ["kvtool.kernels"]),
    ("dispatch", ["kvtool.backend"]),
    ("cache semantics", ["kvtool.paged", "kvtool.indexer", "kvtool.attention", "kvtool.metrics", "kvtool.options"]),
    ("files and layouts", ["kvtool.container", "kvtool.readers", "kvtool.layouts", "kvtool.st_header"]),
    ("workflows", ["kvtool.workflows", "kvtool.capacity", "kvtool.models", "kvtool.engines", "kvtool.doctor",
                   "kvtool.bench", "kvtool.api"]),
    ("cli", ["kvtool.cli", "kvtool.__main__"]),
]


def modules() -> dict[str, Path]:
    out = {}
    for base, pkg in ((ROOT / "kvtool", "kvtool"), (ROOT / "kernels", "kvtool.kernels")):
        for f in sorted(base.rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = f
    return out


def layer_of(mod: str) -> int | None:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


def imports(mod: str, path: Path, known: dict) -> set[str]:
    """kvtool modules that `mod` imports (resolved to the most specific known module)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod and n != "kvtool":
                found.add(n)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items() if m != "kvtool"}  # kvtool/__init__: the facade
    up, unplaced = [], sorted(m for m in graph if layer_of(m) is None)
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            lm, ld = layer_of(m), layer_of(d)
            if lm is not None and ld is not None and ld > lm:
                up.append((m, LAYERS[lm][0], d, LAYERS[ld][0]))
    if "--edges" in argv:
        for m, deps in sorted(graph.items()):
            print(m, "->", ", ".join(sorted(deps)))
    circ = cycles(graph)
    # the same without the package facades (an __init__ that re-exports its submodules, which import it back)
    packages = {m for m, p in known.items() if p.name == "__init__.py"}
    bare = cycles({m: deps - packages for m, deps in graph.items() if m not in packages})
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges")
    print(f"upward edges: {len(up)}")
    for m, lm, d, ld in up:
        print(f"  {m} ({lm}) -> {d} ({ld})")
    print(f"cycles: {len(circ)} ({len(bare)} without the package facades)")
    for c in circ:
        print("  " + " <-> ".join(c))
    for c in bare:
        print("  module cycle: " + " <-> ".join(c))
    if unplaced:
        print("modules in no layer: " + ", ".join(unplaced))
    return 1 if up or circ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
