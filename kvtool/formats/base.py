"""What the codecs need of a format, below the registry that defines `Format` (so the formats package imports one way).

`codecs` and `recipes` take a format descriptor and read a few of its option fields; `registry.Format` (which calls
them) has every one. `FormatParams` names those fields as a structural type, so the codecs type their argument
without importing the registry above them.
"""

from __future__ import annotations

from typing import Protocol

from kvtool.formats.rules import Fp8Scale, NvRecipe, ScaleRule

__all__ = ["FormatParams"]


class FormatParams(Protocol):
    """The fields of `kvtool.formats.registry.Format` that the block codecs read (None where a family has no such
    option)."""

    @property
    def block(self) -> int: ...  # elements per block scale (0: no block scale)

    @property
    def scale_rule(self) -> ScaleRule | None: ...

    @property
    def recipe(self) -> NvRecipe | None: ...

    @property
    def outer_scale(self) -> str | None: ...  # nvfp4 g_dec: "1", "auto" or a float's repr

    @property
    def fp8_scale(self) -> Fp8Scale | None: ...

    @property
    def ds_floor(self) -> bool | None: ...

    @property
    def pow2(self) -> bool | None: ...
