"""Helpers of the integrity tests: small kvtool files, and rewriting a file's header the way a hostile or buggy
writer would (with the digests recomputed, so that a check other than the checksum has to catch it, or left stale)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvtool.container import meta_digest, passthrough_digest, read_header
from kvtool.workflows.cache_ops import quantize_file


def small_cache(path: Path, seed: int = 0) -> Path:
    """A plain safetensors cache: k [32, 2, 64] bf16, idx [32, 64] fp32, and an int tensor `pos` (passthrough)."""
    g = torch.Generator().manual_seed(seed)
    save_file({"k": torch.randn(32, 2, 64, generator=g).bfloat16(), "idx": torch.randn(32, 64, generator=g),
               "pos": torch.arange(32, dtype=torch.int32)}, str(path))
    return path


def quantized(tmp_path: Path, label: str = "nvfp4", name: str = "q.safetensors", **kwargs) -> Path:
    src = small_cache(tmp_path / f"src_{name}")
    out = tmp_path / name
    quantize_file(src, out, label, exclude=["pos"], **kwargs)
    return out


def split(path: Path) -> tuple[dict, bytes]:
    """(header JSON object, data bytes) of a safetensors file."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)
    return Path(path)


def edit_entry(src: Path, dst: Path, name: str, edit, *, redigest: bool = True) -> Path:
    """Rewrite kvtool entry `name` of `src` with `edit(entry_dict)` into `dst`; `redigest` recomputes its metadata
    digest (a writer that lies consistently), else the stale digest stays (tampering after writing)."""
    header, data = split(src)
    meta = header["__metadata__"]
    table = json.loads(meta["kvtool.tensors"])
    edit(table[name])
    if redigest and isinstance(table[name].get("checksum"), dict) and "meta" in table[name]["checksum"]:
        stored = read_header(src).tensors
        planes = {role: stored[table[name][role]] for role in ("payload", "scales")
                  if isinstance(table[name].get(role), str) and table[name][role] in stored}
        fields = {k: v for k, v in table[name].items() if k != "checksum"}
        try:
            table[name]["checksum"]["meta"] = meta_digest(name, fields, planes)
        except ValueError:  # NaN / Infinity: not JSON, the parser refuses the literal before any digest
            pass
    meta["kvtool.tensors"] = json.dumps(table)
    return join(dst, header, data)


def flip_byte(src: Path, dst: Path, tensor: str, offset: int = 0, mask: int = 0x01) -> Path:
    t = read_header(src).tensors[tensor]
    data = bytearray(Path(src).read_bytes())
    data[t.start + offset] ^= mask
    Path(dst).write_bytes(bytes(data))
    return Path(dst)


def set_byte(src: Path, dst: Path, tensor: str, offset: int, value: int, *, redigest: bool = True) -> Path:
    """Set one stored byte; `redigest` also rewrites that plane's checksum (a consistent writer of a bad code)."""
    import hashlib

    t = read_header(src).tensors[tensor]
    data = bytearray(Path(src).read_bytes())
    data[t.start + offset] = value
    Path(dst).write_bytes(bytes(data))
    if not redigest:
        return Path(dst)
    digest = hashlib.blake2b(bytes(data[t.start:t.end]), digest_size=32).hexdigest()
    header, body = split(dst)
    table = json.loads(header["__metadata__"]["kvtool.tensors"])
    for entry in table.values():
        for role in ("payload", "scales"):
            if entry.get(role) == tensor:
                entry["checksum"][role] = digest
    header["__metadata__"]["kvtool.tensors"] = json.dumps(table)
    return join(dst, header, body)


def write_schema1(src: Path, dst: Path) -> Path:
    """`src` (schema 2) as the schema-1 writer wrote it: no meta digests, no passthrough records."""
    header, data = split(src)
    meta = header["__metadata__"]
    table = json.loads(meta["kvtool.tensors"])
    for entry in table.values():
        entry["checksum"].pop("meta", None)
    meta["kvtool.tensors"] = json.dumps(table)
    meta["kvtool.schema"] = "1"
    meta.pop("kvtool.passthrough", None)
    return join(dst, header, data)


__all__ = ["edit_entry", "flip_byte", "join", "passthrough_digest", "quantized", "set_byte", "small_cache", "split",
           "write_schema1"]
