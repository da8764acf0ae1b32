"""Import shims for engines' pure-torch and Triton reference functions: the oracles of the engines test tier.

Each engine function is loaded from the engine's own published wheel at run time (kvtool.engines.wheels.extract
puts single members into the cache), never from a copy in this project. The engine packages' `__init__` files pull
in CUDA extensions, configs and loggers, so they are never imported: `load_defs` parses one module file, keeps only
the named top-level definitions (functions, classes, constants), and executes them under a private module name with
the few globals they need supplied by the caller (torch, triton, a stub for a platform query). Decorators that only
compile (`torch.compile`) are dropped, so functions run eagerly; the recipes record where that matters.

Every accessor returns plain callables and raises `EngineUnavailable` (a KvtoolError) when the wheel cannot be had.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.metadata
import sys
import types
import typing
from pathlib import Path

from kvtool.engines.wheels import FLASHINFER, SGLANG, VLLM, EnginePackage, EngineUnavailable, extract

__all__ = [
    "DROPPED_DECORATORS", "TORCHAO_VERSION", "deepgemm_math", "deepgemm_nvfp4", "flashinfer_quantize", "load_defs",
    "sglang_kvfp4", "torchao_mx", "triton_kernels_downcast_kernel", "triton_kernels_mxfp", "vllm_indexer_writer",
    "vllm_m3_nvfp4_page", "vllm_nvfp4_emulation"
]

DROPPED_DECORATORS = ("torch.compile",)

TORCHAO_VERSION = "0.18.0"


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target)


def load_defs(pkg: EnginePackage, member: str, names: tuple[str, ...], env: dict | None = None,
              *, download: bool = True) -> types.SimpleNamespace:
    """The top-level definitions `names` of wheel member `member` (a .py path inside the wheel), executed in a fresh
    private module whose globals are `env` (plus typing's names). Raises EngineUnavailable when the wheel or the
    member cannot be had, or a name is missing from the file (the function moved in another version)."""
    root = extract(pkg, [member], download=download)
    path = root / member
    tree = ast.parse(path.read_text(), filename=str(path))
    keep, found = [], set()
    for node in tree.body:
        defined = _defined_names(node)
        if not defined & set(names):
            continue
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            node.decorator_list = [d for d in node.decorator_list if _decorator_name(d) not in DROPPED_DECORATORS]
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef) and sub is not node:
                    sub.decorator_list = [d for d in sub.decorator_list
                                          if _decorator_name(d) not in DROPPED_DECORATORS]
        keep.append(node)
        found |= defined
    missing = [n for n in names if n not in found]
    if missing:
        raise EngineUnavailable(f"{pkg.dist}=={pkg.version} {member} has no top-level {', '.join(missing)}")
    module_name = f"_kvtool_oracle_{pkg.dist.replace('-', '_')}_{Path(member).stem}_{abs(hash(names)) % 10**8}"
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    module.__dict__.update({k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Tuple", "Union")})
    module.__dict__.update(env or {})
    sys.modules[module_name] = module  # Triton's JIT and dataclasses look the module up by name
    code = compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec")
    exec(code, module.__dict__)  # noqa: S102 - the engine's own published code, by design the oracle
    return types.SimpleNamespace(**{n: module.__dict__[n] for n in names}, path=path)


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _torch_env() -> dict:
    import torch
    import torch.nn.functional as F

    return {"torch": torch, "F": F, "Enum": enum.Enum}


def _triton_env() -> dict:
    import triton
    import triton.language as tl

    return {**_torch_env(), "triton": triton, "tl": tl}


# ---------------------------------------------------------------------------------------------------- accessors
@functools.cache
def deepgemm_math() -> types.SimpleNamespace:
    """vLLM's vendored DeepGEMM test helpers: per_token_cast_to_fp4 / _nvfp4, cast_back_from_fp4."""
    return load_defs(VLLM, "vllm/third_party/deep_gemm/utils/math.py", (
        "ceil_div", "align", "ceil_to_ue8m0", "pack_ue8m0_to_int", "_quantize_to_fp4_e2m1",
        "_quantize_to_fp4_e2m1_rne", "per_token_cast_to_fp4", "per_token_cast_to_nvfp4", "_dequantize_from_fp4_e2m1",
        "unpack_ue8m0_from_int", "cast_back_from_fp4"), _torch_env())


@functools.cache
def deepgemm_nvfp4() -> types.SimpleNamespace:
    """vLLM's vendored DeepGEMM MegaMoE NVFP4 reference: nvfp4.per_token_cast_to_nvfp4 / cast_back_from_nvfp4."""
    math = deepgemm_math()
    env = {**_torch_env(), "_quantize_to_fp4_e2m1": math._quantize_to_fp4_e2m1,
           "cast_back_from_fp4": math.cast_back_from_fp4}
    return load_defs(VLLM, "vllm/third_party/deep_gemm/utils/nvfp4.py",
                     ("per_token_cast_to_nvfp4", "cast_back_from_nvfp4"), env)


@functools.cache
def vllm_nvfp4_emulation() -> types.SimpleNamespace:
    """vLLM's NVFP4 emulation reference: ref_nvfp4_quant / ref_nvfp4_quant_dequant (the CPU branch)."""
    scalar_types = types.SimpleNamespace(float4_e2m1f=types.SimpleNamespace(max=lambda: 6.0))
    platform = types.SimpleNamespace(is_cuda_alike=lambda: False)  # the torch branch, not the Triton one
    env = {**_torch_env(), "scalar_types": scalar_types, "current_platform": platform}
    return load_defs(VLLM, "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py", (
        "FLOAT4_E2M1_MAX", "FLOAT4_E2M1_MAX_RECIPROCAL", "get_reciprocal", "cast_to_fp4", "ref_nvfp4_quant",
        "ref_nvfp4_quant_dequant"), env)


@functools.cache
def triton_kernels_mxfp() -> types.SimpleNamespace:
    """vLLM's vendored triton_kernels MX conversion, torch form: downcast_to_mxfp_torch / upcast_from_mxfp_torch."""
    env = {**_triton_env(), "MXFP_BLOCK_SIZE": 32}
    return load_defs(VLLM, "vllm/third_party/triton_kernels/numerics_details/mxfp.py", (
        "DequantScaleRoundingMode", "right_shift_unsigned", "get_max_quant_val", "downcast_to_mxfp_torch",
        "cvt_e2m1_to_fp32", "upcast_from_mxfp_torch"), env)


@functools.cache
def vllm_indexer_writer() -> types.SimpleNamespace:
    """vLLM's ROCm DeepSeek V3.2 indexer cache writer, the Triton kernel `_indexer_k_quant_and_cache_kernel`."""
    return load_defs(VLLM, "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py",
                     ("_indexer_k_quant_and_cache_kernel",), _triton_env())


@functools.cache
def vllm_m3_nvfp4_page() -> types.SimpleNamespace:
    """vLLM's MiniMax-M3 SM100 NVFP4 page views: fmha_sm100/nvfp4_kv.py nvfp4_head_slot_views."""
    return load_defs(VLLM, "vllm/third_party/fmha_sm100/nvfp4_kv.py",
                     ("_NVFP4_DATA_BYTES", "_NVFP4_SLOT_BYTES", "nvfp4_head_slot_views"), _torch_env())


@functools.cache
def flashinfer_quantize() -> types.SimpleNamespace:
    """FlashInfer's trace-template references: _mxfp4_quantize_reference, _nvfp4_kv_quantize_reference."""
    return load_defs(FLASHINFER, "flashinfer/trace/templates/quantize.py", (
        "_fp4_e2m1_quantize_block", "_pack_fp4_pairs", "_quantize_fp4_block_scale", "_fp4_quantize_reference",
        "_nvfp4_quantize_reference", "_mxfp4_quantize_reference", "_nvfp4_kv_quantize_reference"), _torch_env())


@functools.cache
def sglang_kvfp4() -> types.SimpleNamespace:
    """SGLang's FP4 KV quantizer, FP4MXBlock16KVQuantizeUtil (batched_quantize / batched_dequantize), run eagerly."""
    return load_defs(SGLANG, "sglang/srt/layers/quantization/kvfp4_tensor.py", (
        "E2M1_MAX", "E2M1_VALUES", "E2M1_BOUNDS", "FP4MXBlock16KVQuantizeUtil"), _torch_env())


@functools.cache
def torchao_mx() -> types.SimpleNamespace:
    """torchao's nvfp4_quantize and to_mx (an ordinary installed package, pinned to TORCHAO_VERSION)."""
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        raise EngineUnavailable(f"torchao is not installed (pip install torchao=={TORCHAO_VERSION})") from None
    if version != TORCHAO_VERSION:
        raise EngineUnavailable(f"torchao {version} is installed; the recipes were checked against {TORCHAO_VERSION}")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    return types.SimpleNamespace(nvfp4_quantize=nvfp4_quantize, to_mx=to_mx, ScaleCalculationMode=ScaleCalculationMode)


@functools.cache
def triton_kernels_downcast_kernel() -> types.SimpleNamespace:
    """vLLM's vendored triton_kernels MX conversion, Triton form: `downcast_to_mxfp` and its `_downcast_to_mxfp`
    kernel (runs in the interpreter on CPU tensors)."""
    import triton.language as tl

    # The kernel file's module-level `MXFP_BLOCK_SIZE = tl.constexpr(32)` is given to the kernels as a plain 32: the
    # interpreter cannot do arithmetic on a global constexpr (the compiler folds it; the values are the same).
    details = load_defs(VLLM, "vllm/third_party/triton_kernels/numerics_details/mxfp_details/_downcast_to_mxfp.py", (
        "_get_max_quant_val", "_compute_quant_and_scale", "_downcast_to_mxfp"), {**_triton_env(), "MXFP_BLOCK_SIZE": 32})
    env = {**_triton_env(), "MXFP_BLOCK_SIZE": tl.constexpr(32), "_downcast_to_mxfp": details._downcast_to_mxfp}
    return load_defs(VLLM, "vllm/third_party/triton_kernels/numerics_details/mxfp.py",
                     ("DequantScaleRoundingMode", "downcast_to_mxfp"), env)
