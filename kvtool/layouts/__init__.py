"""Engine cache layouts (SPEC section 5, issue 7): read and write the paged buffers of vLLM, TensorRT-LLM, SGLang,
ATOM and DeepSeek's indexer, and kvtool's own `planes` and `paged`, as QTensors of logical shape [tokens, heads, D].

Public API (other commands route `--layout` / `--geometry` here):
- `read_layout(path, layout, geometry) -> dict[str, QTensor]` (`read_layout_all`: plus each tensor's Geometry)
- `write_layout(tensors, path, layout, geometry) -> {name: Geometry}` (atomic; `planes` .safetensors = a kvtool file)
- `check_plausible(tensors) -> list[str]` (warnings that the geometry or layout is wrong)
- `PRESETS` / `get_preset(name)`: the presets as data; `parse_geometry(text)`; `Geometry`.
"""

from kvtool.layouts.engine import GEOMETRY_KEYS, Geometry, decode, encode, make_geometry, parse_geometry
from kvtool.layouts.files import (
    LayoutRead,
    encode_for_write,
    load_dump,
    plan_write,
    read_layout,
    read_layout_all,
    read_layout_info,
    write_layout,
)
from kvtool.layouts.plausible import check_plausible
from kvtool.layouts.presets import PRESETS, RULES, LayoutPreset, Plane, Region, Rule, get_preset

__all__ = [
    "GEOMETRY_KEYS", "Geometry", "LayoutPreset", "LayoutRead", "PRESETS", "Plane", "RULES", "Region", "Rule",
    "check_plausible", "decode", "encode", "encode_for_write", "get_preset", "load_dump", "make_geometry",
    "parse_geometry", "plan_write", "read_layout", "read_layout_all", "read_layout_info", "write_layout",
]
