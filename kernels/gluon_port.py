"""The `@triton.jit` codec helpers as Gluon functions, so that Gluon kernels call the very same codec code (one jit
helper per codec, SPEC bit rules in one place) instead of copies.

A Gluon kernel can call a `@triton.jit` function, but that function's own calls then resolve in the Triton module
it was defined in: nested helpers stay Triton functions, and `tl.full` (which needs a layout under Gluon) fails.
`port(module)` re-creates every `@triton.jit` function of a module with a private globals dict in which the module's
other jit functions are their Gluon twins and `tl` is `triton.language` with `full` / `max` / `min` / `sum` taken
from Gluon (layouts inferred from the operands, `AutoLayout` for `full`). The source text is the module's: the
Triton cache keys on it, so an edit of a codec recompiles both kinds of kernel.
"""

from __future__ import annotations

import functools
import types

import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = ["port"]

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - the pinned Triton has Gluon
    gluon = None


@functools.lru_cache(maxsize=None)
def port(module: types.ModuleType) -> types.ModuleType:
    """Gluon twins of `module`'s `@triton.jit` functions, by name, as a module (memoized per module). A module,
    not a namespace: kernels refer to it as a global, and Triton records (deep-copies) non-module globals."""
    if gluon is None:  # pragma: no cover
        raise RuntimeError("Gluon is not available in this Triton")
    tl_gluon = types.ModuleType("triton.language")  # a module: Triton's dependency finder accepts module globals
    tl_gluon.__dict__.update({k: getattr(tl, k) for k in dir(tl) if not k.startswith("__")})
    tl_gluon.full, tl_gluon.max, tl_gluon.min, tl_gluon.sum = gl.full, gl.max, gl.min, gl.sum
    scope = dict(vars(module))
    scope["tl"] = tl_gluon
    twins = {}
    for name, obj in vars(module).items():
        if isinstance(obj, JITFunction):
            f = obj.fn
            g = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
            g.__doc__, g.__qualname__, g.__module__ = f.__doc__, f.__qualname__, f.__module__
            g.__kwdefaults__ = f.__kwdefaults__
            twins[name] = gluon.jit(g, do_not_specialize=list(obj.do_not_specialize or ()))
    scope.update(twins)  # nested calls inside the twins resolve to twins
    twin_module = types.ModuleType(module.__name__ + ".gluon")
    twin_module.__dict__.update(twins)
    return twin_module
