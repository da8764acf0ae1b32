"""With a reference (the unquantized original, or the engine's expected output): which transformation turns the
reference into the dump? Each candidate in TRANSFORMS writes the reference the way one failure would (another scale
rule, the FNUZ element, swapped nibbles, K for V, head-major, scales off by a power of two or shifted against their
payload, the other half type) and the bytes are compared with the dump's; the one that matches exactly (or best) is
the finding. The declared reading ("identity") is tried first: a dump that equals it is clean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvtool.doctor.detectors import scale_realignments
from kvtool.doctor.fnuz import E4M3FNUZ_MAX, e4m3fnuz_encode
from kvtool.doctor.report import CandidateFit, Finding
from kvtool.doctor.subjects import Subject, page_of
from kvtool.formats import (
    E2M1,
    E2M1_MAX,
    E4M3,
    E8M0_BIAS,
    SCALE_UNIT_BYTE,
    Fp8Scale,
    QTensor,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    pack_nibbles,
    rule_variants,
)
from kvtool.formats.codecs import fp8_row_scale, mx_exponent
from kvtool.formats.elements import exp2_int

__all__ = ["TRANSFORMS", "Transform", "compare", "pair_reference", "reference_values"]


@dataclass(frozen=True)
class Transform:
    """One way a writer can turn the reference into the dump: `variants(subject, ref, partner_ref)` yields
    (label, predicted dump bytes) pairs; `code` is the finding when one matches (None: the declared reading)."""

    name: str
    code: "str | None"
    fix: str
    applies: Callable[[Subject], bool]
    variants: Callable


def _bytes(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload bytes, scale bytes) of a QTensor, flat uint8 (no scales: empty)."""
    p = q.payload.contiguous().view(torch.uint8).reshape(-1)
    s = q.scales.contiguous().reshape(-1).view(torch.uint8) if q.scales is not None else torch.zeros(0, dtype=torch.uint8)
    return p, s


def _dump_bytes(s: Subject) -> tuple[torch.Tensor, torch.Tensor]:
    if s.q is not None:
        return _bytes(s.q)
    return s.values.contiguous().view(torch.uint8).reshape(-1), torch.zeros(0, dtype=torch.uint8)


def _quant(fmt, ref: torch.Tensor) -> QTensor:
    return fmt.quantize(ref.float(), check_finite=False)


def _fp8_like(fmt, payload: torch.Tensor, scales, shape) -> QTensor:
    return QTensor(fmt, payload, scales, 1.0, tuple(shape))


# ---------------------------------------------------------------------------------------------- the writers
def _identity(s, ref, partner):
    if s.q is not None and s.q.fmt.element is E4M3 and s.fp8_element == "fnuz":
        yield "declared (E4M3FNUZ writer)", _bytes(_fnuz_writer(s.q.fmt, ref))
    elif s.q is not None:
        yield "declared", _bytes(_quant(s.q.fmt, ref))
    else:
        yield "declared", (ref.to(s.values.dtype).contiguous().view(torch.uint8).reshape(-1),
                           torch.zeros(0, dtype=torch.uint8))


def _other_rules(s, ref, partner):
    for other in rule_variants(s.q.fmt):
        yield _rule_name(other), _bytes(_quant(other, ref))


def _rule_name(fmt) -> str:
    """How a candidate writer is named: by the rule option that tells it apart."""
    if fmt.scale_rule is not None:
        return f"{fmt.family} scale rule {fmt.scale_rule.name.lower()}"
    if fmt.recipe is not None:
        return f"{fmt.family} recipe {fmt.recipe.name.lower()}, outer {fmt.outer_scale}"
    return f"{fmt.family} {fmt.label}"


def _unit_fallback(s, ref, partner):
    fmt = s.q.fmt
    if fmt.scale_element == "fp32-row":  # fp8 rows (E4M3 codes)
        ones = torch.ones(*ref.shape[:-1], 1)
        yield "unit codes, scales 1.0", _bytes(_fp8_like(fmt, e4m3_encode(ref.float()), ones, ref.shape))
    elif fmt.scale_element == "fp32-tensor":
        yield "unit codes, tensor scale 1.0", _bytes(_fp8_like(fmt, e4m3_encode(ref.float()), torch.tensor(1.0),
                                                                ref.shape))
    elif fmt.scale_element in SCALE_UNIT_BYTE:  # one-byte block scales over E2M1 codes
        xb = ref.float().reshape(*ref.shape[:-1], -1, fmt.block)
        payload = pack_nibbles(e2m1_encode(xb).reshape(ref.shape))
        unit = SCALE_UNIT_BYTE[fmt.scale_element]
        sc = torch.full((*ref.shape[:-1], ref.shape[-1] // fmt.block), unit, dtype=torch.uint8)
        yield "unit block scales", (payload.reshape(-1), sc.reshape(-1))


def _fnuz_writer(fmt, ref: torch.Tensor) -> QTensor:
    """The fp8 cache an E4M3FNUZ writer makes (scales from the amax onto 240)."""
    x = ref.float()
    if fmt.scale_element == "none":
        return _fp8_like(fmt, e4m3fnuz_encode(x), None, x.shape)
    amax = x.abs().amax() if fmt.scale_element == "fp32-tensor" else x.abs().amax(-1, keepdim=True)
    sc = amax / E4M3FNUZ_MAX
    sc = torch.where(sc > 0, sc, torch.ones_like(sc))
    return _fp8_like(fmt, e4m3fnuz_encode(x / sc), sc.reshape(()) if sc.dim() == 0 else sc, x.shape)


def _fp8_element(s, ref, partner):
    fmt = s.q.fmt
    if s.fp8_element == "fn":
        yield "E4M3FNUZ writer", _bytes(_fnuz_writer(fmt, ref))
    else:
        yield "E4M3FN writer", _bytes(_quant(fmt, ref))


def _nibble_swap(s, ref, partner):
    p, sc = _bytes(_quant(s.q.fmt, ref))
    yield "nibbles swapped", (((p & 0x0F) << 4) | (p >> 4), sc)


def _kv_swap(s, ref, partner):
    if partner is not None and partner.shape == ref.shape:
        if s.q is not None:
            yield "K and V exchanged", _bytes(_quant(s.q.fmt, partner))
        else:
            yield "K and V exchanged", (partner.to(s.values.dtype).contiguous().view(torch.uint8).reshape(-1),
                                        torch.zeros(0, dtype=torch.uint8))


def _head_major(s, ref, partner):
    if ref.dim() >= 3 and ref.shape[1] > 1:
        hm = ref.transpose(0, 1).contiguous().reshape(ref.shape)  # head-major bytes read token-major
        if s.q is not None:
            yield "written head-major", _bytes(_quant(s.q.fmt, hm))
        else:
            yield "written head-major", (hm.to(s.values.dtype).contiguous().view(torch.uint8).reshape(-1),
                                         torch.zeros(0, dtype=torch.uint8))


def _realigned(s, ref, partner):
    q = _quant(s.q.fmt, ref)
    if q.scales is None or q.scales.dim() == 0:
        return
    p, _ = _bytes(q)
    rows = s.rows
    sc = q.scales.contiguous().reshape(rows, -1)
    width = sc.shape[1]
    heads = s.heads
    page = page_of(s, 16)
    per_head = sc.view(torch.uint8).reshape(rows // heads, heads, -1) if sc.dtype != torch.uint8 else \
        sc.reshape(rows // heads, heads, width)
    for name, fn in scale_realignments(page)[1:]:
        moved = torch.stack([fn(per_head[:, h]) for h in range(heads)], 1)
        yield f"scales {name}", (p, moved.reshape(-1).contiguous().view(torch.uint8))
    for k in (1, -1):
        yield f"scales shifted {k:+d} token", (p, per_head.roll(k, 0).reshape(-1).contiguous().view(torch.uint8))
    flat = per_head.reshape(-1).contiguous().view(torch.uint8)
    for k in (1, 2, 3, 4, -1, -2, -3, -4):  # the whole plane (every head) offset by a few bytes: a wrong base offset
        yield f"scale plane offset {k:+d} bytes", (p, flat.roll(k))


def _scaled_by(fmt, ref: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dump a writer makes whose scales are 2^k times the rule's (k < 0 clips, k > 0 flushes)."""
    x = ref.float()
    if fmt.scale_element == "e8m0":  # MX: a power-of-two scale from the block amax under the format's rule
        xb = x.reshape(*x.shape[:-1], -1, fmt.block)
        amax = xb.abs().amax(-1, keepdim=True)
        e = (mx_exponent(amax, fmt.scale_rule) + k).clamp(-127, 127)
        zero = amax == 0
        codes = e2m1_encode((xb * exp2_int(-e)).masked_fill(zero, 0.0))
        sc = (e + E8M0_BIAS).masked_fill(zero, 0).to(torch.uint8)
        return pack_nibbles(codes.reshape(x.shape)).reshape(-1), sc.reshape(-1)
    if fmt.scale_element == "e4m3":  # NVFP4: an E4M3 scale amax / 6 per block
        xb = x.reshape(*x.shape[:-1], -1, fmt.block)
        amax = xb.abs().amax(-1, keepdim=True)
        sb = e4m3_encode(amax / E2M1_MAX * 2.0**k)
        sv = e4m3_decode(sb)
        y = torch.where(sv > 0, xb * (1.0 / torch.where(sv > 0, sv, 1.0)), 0.0)
        return pack_nibbles(e2m1_encode(y).reshape(x.shape)).reshape(-1), sb.reshape(-1)
    amax = x.abs().amax(-1, keepdim=True) if fmt.fp8_scale == Fp8Scale.TOKEN else x.abs().amax()
    sc = fp8_row_scale(amax, fmt.ds_floor, fmt.pow2) * 2.0**k
    q = _fp8_like(fmt, e4m3_encode(x / sc), sc, x.shape)
    return _bytes(q)


def _mis_scaled(s, ref, partner):
    for k in (-3, -2, -1, 1, 2, 3):
        yield f"scales x 2^{k}", _scaled_by(s.q.fmt, ref, k)


def _half_other(s, ref, partner):
    other = torch.float16 if s.values.dtype == torch.bfloat16 else torch.bfloat16
    yield f"{'fp16' if other == torch.float16 else 'bf16'} bits", (
        ref.to(other).contiguous().view(torch.uint8).reshape(-1), torch.zeros(0, dtype=torch.uint8))


def _q(fact: Callable | None = None):
    """Applies to a quantized subject whose Format has `fact` (a predicate on the Format; None: any)."""
    return lambda s: s.q is not None and (fact is None or fact(s.q.fmt))


def _quantized(fmt) -> bool:
    return fmt.is_quantized


def _e4m3_elements(fmt) -> bool:
    return fmt.element is E4M3


def _e2m1_elements(fmt) -> bool:
    return fmt.element is E2M1


def _scaled_fp8_or_fp4(s):
    # a rule-computed scale to get wrong; fp8 only under the E4M3FN element the rule targets
    return s.q is not None and s.q.fmt.is_quantized and s.q.fmt.scale_element != "none" and (
        s.q.fmt.element is not E4M3 or s.fp8_element == "fn")


TRANSFORMS: tuple[Transform, ...] = (
    Transform("identity", None, "", lambda s: s.q is not None or s.values.is_floating_point(), _identity),
    Transform("rule", "scale-rule-mismatch", "read (or write) with the writer's scale rule / recipe",
              _q(_quantized), _other_rules),
    Transform("unit-scale", "unit-scale-fallback", "apply the computed / checkpoint scales instead of 1.0",
              _q(_quantized), _unit_fallback),
    Transform("fp8-element", None, "decode with the writer's fp8 element (E4M3FN vs E4M3FNUZ)", _q(_e4m3_elements),
              _fp8_element),
    Transform("nibbles", "nibble-order-swapped", "swap the E2M1 nibbles (element 2i is the LOW nibble)",
              _q(_e2m1_elements), _nibble_swap),
    Transform("kv", "kv-swapped", "exchange the K and V planes", lambda s: not s.is_ids, _kv_swap),
    Transform("head-major", "wrong-geometry", "the writer is head-major: transpose heads and tokens",
              lambda s: not s.is_ids, _head_major),
    Transform("realign", "scales-misaligned", "re-align the scale plane with its payload", _q(_quantized),
              _realigned),
    Transform("mis-scaled", None, "compute the scales with the format's rule", _scaled_fp8_or_fp4, _mis_scaled),
    Transform("half", None, "read the buffer as the other half type", lambda s: s.values is not None and s.is_half,
              _half_other),
)


def _code_of(t: Transform, s: Subject, label: str) -> str:
    if t.name == "fp8-element":
        return "fp8-fnuz-as-fn" if s.fp8_element == "fn" else "fp8-fn-as-fnuz"
    if t.name == "mis-scaled":
        return "clipping" if "^-" in label else "flush-to-zero"
    if t.name == "half":
        return "fp16-as-bf16" if s.values.dtype == torch.bfloat16 else "bf16-as-fp16"
    return t.code


def _agreement(pred, dump) -> float:
    (pp, ps), (dp, ds) = pred, dump
    if pp.numel() != dp.numel() or ps.numel() != ds.numel():
        return -1.0
    same = int((pp == dp).sum()) + int((ps == ds).sum())
    return same / max(pp.numel() + ps.numel(), 1)


def _stale_pages(s: Subject, pred, dump, page: int) -> "list[int] | None":
    """Pages (P tokens x every head) that differ from the declared writing when all the others match exactly."""
    (pp, ps), (dp, ds) = pred, dump
    tokens = s.rows // s.heads
    if tokens < 2 * page or pp.numel() != dp.numel() or ps.numel() != ds.numel():
        return None
    full = tokens // page

    def per_page(a, b):
        per_token = a.numel() // tokens
        d = (a != b)[: full * page * per_token].reshape(full, -1).any(-1)
        return d

    bad = per_page(pp, dp) | (per_page(ps, ds) if ps.numel() else False)
    tail_ok = bool((pp[full * page * (pp.numel() // tokens):] == dp[full * page * (pp.numel() // tokens):]).all())
    n = int(bad.sum())
    if n == 0 or n > full // 2 or not tail_ok:
        return None
    return bad.nonzero().reshape(-1).tolist()


def compare(s: Subject, ref: torch.Tensor, partner: "torch.Tensor | None", page: int = 16
            ) -> tuple[list[Finding], list[CandidateFit]]:
    """Findings and the ranked transformations for one dump subject and its reference tensor (same logical shape)."""
    ref = ref.detach().cpu().reshape(s.shape).float()
    dump = _dump_bytes(s)
    fits: list[CandidateFit] = []
    labels = {}
    for t in TRANSFORMS:
        if not t.applies(s):
            continue
        for label, pred in t.variants(s, ref, partner):
            a = _agreement(pred, dump)
            if a < 0:
                continue
            fits.append(CandidateFit(label, round(1.0 - a, 6), {"transform": t.name, "agreement_pct": round(100 * a, 4)}))
            labels[label] = (t, pred)
    fits.sort(key=lambda f: f.score)
    if not fits:
        return [], []
    best = fits[0]
    t, pred = labels[best.what]
    ev = {"best": best.what, "agreement_pct": best.detail["agreement_pct"],
          "ranking": [{"transform": f.what, "agreement_pct": f.detail["agreement_pct"]} for f in fits[:6]]}
    where = dict(tensor=s.name, layer=s.layer)
    if t.name == "identity" and best.score == 0:
        return [Finding("reference-match", "info", message="the dump equals the declared writing of the reference "
                        "byte for byte", fix="", evidence=ev, **where)], fits
    identity = next((f for f in fits if f.detail["transform"] == "identity"), None)
    if identity is not None:
        stale = _stale_pages(s, labels[identity.what][1], dump, page_of(s, page))
        if stale and (best.score > 0 or t.name == "identity"):
            return [Finding("stale-or-missing-pages", "error", message=f"the dump equals the reference except "
                            f"{len(stale)} whole pages ({stale[:8]}): those pages hold other data or none",
                            fix="check the block table / transfer of those pages", evidence={**ev, "pages": stale[:32]},
                            **where)], fits
    if best.score == 0:
        return [Finding(_code_of(t, s, best.what), "error", message=f"the reference written as '{best.what}' equals "
                        "the dump byte for byte", fix=t.fix, evidence=ev, **where)], fits
    if t.name != "identity" and (identity is None or best.score < 0.5 * identity.score):
        return [Finding(_code_of(t, s, best.what), "error", message=f"closest transformation of the reference: "
                        f"'{best.what}' ({best.detail['agreement_pct']:.3f}% of bytes agree; declared "
                        f"{identity.detail['agreement_pct'] if identity else 0:.3f}%)", fix=t.fix, evidence=ev,
                        **where)], fits
    return [Finding("reference-mismatch", "warning", message=f"no candidate transformation reproduces the dump "
                    f"(best '{best.what}', {best.detail['agreement_pct']:.3f}% of bytes)",
                    fix="the reference may not be this cache's source; compare with kvtool diff", evidence=ev,
                    **where)], fits


def pair_reference(subjects: list[Subject], refs: list[Subject]) -> dict:
    """{subject name: reference Subject}: by name, then by unique '.suffix' match, then one-to-one."""
    by_name = {r.name: r for r in refs}
    out = {}
    for s in subjects:
        if s.name in by_name:
            out[s.name] = by_name[s.name]
            continue
        tail = s.name.rsplit(".", 1)[-1]
        hits = [r for r in refs if r.name.endswith("." + tail) or r.name == tail]
        if len(hits) == 1:
            out[s.name] = hits[0]
    if not out and len(subjects) == 1 and len(refs) == 1:
        out[subjects[0].name] = refs[0]
    return out


def reference_values(r: Subject) -> torch.Tensor:
    if r.q is not None:
        return r.q.dequantize().reshape(r.shape)
    return r.values.float()


