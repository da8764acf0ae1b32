"""`examine`: read an input, run every registered detector on every tensor, rank geometries of engine dumps, and
with a reference pin down the transformation that made the dump."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import kvtool.doctor.geometry as geo_rank
from kvtool.doctor.detectors import DETECTORS, ELEMENT_FOUND, Context
from kvtool.doctor.reference import compare, pair_reference, reference_values
from kvtool.doctor.report import DoctorReport, Finding
from kvtool.doctor.subjects import Subject, load_subjects
from kvtool.errors import InputError, LayoutError

__all__ = ["FP8_ELEMENTS", "GEOMETRY_MARGIN", "PLAUSIBLE_SCORE", "TOPK_ORDERS", "examine"]

FP8_ELEMENTS = ("fn", "fnuz")
TOPK_ORDERS = ("ascending", "descending", "any")
# A declared geometry is wrong when the best reading scores at least this much better (and is itself plausible).
GEOMETRY_MARGIN = 0.15
PLAUSIBLE_SCORE = 0.12


def _layout_subjects(path, layout: str, geometry, fp8_element: str, report: DoctorReport) -> list[Subject]:
    """Read an engine dump with the declared geometry; rank the candidate geometries and, when the declared one does
    not fit or is far less plausible than the best, report wrong-geometry and read the dump with the best."""
    read, err = geo_rank.read_declared(path, layout, geometry)
    if read is not None and read.kvtool:
        return [Subject(n, "kvtool", q=q, fp8_element=fp8_element) for n, q in read.tensors.items()]
    given = geo_rank.parse_geometry(geometry)
    preset = geo_rank.get_preset(layout)
    # tokens default to every slot of every page, and a fixed page size is no choice: neither needs ranking
    needed = [k for k in ("format", "page", "heads", "dim") if not (k == "page" and preset.page_fixed)]
    if read is not None and all(k in given for k in needed):
        declared_score, _ = geo_rank.plausibility(read.tensors, read.geometries)
        if declared_score <= PLAUSIBLE_SCORE:  # complete and plausible: nothing to rank
            return [Subject(n, f"layout:{layout}", q=q, fp8_element=fp8_element, geometry=read.geometries.get(n))
                    for n, q in read.tensors.items()]
    fits, given, reads = geo_rank.rank(path, layout, geometry)
    report.candidates["geometry"] = fits[:8]
    best = fits[0] if fits else None
    if read is None and (best is None or best.score > PLAUSIBLE_SCORE):
        raise err
    declared = None
    if read is not None:
        declared_score, detail = geo_rank.plausibility(read.tensors, read.geometries)
        declared = next(iter(read.geometries.values())).text()
    name = Path(path).name  # geometry findings are about the whole dump
    ranking = [{"geometry": f.what, "score": f.score} for f in fits[:5]]
    if read is None and not best.detail.get("changed_keys"):
        # the given keys were not enough to read the dump (no format, say): the best reading keeps all of them
        report.findings.append(Finding(
            "geometry-inferred", "info", name, f"{err}; read as {best.what}, the most plausible reading that keeps "
            f"every given key (score {best.score})", f"pass --geometry {best.what} to pin it",
            evidence={"declared": geometry, "best": best.what, "ranking": ranking}))
        read = reads[best.what]
    elif read is None:
        report.findings.append(Finding(
            "wrong-geometry", "error", name, f"the declared geometry does not fit the file ({err}); the most "
            f"plausible reading is {best.what} (score {best.score})", f"read with --geometry {best.what}",
            evidence={"declared": geometry, "best": best.what, "ranking": ranking}))
        read = reads[best.what]
    elif best is not None and best.score <= PLAUSIBLE_SCORE and declared_score - best.score >= GEOMETRY_MARGIN:
        report.findings.append(Finding(
            "wrong-geometry", "error", name, f"the declared geometry {declared} reads an implausible cache (score "
            f"{declared_score}); {best.what} reads a plausible one (score {best.score})",
            f"read with --geometry {best.what}", evidence={"declared": declared, "declared_score": declared_score,
                                                           "declared_detail": detail, "best": best.what,
                                                           "ranking": ranking}))
        read = reads[best.what]
    elif missing := [k for k in needed if k not in given]:
        rank_of = next((i for i, f in enumerate(fits) if f.what == declared), None)
        where = "the most plausible" if rank_of == 0 else f"most plausible: {fits[0].what}"
        report.findings.append(Finding(
            "geometry-inferred", "info", name, f"{', '.join(missing)} not given: read as {declared} ({where} of "
            f"{len(fits)} geometries that fit the size; score {declared_score})",
            f"pass --geometry {declared} to pin it", evidence={"declared": declared, "ranking": ranking}))
    return [Subject(n, f"layout:{layout}", q=q, fp8_element=fp8_element,
                    geometry=read.geometries.get(n)) for n, q in read.tensors.items()]


def examine(source, layout: str | None = None, geometry: "str | dict | None" = None, reference=None, *,
            reference_layout: str | None = None, reference_geometry: "str | dict | None" = None,
            fp8_element: str = "fn", topk_order: str = "ascending", topk_block: int = 128, page: int = 16,
            include=None, exclude=None) -> DoctorReport:
    """Diagnose a cache. `source`: a path (kvtool cache file, plain safetensors, .pt, .npy, or an engine dump with
    `layout` / `geometry`), a {name: tensor | QTensor} mapping or one tensor. `reference`: the unquantized original
    (or the engine's expected output), same kinds, paired with the dump's tensors by name (or one to one).
    `fp8_element`: how the reader decodes fp8 bytes (fn: E4M3FN, fnuz: E4M3FNUZ as on MI300; .pt fp8 dtypes say it
    themselves). `topk_order` / `topk_block`: what the consumer of a top-k id tensor needs; `page`: tokens per page
    for the stale-page check when no geometry gives one. Returns a DoctorReport (findings sorted: errors first)."""
    if fp8_element not in FP8_ELEMENTS:
        raise InputError(f"unknown fp8 element {fp8_element!r} (choose {'|'.join(FP8_ELEMENTS)})")
    if topk_order not in TOPK_ORDERS:
        raise InputError(f"unknown top-k order {topk_order!r} (choose {'|'.join(TOPK_ORDERS)})")
    if topk_block < 1 or page < 1:
        raise InputError("--topk-block and --page must be positive")
    from kvtool.readers import select

    if layout is not None:
        if not isinstance(source, (str, Path)):
            raise InputError("--layout reads a file: pass a path")
        report = DoctorReport(str(source), f"layout:{layout}")
        subjects = _layout_subjects(source, layout, geometry, fp8_element, report)
    else:
        if geometry:
            raise LayoutError("--geometry needs --layout (a kvtool / safetensors / .pt / .npy file describes itself)")
        path, kind, subjects, _ = load_subjects(source, fp8_element=fp8_element if fp8_element != "fn" else None)
        report = DoctorReport(path, kind)
    keep = set(select([s.name for s in subjects], include, exclude))
    subjects = [s for s in subjects if s.name in keep]
    by_name = {s.name: s for s in subjects}
    ctx = Context(by_name, topk_order=topk_order, topk_block=topk_block, page=page)
    for s in subjects:
        report.tensors.append(s.name)
        found = [f for det in DETECTORS if det.applies(s) for f in det.run(s, ctx)]
        element = next((ELEMENT_FOUND[f.code] for f in found if f.code in ELEMENT_FOUND), None)
        if element is not None:
            redo = [det for det in DETECTORS if det.decodes_fp8]
            dropped = {c for det in redo for c in det.codes}
            s2 = replace(s, fp8_element=element)
            found = [f for f in found if f.code not in dropped]
            found += [f for det in redo if det.applies(s2) for f in det.run(s2, ctx)]
        report.findings.extend(found)
    if reference is not None:
        report.reference = str(reference) if isinstance(reference, (str, Path)) else "<memory>"
        if reference_layout is not None:
            refs = _layout_refs(reference, reference_layout, reference_geometry)
        else:
            _, _, refs, _ = load_subjects(reference)
        pairs = pair_reference(subjects, refs)
        if not pairs:
            raise InputError(f"no tensor of the reference pairs with the dump's ({', '.join(list(by_name)[:6])}): "
                             "name them alike or give one tensor each")
        ref_values = {name: reference_values(r) for name, r in pairs.items()}
        for name, r in ref_values.items():
            s = by_name[name]
            if r.numel() != s.rows * s.dim:
                raise InputError(f"{name}: the reference has {r.numel()} elements, the dump {s.rows * s.dim}")
            partner = _partner_ref(name, ref_values)
            findings, fits = compare(s, r, partner, page)
            report.candidates[f"reference:{name}"] = fits[:6]
            report.findings.extend(findings)
    _dedupe(report)
    report.sort()
    return report


def _partner_ref(name: str, refs: dict):
    for a, b in ((".k", ".v"), (".v", ".k")):
        if name.endswith(a):
            return refs.get(name[: -len(a)] + b)
    if name in ("k", "v"):
        return refs.get("v" if name == "k" else "k")
    return None


def _layout_refs(path, layout, geometry) -> list[Subject]:
    from kvtool.layouts import read_layout

    return [Subject(n, "layout", q=q) for n, q in read_layout(path, layout, geometry).items()]


def _dedupe(report: DoctorReport) -> None:
    """One finding per (code, tensor, head): a reference-pinned finding replaces the bytes-only one of the same
    code, and the reference's verdict on a tensor removes bytes-only findings it contradicts (none when it matched)."""
    seen = {}
    for f in report.findings:
        key = (f.code, f.tensor, f.head)
        if key not in seen or (f.evidence.get("ranking") and not seen[key].evidence.get("ranking")):
            seen[key] = f
    report.findings = list(seen.values())
