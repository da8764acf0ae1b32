"""kvtool: low-precision KV and indexer caches for LLM inference engines.

The library is usable without the CLI: `kvtool.load` / `kvtool.save` / `kvtool.verify` / `kvtool.convert` read and
write cache files (kvtool.api), `kvtool.formats` holds the bit-exact torch codecs (the SPEC as code; `get_format`,
`QTensor`), `kvtool.container` the self-describing cache file, and the workflow modules return plain report
dataclasses. `import kvtool` itself imports no torch: the API is loaded on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "convert", "load", "save", "verify"]

_API = {"convert", "load", "save", "verify"}


def __getattr__(name: str):
    if name in _API:
        from kvtool import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvtool' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
