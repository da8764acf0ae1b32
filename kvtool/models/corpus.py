"""Text for teacher forcing that every machine has: prompts from the command line or a file, else the documentation
the Python standard library carries (so a default run needs no download).

`default_corpus(n_chars)` concatenates, in a fixed order, `inspect.getdoc` of a fixed list of stdlib modules, then the
docstrings of their public classes and functions (sorted by name), separated by blank lines, and cuts at `n_chars`.
The text is deterministic for a given Python version (docstrings change between versions).

`documents(n)` is the multi-document corpus (for intervals over texts, not just positions): document 0 is
`default_corpus` itself ("stdlib-mixed", so a one-document run keeps the classic default text), then one document
per entry of `DOCUMENTS`: the module docstring and member docstrings of one or two stdlib modules, each on its own
subject (doctest, typing, logging, argparse, ...), each long enough for a few thousand tokens.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path

import torch

from kvtool.errors import InputError

__all__ = ["DOCUMENTS", "STDLIB_MODULES", "default_corpus", "documents", "read_prompt", "tokenize"]

# Prose-rich modules first; order is part of the corpus definition.
STDLIB_MODULES = (
    "re", "statistics", "json", "argparse", "http.client", "urllib.request", "csv", "unittest", "copy", "heapq",
    "inspect", "itertools", "io", "subprocess", "os", "typing", "random", "sqlite3", "tempfile", "collections",
    "string", "pickle", "logging", "codecs", "shutil", "textwrap", "functools", "threading", "contextlib",
)


def _module_docs(name: str) -> tuple[str, list[str]]:
    module = importlib.import_module(name)
    members = []
    with warnings.catch_warnings():  # some modules' attributes warn on access (typing.io); the text is what we want
        warnings.simplefilter("ignore")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    members.append(doc)
    return inspect.getdoc(module) or "", members


# name -> modules; each gives well over 8,000 characters of prose on one subject. Order is part of the definition.
DOCUMENTS = (
    ("doctest", ("doctest",)),
    ("inspect", ("inspect",)),
    ("typing", ("typing",)),
    ("pdb-difflib", ("pdb", "difflib")),
    ("logging-shutil", ("logging", "shutil")),
    ("argparse-optparse", ("argparse", "optparse")),
    ("configparser-subprocess", ("configparser", "subprocess")),
    ("statistics-json", ("statistics", "json")),
)


def _document(modules: tuple[str, ...], n_chars: int) -> str:
    parts = []
    for name in modules:
        head, members = _module_docs(name)
        parts += ([head] if head else []) + members
    return "\n\n".join(parts)[:n_chars]


def documents(n: int, n_chars: int = 20000) -> list[tuple[str, str]]:
    """The first `n` documents of the built-in corpus as (name, text), each cut at `n_chars` (module docstring)."""
    if n < 1 or n > len(DOCUMENTS) + 1:
        raise InputError(f"the built-in corpus has {len(DOCUMENTS) + 1} documents; asked for {n}")
    out = [("stdlib-mixed", default_corpus(n_chars))]
    out += [(name, _document(mods, n_chars)) for name, mods in DOCUMENTS[:n - 1]]
    return out


def default_corpus(n_chars: int = 20000) -> str:
    """About `n_chars` characters (exactly, unless the stdlib runs out) of stdlib documentation, deterministic."""
    if n_chars <= 0:
        raise InputError(f"corpus size must be positive, got {n_chars}")
    docs = [_module_docs(name) for name in STDLIB_MODULES]
    parts = [head for head, _ in docs if head] + [doc for _, members in docs for doc in members]
    out, size = [], 0
    for part in parts:
        out.append(part)
        size += len(part) + 2
        if size >= n_chars:
            break
    return "\n\n".join(out)[:n_chars]


def read_prompt(prompt: str | None = None, prompt_file: Path | None = None, default_chars: int = 20000) -> str:
    """The text to run: `prompt`, else the contents of `prompt_file` (UTF-8), else `default_corpus(default_chars)`."""
    if prompt is not None and prompt_file is not None:
        raise InputError("give --prompt or --prompt-file, not both")
    if prompt is not None:
        if not prompt:
            raise InputError("--prompt is empty")
        return prompt
    if prompt_file is not None:
        try:
            text = Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"cannot read prompt file {prompt_file}: {err}") from None
        if not text:
            raise InputError(f"prompt file {prompt_file} is empty")
        return text
    return default_corpus(default_chars)


def tokenize(model, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids LongTensor [T] for `model`: its tokenizer, or for tokenizer-less synthetic models the UTF-8 bytes of
    `text` folded into the vocabulary (byte % vocab_size). Truncated to `max_tokens`."""
    if model.tokenizer is not None:
        ids = model.tokenizer.encode(text)
    else:
        ids = [b % model.config.vocab_size for b in text.encode("utf-8")]
    if max_tokens is not None:
        if max_tokens <= 0:
            raise InputError(f"--max-tokens must be positive, got {max_tokens}")
        ids = ids[:max_tokens]
    if not ids:
        raise InputError("the prompt produced no tokens")
    return torch.tensor(ids, dtype=torch.long)
