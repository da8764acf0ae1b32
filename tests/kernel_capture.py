"""Compile the kernel launches of kvtool's public entry points for a GPU target on a machine without a GPU.

`capture(thunk, target)` runs `thunk` (a call of a public entry point on CPU tensors) with every module-level kernel
object of `kvtool.kernels` (JIT functions and autotuners) replaced by a spy that records the launch (kernel, args,
kwargs, grid) instead of running it, and with the launchers' device switches set as on `target`:
- the INTERPRET constants read at import (store, dequant, index scorer) are set False;
- `native_fp8` (store, dequant, index scorer, and sparse attention's `store_native_fp8`) and the index scorer's SM
  count run their own rule on a fake CUDA device of the target (`_FakeTorch`: torch.version.cuda / hip, capability,
  SM count);
- sparse attention reads the device inline in `_launch` for its register cap, which CPU tensors cannot fake:
  `launch_plan` gets the target's SM count, and `_launch`'s maxnreg rule is applied here (`_SparseAttnRules`).
`compile_launch(launch, target)` lets Triton's own binder specialize the recorded arguments for the target's backend
(signature, constexprs, 16-byte divisibility attributes: what a real launch compiles) and compiles each variant
(every autotune config of an autotuned launch) with `triton.compile(ASTSource(...))`: a cubin for cuda:90, an hsaco
for hip:gfx950. Compiling is not running: a gfx950 compile says nothing about results on that GPU.

Why a worker process (`Worker`): `@triton.jit` decides at decoration time between a compilable JITFunction and an
interpreter object, and tests/conftest.py sets TRITON_INTERPRET=1 (on CPU machines) before triton is imported, so in
the pytest process even triton.language's own jit helpers (tl.max, tl.sum, ...) are interpreter objects that the code
generator cannot compile. The compiles therefore run in a child process started without TRITON_INTERPRET, where every
kernel module imports as on a GPU; it serves (case, target) requests, one JSON line each, from a case table module
(`python tests/kernel_capture.py TABLE.py`: the table module's CASES maps names to thunk factories).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import os
import pkgutil
import queue
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Target:
    """A compile target and the device facts the launchers branch on."""

    name: str  # "cuda:90" | "hip:gfx950"
    backend: str  # GPUTarget backend
    arch: int | str
    warp_size: int
    binary: str  # the asm entry of the compiled kernel that is loaded on the device
    capability: tuple[int, int]  # torch.cuda.get_device_capability on that device (ROCm: gfx950 reports (9, 5))
    sms: int  # multi_processor_count (H200: 132 SMs; MI355X: 256 CUs)
    rocm: bool  # torch.version.cuda is None, torch.version.hip set

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS = {
    "cuda:90": Target("cuda:90", "cuda", 90, 32, "cubin", (9, 0), 132, False),
    "hip:gfx950": Target("hip:gfx950", "hip", "gfx950", 64, "hsaco", (9, 5), 256, True),
}


@dataclass
class Launch:
    """One recorded kernel launch: `kernel` the JITFunction, `configs` the autotune configs ([None]: a plain launch),
    `options` extra compile options the launcher passes only on a real device (sparse attention's maxnreg)."""

    name: str
    kernel: Any
    args: tuple
    kwargs: dict
    grid: Any
    configs: list = field(default_factory=lambda: [None])
    options: dict = field(default_factory=dict)


@dataclass
class Compiled:
    """One compiled variant: kernel name, variant label, binary size in bytes, whether it was a memo hit."""

    name: str
    variant: str
    binary_bytes: int
    memo_hit: bool
    seconds: float


class _FakeTorch:
    """`torch` as a launcher module sees it on the target's device: version.cuda / version.hip, torch.cuda's capability
    and SM count; everything else is torch."""

    def __init__(self, target: Target):
        import torch

        self._torch = torch
        self.version = SimpleNamespace(cuda=None if target.rocm else "12.8", hip="7.0" if target.rocm else None)
        props = SimpleNamespace(multi_processor_count=target.sms)
        self.cuda = SimpleNamespace(get_device_capability=lambda device=None: target.capability,
                                    get_device_properties=lambda device=None: props,
                                    is_available=lambda: True)

    def __getattr__(self, name):
        return getattr(self._torch, name)


class _Spy:
    """Stands in for a kernel object: `spy[grid](*args, **kwargs)` records a Launch."""

    def __init__(self, name: str, real, sink: list):
        self.name, self.real, self.sink = name, real, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime.autotuner import Autotuner

            if isinstance(self.real, Autotuner):
                self.sink.append(Launch(self.name, self.real.fn, args, kwargs, grid, list(self.real.configs)))
            else:
                self.sink.append(Launch(self.name, self.real, args, kwargs, grid))
        return launch

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} was called as a device function from Python during a capture")


class _SparseAttnRules:
    """Sparse attention's device rule that reads `q.device` inline in `_launch` (kernels/sparse_attn.py): `maxnreg`
    (default 128 for fp16-dot formats with 4 warps, else 0) is passed only where torch.version.cuda is set. The
    wrapper records what each call asked for; `finish` adds the rule's result to the recorded attention launch."""

    def __init__(self, sa, target: Target):
        self.real, self.target = sa._launch, target
        self.sig = inspect.signature(sa._launch)
        self.maxnreg: list = []

    def __call__(self, *args, **kwargs):
        bound = self.sig.bind(*args, **kwargs)
        self.maxnreg.append(bound.arguments["maxnreg"])
        return self.real(*bound.args, **bound.kwargs)

    def finish(self, launches: list) -> None:
        attn = [ln for ln in launches if ln.name == "sparse_attn._sparse_attn_kernel"]
        for ln, asked in zip(attn, self.maxnreg):
            default = 128 if ln.kwargs.get("F16") and ln.kwargs.get("num_warps") == 4 else 0
            m = default if asked is None else int(asked)
            if m and not self.target.rocm:
                ln.options["maxnreg"] = m


class _Patches:
    """setattr with undo (the pytest monkeypatch idiom, usable outside a test)."""

    def __init__(self):
        self._undo: list = []

    def setattr(self, obj, name: str, value) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)


def kernel_modules() -> dict:
    """Every module of kvtool.kernels by short name (a new kernel module is spied on without a change here)."""
    import kvtool.kernels

    names = sorted(m.name for m in pkgutil.iter_modules(kvtool.kernels.__path__))
    return {m: importlib.import_module(f"kvtool.kernels.{m}") for m in names}


def capture(thunk: Callable[[], Any], target: Target) -> list[Launch]:
    """Run `thunk` with spies in place of every kernel object and the launchers' device switches set for `target`;
    return the launches in call order. Everything patched is restored before returning."""
    import torch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    mods = kernel_modules()
    launches: list[Launch] = []
    p = _Patches()
    fake = _FakeTorch(target)
    cuda0 = torch.device("cuda", 0)
    try:
        for mname, mod in mods.items():
            for attr, val in list(vars(mod).items()):
                if isinstance(val, (JITFunction, Autotuner)):
                    p.setattr(mod, attr, _Spy(f"{mname}.{attr}", val, launches))
                elif type(val).__name__ == "InterpretedFunction":
                    raise RuntimeError("kernels were imported under TRITON_INTERPRET=1: capture and compile in a "
                                       "process started without it (kernel_capture.Worker)")
            if hasattr(mod, "INTERPRET"):
                p.setattr(mod, "INTERPRET", False)
        st, isc, sa = mods["store"], mods["index_score"], mods["sparse_attn"]
        rule = st.native_fp8.__wrapped__  # the lru_cache'd rule itself (its cache holds CPU answers)
        p.setattr(st, "torch", fake)  # the rule reads torch.version / torch.cuda from the store module
        for mod in (st, mods["dequant"], isc):  # sparse_attn binds it as store_native_fp8
            p.setattr(mod, "native_fp8", lambda device: rule(cuda0))
        p.setattr(sa, "store_native_fp8", lambda device: rule(cuda0))
        real_sms = isc._num_sms
        p.setattr(isc, "torch", fake)
        p.setattr(isc, "_num_sms", lambda device: real_sms(cuda0))
        p.setattr(isc, "_cuda_defaults", lambda device: not target.rocm)
        p.setattr(mods["index_gluon"], "device_ok", lambda device: not target.rocm)  # the NVIDIA fast paths
        p.setattr(mods["sparse_attn_gluon"], "device_ok", lambda device: not target.rocm)
        p.setattr(mods["sparse_attn_gluon"], "num_sms", lambda device: target.sms)
        for mod in (sa, mods["sparse_attn_gluon"]):  # programmatic dependent launch: CUDA sm_90+ only
            p.setattr(mod, "pdl_ok", lambda device: not target.rocm)
        p.setattr(mods["index_gluon"], "num_sms", lambda device: target.sms)
        p.setattr(mods["store_gluon"], "device_ok", lambda device: not target.rocm)
        p.setattr(mods["dequant"], "stream_ok", lambda device: not target.rocm)  # cache hints: CUDA only
        p.setattr(mods["store_gluon"], "num_sms", lambda device: target.sms)
        real_plan = sa.launch_plan
        p.setattr(sa, "torch", fake)
        p.setattr(sa, "launch_plan", lambda *a, **k: real_plan(*a, **{"sms": target.sms, **k}))
        rules = _SparseAttnRules(sa, target)
        p.setattr(sa, "_launch", rules)
        thunk()
        rules.finish(launches)
    finally:
        p.undo()
    return launches


_MEMO: dict = {}
_BACKENDS: dict = {}


def _variants(launch: Launch):
    for cfg in launch.configs:
        kw = dict(launch.kwargs)
        label = "default"
        if cfg is not None:
            kw.update(cfg.all_kwargs())
            label = ",".join(f"{k}={v}" for k, v in sorted(cfg.all_kwargs().items()))
        kw.update(launch.options)
        yield label, kw


def _specialize(kern, args: tuple, kw: dict, target: Target):
    """Triton's binder on a launch's arguments for `target`: (key, compile thunk). The key names the specialization
    (memo key); the thunk compiles it and returns Triton's CompiledKernel."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if target.name not in _BACKENDS:
        _BACKENDS[target.name] = make_backend(target.gpu_target())
    backend = _BACKENDS[target.name]
    kw = {**kw, "debug": False, "instrumentation_mode": ""}
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    bound, spec, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, options)
    key = repr((target.name, kern.fn.__module__, kern.fn.__name__, sorted(signature.items()),
                sorted(constexprs.items()), sorted(attrs.items()), sorted(options.__dict__.items())))

    def build():
        source = ASTSource
        if getattr(kern, "is_gluon", lambda: False)():  # Gluon kernels (kernels/index_gluon.py)
            from triton.experimental.gluon._runtime import GluonASTSource as source
        return triton.compile(source(kern, signature, constexprs, attrs), target=target.gpu_target(),
                              options=options.__dict__)
    return key, build


def compile_kernel(launch: Launch, target: Target, **overrides):
    """Triton's CompiledKernel of a plain (not autotuned) `launch` for `target`, with keyword overrides (such as
    maxnreg): its asm dict holds the cubin / hsaco (bench/sass_index_gluon.py reads the SASS from it)."""
    (_, kw), = _variants(launch)
    return _specialize(launch.kernel, launch.args, {**kw, **overrides}, target)[1]()


def compile_launch(launch: Launch, target: Target) -> list[Compiled]:
    """Compile every variant of `launch` for `target` (memoized on the specialization) -> one Compiled each."""
    out = []
    for label, kw in _variants(launch):
        key, build = _specialize(launch.kernel, launch.args, kw, target)
        t0 = time.perf_counter()
        hit = key in _MEMO
        if not hit:
            _MEMO[key] = len(build().asm.get(target.binary) or b"")
        out.append(Compiled(launch.name, label, _MEMO[key], hit, time.perf_counter() - t0))
    return out


def compile_thunk(thunk: Callable[[], Any], target: Target) -> dict:
    """Capture and compile: {"launches": [names], "compiled": [Compiled as dicts], "switches": [switches()]}
    (raises on a compile error)."""
    launches = capture(thunk, target)
    compiled = [c for ln in launches for c in compile_launch(ln, target)]
    return {"launches": [ln.name for ln in launches], "compiled": [vars(c) for c in compiled],
            "switches": [switches(ln) for ln in launches]}


def switches(launch: Launch) -> dict:
    """The device-dependent choices a launch carries: hardware fp8 conversion, the interpreter's fp32 dots (the
    index scorer's DOT_F32, attention's FP32_DOT), warps, the register cap and programmatic dependent launch (the
    sparse decode kernels' PDL and the launcher's launch_pdl; the portable attention kernel's tiles per program, which
    its PDL mode follows)."""
    kw = launch.kwargs
    return {"name": launch.name, "native_fp8": kw.get("NATIVE_FP8"), "fp32_dots": kw.get("DOT_F32", kw.get("FP32_DOT")),
            "num_warps": kw.get("num_warps"), "maxnreg": launch.options.get("maxnreg"), "pdl": kw.get("PDL"),
            "launch_pdl": kw.get("launch_pdl"), "tiles": kw.get("TILES"),
            "programs": math.prod(launch.grid) if isinstance(launch.grid, tuple) else None}


def _one_line(exc: BaseException) -> str:
    """The compiler's message in one line: a Triton CompilationError's location and last line (the error under the
    source excerpt), else the first line that names an error (ptxas / LLVM), else the first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if type(exc).__name__ == "CompilationError":
        msg = f"{lines[0]} {lines[-1]}"
    else:
        msg = next((ln for ln in lines if "error" in ln.lower()), lines[0])
    return f"{type(exc).__name__}: {msg}"[:400]


# ---------------------------------------------------------------------------------------------- the worker process
class Worker:
    """A child process without TRITON_INTERPRET that compiles cases of `table_path` (a module with CASES: name ->
    thunk factory). `submit` queues requests (the child works through them in order while the caller waits on
    others), `result` waits for one."""

    def __init__(self, table_path: str, timeout_s: float = 300.0):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.dirname(os.path.abspath(__file__)),
                                             env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), table_path], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.timeout_s = timeout_s
        self.results: dict = {}
        self.submitted: set = set()
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the worker exited

    def submit(self, case: str, target: str) -> None:
        self.submitted.add((case, target))
        self.proc.stdin.write(json.dumps({"case": case, "target": target}) + "\n")
        self.proc.stdin.flush()

    def result(self, case: str, target: str) -> dict:
        """The worker's answer for (case, target) (submitted now if it was not): waits at most timeout_s for each
        answer still due."""
        if (case, target) not in self.submitted:
            self.submit(case, target)
        while (case, target) not in self.results:
            try:
                line = self._lines.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"compile worker gave no answer in {self.timeout_s:.0f} s "
                                   f"(waiting for {case} / {target})") from None
            if line is None:
                self._lines.put(None)
                raise RuntimeError(f"compile worker exited (code {self.proc.poll()}) before {case} / {target}")
            r = json.loads(line)
            self.results[(r["case"], r["target"])] = r
        return self.results[(case, target)]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # still compiling requests nobody waits for any more
                self.proc.kill()
                self.proc.wait()


def _serve(table_path: str) -> None:
    """Worker main: one JSON request per stdin line -> one JSON result per stdout line (stdout proper goes to stderr
    so that nothing else lands in the protocol stream)."""
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_capture worker: TRITON_INTERPRET=1 is set; kernels would not compile")
    spec = importlib.util.spec_from_file_location("kernel_compile_table", table_path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        res = {"case": req["case"], "target": req["target"]}
        try:
            res.update(compile_thunk(table.CASES[req["case"]](), TARGETS[req["target"]]), ok=True)
        except Exception as exc:  # reported to the test, which fails or xfails with the one-line message
            res.update(ok=False, error=_one_line(exc), trace=traceback.format_exc()[-3000:])
        res["seconds"] = time.perf_counter() - t0
        proto.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    _serve(sys.argv[1])
