"""`kvtool doctor`: explain a broken cache from its bytes (and, given one, its reference).

`examine(path_or_tensors, layout=None, geometry=None, reference=None, ...) -> DoctorReport`. Each failure class is one
detector in `DETECTORS` (bytes alone: statistics of codes, exponents and scales, re-quantization under each rule) and
one writer in `TRANSFORMS` (with a reference: which transformation of the reference gives the dump). Codes:
fp8-fnuz-as-fn, fp8-fn-as-fnuz, fp16-as-bf16, bf16-as-fp16, unit-scale-fallback, scale-rule-mismatch,
nibble-order-swapped, wrong-geometry, kv-swapped, scales-misaligned, topk-contract, stale-or-missing-pages,
non-finite-codes, clipping, flush-to-zero (and info / warning codes geometry-inferred, reference-match,
reference-mismatch).
"""

from kvtool.doctor.detectors import DETECTORS, Context, Detector
from kvtool.doctor.examine import examine
from kvtool.doctor.fnuz import E4M3FNUZ, e4m3fnuz_decode, e4m3fnuz_encode
from kvtool.doctor.reference import TRANSFORMS, Transform
from kvtool.doctor.report import CandidateFit, DoctorReport, Finding

CODES = ("fp8-fnuz-as-fn", "fp8-fn-as-fnuz", "fp16-as-bf16", "bf16-as-fp16", "unit-scale-fallback",
         "scale-rule-mismatch", "nibble-order-swapped", "wrong-geometry", "kv-swapped", "scales-misaligned",
         "topk-contract", "stale-or-missing-pages", "non-finite-codes", "clipping", "flush-to-zero")

__all__ = ["CODES", "CandidateFit", "Context", "DETECTORS", "Detector", "DoctorReport", "E4M3FNUZ", "Finding",
           "TRANSFORMS", "Transform", "e4m3fnuz_decode", "e4m3fnuz_encode", "examine"]
