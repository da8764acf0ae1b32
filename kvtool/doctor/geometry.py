"""Which geometry (format, page size, heads, head dim) reads an engine dump as a real cache? Every candidate whose
byte count fits the file is read through kvtool.layouts and scored for plausibility (kvtool.layouts.check_plausible
plus the code / scale statistics below); the declared geometry is compared with the best.

Score (lower is more plausible; a true reading scores ~0): the share of scales that are NaN / negative / spread over
an implausible range, of non-zero blocks whose largest code no scale rule of the format gives (a block scaled from
its own amax tops out near the element max), of groups whose codes and scale disagree on being zero, plus a small
term for how little consecutive tokens of a head look alike ((1 - coherence) / 20, a tie-breaker), plus 0.02 per
kvtool.layouts.check_plausible warning.
"""

from __future__ import annotations

import itertools

import torch

import kvtool.doctor.stats as stats
from kvtool.doctor.detectors import MX_MAX_CODES, coherence
from kvtool.doctor.report import CandidateFit
from kvtool.doctor.subjects import Subject
from kvtool.errors import KvtoolError, LayoutError
from kvtool.formats import E4M3, get_format
from kvtool.layouts import check_plausible, get_preset, load_dump, make_geometry, parse_geometry, read_layout_all
from kvtool.layouts.engine import resolve_format

__all__ = [
    "CHANGED_KEY_COST", "DIMS", "FP4_MAX_CODES", "FP8_ROW_TOPS", "HEADS", "KEYS", "MAX_CANDIDATES", "PAGES",
    "candidates", "plausibility", "rank", "read_declared"
]

PAGES = (1, 16, 32, 64, 128, 256)
HEADS = (1, 2, 4, 8, 16, 32, 64)
DIMS = (64, 128, 256, 512)
MAX_CANDIDATES = 48
KEYS = ("format", "page", "heads", "dim", "tokens")
CHANGED_KEY_COST = 0.02
# Largest E2M1 code of a block scaled from its own amax, per block-scale element (any rule / recipe): an E4M3 scale
# is amax / 6 rounded (4 or 6), an E8M0 one a power of two under one of the MX rules.
FP4_MAX_CODES = {"e4m3": (4.0, 6.0), "e8m0": tuple(sorted({c for cs in MX_MAX_CODES.values() for c in cs}))}
# fp8 token: a row scaled from its amax tops out at 448 (0x7E; 0x7F for an E4M3FNUZ writer); ds-floor rows a bit less
FP8_ROW_TOPS = (0x7D, 0x7E, 0x7F)


def _labels(preset, given: dict) -> list[str]:
    if "format" in given:
        return [given["format"]]
    out = []
    for fam in preset.families:
        out.append(get_format(fam).label if fam != "fp8" else "fp8")
        if fam == "fp8":
            out += ["fp8-token", "fp8-ds"]
    if preset.default_format and preset.default_format not in out:
        out.insert(0, preset.default_format)
    return out


def candidates(path, layout: str, geometry: "str | None") -> tuple[dict, list[dict]]:
    """(given keys, candidate geometry dicts whose byte count fits the file), fewest keys changed first."""
    preset = get_preset(layout)
    given = parse_geometry(geometry)
    dump = load_dump(path)
    total = dump.nbytes
    out = []
    pages = (preset.page_size,) if preset.page_fixed else PAGES
    for label, page, heads, dim in itertools.product(_labels(preset, given), pages, HEADS, DIMS):
        try:
            fmt = resolve_format(preset, label)
            geo = make_geometry(preset, fmt, page, heads, dim, 0)
        except KvtoolError:
            continue
        per_page = sum(geo.region_page_bytes(r) for r in preset.regions)
        if not per_page or total % per_page:
            continue
        n_pages = total // per_page
        tokens = given.get("tokens", n_pages * page)
        if -(-tokens // page) != n_pages or tokens < 1:
            continue
        cand = {"format": label, "page": page, "heads": heads, "dim": dim, "tokens": tokens}
        cand.update({k: v for k, v in given.items() if k not in cand})
        out.append(cand)
    out.sort(key=lambda c: sum(1 for k in KEYS if k in given and given[k] != c[k]))
    return given, out[:MAX_CANDIDATES]


def _text(geo: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in geo.items())


def plausibility(tensors: dict, geometries: dict | None = None) -> tuple[float, dict]:
    """(score, detail) of {name: QTensor} read with one geometry (see the module docstring)."""
    detail: dict = {"warnings": len(check_plausible(tensors))}
    score = 0.0
    for name, q in tensors.items():
        s = Subject(name, "layout", q=q, geometry=(geometries or {}).get(name))
        terms = {}
        if q.scales is not None and q.scales.dim() > 0 and q.scales.numel() > 1:
            sc = stats.sample_rows(s.scale_rows(), s.heads)
            if q.fmt.scale_element == "e8m0":
                b = sc.view(torch.uint8)
                live = b[(b != 0)]
                med = float(live.float().median()) if live.numel() else 127.0
                terms["scales"] = float(((b == 0xFF) | ((b != 0) & ((b.float() - med).abs() > 20))).float().mean())
            elif q.fmt.scale_element == "e4m3":
                b = sc.view(torch.uint8)
                terms["scales"] = float((((b & 0x80) != 0) | ((b & 0x7F) == 0x7F)).float().mean())
            else:
                f = sc.float()
                good = torch.isfinite(f) & (f > 0)
                lg = torch.log2(torch.where(good, f, 1.0))
                med = float(lg[good].median()) if bool(good.any()) else 0.0
                terms["scales"] = float((~good | ((lg - med).abs() > 30)).float().mean())
        if q.fmt.is_quantized:
            codes = stats.sample_rows(stats.element_codes(s), s.heads)
            if q.fmt.element is E4M3:
                low = codes & 0x7F
                # NaN under one fp8 element or the other: E4M3FN or E4M3FNUZ bytes (which one is the fp8-element
                # detector's question) both read plausibly; bytes that are NaN under both are not fp8 codes
                terms["nan_codes"] = min(float((low == 0x7F).float().mean()), float((codes == 0x80).float().mean())) * 10
                if q.fmt.scale_element == "fp32-row":
                    tops = low.amax(-1)
                    live = tops > 0
                    terms["row_tops"] = float((~torch.isin(tops[live], torch.tensor(FP8_ROW_TOPS))).float().mean()) \
                        if bool(live.any()) else 0.0
            else:
                gmax = stats.grouped(stats.magnitude_of_codes(s, codes), q.fmt.block).amax(-1)
                live = gmax > 0
                terms["block_tops"] = float((~torch.isin(gmax[live], torch.tensor(FP4_MAX_CODES[q.fmt.scale_element])))
                                            .float().mean()) if bool(live.any()) else 0.0
                b = stats.sample_rows(s.scale_rows(), s.heads).view(torch.uint8)
                terms["pairing"] = float(((~live & (b != 0)) | (live & (b == 0))).float().mean())
        else:  # bf16: the payload is the values
            x = q.payload.float()
            lo, hi, n = stats.log2_spread(x)
            terms["nonfinite"] = float((~torch.isfinite(x)).float().mean()) * 10
            terms["spread"] = 0.0 if hi - lo <= 40 else 1.0
        x = q.dequantize().reshape(s.rows, s.dim)[: 1024 * s.heads]  # the first 1024 tokens are plenty
        terms["incoherence"] = (1.0 - max(0.0, coherence(x, s.heads))) / 20
        detail[name] = {k: round(v, 4) for k, v in terms.items()}
        score += sum(terms.values())
    score = score / max(len(tensors), 1) + 0.02 * detail["warnings"]
    return round(score, 4), detail


def rank(path, layout: str, geometry: "str | None") -> tuple[list[CandidateFit], dict, dict]:
    """Candidates ranked best first, the given keys, and {geometry text: LayoutRead} of the readings scored."""
    given, cands = candidates(path, layout, geometry)
    fits, reads = [], {}
    for cand in cands:
        try:
            read = read_layout_all(path, layout, cand)
        except KvtoolError:
            continue
        if not read.tensors:
            continue
        score, detail = plausibility(read.tensors, read.geometries)
        # among readings the bytes cannot tell apart (planes aligned, tokens / heads renumbered), the one closest
        # to what the user said wins: each given key changed costs CHANGED_KEY_COST
        changed = [k for k in KEYS if k in given and str(given[k]) != str(cand[k])]
        detail["changed_keys"] = changed
        text = _text({k: cand[k] for k in KEYS})
        reads[text] = read
        fits.append(CandidateFit(text, round(score + CHANGED_KEY_COST * len(changed), 4), detail))
    fits.sort(key=lambda f: f.score)  # stable: among equals, fewest keys changed from the given geometry first
    return fits, given, reads


def read_declared(path, layout: str, geometry: "str | None"):
    """The dump read with the declared geometry, or the LayoutError that says why it does not fit."""
    try:
        return read_layout_all(path, layout, geometry), None
    except LayoutError as err:
        return None, err
