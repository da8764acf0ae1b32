"""verify-topk reads kvtool cache files verified by default (a tampered payload is a one-line error, exit 2);
`--no-verify` trusts them."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from kvtool.cli import app


def test_a_tampered_cache_file_is_refused_unless_no_verify(tmp_path):
    g = torch.Generator().manual_seed(5)
    save_file({"l.index_k": torch.randn(256, 128, generator=g).to(torch.bfloat16)}, str(tmp_path / "k.safetensors"))
    save_file({"l.index_q": torch.randn(256, 4, 128, generator=g).to(torch.bfloat16)}, str(tmp_path / "q.safetensors"))
    kq = tmp_path / "kq.safetensors"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "k.safetensors"), "-o", str(kq), "--to", "nvfp4"])
    assert res.exit_code == 0, res.output
    data = bytearray(kq.read_bytes())
    data[-1] ^= 0x01  # the last stored byte (a payload or scale byte): its checksum no longer matches
    kq.write_bytes(bytes(data))
    args = ["verify-topk", str(kq), "--queries", str(tmp_path / "q.safetensors"), "--block-size", "32", "--topk", "4",
            "--max-queries", "4", "--backend", "torch"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "checksum" in res.output.lower(), res.output
    res = CliRunner().invoke(app, args + ["--no-verify"])
    assert res.exit_code in (0, 1), res.output  # it ran (the verdict is the check's business)
