"""The CLI renderer (kvtool/cli/render.py): layouts chosen by width, values never cut or wrapped, and every cheap
command rendered at 80 columns in process (stdout not a terminal) and once through a real pipe."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console as RichConsole
from rich.table import Table as RichTable

from cli_helpers import kv

from kvtool.cli import common
from kvtool.cli.render import Console, Table, from_rich, print_table, render_lines

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures" / "synthetic_cache.safetensors"
VLLM = ROOT / "fixtures" / "vllm_mxfp4_k.bin"
GEO = ["--layout", "vllm-mxfp4-page", "--geometry", "format=mxfp4,page=128,heads=2,dim=128,tokens=256"]


def _table() -> Table:
    t = Table("a title long enough to wrap at a narrow width, at spaces only", legend="x: what x means")
    t.column("name")
    t.column("value", justify="right")
    t.column("detail", optional=True)
    t.row("layers.0.index_k", "0.123456", "fits mxfp4-rceil 100%")
    t.row("layers.12.k", "12,345,678", "-", style="bold")
    return t


def _cells(t: Table) -> list[str]:
    return [c.plain for row in t.rows for c in row]


@pytest.mark.parametrize("limit,layout", [(200, "columns"), (40, "fewer"), (25, "records"), (12, "records")])
def test_layout_follows_the_width_and_values_stay_whole(limit, layout):
    t = _table()
    lines, used = render_lines(t, limit)
    text = [x.plain for x in lines]
    assert used == layout
    shown = _cells(t) if layout != "fewer" else [c.plain for row in t.rows for c in row[:2]]
    for value in shown:  # each value whole on one line
        assert any(value in x for x in text), (value, text)
    if layout == "fewer":
        assert any("left out at 40 columns: detail" in x for x in text)
    if layout != "records":  # records may run past the width only with a value too long for its line
        assert max(len(x) for x in text) <= limit, text
    assert "…" not in "".join(text)
    assert text[-1] == "x: what x means" or "x: what x means" in " ".join(text)


def test_a_group_column_left_out_for_width_heads_its_rows():
    """A benchmark's case names repeat in every group ("triton score" at each batch x context): when the group column
    does not fit, each group becomes a heading line, so no two rows read alike; other optional columns just go."""
    t = Table()
    t.column("group", optional=True, group=True)
    t.column("case")
    t.column("time (us)", justify="right")
    t.column("note", optional=True)
    for group in ("decode b64 x 150000", "prefill 32768"):
        t.row(group, "triton score+topk mxfp4-rceil", "1234.5", "eager x 1 layer")
        t.row(group, "torch eager mxfp4-rceil", "99.0", "")
    text = [x.plain for x in render_lines(t, 50)[0]]
    assert text == ["case                           time (us)", "-----------------------------  ---------",
                    "decode b64 x 150000:",
                    "triton score+topk mxfp4-rceil     1234.5", "torch eager mxfp4-rceil             99.0",
                    "prefill 32768:",
                    "triton score+topk mxfp4-rceil     1234.5", "torch eager mxfp4-rceil             99.0",
                    "(left out at 50 columns: note; widen the terminal,", "  set COLUMNS, or use --json)"]
    assert render_lines(t, 200)[1] == "columns" and "decode b64 x 150000:" not in \
        [x.plain for x in render_lines(t, 200)[0]]


def test_columns_align_numbers_right_and_keep_multiline_cells():
    t = Table()
    t.column("k")
    t.column("n", justify="right")
    t.row("a\nb", "1")
    t.row("c", "100")
    text = [x.plain for x in render_lines(t, 80)[0]]
    assert text == ["k    n", "-  ---", "a    1", "b", "c  100"]


def test_rich_tables_printed_on_the_cli_consoles_go_through_the_renderer():
    rt = RichTable(title="bench — cpu", caption="a caption")
    rt.add_column("case")
    rt.add_column("time (us)", justify="right")
    rt.add_row("nvfp4 (store)", "[green]12.5[/green]")
    rt.add_row("overall", "99.0", end_section=True)
    rt.columns[0].group = True
    t = from_rich(rt)
    assert [c.header for c in t.columns] == ["case", "time (us)"] and t.legend == "a caption"
    assert [c.group for c in t.columns] == [True, False]
    assert _cells(t) == ["nvfp4 (store)", "12.5", "overall", "99.0"]
    out = io.StringIO()
    Console(file=out, width=80).print(rt)
    assert "nvfp4 (store)  " in out.getvalue() and "a caption" in out.getvalue() and "│" not in out.getvalue()


def test_messages_printed_on_the_cli_consoles_wrap_between_clauses(monkeypatch):
    """A benchmark's goal lines are strings printed on the CLI's console: they wrap as render.line does (a number
    stays with its unit, continuations indented under the line's own indent, no trailing blank), markup still
    applies unless turned off."""
    monkeypatch.setenv("COLUMNS", "60")
    out = io.StringIO()
    console = Console(file=out, highlight=False)
    console.print("  eager step, bf16 dense (plain): 839.1 tok/s (1.00x plain bf16, 20.09x paged bf16)")
    console.print("goal: nvfp4-rcp score+topk <= 1.15x byte floor: 1.234 (target 1.15) [green]met[/green]")
    console.print("a [INST] b", markup=False)
    assert out.getvalue().splitlines() == [
        "  eager step, bf16 dense (plain):", "    839.1 tok/s (1.00x plain bf16, 20.09x paged bf16)",
        "goal: nvfp4-rcp score+topk <= 1.15x byte floor:", "  1.234 (target 1.15) met", "a [INST] b"]


def test_a_benchmark_table_shows_brackets_as_they_are(monkeypatch):
    """A bench report's title and names are text, not rich markup: `bench quant`'s "bf16 [tokens, 1, 128]" printed
    as "bf16 ," (the brackets read as a style tag)."""
    from kvtool.bench.common import BenchReport, BenchRow, render_report

    monkeypatch.setenv("COLUMNS", "80")
    report = BenchReport("quant: bf16 [tokens, 1, 128]", "CPU", "2", "3", "today", 10.0,
                         [BenchRow("[g]", "store [x]", 1.0, 100, 0.1, 0.01, "[note]")])
    out = io.StringIO()
    render_report(report, Console(file=out, highlight=False))
    assert "quant: bf16 [tokens, 1, 128] — CPU" in out.getvalue()
    assert "[g]    store [x]" in out.getvalue() and "[note]" in out.getvalue()


def test_print_table_on_a_plain_console_has_no_box_or_colour(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    assert print_table(_table(), RichConsole(file=out)) == "columns"
    assert "\x1b[" not in out.getvalue() and "layers.12.k" in out.getvalue()


def test_progress_is_plain_periodic_lines_when_stderr_is_not_a_terminal(capsys):
    with common.progress("quantize", every_s=0.0) as tick:
        tick(1, 4, "layers.0.k")
        tick(4, 4, "layers.0.v")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "quantize:  25% (1/4) layers.0.k" and err[1] == "quantize: 100% (4/4) layers.0.v"
    assert err[-1].startswith("quantize: 100% (4/4) layers.0.v in ") and err[-1].endswith(" s")
    with common.progress("quantize") as tick:  # a short run: no line at all
        tick(4, 4, "x")
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------------ every command
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("render")
    mx, nv = d / "mx.safetensors", d / "nv.safetensors"
    assert kv("quantize", FIX, "-o", mx, "--to", "mxfp4").exit_code == 0
    assert kv("quantize", FIX, "-o", nv, "--to", "nvfp4", "--outer-scale", "auto").exit_code == 0
    return d, mx, nv


def _commands(d: Path, mx: Path, nv: Path) -> dict[str, list]:
    return {
        "quantize": ["quantize", FIX, "-o", d / "q.safetensors", "--to", "fp8", "--fp8-scale", "token"],
        "dequantize": ["dequantize", mx, "-o", d / "back.safetensors"],
        "inspect": ["inspect", mx, "--verify"],
        "inspect-nvfp4": ["inspect", nv],
        "inspect-dump": ["inspect", VLLM, *GEO],
        "diff": ["diff", mx, FIX],
        "diff-gated": ["diff", nv, FIX, "--min-sqnr", "10"],
        "layouts": ["layouts"],
        "convert": ["convert", VLLM, "-o", d / "k.planes.safetensors", "--from-layout", "vllm-mxfp4-page",
                    "--to-layout", "planes", "--geometry", GEO[-1]],
        "capacity": ["capacity", "--model", "minimax-m3.1-flash", "--kv", "nvfp4", "--index", "fp4"],
        "verify-attn": ["verify-attn", "--synthetic", "--formats", "nvfp4,bf16"],
        "verify-topk": ["verify-topk", "--synthetic", "--formats", "nvfp4,mxfp4", "--batch", "2", "--context-lens",
                        "2048"],
        "recipes": ["recipes"],
        "doctor": ["doctor", mx, "--reference", FIX],
        "capture": ["capture", "--model", "tiny-llama", "--max-tokens", "20", "-o", d / "c.safetensors"],
        # The benchmarks at their smallest shapes: the kernel rows run in the interpreter (tests/conftest.py).
        "bench-codecs": ["bench", "codecs", "--size", "0.01"],
        "bench-quant": ["bench", "quant", "--device", "cpu", "--sizes", "1K", "--formats", "nvfp4,mxfp4"],
        # 1000 tokens: "decode b1 x 1000" leaves no room for the group column at 80, so it heads its rows
        "bench-index": ["bench", "index", "--device", "cpu", "--batches", "1", "--contexts", "1000", "--prefill", "",
                        "--formats", "mxfp4"],
        "bench-attn": ["bench", "attn", "--device", "cpu", "--batches", "1", "--context", "256", "--formats", "fp8"],
        "bench-decode": ["bench", "decode", "--model", "tiny-llama", "--batch", "1", "--context", "40"],
    }


def _json_values(report) -> list[str]:
    """The string values of a JSON report that a table shows (names, formats, labels, a benchmark row's group)."""
    out = []
    if isinstance(report, dict):
        for key, value in report.items():
            if key in ("name", "format", "label", "format_a", "format_b", "checksum", "action", "group") and \
                    isinstance(value, str):
                out.append(value)
            else:
                out += _json_values(value)
    elif isinstance(report, list):
        for value in report:
            out += _json_values(value)
    return out


@pytest.mark.parametrize("name", list(_commands(Path("."), Path("."), Path("."))))
def test_every_command_at_80_columns_shows_whole_values(name, files, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    if name.startswith("bench-"):  # one call per case, no warm-up: this checks the layout, not the times
        from kvtool.bench import common as bench_common

        real = bench_common.time_fn
        monkeypatch.setattr(bench_common, "time_fn", lambda fn, device, **kw: real(fn, device, **{**kw, "warmup": 0,
                                                                                                "rep": 1}))
    args = _commands(*files)[name]
    out = files[0] / "q.safetensors"
    if out.exists():
        out.unlink()
    result = kv(*args)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "…" not in result.output and "Traceback" not in result.output
    assert "│" not in text and "┃" not in text  # no box drawing in a pipe or a log
    if name in ("quantize", "dequantize") or (files[0] / "k.planes.safetensors").exists() and name == "convert":
        for p in (out, files[0] / "back.safetensors", files[0] / "k.planes.safetensors"):
            p.unlink(missing_ok=True)
    lines = text.splitlines()
    json_run = kv(*args, "--json")
    assert json_run.exit_code == 0, json_run.output
    for value in set(_json_values(json.loads(json_run.stdout))):
        if name == "capture":  # one layer's tensors stand for every layer's: `k=[20,2,32]`
            value = value.split(".", 2)[2] + "=["
        assert any(value in line for line in lines), (value, text)  # whole, on one line
    assert not [line for line in lines if line != line.rstrip()]  # wrapped prose leaves no trailing blanks
    too_wide = [line for line in lines if len(line) > 80 and " " in line.strip()]
    # Only single long tokens (a path, a formula) may exceed the width; prose and tables fit.
    assert all(len(max(line.split(), key=len)) > 40 or "(off =" in line for line in too_wide), too_wide


def test_diff_without_thresholds_reports_without_a_pass(files, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    _, mx, _ = files
    result = kv("diff", mx, FIX)
    assert result.exit_code == 0 and "REPORT" in result.stdout and "PASS" not in result.stdout
    report = json.loads(kv("diff", mx, FIX, "--json").stdout)
    assert report["verdict"] == "REPORT" and report["passed"]
    gated = json.loads(kv("diff", mx, FIX, "--max-rel-l2", "0.5", "--json").stdout)
    assert gated["verdict"] == "PASS"
    failed = kv("diff", mx, FIX, "--max-rel-l2", "0.01", "--json")
    assert failed.exit_code == 1 and json.loads(failed.stdout)["verdict"] == "FAIL"


def test_json_numbers_stay_numbers(files):
    _, mx, _ = files
    report = json.loads(kv("diff", mx, mx, "--json").stdout)  # A == B: SQNR is +inf
    assert all(t["metrics"]["sqnr_db"] is None for t in report["tensors"])
    assert common.to_json({"a": float("inf"), "b": float("-inf"), "c": float("nan"), "d": 1.5}) == \
        '{\n  "a": null,\n  "b": null,\n  "c": null,\n  "d": 1.5\n}'


def test_inspect_saturation_means_clipping(files):
    _, mx, nv = files
    mxr = json.loads(kv("inspect", mx, "--json").stdout)["tensors"]
    nvr = json.loads(kv("inspect", nv, "--json").stdout)["tensors"]
    assert all(t["scales"]["saturation"] == "element" and 0 < t["scales"]["saturated_pct"] < 100 for t in mxr)
    # nvfp4 reaches code 6 in every block by design: what counts is a scale at its max (auto outer scale: few)
    assert all(t["scales"]["saturation"] == "scale" and t["scales"]["saturated_pct"] < 5 for t in nvr)
    text = kv("inspect", nv).stdout
    assert "sat%:" in text and "zero%:" in text  # the legend


def test_a_real_pipe_at_80_columns_shows_whole_values(files):
    _, mx, _ = files
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    proc = subprocess.run(f"{sys.executable} -m kvtool inspect {mx} --verify | cat", shell=True, env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for value in ("layers.0.index_k", "mxfp4-rceil", "[256,2,128]", "0.0312..2", "checksums: ok"):
        assert any(value in line for line in proc.stdout.splitlines()), proc.stdout
    assert "…" not in proc.stdout and max(len(line) for line in proc.stdout.splitlines()) <= 80


def test_diff_plot_histograms_have_axis_labels(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    import torch

    from kvtool.workflows import diff as diff_mod

    labels = []
    real = matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", lambda self, text, *a, **k: labels.append(text) or
                        real(self, text, *a, **k))
    diff_mod._plot({"k": torch.tensor([0.0, 1e-3, -2e-2, 0.5])}, tmp_path / "p.png", "title")
    assert (tmp_path / "p.png").stat().st_size > 0 and labels == ["elements (of 4 sampled)"]


def test_a_column_with_nothing_in_it_is_left_out():
    t = Table()
    t.column("name")
    t.column("scale")
    t.column("n", justify="right")
    t.row("a", "-", "1")
    t.row("b", "", "2")
    assert [x.plain for x in render_lines(t, 80)[0]] == ["name  n", "----  -", "a     1", "b     2"]
    t.keep_empty = True
    assert "scale" in render_lines(t, 80)[0][0].plain
