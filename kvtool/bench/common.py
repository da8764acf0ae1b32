"""Benchmark plumbing shared by every `kvtool bench ...` command.

A benchmark is a table of `BenchCase`s (name, callable, bytes it must move at least). `run_cases` measures the copy
bandwidth first (a device-to-device copy, bytes read + written), then times each case and reports time, bytes,
bandwidth and the fraction of that copy bandwidth (SPEC section 6). On CUDA, timing uses CUDA events around many
replays (or CUDA-graph replay when a case asks for it); on CPU, wall-clock time.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "BenchCase", "BenchReport", "BenchRow", "copy_bandwidth", "device_name", "quiet_third_party", "render_report",
    "run_cases", "time_fn"
]


@contextlib.contextmanager
def quiet_third_party(loggers: tuple[str, ...] = ("torchao", "torch.utils._pytree")):
    """Silence a peer library's import noise on stderr (torchao logs a warning per optional CUDA .so it cannot load,
    torch's pytree a deprecation note per enum torchao registers): warnings and those loggers' records below ERROR."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger, _ in saved:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in saved:
                logger.setLevel(level)


@dataclass
class BenchCase:
    name: str
    fn: Callable[[], Any]
    bytes_moved: int  # fewest bytes the operation must move: each input read once, each output written once
    group: str = ""
    note: str = ""
    cuda_graph: bool = False  # time by CUDA-graph replay (small launches, as engines run them)


@dataclass
class BenchRow:
    group: str
    name: str
    time_us: float
    bytes_moved: int
    gbps: float
    frac_copy: float
    note: str = ""


@dataclass
class BenchReport:
    title: str
    device: str
    torch_version: str
    triton_version: str
    date: str
    copy_gbps: float
    rows: list[BenchRow] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.multi_processor_count} SMs)"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], device: str, warmup: int = 3, rep: int = 20, cuda_graph: bool = False,
            min_time_s: float = 0.05, settle_s: float = 0.2) -> float:
    """Median seconds per call of `fn`. On CUDA each sample times a batch of calls with events (a batch long enough to
    hide launch gaps); with `cuda_graph`, the batch is captured once in a CUDA graph and replayed. Before the samples
    the batch runs for settle_s seconds: after the compiles and autotuning of a case's first calls (seconds of an
    idle GPU) the first cases of a run read up to 12 % slow on the H200 without it."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if not device.startswith("cuda"):
        samples = []
        deadline = time.perf_counter() + min_time_s
        for i in range(rep):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
            if i >= 2 and time.perf_counter() > deadline:
                break
        return statistics.median(samples)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end) / 1e3, 1e-6)
    inner = max(1, min(200, int(2e-3 / one)))
    run = lambda: [fn() for _ in range(inner)]  # noqa: E731
    if cuda_graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay  # noqa: E731
    settle_end = time.perf_counter() + settle_s
    while time.perf_counter() < settle_end:
        run()
        torch.cuda.synchronize()
    samples = []
    for _ in range(rep):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(samples)


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (the ceiling for fractions)."""
    if not device.startswith("cuda"):
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, rep=10)
    return 2 * nbytes / t / 1e9


def run_cases(title: str, cases: list[BenchCase], device: str, copy_gbps: float | None = None,
              progress: Callable[[str], None] | None = None) -> BenchReport:
    copy = copy_bandwidth(device) if copy_gbps is None else copy_gbps
    import triton

    report = BenchReport(title, device_name(device), torch.__version__, triton.__version__,
                         datetime.datetime.now().isoformat(timespec="seconds"), copy)
    for case in cases:
        if progress:
            progress(case.name)
        t = time_fn(case.fn, device, cuda_graph=case.cuda_graph)
        gbps = case.bytes_moved / t / 1e9
        report.rows.append(BenchRow(case.group, case.name, t * 1e6, case.bytes_moved, gbps, gbps / copy, case.note))
    return report


def render_report(report: BenchReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    # Text, not str: a str is rich markup, where "bf16 [tokens, 1, 128]" is a style tag and vanishes
    table = Table(title=Text(f"{report.title} — {report.device}, torch {report.torch_version}, triton "
                             f"{report.triton_version}, copy {report.copy_gbps:.0f} GB/s"))
    for col in ("group", "case", "time (us)", "bytes", "GB/s", "of copy", "note"):
        table.add_column(col, justify="right" if col in ("time (us)", "bytes", "GB/s", "of copy") else "left")
    for column in (table.columns[0], table.columns[-1]):
        column.optional = True  # the CLI's renderer may leave these out at a narrow width (kvtool.cli.render)
    table.columns[0].group = True  # left out, it heads its rows instead: case names repeat in every group
    for r in report.rows:
        table.add_row(Text(r.group), Text(r.name), f"{r.time_us:.1f}", f"{r.bytes_moved:,}", f"{r.gbps:.0f}",
                      f"{100 * r.frac_copy:.1f} %", Text(r.note))
    console.print(table)
