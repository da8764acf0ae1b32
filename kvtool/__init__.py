"""kvtool: low-precision KV and indexer caches for LLM inference engines.

The library is usable without the CLI: `kvtool.formats` holds the bit-exact torch codecs (the SPEC as code),
`kvtool.container` the self-describing cache file, and the workflow modules return plain report dataclasses.
"""

__version__ = "0.1.0"
