"""`diff` workflow: compare two caches tensor by tensor (matched by name), across formats, streamed.

A is the candidate, B the reference (metrics are `metric(a=A, b=B)`, SPEC section 6). Both sides are decoded to fp32
(plain files are read as they are) and compared with the value metrics (rel_l2, max_rel, max_abs, SQNR, cosine) plus
the decoded-value disagreement % (elements whose values differ).

Code metrics (SPEC section 6: scale-byte, payload-byte disagreement %) need two byte streams of the same planes:
- both sides quantized in the same family with the same plane shapes: their stored bytes are compared directly;
- one side quantized, the other plain: the plain side is RE-ENCODED with the quantized side's declared format (what
  a correct writer of that format stores for these values), and the stored bytes are compared with that. The plain
  side should be the ORIGINAL the cache was made from: a dequantized copy re-encodes to other, equally valid bytes
  (a block whose largest code is 3 re-encodes one binade down), so its byte disagreement is not a writer error.
A block is a scale block (16 / 32 elements, or a row of D for fp8 / bf16); `differing_blocks` counts blocks whose
scale or any payload byte differs.

Scale-rule diagnosis:
- `rule_blocks` (both quantized): the differing blocks when the two files DECLARE different formats (rule, recipe,
  outer scale): differences the declared rule change accounts for. When both declare the same format, it is 0 and
  every differing block is a data or writer difference.
- `rule_fit` (one side plain): for every variant of the quantized side's family with the same planes (every MXFP4
  scale rule, every NVFP4 recipe and outer scale, ..., then every engine recipe of the family, e.g.
  `mxfp4@torchao.to_mx_floor`), the % of blocks whose stored bytes that variant reproduces
  exactly from the plain values. A best fit other than the declared format means the writer used another rule than it
  declared: the silent rule mismatch that SPEC section 2 warns about.

Tensors pair by name; two files that hold one (selected) tensor each pair whatever their names; `pair` ("A=B", e.g.
`x=layers.0.k` for an engine dump's tensor against a kvtool file's) names the pairs explicitly, and then only those
are compared (names outside them are not "only in A/B"). Shapes pair when they agree as [rows, D] ([T, 1, D] vs
[T, D]). Engine dumps (`layout`) are checked for a plausible geometry: `warnings`.

Exit status (CLI): 1 when a threshold is exceeded (`max_rel_l2`, `max_abs`, `min_sqnr`, `max_scale_mismatch` in %;
a scale threshold on a tensor without comparable scale bytes also fails) or when the files' tensor names or shapes
differ; 0 otherwise. Value differences alone are a report, not a failure: `verdict` is FAIL when a check failed,
PASS when at least one threshold was given and every check held, and REPORT when no threshold was given (nothing
about the values was gated; `passed` is then true only in the sense that nothing failed).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtool.container import check_output, dtype_name, plane_specs
from kvtool.errors import InputError, KvtoolError
from kvtool.formats import Format, QTensor, all_formats, engine_formats
from kvtool.metrics import ValueAccumulator, ValueMetrics
from kvtool.readers import Entry, check_finite_rows, open_input, row_chunks, select
from kvtool.workflows.cache_ops import Progress, chunk_bytes, tensor_amax

__all__ = ["CodeDiff", "DiffReport", "METRIC_SLICE", "PLOT_SAMPLES", "TensorDiff", "diff_files"]

PLOT_SAMPLES = 200_000  # error samples kept per tensor for --plot
METRIC_SLICE = 1 << 20  # elements per metric update (bounds the fp64 temporaries)


@dataclass
class CodeDiff:
    compared: str  # stored | reencoded-a | reencoded-b (which side's bytes were re-derived from its plain values)
    format: str  # the format whose bytes are compared
    blocks: int
    differing_blocks: int
    scale_mismatch_pct: float | None  # None when the format has no scales
    payload_mismatch_pct: float
    rule_blocks: int


@dataclass
class TensorDiff:
    name: str
    shape: list[int]
    format_a: str
    format_b: str
    metrics: ValueMetrics
    value_mismatch_pct: float
    codes: CodeDiff | None
    rule_fit: dict[str, float] | None  # variant label -> % of blocks reproduced (one side plain)
    failures: list[str] = field(default_factory=list)


@dataclass
class DiffReport:
    a: str
    b: str
    tensors: list[TensorDiff]
    only_in_a: list[str]
    only_in_b: list[str]
    shape_mismatch: list[str]
    overall: ValueMetrics | None
    thresholds: dict
    failures: list[str]
    passed: bool  # no check failed (exit 0)
    verdict: str = "REPORT"  # PASS | FAIL | REPORT (no threshold given: see the module docstring)
    plot: str | None = None
    warnings: list[str] = field(default_factory=list)  # engine dumps: the layout or geometry looks wrong


def diff_files(a: Path, b: Path, *, max_rel_l2: float | None = None, max_abs: float | None = None,
               min_sqnr: float | None = None, max_scale_mismatch: float | None = None,
               include: list[str] | None = None, exclude: list[str] | None = None, chunk_mb: float = 64.0,
               layout: str | None = None, geometry: str | None = None, layout_b: str | None = None,
               geometry_b: str | None = None, plot: Path | None = None, pair: list[str] | None = None,
               progress: Progress | None = None, verify: bool = True) -> DiffReport:
    """Compare A (candidate) with B (reference), tensor by tensor; see the module docstring for every field.
    `verify` checks both files' checksums and decoded codes as they are read (kvtool.readers)."""
    thresholds = {"max_rel_l2": max_rel_l2, "max_abs": max_abs, "min_sqnr": min_sqnr,
                  "max_scale_mismatch": max_scale_mismatch}
    if plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise KvtoolError("--plot needs matplotlib: pip install 'kvtool[plot]' (or matplotlib)")
        plot = check_output(plot, [a, b])
    chunk = chunk_bytes(chunk_mb)
    with open_input(a, layout, geometry, verify=verify) as fa, open_input(b, layout_b, geometry_b, verify=verify) as fb:
        names_a = select(list(fa.entries), include, exclude)
        names_b = select(list(fb.entries), include, exclude)
        if pair:
            pairs = _explicit_pairs(pair, list(fa.entries), list(fb.entries))
            only_a, only_b = [], []
        else:
            pairs = [(n, n) for n in names_a if n in names_b]
            if not pairs and len(names_a) == 1 and len(names_b) == 1:
                pairs = [(names_a[0], names_b[0])]  # two single-tensor files (e.g. .npy vs an engine dump's `x`)
            only_a = [n for n in names_a if n not in {p[0] for p in pairs}]
            only_b = [n for n in names_b if n not in {p[1] for p in pairs}]
        if not pairs:
            raise InputError(f"{a} and {b} share no tensor names (A: {', '.join(names_a[:5]) or 'none selected'}; "
                             f"B: {', '.join(names_b[:5]) or 'none selected'}); pair them with --pair A_NAME=B_NAME")
        report = DiffReport(str(a), str(b), [], only_a, only_b, [], None, thresholds, [], True)
        report.warnings = [w for na, nb in pairs for w in fa.warnings.get(na, []) + fb.warnings.get(nb, [])]
        overall = ValueAccumulator()
        samples: dict[str, torch.Tensor] = {}
        total = sum(fa.entries[n].rows for n, _ in pairs)
        done = 0
        for name, name_b in pairs:
            ea, eb = fa.entries[name], fb.entries[name_b]
            if (ea.rows, ea.dim) != (eb.rows, eb.dim):  # [T, 1, D] and [T, D] compare row for row
                report.shape_mismatch.append(f"{name}: A {list(ea.shape)} vs B {list(eb.shape)}")
                continue
            td, sample = _diff_tensor(ea, eb, chunk, overall)
            _check_thresholds(td, thresholds)
            report.tensors.append(td)
            samples[name] = sample
            done += ea.rows
            if progress:
                progress(done, total, name)
    report.overall = overall.result() if overall.numel else None
    report.failures = [f"{t.name}: {f}" for t in report.tensors for f in t.failures]
    report.failures += [f"only in A: {n}" for n in only_a] + [f"only in B: {n}" for n in only_b]
    report.failures += [f"shape differs: {s}" for s in report.shape_mismatch]
    report.passed = not report.failures
    gated = any(v is not None for v in thresholds.values())
    report.verdict = "FAIL" if report.failures else ("PASS" if gated else "REPORT")
    if plot is not None and samples:
        _plot(samples, plot, f"{Path(a).name} vs {Path(b).name} (reference)")
        report.plot = str(plot)
    return report


def _explicit_pairs(pair: list[str], names_a: list[str], names_b: list[str]) -> list[tuple[str, str]]:
    """--pair "A=B" items as (name in A, name in B); InputError naming the tensors of each side on a bad one."""
    out = []
    for item in pair:
        na, sep, nb = (part.strip() for part in item.partition("="))
        if not sep or not na or not nb:
            raise InputError(f"--pair {item!r} is not A_NAME=B_NAME")
        for name, names, side in ((na, names_a, "A"), (nb, names_b, "B")):
            if name not in names:
                raise InputError(f"--pair {item}: {side} has no tensor {name!r} (it holds: {', '.join(names[:8])})")
        out.append((na, nb))
    return out


def _label(e: Entry) -> str:
    return e.fmt.label if e.quantized else f"{dtype_name(e.dtype)} plain"


def _diff_tensor(ea: Entry, eb: Entry, chunk: int, overall: ValueAccumulator) -> tuple[TensorDiff, torch.Tensor]:
    acc = ValueAccumulator()
    unequal = 0
    codes = _CodeCounter.for_pair(ea, eb, chunk)
    stride = max(1, ea.numel // PLOT_SAMPLES)
    samples = []
    for r0, r1 in row_chunks(ea.rows, ea.dim, chunk):
        xa, xb = ea.read(r0, r1), eb.read(r0, r1)
        for e, x in ((ea, xa), (eb, xb)):
            if not e.quantized:
                check_finite_rows(x, e.name, e.shape, r0)
        xa, xb = xa.double().reshape(-1), xb.double().reshape(-1)
        for s in range(0, xa.numel(), METRIC_SLICE):
            acc.update(xa[s:s + METRIC_SLICE], xb[s:s + METRIC_SLICE])
            overall.update(xa[s:s + METRIC_SLICE], xb[s:s + METRIC_SLICE])
        unequal += int((xa != xb).sum())
        first = (-(r0 * ea.dim)) % stride  # global positions that are multiples of `stride`
        samples.append((xa[first::stride] - xb[first::stride]).float())
        if codes is not None:
            codes.update(ea, eb, r0, r1)
    metrics = acc.result()
    name = ea.name if ea.name == eb.name else f"{ea.name}~{eb.name}"
    td = TensorDiff(name, list(ea.shape), _label(ea), _label(eb), metrics,
                    round(100 * unequal / max(ea.numel, 1), 6), codes.result() if codes else None,
                    codes.rule_fit() if codes else None)
    return td, torch.cat(samples) if samples else torch.zeros(0)


def _check_thresholds(td: TensorDiff, t: dict) -> None:
    m = td.metrics
    if t["max_rel_l2"] is not None and not m.rel_l2 <= t["max_rel_l2"]:
        td.failures.append(f"rel_l2 {m.rel_l2:.4g} > {t['max_rel_l2']:g}")
    if t["max_abs"] is not None and not m.max_abs <= t["max_abs"]:
        td.failures.append(f"max_abs {m.max_abs:.4g} > {t['max_abs']:g}")
    if t["min_sqnr"] is not None and not m.sqnr_db >= t["min_sqnr"]:
        td.failures.append(f"sqnr {m.sqnr_db:.4g} dB < {t['min_sqnr']:g} dB")
    if t["max_scale_mismatch"] is not None:
        pct = td.codes.scale_mismatch_pct if td.codes else None
        if pct is None:
            td.failures.append(f"scale bytes not comparable ({td.format_a} vs {td.format_b})")
        elif pct > t["max_scale_mismatch"]:
            td.failures.append(f"scale-byte mismatch {pct:.4g}% > {t['max_scale_mismatch']:g}%")


# ------------------------------------------------------------------------------------------------ code compare
def _same_planes(f1: Format, f2: Format, shape: tuple[int, ...]) -> bool:
    return f1.same_codecs(f2) and plane_specs(f1, shape) == plane_specs(f2, shape)


class _CodeCounter:
    """Streams the byte comparison of one tensor pair (see the module docstring)."""

    def __init__(self, fmt: Format, compared: str, rule_differs: bool, plain: Entry | None, variants: list[Format],
                 chunk: int):
        self.fmt, self.compared, self.rule_differs = fmt, compared, rule_differs
        self.amax = tensor_amax(plain, chunk) if plain is not None and any(
            v.needs_tensor_amax for v in [fmt, *variants]) else None
        self.variants = variants
        self.counts = {"blocks": 0, "diff_blocks": 0, "scales": 0, "diff_scales": 0, "payload": 0, "diff_payload": 0}
        self.fit = {v.label: 0 for v in variants}
        self.scalar_seen = False

    @classmethod
    def for_pair(cls, ea: Entry, eb: Entry, chunk: int) -> "_CodeCounter | None":
        if ea.quantized and eb.quantized:
            if not _same_planes(ea.fmt, eb.fmt, ea.shape):
                return None
            return cls(ea.fmt, "stored", ea.fmt.label != eb.fmt.label, None, [], chunk)
        if ea.quantized != eb.quantized:
            q, p = (ea, eb) if ea.quantized else (eb, ea)
            if not p.floating:
                return None
            variants = [v for v in all_formats() + engine_formats() if _same_planes(v, q.fmt, q.shape)]
            return cls(q.fmt, "reencoded-b" if ea.quantized else "reencoded-a", False, p, variants, chunk)
        return None

    def _bytes(self, e: Entry, other: Entry, r0: int, r1: int, fmt: Format) -> QTensor:
        if e.quantized:
            return e.read_q(r0, r1)
        return fmt.quantize(e.read(r0, r1), tensor_amax=self.amax, name=e.name, check_finite=False)

    def update(self, ea: Entry, eb: Entry, r0: int, r1: int) -> None:
        qa, qb = self._bytes(ea, eb, r0, r1, self.fmt), self._bytes(eb, ea, r0, r1, self.fmt)
        blk, sdiff, nscale, pdiff, npay = _compare_blocks(qa, qb)
        if qa.scales is not None and (qa.scales.dim() > 0 or not self.scalar_seen):  # a tensor-wide scale counts once
            self.counts["scales"] += nscale
            self.counts["diff_scales"] += sdiff
            self.scalar_seen = True
        self.counts["blocks"] += blk.numel()
        self.counts["diff_blocks"] += int(blk.sum())
        self.counts["payload"] += npay
        self.counts["diff_payload"] += pdiff
        if self.variants:
            stored, plain = (ea, eb) if ea.quantized else (eb, ea)
            q_stored = stored.read_q(r0, r1)
            x = plain.read(r0, r1)
            for v in self.variants:
                qv = v.quantize(x, tensor_amax=self.amax, name=plain.name, check_finite=False)
                self.fit[v.label] += int((~_compare_blocks(q_stored, qv)[0]).sum())

    def result(self) -> CodeDiff:
        c = self.counts
        scale_pct = round(100 * c["diff_scales"] / c["scales"], 6) if c["scales"] else (
            None if self.fmt.scale_element == "none" else 0.0)
        return CodeDiff(self.compared, self.fmt.label, c["blocks"], c["diff_blocks"], scale_pct,
                        round(100 * c["diff_payload"] / max(c["payload"], 1), 6),
                        c["diff_blocks"] if self.rule_differs else 0)

    def rule_fit(self) -> dict[str, float] | None:
        if not self.variants:
            return None
        n = max(self.counts["blocks"], 1)
        ranked = sorted(self.fit.items(), key=lambda kv: (-kv[1], kv[0] != self.fmt.label))  # declared wins ties
        return {k: round(100 * v / n, 4) for k, v in ranked}


def _compare_blocks(qa: QTensor, qb: QTensor) -> tuple[torch.Tensor, int, int, int, int]:
    """Byte comparison of two QTensors with the same planes ([n, ...] rows). Returns (differing blocks [n, G] bool,
    differing scales, scales compared, differing payload bytes, payload bytes compared). A tensor-wide scale is one
    scale (compared once per call) that every block of the call depends on."""
    n = qa.payload.shape[0]
    pdiff = _bytes_of(qa.payload, n) != _bytes_of(qb.payload, n)  # [n, payload bytes per row]
    groups, sdiff, sdiff_count, nscale = 1, None, 0, 0
    if qa.scales is not None and qa.scales.dim() == 0:
        sdiff = bool((_bytes_of(qa.scales, 1) != _bytes_of(qb.scales, 1)).any())
        sdiff_count, nscale = int(sdiff), 1
    elif qa.scales is not None:
        sa, sb = qa.scales.reshape(n, -1), qb.scales.reshape(n, -1)
        groups = sa.shape[1]
        item = sa.element_size()
        sdiff = (_bytes_of(sa, n).reshape(n, groups, item) != _bytes_of(sb, n).reshape(n, groups, item)).any(-1)
        sdiff_count, nscale = int(sdiff.sum()), sa.numel()
    blk = pdiff.reshape(n, groups, -1).any(-1)
    if sdiff is not None:
        blk = blk | sdiff
    return blk, sdiff_count, nscale, int(pdiff.sum()), pdiff.numel()


def _bytes_of(t: torch.Tensor, n: int) -> torch.Tensor:
    """The raw bytes of `t` as uint8 [n, bytes per row] (bit-exact comparison: -0 != +0, NaN == same NaN)."""
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(n, -1)


# ------------------------------------------------------------------------------------------------ plot
def _plot(samples: dict[str, torch.Tensor], path: Path, title: str) -> None:
    """Histograms of sampled errors (A - B) per tensor, on a log |error| axis (exact matches counted in the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtool.container import AtomicFile

    names = list(samples)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        err = samples[name].abs()
        nz = err[err > 0]
        if nz.numel():
            ax.hist(torch.log10(nz).numpy(), bins=60, color="tab:blue")
        ax.set_title(f"{name}\n{100 * (1 - nz.numel() / max(err.numel(), 1)):.1f}% exact", fontsize=9)
        ax.set_xlabel("log10 |A - B|", fontsize=8)
        ax.set_ylabel(f"elements (of {err.numel():,} sampled)", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with AtomicFile(path) as out:
        with open(out.fd, "wb", closefd=False) as f:
            fig.savefig(f, format="png", dpi=110)
        out.commit()
    plt.close(fig)
