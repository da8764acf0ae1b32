"""kvtool: low-precision KV and indexer caches for LLM inference engines.

The library is usable without the CLI: `kvtool.load` / `kvtool.save` / `kvtool.verify` / `kvtool.convert` read and
write cache files (kvtool.api), `kvtool.formats` holds the bit-exact torch codecs (the SPEC as code; `get_format`,
`QTensor`), `kvtool.container` the self-describing cache file, and the workflow modules return plain report
dataclasses. `import kvtool` itself imports no torch: the API is loaded on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "convert", "load", "save", "verify"]

_API = {"convert", "load", "save", "verify"}


def _map_kernels() -> None:
    """kernels/ is a top-level folder that pyproject's package-dir mapping installs as `kvtool.kernels` (installed or
    editable). A source tree used without installing (PYTHONPATH=. from the repository root, as bench/gpu_run.sh runs
    on the GPU device) has no such mapping: only then the package is loaded from the folder next to this one, and
    everything below it resolves through its __path__ as usual (tests/kernels/test_kernel_package.py checks both)."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec(__name__ + ".kernels") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    init = os.path.join(folder, "__init__.py")
    if os.path.isfile(init):
        spec = importlib.util.spec_from_file_location(__name__ + ".kernels", init, submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        globals()["kernels"] = module  # the attribute an import of the subpackage sets on its parent


_map_kernels()


def __getattr__(name: str):
    if name in _API:
        from kvtool import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvtool' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
