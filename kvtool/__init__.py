"""kvtool: low-precision KV and indexer caches for LLM inference engines.

The library is usable without the CLI: `kvtool.formats` holds the bit-exact torch codecs (the SPEC as code),
`kvtool.container` the self-describing cache file, and the workflow modules return plain report dataclasses.
"""

__version__ = "0.1.0"

import importlib.util as _importlib_util  # noqa: E402
import os as _os  # noqa: E402
import sys as _sys  # noqa: E402

# kernels/ is a top-level folder that pyproject's package-dir mapping installs as `kvtool.kernels` (installed or
# editable). A source tree used without installing (PYTHONPATH=. from the repository root, as bench/gpu_run.sh runs on
# the GPU device, where nothing is pip-installed) has no such mapping, so only then the package is loaded from the
# folder next to this one; everything below it then resolves through its __path__ as usual.
if _importlib_util.find_spec(__name__ + ".kernels") is None:
    _kernels_dir = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "kernels")
    _spec = _importlib_util.spec_from_file_location(__name__ + ".kernels", _os.path.join(_kernels_dir, "__init__.py"),
                                                    submodule_search_locations=[_kernels_dir])
    if _spec is not None and _os.path.isfile(_spec.origin):
        kernels = _importlib_util.module_from_spec(_spec)
        _sys.modules[_spec.name] = kernels
        _spec.loader.exec_module(kernels)
