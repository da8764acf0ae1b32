"""`kvtool bench decode`: one decode step of a whole model over a long context, per cache configuration.

Cases (one table, STYLE 11): a plain bf16 dense decode (contiguous bf16 K/V, torch SDPA), the bf16 K/V + bf16 index
paged sparse step (the baseline configuration of `kvtool decode`), and each candidate configuration (default nvfp4 K/V
+ fp4 index). Each case is one `Decoder.forward` of one token per sequence at a fixed position: the context is filled
first (random K, V and index keys written through `store`, the same path a real prefill takes; the values do not change
the work), then every timed call re-writes the same position. On CUDA every case is timed twice: eager (Python launches
included, as `kvtool decode` runs) and replayed from a CUDA graph (as an engine runs its decode step). On CUDA the paged cases run the Triton store (without its finite / slot-range
checks, which cost a host sync: engines skip them too), scorer and sparse-attention kernels; on CPU the torch path (fp32
shadow of the dequantized cache).

Bytes per case = model weights read once (fp32) + the cache bytes the step must read: for the sparse cases the whole
index-key cache plus the selected K/V tokens (top-k x block of each KV head), for the dense case all K/V; x batch.

Goals (the issue): on CPU (smollm2, batch 1, 1K context) the quantized configuration at >= 0.5x the plain bf16 dense
tokens/s; on the H200 (synthetic-m3, batch 64, 32K context) the nvfp4 + fp4 step faster than the bf16 + bf16 step
(reported for both timing modes).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch

from kvtool.backend import resolve_backend, resolve_device, triton_available
from kvtool.bench.common import BenchCase, BenchReport, run_cases
from kvtool.errors import InputError
from kvtool.formats import get_format
from kvtool.indexer import IndexerConfig
from kvtool.models.base import CausalLM, load_model
from kvtool.workflows.decode import Decoder
from kvtool.workflows.decode_cache import CacheSpec, ConfigCache, PlainCache

__all__ = [
    "DEMO_GOAL_S", "DecodeBenchSetup", "PRESETS", "render_demo", "render_goals", "run_decode_bench", "run_demo_bench"
]

# Per device: the model and sizes of the goals (kwargs of run_decode_bench).
PRESETS = {
    "cpu": dict(model="smollm2", batch=1, context=1024, layers=None, rounds=3),
    "cuda": dict(model="synthetic-m3", batch=64, context=32768, layers=4, rounds=1),
}


@dataclass
class DecodeBenchSetup:
    model: str
    layers: int
    batch: int
    context: int
    selection: dict


def _fill(dec: Decoder, batch: int, context: int, seed: int, chunk: int = 4096) -> None:
    """Write `context` random tokens of `batch` sequences into every layer of dec's cache (through `update`, i.e.
    `store`): K, V and index keys ~ N(0, 1)."""
    c, dev = dec.model.config, dec.model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    B = batch
    for layer in range(c.n_layers):
        for p0 in range(0, context, chunk):
            pos = torch.arange(p0, min(context, p0 + chunk), device=dev)
            T = pos.shape[0]
            k = torch.randn(B, T, c.n_kv_heads, c.head_dim, generator=g, device=dev)    # k, v: [B, T, Hkv, D]
            v = torch.randn(B, T, c.n_kv_heads, c.head_dim, generator=g, device=dev)
            ik = torch.randn(B, T, c.index_dim, generator=g, device=dev)                # ik: [B, T, Di]
            dec.cache.update(layer, pos, k, v, ik)
    dec.pos = context


def _weight_bytes(model: CausalLM) -> int:
    return sum(t.numel() * t.element_size() for t in getattr(model, "w", {}).values())


def _step_cases(name: str, dec: Decoder, batch: int, context: int, nbytes: int, note: str,
                warn) -> list[BenchCase]:
    """The eager step (Python launches included, as `kvtool decode` runs it) and, on CUDA, the same step replayed
    from a CUDA graph (launch overhead gone: what an engine's captured decode step costs)."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=dec.model.device)

    def step():
        dec.pos = context  # every call decodes the token at the same position (context + 1 tokens visible)
        return dec.forward(token)

    cases = [BenchCase(name, step, nbytes, group="eager step", note=note)]
    if token.is_cuda:
        try:  # a capture that fails (an op that syncs the host) drops the graph row with a note, not the table
            step()
            torch.cuda.synchronize()
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                step()
            cases.append(BenchCase(name, step, nbytes, group="CUDA graph", note=note, cuda_graph=True))
        except Exception as err:  # noqa: BLE001
            warn(f"{name}: no CUDA-graph row ({type(err).__name__}: {err})")
    return cases


def run_decode_bench(model: str | None = None, device: str = "cpu", kv: tuple[str, ...] = ("nvfp4",),
                     index: tuple[str, ...] = ("fp4",), batch: int | None = None, context: int | None = None,
                     layers: int | None = None, backend: str = "auto", seed: int = 0, rounds: int | None = None,
                     progress=None) -> BenchReport:
    """Time one decode step per configuration (module docstring); None = the device's preset. Each case's time is
    the median over `rounds` rounds of the whole table (CPU default 3: a shared CPU's load then hits every case
    alike). Returns the BenchReport with `extra`: tokens/s per case, the speed ratios and the goals."""
    dev = resolve_device(device)
    preset = PRESETS["cuda" if dev.type == "cuda" else "cpu"]
    model = model or preset["model"]
    batch = batch or preset["batch"]
    context = context or preset["context"]
    layers = layers if layers is not None else preset["layers"]
    rounds = rounds or preset["rounds"]
    if batch < 1 or context < 1:
        raise InputError("--batch and --context must be positive")
    kw = ({"layers": layers} if layers is not None else {}) | ({"seed": seed} if model != "smollm2" else {})
    lm = load_model(model, dev, **kw)
    c = lm.config
    sel = IndexerConfig(c.block_size, c.topk, c.init_blocks, c.local_blocks)
    kernels = triton_available(lambda m: None) if resolve_backend(backend, dev) == "triton" else {}
    weights = _weight_bytes(lm)
    chosen = min(sel.topk * sel.block_size, context + 1)  # tokens of the selected blocks (per KV head)
    cases = []

    plain = Decoder(lm, PlainCache(c.n_layers, c.n_kv_heads, c.head_dim, batch, context + 1, dev), None)
    cases.append(("bf16 dense (plain)", plain,
                  weights + batch * c.n_layers * (context + 1) * 2 * c.n_kv_heads * 2 * c.head_dim,
                  "contiguous bf16 K/V, no index (SDPA on cuda)"))
    specs = [CacheSpec(get_format("bf16"), get_format("bf16"))]
    specs += [CacheSpec(get_format(k), get_format(i)) for k in kv for i in index]
    for spec in specs:
        cache = ConfigCache(spec, c.n_layers, c.n_kv_heads, c.head_dim, c.index_dim, batch, context + 1,
                            sel.block_size, dev, shadow=not kernels,
                            store_backend="triton" if kernels.get("store") else "torch", validate=False)
        dec = Decoder(lm, cache, sel, kernels)
        per_tok_kv = 2 * c.n_kv_heads * spec.kv.bytes_per_token(c.head_dim)
        nbytes = weights + batch * c.n_layers * ((context + 1) * spec.index.bytes_per_token(c.index_dim)
                                                 + chosen * per_tok_kv)
        path = "triton" if kernels.get("attention") else "torch shadow"
        bpt = spec.bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, c.index_dim)
        cases.append((f"{spec.label} paged sparse", dec, nbytes, f"{path}; {bpt:,} B/token"))
    bench, notes = [], []
    with torch.no_grad():
        for name, dec, nbytes, note in cases:
            if progress:
                progress(f"fill {name}")
            _fill(dec, batch, context, seed)
            bench += _step_cases(name, dec, batch, context, nbytes, note, notes.append)
        title = f"decode step: {model}, {c.n_layers} layers, batch {batch}, context {context}"
        report = run_cases(title, bench, str(dev), progress=progress)
        more = [run_cases(title, bench, str(dev), copy_gbps=report.copy_gbps, progress=progress).rows
                for _ in range(rounds - 1)]
    for i, row in enumerate(report.rows):  # the median over rounds: each round times every case in turn, so load
        row.time_us = statistics.median([row.time_us] + [r[i].time_us for r in more])  # from others hits all alike
        row.gbps = row.bytes_moved / row.time_us / 1e3
        row.frac_copy = row.gbps / report.copy_gbps
    groups = {}
    for r in report.rows:  # per timing mode: case name -> tokens/s
        groups.setdefault(r.group, {})[r.name] = batch / (r.time_us * 1e-6)
    names = list(groups["eager step"])
    report.extra = {
        "setup": dataclasses.asdict(DecodeBenchSetup(model, c.n_layers, batch, context, dataclasses.asdict(sel))),
        "tokens_per_s": groups,
        "vs_plain_bf16": {g: {n: t[n] / t[names[0]] for n in t} for g, t in groups.items() if names[0] in t},
        "vs_paged_bf16": {g: {n: t[n] / t[names[1]] for n in t} for g, t in groups.items() if names[1] in t},
        "goals": [line for g, t in groups.items() for line in _goals(dev, g, names, t)],
        "notes": notes,
    }
    return report


def _goals(dev: torch.device, group: str, names: list[str], tps: dict) -> list[str]:
    out = []
    for n in names[2:]:
        if n not in tps:
            continue
        if dev.type == "cuda":
            ratio = tps[n] / tps[names[1]] if names[1] in tps else float("nan")
            out.append(f"{group}, {n}: {ratio:.2f}x the bf16 paged step (goal > 1): "
                       f"{'met' if ratio > 1 else 'NOT met'}")
        else:
            ratio = tps[n] / tps[names[0]]
            out.append(f"{group}, {n}: {ratio:.2f}x the plain bf16 dense tokens/s (goal >= 0.5): "
                       f"{'met' if ratio >= 0.5 else 'NOT met'}")
    return out


def render_goals(report: BenchReport, console) -> None:
    for group, tps in report.extra["tokens_per_s"].items():
        for name, value in tps.items():
            plain = report.extra["vs_plain_bf16"].get(group, {}).get(name)
            paged = report.extra["vs_paged_bf16"].get(group, {}).get(name)
            console.print(f"  {group}, {name}: {value:,.1f} tok/s"
                          + (f" ({plain:.2f}x plain bf16, {paged:.2f}x paged bf16)" if plain and paged else ""))
    for line in report.extra["goals"] + report.extra["notes"]:
        console.print(f"  goal: {line}" if "goal" in line else f"  note: {line}", markup=False)


# ------------------------------------------------------------------------------------------------ the demo, timed
DEMO_GOAL_S = 30.0  # the goal: the default `kvtool decode` within 30 s on the 2-core CPU machine


def run_demo_bench(device: str = "cpu", progress=None, **overrides) -> BenchReport:
    """Time the default `kvtool decode --kv nvfp4 --index fp4` end to end, in process (the CLI's own imports, about
    1.5 s on the 2-core machine, are not in it): wall time and the process's CPU time (user + sys over all its
    threads; on a machine shared with other jobs the wall time inflates, the CPU time much less), split into model
    load, teacher-forced, free run and report (bootstrap included), beside the plain bf16 dense decode's tokens/s
    that the run reports. One row per phase; `extra` holds the totals and the goal line. `overrides`: DecodeOptions
    fields (tests run tiny-llama; the goal is only meaningful for the default)."""
    import os  # noqa: PLC0415
    import time  # noqa: PLC0415

    from kvtool.bench.common import BenchRow, device_name  # noqa: PLC0415
    from kvtool.workflows.decode import DecodeOptions, run_decode  # noqa: PLC0415

    marks: dict[str, float] = {}

    def on_event(ev) -> None:
        marks.setdefault(f"{ev.phase} start", time.perf_counter())
        marks[f"{ev.phase} end"] = time.perf_counter()
        if progress and ev.done == ev.total:
            progress(f"{ev.phase} done")

    t_cpu0, t0 = os.times(), time.perf_counter()
    report = run_decode(DecodeOptions(kv=["nvfp4"], index=["fp4"], device=device, **overrides), progress=on_event,
                        warn=lambda m: None)
    t1, t_cpu1 = time.perf_counter(), os.times()
    user, sys_ = t_cpu1.user - t_cpu0.user, t_cpu1.system - t_cpu0.system
    first_tf = marks.get("teacher-forced start", t0)
    tf_end = marks.get("teacher-forced end", first_tf)
    gen_end = marks.get("generate end", tf_end)
    timed_end = marks.get("timed steps end", gen_end)
    # the first progress event comes after the first chunk: the load span includes it (a few % of the run)
    phases = [("model load + first chunk", first_tf - t0), ("teacher-forced", tf_end - first_tf),
              ("free run (lockstep)", gen_end - tf_end), ("timed steps", timed_end - gen_end),
              ("report (bootstrap, statistics)", t1 - timed_end), ("whole run", t1 - t0)]
    rows = [BenchRow("demo", name, 1e6 * s, 0, 0.0, 0.0) for name, s in phases]
    cand = report.candidates[0]
    wall = t1 - t0
    extra = {
        "setup": {"command": "kvtool decode --kv nvfp4 --index fp4", "tokens": report.tokens,
                  "gen_tokens": report.gen_tokens, "floor": report.floor is not None, "threads":
                  torch.get_num_threads(), "cpus": os.cpu_count()},
        "wall_s": wall, "cpu_user_s": user, "cpu_sys_s": sys_, "cpu_s": user + sys_,
        "tokens_per_s": {cand.label: cand.tokens_per_s, "bf16 dense (plain)": report.bf16_dense_tokens_per_s},
        "goals": [f"default demo wall {wall:.1f} s (CPU {user + sys_:.1f} s): "
                  f"{'met' if wall <= DEMO_GOAL_S else 'NOT met'} (goal <= {DEMO_GOAL_S:.0f} s)"],
        "notes": [f"KL {cand.overall.kl_mean:.4f}, top-1 {cand.overall.top1_pct:.1f} % (the demo's own numbers)"],
    }
    return BenchReport("the default kvtool decode, end to end", device_name(device), torch.__version__, "-",
                       time.strftime("%Y-%m-%d %H:%M:%S"), 0.0, rows, extra)


def render_demo(report: BenchReport, console) -> None:
    x = report.extra
    console.print(f"  wall {x['wall_s']:.1f} s, CPU {x['cpu_s']:.1f} s (user {x['cpu_user_s']:.1f}, sys "
                  f"{x['cpu_sys_s']:.1f}), {x['setup']['threads']} torch threads on {x['setup']['cpus']} CPUs")
    for name, tps in x["tokens_per_s"].items():
        console.print(f"  {name}: {tps:,.1f} tok/s" if tps else f"  {name}: -")
    for line in x["goals"] + x["notes"]:
        console.print(f"  goal: {line}" if "goal" in line else f"  note: {line}", markup=False)
