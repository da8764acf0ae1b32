"""`inspect` workflow: what a cache file holds, per tensor, streamed row block by row block.

Per tensor: the format label and recipe options, logical shape, original dtype, bytes per token per head (per row of D
elements: payload + scales), compression against bf16, the outer / tensor scale, scale statistics and checksum status.
Plain (unquantized) tensors are reported as `bf16 plain` / `fp32 plain` with their own bytes per token.

Scale statistics (quantized tensors): `min_nonzero` / `max` of the decoded scales (E8M0 `2^(byte-127)`, E4M3 value,
or the fp32 scale; the nvfp4 outer scale is reported separately), a histogram of the scale exponents
`floor(log2 scale)`, and per block (a scale block: 16 or 32 elements, or a row of D for fp8 and bf16): the share of
SATURATED blocks and of ALL-ZERO blocks (every code is +-0). Scales of all-zero blocks are left out of min / max /
histogram (their byte is a convention: 0).
Saturated means "at the format's clipping point", which depends on what the scale is (`SATURATION`, by scale
element): with power-of-two or fixed scales (mxfp4's E8M0, fp8 `unit` and `tensor`) a block saturates when its
largest element code is the element's max (E2M1 6, E4M3 448): for mxfp4 the share of blocks that use the top code
(with `floor` some of them clipped), for fp8 `unit` the rows clipped at 448, for fp8 `tensor` the rows that hold the
tensor's max. Where the scale maps each block's amax onto the element max (nvfp4's E4M3 scale), every block reaches
the top code by design, so the share counted is of blocks whose SCALE is at its own max (E4M3 448): there the
block's amax reached 448 * 6 * outer scale, and anything above it was clipped (with `auto`, the blocks that hold the
tensor's max are there by construction). An fp32 per-row scale (fp8 `token`) never clips:
`saturation` "none" and `saturated_pct` None.

Engine dumps (`--layout`): `warnings` lists what kvtool.layouts.check_plausible found in the tensors read (E8M0
scale bytes 0xFF or spread over an implausible exponent range, E4M3 scales with the sign bit set, ...): a wrong
page size, head count or layout reads payload bytes as scales and gives exactly that, with no size error.

Checksums: `verify=True` (the default) recomputes every plane's blake2b-256 and the metadata digest and reports
`ok`, `mismatch: payload|scales|data|meta` or `missing` (a kvtool entry without a checksum record); `unverified`
with `verify=False`; tensors of plain files have `none`. The CLI exits 1 when a verified checksum mismatches (the file
parses but its bytes changed) and 2 when the file cannot be read at all.

The report dataclasses and the plain rows live in kvtool.workflows.inspect_plain, which also reports plain safetensors
files without importing torch (`plain_report`, which the CLI tries first).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvtool.container import dtype_name
from kvtool.formats import E4M3_MAX, Format, e4m3_decode, e8m0_decode, unpack_nibbles
from kvtool.readers import Entry, open_input, row_chunks, select
from kvtool.workflows.cache_ops import Progress, chunk_bytes
from kvtool.workflows.inspect_plain import InspectReport, ScaleStats, TensorInfo, plain_info

__all__ = ["InspectReport", "SATURATION", "SCALE_DECODERS", "ScaleStats", "TensorInfo", "inspect_file",
           "scale_stats"]

# Decoded value of each stored scale element (how to read a scale plane; formats name their scale element).
SCALE_DECODERS = {"e8m0": e8m0_decode, "e4m3": e4m3_decode, "fp32-row": torch.Tensor.float,
                  "fp32-tensor": torch.Tensor.float}
# What "saturated" counts, by scale element (see the module docstring): the element's top code, the scale's own max
# (a scale fitted to each block's amax: the top code is reached by design), or nothing (an fp32 scale per row).
SATURATION = {"e8m0": "element", "none": "element", "fp32-tensor": "element", "e4m3": "scale", "fp32-row": "none"}


def inspect_file(path: Path, *, verify: bool = True, include: list[str] | None = None,
                 exclude: list[str] | None = None, chunk_mb: float = 64.0, layout: str | None = None,
                 geometry: str | None = None, progress: Progress | None = None) -> InspectReport:
    """Describe every (selected) tensor of `path`; `verify` (default) recomputes the kvtool checksums (a missing
    record fails like a mismatch) and checks the decoded codes (kvtool.readers)."""
    chunk = chunk_bytes(chunk_mb)
    with open_input(path, layout, geometry, verify=verify, report_checksums=True) as inp:
        report = InspectReport(str(path), inp.kind, inp.schema, inp.writer_version, Path(path).stat().st_size,
                               verified=verify)
        names = select(list(inp.entries), include, exclude)
        total, done = sum(inp.entries[n].rows for n in names), 0
        for name in names:
            report.warnings += inp.warnings.get(name, [])
            e = inp.entries[name]
            info = _plain_info(e) if not e.quantized else _quant_info(e, chunk)
            if inp.kind == "kvtool":
                info.checksum = (inp.verify(e) or "none") if verify else "unverified"
                report.ok &= info.checksum in ("ok", "none", "unverified")
            report.tensors.append(info)
            done += e.rows
            if progress:
                progress(done, total, name)
    return report


def _plain_info(e: Entry) -> TensorInfo:
    return plain_info(e.name, e.shape, dtype_name(e.dtype), e.dtype.itemsize, e.nbytes)


def _quant_info(e: Entry, chunk: int) -> TensorInfo:
    fmt = e.fmt
    meta = fmt.to_meta()
    options = {k: v for k, v in meta.items() if k not in ("family", "label", "block", "scale_element")}
    bpt = fmt.bytes_per_token(e.dim)
    tscale = float(e.scalar_scale) if e.scalar_scale is not None else None
    return TensorInfo(e.name, fmt.label, options, list(e.shape), dtype_name(e.dtype), bpt,
                      round(2 * e.dim / max(bpt, 1), 4), e.nbytes, e.outer_scale, tscale, "none", scale_stats(e, chunk))


def scale_stats(e: Entry, chunk: int) -> ScaleStats:
    """Scale and block statistics of a quantized entry, streamed (see the module docstring)."""
    fmt: Format = e.fmt
    block = fmt.block or e.dim
    table = fmt.element.values().abs() if fmt.element is not None else None
    decode = SCALE_DECODERS.get(fmt.scale_element)
    acc = {"scales": 0, "zero": 0, "nan": 0, "blocks": 0, "sat": 0, "zblk": 0}
    saturation = SATURATION.get(fmt.scale_element, "none") if table is not None else "none"
    hist: dict[int, int] = {}
    lo, hi = None, None
    scalar_done = False
    for a, b in row_chunks(e.rows, e.dim, chunk):
        q = e.read_q(a, b)
        n = b - a
        if table is not None:
            codes = unpack_nibbles(q.payload) if fmt.spec.payload_bits == 4 else q.payload
            blk_max = table[codes.long()].reshape(n, e.dim // block, block).amax(-1)  # [n, blocks per row]
            zero_blk = blk_max == 0
            if saturation == "element":
                acc["sat"] += int((blk_max == fmt.element.max).sum())
        else:  # bf16 payload: a row is a block
            vals = q.payload.float().abs()
            blk_max = vals.amax(-1, keepdim=True)
            zero_blk = blk_max == 0
        acc["blocks"] += zero_blk.numel()
        acc["zblk"] += int(zero_blk.sum())
        if q.scales is None or decode is None:
            continue
        if q.scales.dim() == 0:
            if scalar_done:
                continue
            values, scalar_done = decode(q.scales).reshape(1), True
        else:
            values = decode(q.scales).reshape(n, -1)
            if values.shape == zero_blk.shape:
                values = values[~zero_blk]  # all-zero blocks' scale bytes are a convention, not data
            values = values.reshape(-1)
        if saturation == "scale":  # the block scale at its own max (E4M3 448): the block's amax was clipped
            acc["sat"] += int((values == E4M3_MAX).sum())
        nan = torch.isnan(values)
        acc["nan"] += int(nan.sum())
        values = values[~nan]
        zero = values == 0
        acc["zero"] += int(zero.sum())
        acc["scales"] += values.numel() + int(nan.sum())
        nz = values[~zero]
        if nz.numel():
            lo = min(lo, float(nz.min())) if lo is not None else float(nz.min())
            hi = max(hi, float(nz.max())) if hi is not None else float(nz.max())
            _, exp = torch.frexp(nz)
            exps, counts = torch.unique(exp.to(torch.int32) - 1, return_counts=True)  # frexp mantissa in [0.5, 1)
            for x, c in zip(exps.tolist(), counts.tolist()):
                hist[x] = hist.get(x, 0) + c
        if zero.numel() and hi is None:
            hi = 0.0
    blocks = max(acc["blocks"], 1)
    return ScaleStats(fmt.scale_element, acc["scales"], lo, hi, acc["zero"], acc["nan"], dict(sorted(hist.items())),
                      acc["blocks"], acc["sat"], acc["zblk"],
                      None if saturation == "none" else round(100 * acc["sat"] / blocks, 4),
                      round(100 * acc["zblk"] / blocks, 4), saturation)
