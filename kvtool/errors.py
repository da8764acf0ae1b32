"""Typed errors. Every expected failure is a `KvtoolError` with a one-line message; the CLI turns it into exit code 2."""

__all__ = [
    "FileFormatError", "FormatError", "InputError", "KernelArgumentError", "KvtoolError", "LayoutError", "OutputError"
]


class KvtoolError(Exception):
    """Base class: a user-facing, one-line failure (bad input, bad option, bad file)."""

    exit_code = 2


class FormatError(KvtoolError):
    """Unknown format, recipe, rule or option value, or data that does not fit a format (e.g. dim % block)."""


class InputError(KvtoolError):
    """An input tensor that cannot be quantized (non-floating, NaN/Inf, wrong shape)."""


class FileFormatError(KvtoolError):
    """A file that is truncated, corrupt, lies about its sizes, or carries an unsupported schema version."""


class OutputError(KvtoolError):
    """An output path that cannot be written (same as input, missing or read-only directory)."""


class LayoutError(KvtoolError):
    """A geometry or engine layout that does not match the data."""


class KernelArgumentError(KvtoolError):
    """A kernel launcher was given tensors of the wrong dtype, shape, device or alignment."""
