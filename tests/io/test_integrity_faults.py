"""Issue 30, faults: a writer killed with -9 leaves nothing at the target, and its hidden temporary file
(`.NAME.kvtool-PID-RANDOM.tmp`) is removed by the next write to the same target; a live writer's file is kept; two
writers to one target both finish and the last rename wins (the target is always one complete file)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from integrity_helpers import small_cache

from kvtool.container import AtomicFile, TEMP_PATTERN, remove_stale_temps, temp_path
from kvtool.readers import open_input
from kvtool.workflows.cache_ops import quantize_file

BIG_MB = 256


def _temps(d: Path, name: str) -> list[Path]:
    return [p for p in d.iterdir() if (m := TEMP_PATTERN.fullmatch(p.name)) and m.group("name") == name]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no such process (until the PID is reused, which the test does not rely on)


def test_temp_names_carry_the_writer_pid(tmp_path):
    tmp = temp_path(tmp_path / "out.safetensors")
    m = TEMP_PATTERN.fullmatch(tmp.name)
    assert m and m.group("name") == "out.safetensors" and int(m.group("pid")) == os.getpid()
    assert tmp.parent == tmp_path and tmp.name.startswith(".")


def test_a_dead_writers_temp_is_removed_and_a_live_one_kept(tmp_path):
    target = tmp_path / "o.safetensors"
    dead = tmp_path / f".o.safetensors.kvtool-{_dead_pid()}-0123abcd.tmp"
    live = tmp_path / f".o.safetensors.kvtool-{os.getppid()}-0123abcd.tmp"  # pytest's parent is alive
    other = tmp_path / f".other.safetensors.kvtool-{_dead_pid()}-0123abcd.tmp"  # another target's: not ours
    for p in (dead, live, other):
        p.write_bytes(b"partial")
    quantize_file(small_cache(tmp_path / "c.safetensors"), target, "mxfp4", exclude=["pos"])
    assert not dead.exists() and live.exists() and other.exists() and target.exists()
    assert remove_stale_temps(tmp_path / "other.safetensors") == [other]


def test_two_writers_last_rename_wins(tmp_path):
    target = tmp_path / "o.bin"
    with AtomicFile(target) as a, AtomicFile(target) as b:
        assert a.tmp != b.tmp
        os.write(a.fd, b"A" * 10)
        os.write(b.fd, b"B" * 20)
        b.commit()
        a.commit()
    assert target.read_bytes() == b"A" * 10 and _temps(tmp_path, "o.bin") == []


def _big_plain(path: Path, mb: int) -> None:
    """A `mb` MiB bf16 safetensors file of zeros, written sparse (instant, little disk)."""
    rows = mb * (1 << 20) // 256
    header = json.dumps({"x": {"dtype": "BF16", "shape": [rows, 128], "data_offsets": [0, rows * 256]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + rows * 256)


def test_sigkill_midway_leaves_no_output_and_the_next_run_cleans_up(tmp_path):
    if shutil.disk_usage(tmp_path).free < 3 * BIG_MB << 20:
        pytest.skip(f"needs {3 * BIG_MB} MiB free in {tmp_path}")
    src, target = tmp_path / "big.safetensors", tmp_path / "out.safetensors"
    _big_plain(src, BIG_MB)
    proc = subprocess.Popen([sys.executable, "-m", "kvtool", "quantize", str(src), "-o", str(target), "--to",
                             "mxfp4", "--chunk-mb", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 60
        while not _temps(tmp_path, target.name) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # midway: the temporary file holds a partial output
        assert proc.poll() is None, "the quantize finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    left = _temps(tmp_path, target.name)
    assert not target.exists() and len(left) == 1 and int(TEMP_PATTERN.fullmatch(left[0].name).group("pid")) == proc.pid
    quantize_file(small_cache(tmp_path / "c.safetensors"), target, "nvfp4", exclude=["pos"])  # a later run
    assert _temps(tmp_path, target.name) == [] and target.exists()
    with open_input(target) as inp:
        assert inp.entries["k"].read(0, 1).shape == (1, 64) and torch.isfinite(inp.entries["k"].read(0, 4)).all()
