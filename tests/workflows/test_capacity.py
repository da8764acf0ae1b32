"""Capacity arithmetic (SPEC section 4): the published ATOM block sizes, reproduced exactly, and the pool arithmetic."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtool.capacity import GIB, PRESETS, capacity, index_format, kv_format
from kvtool.errors import KvtoolError

# (model, kv, index, bytes per 128-token block) as published (SPEC section 4)
PUBLISHED = [
    ("minimax-m3.1-flash", "fp8", "fp8", 3_179_520),
    ("minimax-m3.1-flash", "fp8", "fp4", 2_749_440),
    ("minimax-m3.1-flash", "nvfp4", "fp4", 1_827_840),
    ("minimax-m3", "fp8", "fp8", 2_961_408),
    ("minimax-m3", "fp8", "fp4", 2_552_832),
    ("minimax-m3", "nvfp4", "fp4", 1_677_312),
]


@pytest.mark.parametrize("model,kv,index,expected", PUBLISHED, ids=lambda v: str(v))
def test_published_block_bytes(model, kv, index, expected):
    r = capacity(model, kv, index)
    assert r.selected.block_bytes == expected
    assert r.selected.published_block_bytes == expected
    assert r.selected.bytes_per_token * 128 == expected


def test_per_token_bytes_match_spec():
    # SPEC 4: FP8 K+V 264 (2 x (128 + 4)), NVFP4 K+V 144, FP8 index 128, FP4 index 72, MXFP4 K+V 136 / index 68,
    # bf16 index 256 (one KV head per rank at TP4, D = 128)
    rows = {(r.kv, r.index): r for r in capacity("minimax-m3").rows}
    assert rows["fp8-token", "fp8-unit"].kv_sparse_bytes == 264
    assert rows["nvfp4-rcp", "nvfp4-rcp"].kv_sparse_bytes == 144
    assert rows["mxfp4-rceil", "mxfp4-rceil"].kv_sparse_bytes == 136
    assert [rows["fp8-token", i].index_bytes for i in ("fp8-unit", "nvfp4-rcp", "mxfp4-rceil", "bf16")] == \
        [128, 72, 68, 256]


def test_table_covers_every_pair_and_every_row_follows_the_formula():
    r = capacity("minimax-m3.1-flash")
    assert len(r.rows) == 16 and sum(row.selected for row in r.rows) == 1
    for row in r.rows:
        expect = 128 * ((65 - 60) * row.kv_dense_bytes + 60 * (row.kv_sparse_bytes + row.index_bytes))
        assert row.block_bytes == expect
        assert row.kv_sparse_bytes == 2 * kv_format(row.kv).bytes_per_token(128)
        assert row.index_bytes == index_format(row.index).bytes_per_token(128)
    assert {row.published_block_bytes for row in r.rows} - {None} == {3_179_520, 2_749_440, 1_827_840}


def test_dense_layers_keep_at_least_fp8():
    rows = {(r.kv, r.index): r for r in capacity("minimax-m3").rows}
    assert rows["nvfp4-rcp", "nvfp4-rcp"].kv_dense == "fp8-token"   # FP4 sparse KV: dense layers stay FP8
    assert rows["bf16", "bf16"].kv_dense == "bf16"                 # wider than FP8: dense layers as the KV
    forced = capacity("minimax-m3", "nvfp4", "fp4", kv_dense="nvfp4").selected
    assert forced.kv_dense == "nvfp4-rcp" and forced.block_bytes == 128 * (3 * 144 + 57 * (144 + 72))


def test_pool_blocks():
    # The published 57,011 FP8 + FP8 blocks: a pool of exactly that many blocks holds floor(pool / bytes) of each pair
    r = capacity("minimax-m3.1-flash", "fp8", "fp8", blocks=57_011)
    rows = {(x.kv, x.index): x for x in r.rows}
    assert r.pool_bytes == 57_011 * 3_179_520
    assert rows["fp8-token", "fp8-unit"].blocks == 57_011 and rows["fp8-token", "fp8-unit"].tokens == 57_011 * 128
    assert rows["nvfp4-rcp", "nvfp4-rcp"].blocks == r.pool_bytes // 1_827_840 == 99_170
    # the published NVFP4 + FP4 count (99,130) is within 0.05 % of it: the published pools differ by that much
    assert abs(99_130 / rows["nvfp4-rcp", "nvfp4-rcp"].blocks - 1) < 5e-4
    g = capacity("minimax-m3", pool_gb=100)
    assert g.pool_bytes == 100 * GIB and g.selected.blocks == 100 * GIB // 2_961_408


def test_tp_and_smollm2():
    one = capacity("minimax-m3", "nvfp4", "fp4", tp=1).selected   # 4 KV heads per rank, index key still one
    assert one.kv_sparse_bytes == 4 * 144 and one.index_bytes == 72 and one.published_block_bytes is None
    assert capacity("minimax-m3", tp=8).kv_heads_per_rank == 1      # GQA heads replicate past 4 ranks
    s = capacity("smollm2", "fp8", "fp8")
    assert (s.pool_layers, s.sparse_layers, s.block_tokens, s.kv_heads_per_rank) == (30, 30, 64, 3)
    assert s.selected.block_bytes == 64 * 30 * (2 * 3 * 68 + 64)      # D = 64: fp8-token 68 B/head, fp8 index 64


@pytest.mark.parametrize("kwargs", [dict(model="gpt"), dict(model="minimax-m3", tp=0),
                                    dict(model="minimax-m3", pool_gb=1, blocks=2),
                                    dict(model="minimax-m3", pool_gb=-1), dict(model="minimax-m3", kv="int3")])
def test_errors(kwargs):
    with pytest.raises(KvtoolError):  # InputError, or FormatError for an unknown format name
        capacity(**kwargs)


def test_presets_are_data():
    for name, p in PRESETS.items():
        assert p["sparse_layers"] <= p["pool_layers"] and p["kv_heads"] >= 1, name


def test_cli_json_and_table(monkeypatch):
    from kvtool.cli import app

    res = CliRunner().invoke(app, ["capacity", "--model", "minimax-m3.1-flash", "--kv", "nvfp4", "--index", "fp4",
                                   "--blocks", "57011", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["selected"]["block_bytes"] == 1_827_840 and data["selected"]["blocks"] == 57_011
    assert len(data["rows"]) == 16
    table = CliRunner().invoke(app, ["capacity", "--model", "minimax-m3"])
    assert table.exit_code == 0 and "2,961,408*" in table.stdout and "2,552,832*" in table.stdout
    bad = CliRunner().invoke(app, ["capacity", "--model", "nope"])
    assert bad.exit_code == 2 and "unknown model" in bad.output


def test_cli_passes_options(monkeypatch):
    from kvtool import capacity as capacity_mod
    from kvtool.cli import app

    got = {}
    real = capacity_mod.capacity

    def spy(*args, **kw):
        got.update(args=args, kw=kw)
        return real(*args, **kw)

    monkeypatch.setattr(capacity_mod, "capacity", spy)
    res = CliRunner().invoke(app, ["capacity", "--model", "smollm2", "--kv", "mxfp4", "--index", "nvfp4", "--tp",
                                   "2", "--pool-gb", "1.5", "--kv-dense", "bf16", "--json"])
    assert res.exit_code == 0, res.output
    assert got == dict(args=("smollm2", "mxfp4", "nvfp4"),
                       kw=dict(tp=2, pool_gb=1.5, blocks=None, kv_dense="bf16"))
