"""The one renderer of the CLI: tables and text that fit the width they get, in a terminal and in a log alike.

A value is never cut or wrapped: no cell is truncated ("..."), no number or name is broken over two lines. What
changes with the width is the layout, chosen per table:

1. columns: every column at its natural width (the widest cell), separated by two spaces, a dashed rule under the
   headers; numbers right-aligned. Plain text, so a pipe or a CI log gets the same table as a terminal (a terminal
   also gets bold headers and row styles).
2. fewer columns: when that is wider than the width, columns declared `optional` are left out (last first) and a line
   names them (`--json` has every field); an optional column declared `group` (rows in runs of one value: a
   benchmark's "decode b64 x 150000") is not lost but printed as a heading line above each run. A column with
   nothing but "" or "-" in it is always left out.
3. records: when even that does not fit, each row becomes a block of `header  value` lines under the row's first
   cell: readable at any width, values still whole.

Width: `$COLUMNS` when set, else the terminal's (stdout's, else stderr's, so `kvtool ... | less` fits the screen),
else 120 (a log file). Prose (titles, legends, notes) wraps at spaces only.

Usage, for a command's renderer:

    table = Table("title", legend="what the columns mean")
    table.column("tensor")
    table.column("B/token", justify="right")
    table.column("checksum", optional=True)
    table.row("layers.0.k", "68", "ok", style="bold")
    print_table(table)
"""

from __future__ import annotations

import io
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from rich.console import Console as RichConsole
from rich.table import Table as RichTable
from rich.text import Text

LOG_WIDTH = 120  # no terminal and no $COLUMNS: a log file or a pipe into a program
GAP = 2  # spaces between columns
INDENT = 2  # records: the header/value lines under a row's first cell



class Console(RichConsole):
    """A rich Console whose `print(table)` of a rich Table goes through this renderer (`from_rich`), so modules that
    build rich Tables (benchmarks, older commands) get the same width-aware layouts without a rewrite; and whose
    `print(message)` of one string wraps it as `line` does (between clauses, continuations indented under the
    message's own indent, no trailing blanks), not with rich's wrapping, which breaks "20.09x paged" at any space
    and leaves a blank at the end of the line."""

    def print(self, *objects, **kwargs) -> None:
        if len(objects) == 1 and isinstance(objects[0], RichTable) and objects[0].show_header:  # not a layout grid
            print_table(from_rich(objects[0]), self)
            return
        if len(objects) == 1 and isinstance(objects[0], str) and "soft_wrap" not in kwargs:
            markup = kwargs.pop("markup", None)
            message = objects[0]
            text = Text.from_markup(message) if (self._markup if markup is None else markup) else Text(message)
            for part in text.split("\n", allow_blank=True):
                for piece in _wrapped(part, width(self)):
                    super().print(piece, soft_wrap=True, **kwargs)
            return
        super().print(*objects, **kwargs)


stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)

__all__ = ["Column", "Console", "Table", "clauses", "from_rich", "line", "paragraph", "print_table", "render_lines",
           "stderr", "stdout", "width"]


def width(console: Console | None = None) -> int:
    """The width output is laid out for (see the module docstring)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    console = console or stdout
    if console.is_terminal:
        return console.width
    for fd in (1, 2):
        try:
            return os.get_terminal_size(fd).columns
        except OSError:
            continue
    return LOG_WIDTH


@dataclass
class Column:
    header: str  # may hold "\n" for a two-line header in the columns layout (joined by a space in records)
    justify: str = "left"  # left | right
    optional: bool = False  # may be left out when the table is too wide
    wrap: bool = False  # prose (a note, a source): wrapped at spaces in the records layout
    group: bool = False  # left out for width: its value becomes a heading line above each run of rows instead

    @property
    def label(self) -> str:
        return " ".join(self.header.split("\n"))


@dataclass
class Table:
    """A table to print: columns, rows of cells (str or rich Text, possibly multi-line), and optional title,
    legend (printed under the table) and per-row styles (terminals only)."""

    title: str | None = None
    legend: str | None = None
    columns: list[Column] = field(default_factory=list)
    rows: list[list[Text]] = field(default_factory=list)
    styles: list[str | None] = field(default_factory=list)
    sections: set[int] = field(default_factory=set)  # row indices that start a new section (a rule above them)
    records: bool = False  # always the records layout (rows that are documents rather than lines)
    keep_empty: bool = False  # show a column whose every cell is empty or "-" (by default it carries nothing: left out)

    def column(self, header: str, *, justify: str = "left", optional: bool = False, wrap: bool = False,
               group: bool = False) -> "Table":
        self.columns.append(Column(header, justify, optional, wrap, group))
        return self

    def row(self, *cells, style: str | None = None) -> "Table":
        if len(cells) != len(self.columns):
            raise ValueError(f"row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([c.copy() if isinstance(c, Text) else Text("-" if c is None else str(c)) for c in cells])
        self.styles.append(style)
        return self

    def section(self) -> "Table":
        """The next row starts a new section (e.g. the overall rows under the per-layer ones)."""
        self.sections.add(len(self.rows))
        return self


def _cell_width(cell: Text) -> int:
    return max((len(part) for part in cell.plain.split("\n")), default=0)


def _natural(table: Table, keep: Sequence[int]) -> tuple[list[int], int]:
    widths = []
    for i in keep:
        head = max(len(p) for p in table.columns[i].header.split("\n"))
        widths.append(max([head] + [_cell_width(r[i]) for r in table.rows]))
    return widths, sum(widths) + GAP * (len(widths) - 1)


def paragraph(text: str, limit: int, indent: str = "", first: str = "") -> list[str]:
    """`text` wrapped at spaces to `limit` columns (words longer than the line stay whole; "\n" starts a line)."""
    out = []
    for part in text.split("\n"):
        out += textwrap.wrap(part, max(limit, 20), initial_indent=first,
                             subsequent_indent=indent, break_long_words=False, break_on_hyphens=False) or [""]
    return out


def render_lines(table: Table, limit: int) -> tuple[list[Text], str]:
    """The table laid out for `limit` columns: its lines and the layout used (columns | fewer | records)."""
    out: list[Text] = []
    if table.title:
        out += [Text(s, style="bold") for s in clauses(table.title, limit)]
    keep = [i for i in range(len(table.columns)) if table.keep_empty or i == 0 or not table.rows
            or any(row[i].plain.strip() not in ("", "-") for row in table.rows)]
    shown = list(keep)
    widths, total = _natural(table, keep)
    layout = "columns"
    while total > limit and any(table.columns[i].optional for i in keep):
        drop = max(i for i in keep if table.columns[i].optional)
        keep.remove(drop)
        widths, total = _natural(table, keep)
        layout = "fewer"
    if table.records or (total > limit and len(keep) > 1):
        keep, layout = shown, "records"
    if layout == "records":
        out += _records(table, keep, limit)
    else:
        headings = [i for i in shown if i not in keep and table.columns[i].group]
        out += _columns(table, keep, widths, headings)
        left_out = [table.columns[i].label for i in shown if i not in keep and i not in headings]
        if left_out:
            out += [Text(s, style="dim") for s in paragraph(
                f"(left out at {limit} columns: {', '.join(left_out)}; widen the terminal, set COLUMNS, or use "
                "--json)", limit, indent="  ")]
    if table.legend:  # one term a line ("\n"), continuation lines indented
        out += [Text(s, style="dim") for s in paragraph(table.legend, limit, indent="  ")]
    return out, layout


def _columns(table: Table, keep: list[int], widths: list[int], headings: Sequence[int] = ()) -> list[Text]:
    """The columns layout; each `headings` column's value, where it changes, as a line of its own (`value:`)."""
    cols = [table.columns[i] for i in keep]
    out = []
    head_lines = max(len(c.header.split("\n")) for c in cols) if cols else 0
    for k in range(head_lines):  # two-line headers: bottom-aligned
        parts = []
        for c, w in zip(cols, widths):
            lines = c.header.split("\n")
            text = lines[k - (head_lines - len(lines))] if k >= head_lines - len(lines) else ""
            parts.append(Text(text.rjust(w) if c.justify == "right" else text.ljust(w)))
        out.append(_join(parts, "bold"))
    rule = Text(" " * GAP).join(Text("-" * w) for w in widths)
    out.append(rule)
    previous = None
    for r, (cells, style) in enumerate(zip(table.rows, table.styles)):
        if r in table.sections and r:
            out.append(rule.copy())
        heading = " / ".join(cells[i].plain for i in headings if cells[i].plain.strip() not in ("", "-"))
        if heading and heading != previous:
            out.append(Text(f"{heading}:", style="bold"))
        previous = heading
        split = [_split(cells[i]) for i in keep]
        for k in range(max(len(s) for s in split)):
            parts = []
            for c, w, s in zip(cols, widths, split):
                part = s[k] if k < len(s) else Text("")
                pad = " " * (w - len(part.plain))
                parts.append(Text(pad) + part if c.justify == "right" else part + Text(pad))
            out.append(_join(parts, style))
    return out


def _records(table: Table, keep: list[int], limit: int) -> list[Text]:
    """Each row as its first cell, then `header  value` lines (multi-line values continue under the value)."""
    out = []
    rest = [i for i in keep if i != 0]
    key_w = max((len(table.columns[i].label) for i in rest), default=0)
    offset = INDENT + key_w + GAP
    for r, (cells, style) in enumerate(zip(table.rows, table.styles)):
        if r:
            out.append(Text(""))
        head = cells[0].copy()
        head.stylize(style or "bold")
        out.append(Text(f"{table.columns[0].label}: ") + head if table.columns[0].label else head)
        for c, cell in ((table.columns[i], cells[i]) for i in rest):
            parts = [Text(p) for p in paragraph(cell.plain, limit - offset)] if c.wrap else _split(cell)
            for k, part in enumerate(parts):
                key = (c.label if k == 0 else "").ljust(key_w)
                out.append(Text(" " * INDENT + key + " " * GAP, style="dim" if k == 0 else "") + part)
    return out


def _split(cell: Text) -> list[Text]:
    return cell.split("\n") if "\n" in cell.plain else [cell]


def _join(parts: Iterable[Text], style: str | None) -> Text:
    text = Text(" " * GAP).join(parts)
    text.rstrip()
    if style:
        text.stylize(style)
    return text


def print_table(table: Table, console: Console | None = None) -> str:
    """Print `table` laid out for the output's width (see the module docstring); returns the layout used."""
    console = console or stdout
    lines, layout = render_lines(table, width(console))
    for text in lines:
        console.print(text, soft_wrap=True)  # laid out already: rich must not wrap or crop
    return layout


NBSP = "\xa0"  # textwrap does not break at it


def clauses(text: str, limit: int, indent: str = "  ") -> list[str]:
    """`text` wrapped to `limit` columns between its clauses only (after ", ", "; " or ": "); a clause longer than a
    line wraps at its spaces. Continuation lines get `indent`."""
    out = []
    for piece in paragraph(re.sub(r"(?<![,;:]) ", NBSP, text), limit, indent=indent):
        plain = piece.replace(NBSP, " ")
        out += [plain] if len(piece) <= limit else paragraph(plain, limit, indent=indent)
    return out


def _wrapped(text: Text, limit: int) -> list[Text]:
    """`text` wrapped as `clauses` wraps its plain text (continuations indented two more than its own first line),
    each line keeping the styles of its characters."""
    plain = text.plain
    lead = " " * (len(plain) - len(plain.lstrip(" ")))
    out, at = [], 0
    for k, piece in enumerate(clauses(plain, limit, indent=lead + "  ")):
        body = piece if k == 0 else piece[len(lead) + 2:]
        start = plain.find(body, at)
        if start < 0:  # textwrap changed the whitespace (a tab): the plain lines, unstyled
            return [Text(p) for p in clauses(plain, limit, indent=lead + "  ")]
        out.append(Text(piece[:len(piece) - len(body)]) + text[start:start + len(body)])
        at = start + len(body)
    return out


def line(text: str, console: Console | None = None, *, style: str | None = None, wrap: bool = True) -> None:
    """Print one message (no markup), wrapped to the width between its clauses only (after ", ", "; " or ": "), so
    that "20 tokens" or "1,827,840 B per block" never splits (a clause longer than a line wraps at its spaces);
    continuation lines are indented. `wrap=False` keeps it on one line."""
    console = console or stdout
    pieces = clauses(text, width(console)) if wrap else [text]
    for piece in pieces:
        console.print(Text(piece, style=style or ""), soft_wrap=True)


def _text(value) -> Text:
    if value is None:
        return Text("")
    if isinstance(value, Text):
        return value.copy()
    if isinstance(value, str):
        return Text.from_markup(value)
    plain = RichConsole(width=10_000, color_system=None, file=io.StringIO())  # another renderable: its text
    with plain.capture() as captured:
        plain.print(value, end="")
    return Text(captured.get())


def from_rich(rich_table: RichTable) -> Table:
    """A rich Table (title, caption, columns with their justification, rows with styles and sections) as a Table.
    A rich Column may carry `optional = True` (set as an attribute) to be left out first at a narrow width, and
    `group = True` to become heading lines when it is left out."""
    title = _text(rich_table.title).plain or None
    table = Table(title, _text(rich_table.caption).plain or None)
    for col in rich_table.columns:  # a column may say `optional = True` (an attribute set on the rich Column)
        table.column(_text(col.header).plain, justify="right" if col.justify == "right" else "left",
                     optional=bool(getattr(col, "optional", False)), wrap=col.overflow == "fold",
                     group=bool(getattr(col, "group", False)))
    cells = [list(col.cells) for col in rich_table.columns]
    for r, row in enumerate(rich_table.rows):
        table.row(*(_text(c[r]) if r < len(c) else Text("") for c in cells),
                  style=str(row.style) if row.style else None)
        if row.end_section:
            table.section()
    return table
