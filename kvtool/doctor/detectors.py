"""The bytes-only detectors: one small function per failure class, registered in DETECTORS (data, not an if-chain).

Each detector takes a Subject (one tensor as declared) and the Context (every subject, the options) and returns
findings. A detector says nothing when its evidence is absent; thresholds are set so that clean caches of every
format give no error and no warning (tests/workflows/test_doctor_breaks.py measures the false-positive rate).
What the bytes alone cannot show (a nibble swap, a K/V swap of look-alike planes, a whole-row shift of the scale
plane, floor vs rceil on data where they give the same bytes) needs `--reference`: see kvtool.doctor.reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import kvtool.doctor.stats as stats
from kvtool.doctor.report import Finding
from kvtool.doctor.subjects import Subject, page_of
from kvtool.formats import E4M3, SCALE_UNIT_BYTE, ScaleRule, e4m3_decode

__all__ = [
    "Context", "DETECTORS", "Detector", "ELEMENT_FOUND", "HALF_CODE", "HALF_NAME", "HALF_OTHER", "MIN_COUNT",
    "MIN_SHARE", "MX_MAX_CODES", "SPREAD_OK", "UNIT_BYTES", "channel_anisotropy", "coherence", "detect_fp8_element",
    "detect_half_swap", "detect_head_major", "detect_kv_swap", "detect_mx_rule", "detect_nonfinite", "detect_pages",
    "detect_range", "detect_scale_pairing", "detect_scale_profile", "detect_topk", "detect_unit_scale", "fp8_signature",
    "head_stability", "mx_block_maxima", "row_spread", "scale_realignments"
]

# Clean caches: a detector fires only above these (each a share of the groups / elements it counts).
MIN_SHARE = 0.01  # 1 %: the least share of blocks / rows that makes a statistical finding
MIN_COUNT = 3  # and at least this many


@dataclass
class Context:
    """Options and the other subjects (pair detectors look up a tensor's K / V partner)."""

    subjects: dict
    topk_order: str = "ascending"  # ascending | descending | any
    topk_block: int = 128
    page: int = 16  # tokens per page for the stale / missing page check when no geometry says it
    notes: list = field(default_factory=list)


@dataclass(frozen=True)
class Detector:
    """One hypothesis: the codes it can report, which subjects it looks at, and the test."""

    name: str
    codes: tuple[str, ...]
    applies: Callable[[Subject], bool]
    run: Callable[[Subject, Context], list]
    decodes_fp8: bool = False  # its statistics depend on the fp8 element: rerun under the element the bytes are in


# A finding that says which fp8 element the bytes really are: the element-dependent detectors are rerun under it, so
# that (say) the clipping of an E4M3FNUZ cache is measured at FNUZ's 240, not at the NaN FN reads there.
ELEMENT_FOUND = {"fp8-fnuz-as-fn": "fnuz", "fp8-fn-as-fnuz": "fn"}


def _finding(s: Subject, code: str, severity: str, message: str, fix: str, head=None, **evidence) -> Finding:
    return Finding(code, severity, s.name, message, fix, s.layer, head, evidence)


def _is_q(fact: Callable | None = None):
    """Applies to a quantized subject whose Format has `fact` (a predicate on the Format; None: any)."""
    return lambda s: s.q is not None and (fact is None or fact(s.q.fmt))


def _quantized(fmt) -> bool:
    return fmt.is_quantized


def _e4m3_elements(fmt) -> bool:
    return fmt.element is E4M3


def _block_scaled(fmt) -> bool:
    return fmt.block > 0


def _mx_rule_option(fmt) -> bool:
    """E8M0 block scales under a rule the format names (MX: `--scale-rule`)."""
    return fmt.scale_element == "e8m0" and fmt.scale_rule is not None


# ---------------------------------------------------------------------------------------------- fp8 element
def fp8_signature(s: Subject) -> dict:
    """Counts that tell E4M3FN bytes from E4M3FNUZ bytes: codes 0x7F/0xFF (FN: NaN, FNUZ: the saturated +-240),
    0x80 (FN: -0, which FN encoders write for tiny negatives; FNUZ: NaN, never written), and per scale group the
    largest code (the FN rule puts each row's amax at 0x7E, the FNUZ rule at 0x7F)."""
    codes = stats.sample_rows(s.payload_rows(), s.heads)
    low = codes & 0x7F
    top7f = low == stats.E4M3_NAN_LOW
    neg0 = codes == stats.NEG_ZERO
    scaled = s.q.fmt.scale_element == "fp32-row"
    row_max = low.amax(-1) if codes.numel() else low.new_zeros(0)
    live = row_max > 0
    return {"codes": codes.numel(), "x7f": int(top7f.sum()), "x80": int(neg0.sum()), "scaled": scaled,
            "rows": int(live.sum()), "rows_max_7f": int((row_max[live] == 0x7F).sum()),
            "rows_max_7e": int((row_max[live] == 0x7E).sum()), "tensor_scale": s.q.fmt.scale_element == "fp32-tensor",
            "max_low": int(low.max()) if codes.numel() else 0,
            "first_7f": stats.first_index(top7f, tuple(codes.shape)),
            "first_80": stats.first_index(neg0, tuple(codes.shape))}


def _fnuz_as_fn(sig: dict) -> bool:
    """E4M3FNUZ bytes read as FN: NaN codes (the FNUZ max 240) and no -0 at all; with per-row scales the 0x7F codes
    are where the FNUZ rule puts each row's amax, with a tensor scale the tensor's amax."""
    if sig["x7f"] == 0 or sig["x80"] > 0:
        return False
    if sig["scaled"]:
        return sig["rows_max_7f"] >= max(MIN_COUNT, 0.5 * sig["rows"])
    return sig["tensor_scale"] or sig["x7f"] >= MIN_COUNT


def _fn_as_fnuz(sig: dict) -> bool:
    """E4M3FN bytes read as FNUZ: -0 codes (FNUZ's NaN), or rows (or the tensor) scaled to top out at 0x7E (448 in
    FN), where the FNUZ rule puts 0x7F."""
    if sig["x7f"] > 0:
        return False
    if sig["scaled"]:
        return sig["rows"] >= MIN_COUNT and sig["rows_max_7e"] >= 0.5 * sig["rows"]
    if sig["tensor_scale"]:
        return sig["max_low"] == 0x7E
    return sig["x80"] >= MIN_COUNT


def detect_fp8_element(s: Subject, ctx: Context) -> list:
    sig = fp8_signature(s)
    ev = {k: sig[k] for k in ("x7f", "x80", "rows_max_7f", "rows_max_7e", "rows", "codes")}
    if s.fp8_element == "fn" and _fnuz_as_fn(sig):
        return [_finding(s, "fp8-fnuz-as-fn", "error",
                         f"E4M3FNUZ bytes read as E4M3FN: {sig['x7f']} codes 0x7F/0xFF (NaN in FN, +-240 in FNUZ), "
                         f"no 0x80 (-0) among {sig['codes']} codes; values decode 2x too large",
                         "decode the cache as float8_e4m3fnuz (MI300) or convert it to E4M3FN (halve the codes' "
                         "values) before this reader", first_offset=sig["first_7f"],
                         expected="E4M3FN rule: rows top out at code 0x7E (448), NaN codes never written", **ev)]
    if s.fp8_element == "fnuz" and _fn_as_fnuz(sig):
        return [_finding(s, "fp8-fn-as-fnuz", "error",
                         f"E4M3FN bytes read as E4M3FNUZ: {sig['x80']} codes 0x80 (-0 in FN, NaN in FNUZ), "
                         f"{sig['rows_max_7e']} of {sig['rows']} rows top out at 0x7E; values decode 2x too small",
                         "decode the cache as float8_e4m3fn, or re-encode it as FNUZ for the MI300 reader",
                         first_offset=sig["first_80"], expected="E4M3FNUZ rule: rows top out at 0x7F (240), "
                         "0x80 never written", **ev)]
    return []


# -------------------------------------------------------------------------------------------- non-finite codes
def _nonfinite_scales(s: Subject):
    """(count, total, first index, what) of scales that decode to NaN / negative / 0 where the rule never writes it."""
    elem = s.q.fmt.scale_element
    sc = s.q.scales
    if sc is None:
        return None
    if elem == "e8m0":
        bad = sc.view(torch.uint8) == 0xFF
        what = "E8M0 scale bytes 0xFF (NaN)"
    elif elem == "e4m3":
        b = sc.view(torch.uint8)
        bad = ((b & 0x7F) == 0x7F) | ((b & 0x80) != 0)
        what = "E4M3 block scales NaN or negative"
    else:
        f = sc.float()
        bad = ~torch.isfinite(f) | (f <= 0)
        what = "fp32 scales NaN / Inf / <= 0 (the rule writes 1 for an all-zero row)"
    return int(bad.sum()), bad.numel(), stats.first_index(bad, tuple(bad.shape)), what


def detect_nonfinite(s: Subject, ctx: Context) -> list:
    out = []
    if s.q is not None and s.q.fmt.element is E4M3:
        sig = fp8_signature(s)
        explained = _fnuz_as_fn(sig) if s.fp8_element == "fn" else _fn_as_fnuz(sig)
        nan = sig["x7f"] if s.fp8_element == "fn" else sig["x80"]
        if nan and not explained:
            code = "0x7F/0xFF" if s.fp8_element == "fn" else "0x80"
            out.append(_finding(s, "non-finite-codes", "error", f"{nan} E4M3 NaN codes ({code}) among "
                                f"{sig['codes']}", "the writer produced NaN (non-finite input or a garbage buffer); "
                                "check the source tensor and the buffer's layout",
                                count=nan, total=sig["codes"],
                                first_offset=sig["first_7f"] if s.fp8_element == "fn" else sig["first_80"]))
    if s.q is not None and not s.q.fmt.is_quantized or s.values is not None and s.values.is_floating_point():
        v = s.q.payload if s.q is not None else s.values
        bad = ~torch.isfinite(v.float())
        n = int(bad.sum())
        if n:
            out.append(_finding(s, "non-finite-codes", "error", f"{n} NaN / Inf values among {v.numel()}",
                                "the source held NaN / Inf or the bytes are not this dtype (see fp16/bf16 findings)",
                                count=n, total=v.numel(), first_offset=stats.first_index(bad, tuple(v.shape))))
    if s.q is not None:
        res = _nonfinite_scales(s)
        if res and res[0]:
            n, total, first, what = res
            out.append(_finding(s, "non-finite-codes", "error", f"{n} of {total} {what}",
                                "garbage scale plane: check the layout / geometry (payload read as scales?) and "
                                "the writer", count=n, total=total, first_offset=first))
    return out


# ------------------------------------------------------------------------------------------------- half types
HALF_OTHER = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}
HALF_CODE = {torch.bfloat16: "fp16-as-bf16", torch.float16: "bf16-as-fp16"}
HALF_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# Real caches span ~5-25 binades between their 1st and 99th percentile magnitude. fp16 bits read as bf16 spread
# 8x wider (3 mantissa bits become exponent), bf16 bits read as fp16 squeeze into ~2 binades.
SPREAD_OK = (3.0, 40.0)


def _half_reading(bits: torch.Tensor, dtype: torch.dtype) -> dict:
    x = bits.view(dtype).float()
    lo, hi, n = stats.log2_spread(x)
    nonfinite = int((~torch.isfinite(x)).sum())
    plausible = n >= 64 and SPREAD_OK[0] <= hi - lo <= SPREAD_OK[1] and nonfinite == 0
    return {"spread_binades": round(hi - lo, 2), "p1_log2": round(lo, 2), "p99_log2": round(hi, 2),
            "nonfinite": nonfinite, "plausible": plausible, "count": n}


def detect_half_swap(s: Subject, ctx: Context) -> list:
    bits, dtype = s.half_bits()
    bits = stats.sample_rows(bits, s.heads)
    declared = _half_reading(bits, dtype)
    other_dtype = HALF_OTHER[dtype]
    other = _half_reading(bits, other_dtype)
    if declared["count"] < 64 or declared["plausible"] or not other["plausible"]:
        return []
    a, b = HALF_NAME[other_dtype], HALF_NAME[dtype]
    return [_finding(s, HALF_CODE[dtype], "error",
                     f"{a} bits read as {b}: as {b} the magnitudes span {declared['spread_binades']} binades "
                     f"(1st..99th percentile, {declared['nonfinite']} non-finite), as {a} {other['spread_binades']}",
                     f"read the buffer as {a} (the cache dtype and the model dtype differ: --kv-cache-dtype?)",
                     declared=declared, reinterpreted=other,
                     expected=f"a real cache spans {SPREAD_OK[0]:g}..{SPREAD_OK[1]:g} binades")]


# ----------------------------------------------------------------------------------------- unit-scale fallback
UNIT_BYTES = SCALE_UNIT_BYTE  # the byte of scale 1.0 per block-scale element (kvtool.formats.registry)


def detect_unit_scale(s: Subject, ctx: Context) -> list:
    elem = s.q.fmt.scale_element
    codes = stats.element_codes(s)
    block = stats.group_size(s)
    live = stats.grouped(codes & s.q.fmt.element.magnitude_mask, block).amax(-1) > 0  # non-zero groups
    if elem in UNIT_BYTES:
        sc = s.scale_rows()
        unit = sc.view(torch.uint8) == UNIT_BYTES[elem]
    elif elem == "fp32-row":
        unit = s.scale_rows().float() == 1.0
    elif elem == "fp32-tensor":
        unit = (s.q.scales.float().reshape(1, 1) == 1.0).expand(*live.shape)
    else:
        return []
    n_live = int(live.sum())
    if n_live < 4 or not bool(unit[live].all()):
        return []
    mags = stats.magnitude_of_codes(s, codes)
    top = float(stats.magnitude_of_codes(s, torch.tensor([stats.top_code(s)], dtype=torch.uint8))[0])
    sat = int((mags == top).sum())
    return [_finding(s, "unit-scale-fallback", "error",
                     f"every scale of the {n_live} non-zero {'blocks' if s.q.fmt.block else 'rows'} is exactly 1.0: "
                     f"the scales were never computed or never applied ({stats.pct(sat, mags.numel())}% of codes at "
                     "the element max)", "apply the checkpoint's k/v scales (or compute them: quantize with the "
                     "format's scale rule) instead of the unit fallback", unit_groups=n_live,
                     saturated_pct=stats.pct(sat, mags.numel()),
                     expected="scales follow each group's amax: they vary across groups")]


# ------------------------------------------------------------------------------------------ MX scale rule
# The largest element code a block can hold under each rule (E2M1 magnitudes): rceil puts the amax in (3, 6]
# (codes 3, 4, 6), floor in [4, 8) (4, 6: (6, 8) clips), even in [3.5, 7) (4, 6), ceil in (2, 4] (2, 3, 4).
MX_MAX_CODES = {ScaleRule.RCEIL: (3.0, 4.0, 6.0), ScaleRule.FLOOR: (4.0, 6.0), ScaleRule.EVEN: (4.0, 6.0),
                ScaleRule.CEIL: (2.0, 3.0, 4.0)}


def mx_block_maxima(s: Subject) -> torch.Tensor:
    """Largest |E2M1 value| of every non-zero block whose exponent is not clamped (bytes 1..254)."""
    codes = stats.sample_rows(stats.element_codes(s), s.heads)
    scales = stats.sample_rows(s.scale_rows(), s.heads).view(torch.uint8)
    gmax = stats.grouped(stats.magnitude_of_codes(s, codes), s.q.fmt.block).amax(-1)
    keep = (gmax > 0) & (scales > 0) & (scales < 254)
    return gmax[keep]


def detect_mx_rule(s: Subject, ctx: Context) -> list:
    gmax = mx_block_maxima(s)
    n = gmax.numel()
    if n < 32:
        return []
    declared = s.q.fmt.scale_rule
    if float((gmax == 6.0).float().mean()) > 0.9:  # nearly every block at the top code: clipping, not a rule
        return []
    off = {rule: int((~torch.isin(gmax, torch.tensor(codes))).sum()) for rule, codes in MX_MAX_CODES.items()}
    if off[declared] < max(MIN_COUNT, MIN_SHARE * n):
        return []
    fits = sorted((r for r in off if off[r] < max(MIN_COUNT, MIN_SHARE * n)), key=lambda r: off[r])
    hist = {f"{float(v):g}": int(c) for v, c in zip(*torch.unique(gmax, return_counts=True))}
    name = declared.name.lower()
    writer = "/".join(r.name.lower() for r in fits) or "none of floor/even/ceil/rceil"
    return [_finding(s, "scale-rule-mismatch", "error",
                     f"MX scales written under {writer}, read as {name}: {off[declared]} of {n} blocks top out at a "
                     f"code the {name} rule never gives", f"read with --scale-rule {fits[0].name.lower()}"
                     if fits else "check the writer's E8M0 rule (floor|even|ceil|rceil)",
                     blocks=n, inconsistent_blocks=off, block_max_histogram=hist, rules_that_fit=[r.name.lower()
                                                                                                  for r in fits],
                     expected={r.name.lower(): list(c) for r, c in MX_MAX_CODES.items()})]


# ----------------------------------------------------------------------------------------- clipping / flush
def _per_head(s: Subject, per_row: torch.Tensor) -> torch.Tensor:
    """Sum a per-row [rows] statistic per head -> [H]."""
    return torch.zeros(s.heads, dtype=torch.float64).index_add_(0, s.head_of_rows()[: per_row.shape[0]],
                                                                per_row.double())


def detect_range(s: Subject, ctx: Context) -> list:
    """Per head: share of elements at the element max in groups that pile up there (clipping), and share of
    groups whose largest code is at most a quarter of the element max (scales too large: flush-to-zero); against the
    format's own rates on well-scaled data (kvtool.doctor.stats.gaussian_rates) and on re-quantizing the
    dequantized values under the format's rule."""
    fmt = s.q.fmt
    codes = stats.element_codes(s)
    mags = stats.magnitude_of_codes(s, codes)
    top = float(stats.magnitude_of_codes(s, torch.tensor([stats.top_code(s)], dtype=torch.uint8))[0])
    rows, d = mags.shape
    unit = not fmt.has_local_scales
    block = fmt.block or d
    g = stats.grouped(mags, block)
    gmax = g.amax(-1)
    live = gmax > 0
    at_top = (g == top).sum(-1)
    live_rows = live.sum(-1)
    base = stats.gaussian_rates(fmt.label if not unit else "fp8-token", d)
    if unit:  # one scale for everything: elements at the max beyond the tensor amax's few are clipped data
        clip_h = _per_head(s, (mags == top).sum(-1)) / _per_head(s, torch.full((rows,), d)).clamp(min=1)
        n_head = rows // s.heads * d
        clip_limit = 0.001 if fmt.scale_element == "none" else max(0.001, 16 / max(n_head, 1))
        pile = 1
        # flush at a unit / tensor scale: the share of non-zero codes that are E4M3 subnormals (below 2^-6)
        sub = ((mags > 0) & (mags < 2.0**-6)).sum(-1)
        under_h = _per_head(s, sub) / _per_head(s, (mags > 0).sum(-1)).clamp(min=1)
        under_limit = 0.25
    else:  # a rule-scaled group holds its amax at (or next to) the top: a pile of several there is clipped data
        pile = stats.pile_min(fmt)
        clip_h = _per_head(s, ((at_top >= pile) & live).sum(-1)) / _per_head(s, live_rows).clamp(min=1)
        # 4x the rate on normal data, at most 25 points above it, and never below 15 % (rceil rarely piles on
        # normal data, but near-uniform blocks, like values, pile more)
        clip_limit = max(0.15, min(4 * base["piled_groups_pct"] / 100, base["piled_groups_pct"] / 100 + 0.25))
        under_h = _per_head(s, ((gmax <= top / 4) & live).sum(-1)) / _per_head(s, live_rows).clamp(min=1)
        under_limit = max(0.2, 3 * base["under_range_pct"] / 100)
    out = []
    requant = _requant_rates(s, top)
    for code, per_head, limit, what, fix in (
            ("clipping", clip_h, clip_limit, "elements saturated at the element max (unit / tensor scale)" if unit
             else f"scale groups with >= {pile} elements at the element max",
             "the scales are too small for the data: compute them from the amax (or apply the checkpoint's scales)"),
            ("flush-to-zero", under_h, under_limit, "non-zero codes that are E4M3 subnormals" if unit else
             "groups whose largest code is <= 1/4 of the element max",
             "the scales are too large (or the data too small for a unit scale): small values flush to zero")):
        bad = (per_head > limit).nonzero().reshape(-1).tolist()
        if not bad:
            continue
        worst = int(per_head.argmax())
        # A unit-scale cache flushes small values by the format's own rule (the M3 index cache's choice): a hint,
        # not an error; clipping at unit scale destroys values outside +-448 and always is one.
        severity = "info" if unit and code == "flush-to-zero" else "error"
        out.append(_finding(s, code, severity, f"{100 * float(per_head[worst]):.3g}% {what} (head {worst}; "
                            f"{len(bad)} of {s.heads} heads above {100 * limit:.3g}%)", fix,
                            head=worst if s.heads > 1 else None,
                            per_head_pct=[round(100 * float(v), 3) for v in per_head], heads_affected=bad,
                            limit_pct=round(100 * limit, 3), rule_rates_gaussian=base, rule_rates_requantized=requant))
    return out


def _requant_rates(s: Subject, top: float) -> dict:
    """The same two rates after re-quantizing the dequantized values under the format's own rule."""
    fmt = s.q.fmt
    if fmt.element is E4M3 and s.fp8_element != "fn":
        return {}
    x = stats.sample_rows(s.q.dequantize().reshape(s.rows, s.dim), s.heads)[:4096]
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    q2 = fmt.quantize(x, check_finite=False)
    from kvtool.doctor.subjects import Subject as _S

    s2 = _S(s.name, s.kind, q=q2)
    mags = stats.magnitude_of_codes(s2, stats.element_codes(s2))
    g = stats.grouped(mags, fmt.block or s.dim)
    gmax = g.amax(-1)
    live = gmax > 0
    return {"top_pct": stats.pct(int((mags == top).sum()), mags.numel()),
            "piled_groups_pct": stats.pct(int((((g == top).sum(-1) >= stats.pile_min(fmt)) & live).sum()),
                                          int(live.sum())),
            "under_range_pct": stats.pct(int(((gmax <= top / 4) & live).sum()), int(live.sum()))}


# ------------------------------------------------------------------------------------------ scales misaligned
def detect_scale_pairing(s: Subject, ctx: Context) -> list:
    """A scale group whose codes are all zero must carry the rule's zero-block scale (byte 0; fp32 1.0 for fp8
    token), and a group with non-zero codes a non-zero scale. Pairs that break this show a scale plane shifted
    against its payload."""
    fmt = s.q.fmt
    sc = s.scale_rows()
    if sc is None:
        return []
    codes = stats.element_codes(s)
    low = codes & fmt.element.magnitude_mask
    zero_group = stats.grouped(low, fmt.block or s.dim).amax(-1) == 0
    if fmt.scale_element == "fp32-row":
        f = sc.float()
        zero_scale_rule = f == 1.0
        odd = (zero_group & ~zero_scale_rule) | (~zero_group & (f == 0))
    else:
        b = sc.view(torch.uint8)
        odd = (zero_group & (b != 0)) | (~zero_group & (b == 0))
    n = int(odd.sum())
    if n < 1 or (n < MIN_COUNT and int(zero_group.sum()) > n * 4):
        return []
    first = stats.first_index(odd, tuple(odd.shape))
    return [_finding(s, "scales-misaligned", "error",
                     f"{n} scale groups whose scale does not match their codes (all-zero codes with a live scale, or "
                     "live codes with scale 0): the scale plane is offset from its payload",
                     "check the scale plane's stride / offset / page interleave (e.g. trtllm-nvfp4-kv vs "
                     "vllm-nvfp4-kv)", groups=n, zero_code_groups=int(zero_group.sum()), first_group=first,
                     expected="all-zero groups carry the zero scale and only they")]


def row_spread(logs: torch.Tensor, live: torch.Tensor) -> float:
    """99th percentile over tokens of the spread (max - min, binades) of a token's log2 block scales once the
    channel profile (each block's mean over tokens) is taken out: a token's blocks share its magnitude, so this is
    small for a real cache (~2 binades) and large when a row's scales come from other tokens' blocks."""
    w = live.float()
    col = (logs * w).sum(0, keepdim=True) / w.sum(0, keepdim=True).clamp(min=1)
    r = logs - col
    hi = torch.where(live, r, -torch.inf).amax(1)
    lo = torch.where(live, r, torch.inf).amin(1)
    spread = (hi - lo)[live.sum(1) > 1]
    return float(torch.quantile(spread, 0.99)) if spread.numel() else 0.0


def scale_realignments(page: int):
    """Candidate re-alignments of a per-head scale plane [tokens, S] (the declared reading first): TRT-LLM's 4-token
    interleave undone / applied per page, and byte offsets of a fraction of a row."""
    from kvtool.layouts import RULES

    out = [("declared", lambda t: t)]
    for name, rule in (("trtllm-v4 inverse", RULES["trtllm-v4"].inverse), ("trtllm-v4", RULES["trtllm-v4"].forward)):
        def fn(t, rule=rule):
            n, width = t.shape
            p = page if n % page == 0 and page % 4 == 0 else 4 if n % 4 == 0 else 0
            return rule(t.reshape(n // p, p, width)).reshape(n, width) if p else t
        out.append((name, fn))
    for k in (1, 2, 4):
        out.append((f"offset +{k} scale bytes", lambda t, k=k: t.reshape(-1).roll(-k).reshape(t.shape)))
        out.append((f"offset -{k} scale bytes", lambda t, k=k: t.reshape(-1).roll(k).reshape(t.shape)))
    return out


def detect_scale_profile(s: Subject, ctx: Context) -> list:
    """Scales of one token's blocks come from one amax profile: for block formats, rank re-alignments of the scale
    plane by the row spread (kvtool.doctor.detectors.row_spread); a re-alignment far more coherent than the declared
    one is the fix (e.g. TRT-LLM's interleaved V scales read as vLLM's linear ones)."""
    fmt = s.q.fmt
    if fmt.scale_element not in ("e4m3", "e8m0") or s.dim // fmt.block < 4:
        return []
    sc = s.scale_rows().view(torch.uint8)
    decode = e4m3_decode if fmt.scale_element == "e4m3" else (lambda b: torch.exp2(b.float() - 127))
    page = page_of(s, ctx.page)
    by: dict = {}
    for h in range(s.heads):
        per_head = sc[h:: s.heads][:4096]
        for name, fn in scale_realignments(page):
            v = decode(fn(per_head))
            live = (v > 0) & torch.isfinite(v)
            by.setdefault(name, []).append(row_spread(torch.log2(torch.where(live, v, 1.0)), live))
    mean = {name: sum(v) / len(v) for name, v in by.items()}
    best = min(mean, key=mean.get)
    if best == "declared" or mean[best] > 0.6 * mean["declared"] or mean["declared"] - mean[best] < 1.0:
        return []
    return [_finding(s, "scales-misaligned", "error",
                     f"the scale plane reads far more coherently re-aligned as '{best}' (99th-percentile spread of a "
                     f"token's block scales {mean[best]:.2f} vs {mean['declared']:.2f} binades as declared)",
                     f"re-align the scale plane ({best}): wrong stride, offset or page interleave (e.g. "
                     "trtllm-nvfp4-kv read as vllm-nvfp4-kv)",
                     row_spread_binades={k: round(v, 3) for k, v in sorted(mean.items(), key=lambda kv: kv[1])},
                     expected="a token's block scales share its magnitude: spread ~2 binades")]


# ---------------------------------------------------------------------------------------------- K / V swapped
def channel_anisotropy(x: torch.Tensor, heads: int) -> float:
    """Per head: the 99th / 50th percentile of channel RMS over tokens (median over heads). Keys carry outlier
    channels (RoPE, ~5-50x); values are near-isotropic (~1.5-2)."""
    d = x.shape[-1]
    x = x.reshape(-1, heads, d).float()
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    rms = x.pow(2).mean(0).sqrt()  # [H, D]
    q = torch.quantile(rms, torch.tensor([0.5, 0.99]), dim=-1)
    return float((q[1] / q[0].clamp(min=1e-30)).median())


def _values_of(s: Subject) -> torch.Tensor:
    if s.q is not None:
        return stats.sample_rows(s.q.dequantize().reshape(s.rows, s.dim), s.heads)
    return stats.sample_rows(s.values.reshape(s.rows, s.dim).float(), s.heads)


def _partner(s: Subject, ctx: Context) -> Subject | None:
    for suffix, other in ((".k", ".v"), ("k", "v")):
        if s.name.endswith(suffix):
            return ctx.subjects.get(s.name[: len(s.name) - len(suffix)] + other)
    return None


def detect_kv_swap(s: Subject, ctx: Context) -> list:
    v = _partner(s, ctx)
    if v is None or v.shape != s.shape or s.is_ids or v.is_ids:
        return []
    ak, av = channel_anisotropy(_values_of(s), s.heads), channel_anisotropy(_values_of(v), v.heads)
    if not (av > 4.0 and av > 3.0 * ak):
        return []
    return [_finding(s, "kv-swapped", "error",
                     f"{v.name} looks like keys and {s.name} like values: channel anisotropy (99th/50th percentile "
                     f"channel RMS) {av:.3g} vs {ak:.3g}", "exchange the K and V planes (buffer order or "
                     "k_cache / v_cache arguments swapped)", anisotropy={s.name: round(ak, 3), v.name: round(av, 3)},
                     expected="keys carry outlier channels (anisotropy > 4); values are near-isotropic")]


# ----------------------------------------------------------------------------------------- token vs head major
def coherence(x: torch.Tensor, heads: int) -> float:
    """Mean cosine similarity of |x| between consecutive tokens of one head (x [rows, D] token-major)."""
    d = x.shape[-1]
    a = torch.nan_to_num(x.reshape(-1, heads, d).float().abs(), nan=0.0, posinf=0.0)
    if a.shape[0] < 8:
        return 0.0
    return float(torch.nn.functional.cosine_similarity(a[1:], a[:-1], dim=-1).mean())


def head_stability(x: torch.Tensor, heads: int) -> float:
    """Mean over heads of the cosine similarity between a head's channel profile (RMS per channel) over the first
    and over the second half of the tokens: ~1 when each head keeps its own channel structure, lower when the
    'heads' of a reading are really other heads' tokens (a head-major buffer read token-major)."""
    d = x.shape[-1]
    a = torch.nan_to_num(x.reshape(-1, heads, d).float(), nan=0.0, posinf=0.0, neginf=0.0)
    n = a.shape[0] // 2
    p1, p2 = a[:n].pow(2).mean(0).sqrt(), a[n: 2 * n].pow(2).mean(0).sqrt()
    return float(torch.nn.functional.cosine_similarity(p1, p2, dim=-1).mean())


def detect_head_major(s: Subject, ctx: Context) -> list:
    """A [N, H, D] tensor whose bytes were written head-major ([H, N, D]) reads with heads and tokens interleaved:
    the first half of the 'tokens' of every head are then tokens of the first heads. Compare how stable each head's
    channel profile is in both readings."""
    n, h = s.rows // s.heads, s.heads
    if h < 2 or n < 32 or s.rows > stats.SAMPLE_ROWS:
        return []
    x = _values_of(s)
    declared = head_stability(x, h)
    transposed = head_stability(x.reshape(h, n, s.dim).transpose(0, 1).reshape(-1, s.dim), h)
    if not (transposed > 0.9 and transposed - declared > 0.1):
        return []
    return [_finding(s, "wrong-geometry", "error",
                     f"each head keeps its channel profile when the bytes are read head-major [{h}, {n}, {s.dim}] "
                     f"(stability {transposed:.3f}), not as the declared token-major [{n}, {h}, {s.dim}] "
                     f"({declared:.3f})", "the writer is head-major: transpose heads and tokens (or read with the "
                     "head-major layout)", stability={"token-major (declared)": round(declared, 4),
                                                      "head-major": round(transposed, 4)},
                     expected="a head's channel profile is the same over the first and the second half of the tokens")]


# ---------------------------------------------------------------------------------------- stale / missing pages
def _row_bytes(s: Subject) -> torch.Tensor:
    """Every byte of each row [rows, nbytes] (payload, then per-row scales) for page comparisons."""
    if s.q is not None:
        parts = [s.payload_rows()]
        sc = s.scale_rows()
        if sc is not None:
            parts.append(sc.contiguous().view(torch.uint8).reshape(s.rows, -1))
        return torch.cat(parts, 1)
    return s.values.reshape(s.rows, -1).contiguous().view(torch.uint8).reshape(s.rows, -1)


def detect_pages(s: Subject, ctx: Context) -> list:
    """Pages (P tokens, every head) that are all zero bytes (never written: the rule never writes an all-zero page of
    a scaled format, and data has no all-zero page), or byte-identical copies of another page (left over)."""
    page = page_of(s, ctx.page)
    n_tok = s.rows // s.heads
    if n_tok < 2 * page or page < 2:
        return []
    b = _row_bytes(s)
    full = n_tok // page
    pages = b[: full * page * s.heads].reshape(full, -1)
    zero = (pages == 0).all(-1)
    out = []
    nz = int(zero.sum())
    if nz and nz < full:
        idx = zero.nonzero().reshape(-1).tolist()
        out.append(_finding(s, "stale-or-missing-pages", "error",
                            f"{nz} of {full} pages ({page} tokens each) are all zero bytes: never written "
                            f"(first page {idx[0]}, tokens {idx[0] * page}..{idx[0] * page + page - 1})",
                            "the pages were never stored or never transferred (e.g. an index-K cache not sent to "
                            "the decode node): check the block table and the transfer", pages=idx[:32], page=page,
                            expected="no page of live tokens is all zero"))
    live = (~zero).nonzero().reshape(-1)
    if live.numel() > 1:
        uniq, inverse, counts = torch.unique(pages[live], dim=0, return_inverse=True, return_counts=True)
        dup = counts[inverse] > 1
        if bool(dup.any()):
            idx = live[dup].tolist()
            out.append(_finding(s, "stale-or-missing-pages", "error",
                                f"{len(idx)} pages are byte-identical copies of another page (pages {idx[:8]}): "
                                "left over from another request or a stale block table",
                                "check the block table / slot mapping for these pages", pages=idx[:32], page=page,
                                expected="distinct tokens give distinct pages"))
    return out


# ----------------------------------------------------------------------------------------------- top-k ids
def detect_topk(s: Subject, ctx: Context) -> list:
    """A top-k id tensor [..., k] (block ids per query row, -1 padding): ascending where the consumer needs it, no
    duplicates, -1 only at the end, ids inside the causal range 0..p // block of the row's query position p."""
    ids = s.values.long()
    if ids.dim() < 2 or ids.shape[-1] > 4096 or int(ids.min()) < -1:
        return []
    k = ids.shape[-1]
    rows = ids.reshape(-1, k)
    pad = rows == -1
    out = []

    def add(what, mask, fix, **ev):
        n = int(mask.sum())
        if n:
            out.append(_finding(s, "topk-contract", "error", f"{n} of {rows.shape[0]} rows: {what}", fix,
                                rows=n, first_row=int(mask.nonzero()[0]), **ev))

    add("-1 padding before a valid id", (pad[:, :-1] & ~pad[:, 1:]).any(-1),
        "pad with -1 only after the valid ids (the consumer stops at the first -1)")
    srt, _ = torch.sort(torch.where(pad, torch.iinfo(torch.int64).max, rows), dim=-1)
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != torch.iinfo(torch.int64).max)
    add("duplicate ids", dup.any(-1), "deduplicate the selection (a block attended twice doubles its weight)")
    valid_next = ~pad[:, 1:] & ~pad[:, :-1]
    if ctx.topk_order in ("ascending", "descending"):
        step = rows[:, 1:] - rows[:, :-1]
        wrong = ((step < 0) if ctx.topk_order == "ascending" else (step > 0)) & valid_next
        add(f"ids not {ctx.topk_order}", wrong.any(-1), f"sort each row's ids {ctx.topk_order} (the consumer "
            "kernel, e.g. M3's MSA, needs it)", order=ctx.topk_order)
    # causal range: the query position of a row is its token index (axis 0 of [T, ...]; rows of one token repeat).
    if ids.dim() >= 2:
        t = ids.shape[0]
        per_token = rows.shape[0] // t
        pos = torch.arange(t).repeat_interleave(per_token)
        limit = (pos // ctx.topk_block)[:, None]
        bad = ~pad & (rows > limit)
        if int(bad.sum()):
            ev = {"block": ctx.topk_block, "first_id": int(rows[bad][0])}
            if ids.dim() >= 3 and ids.shape[1] > 1:
                t2 = ids.shape[0]  # the same bytes as [heads, tokens, k]: position = row % tokens
                hm = ids.reshape(-1, k)
                pos2 = torch.arange(hm.shape[0]) % t2
                if int((~(hm == -1) & (hm > (pos2 // ctx.topk_block)[:, None])).sum()) == 0:
                    out.append(_finding(s, "wrong-geometry", "error", "top-k ids violate causality token-major "
                                        "but not head-major: written head-major, read token-major",
                                        "read the id tensor as [heads, tokens, k] (or transpose at the writer)",
                                        **ev))
                    return out
            add(f"ids outside the causal range 0..p // {ctx.topk_block}", bad.any(-1),
                "the ids are for another query position / block size (check --topk-block and the row order)", **ev)
        neg = ~pad & (rows < 0)
        add("negative ids other than -1", neg.any(-1), "garbage ids: check the dtype and layout")
    return out


# ------------------------------------------------------------------------------------------------ the table
DETECTORS: tuple[Detector, ...] = (
    Detector("non-finite", ("non-finite-codes",), lambda s: not s.is_ids, detect_nonfinite),
    Detector("fp8-element", ("fp8-fnuz-as-fn", "fp8-fn-as-fnuz"), _is_q(_e4m3_elements), detect_fp8_element),
    Detector("half-swap", ("fp16-as-bf16", "bf16-as-fp16"), lambda s: s.is_half, detect_half_swap),
    Detector("unit-scale", ("unit-scale-fallback",), _is_q(_quantized), detect_unit_scale),
    Detector("mx-rule", ("scale-rule-mismatch",), _is_q(_mx_rule_option), detect_mx_rule),
    Detector("range", ("clipping", "flush-to-zero"), _is_q(_quantized), detect_range, decodes_fp8=True),
    Detector("scale-pairing", ("scales-misaligned",), _is_q(_quantized), detect_scale_pairing),
    Detector("scale-profile", ("scales-misaligned",), _is_q(_block_scaled), detect_scale_profile),
    Detector("kv-swap", ("kv-swapped",), lambda s: not s.is_ids and s.name.endswith("k"), detect_kv_swap),
    Detector("head-major", ("wrong-geometry",), lambda s: not s.is_ids and s.geometry is None
             and (s.q is not None or s.values.is_floating_point()), detect_head_major),
    Detector("pages", ("stale-or-missing-pages",), lambda s: not s.is_ids, detect_pages),
    Detector("topk", ("topk-contract", "wrong-geometry"), lambda s: s.is_ids, detect_topk),
)
