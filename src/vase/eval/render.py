"""The summary rows as files and on the console: ``summary.csv``, ``summary.md`` and a rich table."""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vase.eval.cells import DEFAULT_CELLS, LEGEND, table_cells
from vase.eval.config import FULL
from vase.eval.store import atomic_write_text
from vase.eval.table import COLUMNS, conclusion, noise_line, reference_of, verdict_lines

__all__ = ["write_csv", "write_markdown", "print_table", "fit_columns", "column_widths"]


def _csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return ""
        return repr(round(v, 6))
    return str(v)


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """The rows as CSV, every column of :data:`~vase.eval.table.COLUMNS` (None and non-finite as empty)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_csv_value(r.get(c)) for c in COLUMNS])
    p = Path(path)
    atomic_write_text(p, buf.getvalue())  # a reader never sees half a summary, a crash never leaves one
    return p


def write_markdown(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """The rows as a Markdown table (every cell of :func:`~vase.eval.cells.table_cells`), the conclusion, the
    noise floor and the legend."""
    cells = table_cells(reference_of(rows))
    lines = []
    if title:
        lines += [f"# {title}", ""]
    lines.append("| " + " | ".join(h for _, h, _ in cells) + " |")
    lines.append("|" + "|".join("---" if k == "method" else "---:" for k, _, _ in cells) + "|")
    for r in rows:
        lines.append("| " + " | ".join(f(r) for _, _, f in cells) + " |")
    lines += ["", conclusion(rows), ""]
    noise = noise_line(rows)
    if noise:
        lines += [noise, ""]
    lines += [LEGEND, ""]
    p = Path(path)
    atomic_write_text(p, "\n".join(lines))
    return p


def _min_width(header: str, cells: Sequence[str]) -> int:
    """Narrowest a column can be drawn: cells never wrap, a header wraps between words."""
    from rich.cells import cell_len

    return max([cell_len(c) for c in cells] + [cell_len(w) for w in header.split()] + [1])


def fit_columns(rows: Sequence[Mapping[str, Any]], width: int, *, reference: str = FULL,
                keys: Sequence[str] = DEFAULT_CELLS) -> dict[str, int]:
    """The columns of ``keys`` (in priority order) that fit a rich table ``width`` columns wide, with their
    widths, in table order.

    Each column needs its widest cell or its header's widest word, plus 3 for padding and border; keys
    are dropped from the end until the rest fit (the first two always stay). Width left over goes to
    the headers, those nearest to fitting on one line first, so they wrap less.
    """
    from rich.cells import cell_len

    need = column_widths(rows, reference=reference)
    chosen = list(keys)
    while len(chosen) > 2 and 1 + sum(need[k] + 3 for k in chosen) > width:
        chosen.pop()
    headers = {k: h for k, h, _ in table_cells(reference)}
    widths = {k: need[k] for k in headers if k in chosen}
    spare = width - 1 - sum(w + 3 for w in widths.values())
    for k in sorted(widths, key=lambda k: cell_len(headers[k]) - widths[k]):  # nearest to one line first
        extra = max(0, min(spare, cell_len(headers[k]) - widths[k]))
        widths[k] += extra
        spare -= extra
    return widths


def column_widths(rows: Sequence[Mapping[str, Any]], *, reference: str = FULL) -> dict[str, int]:
    """Per column key, the narrowest it can be drawn: its widest cell, or its header's widest word."""
    return {k: _min_width(h, [f(r) for r in rows]) for k, h, f in table_cells(reference)}


def print_table(rows: Sequence[Mapping[str, Any]], title: str | None = None, console=None, *,
                wide: bool = False) -> None:
    """The summary as a rich table, with the conclusion line and the noise floor under it.

    By default the README's columns (:data:`DEFAULT_CELLS`) that fit the console's width; ``wide``:
    every column (the CSV, Markdown and HTML always hold them all).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal and not os.environ.get("COLUMNS"):  # a log file: not squeezed into 80 columns
            console = Console(width=max(console.width, 240))  # (COLUMNS, when set, is the width to fit)
    ref = reference_of(rows)
    all_cells = table_cells(ref)
    widths = {} if wide else fit_columns(rows, console.width, reference=ref)
    keys = [k for k, _, _ in all_cells] if wide else list(widths)
    cells = [c for c in all_cells if c[0] in keys]
    table = Table(title=title)
    for k, h, _ in cells:
        # As wide as the widest cell, so a number never wraps (a wrapped interval reads as two numbers) and
        # only headers wrap, between words (fit_columns chose columns that fit so); --wide: rich folds what does not fit.
        table.add_column(h, justify="left" if k == "method" else "right", width=widths.get(k),
                         no_wrap=k == "method")
    for r in rows:
        table.add_row(*(f(r) for _, _, f in cells))
    console.print(table)
    hidden = [h for k, h, _ in all_cells if k not in keys]
    if hidden and not wide:
        left = [h for k, h, _ in all_cells if k in DEFAULT_CELLS and k not in keys]
        console.print(f"[dim]{len(hidden)} more columns with --wide"
                      + (f" (too narrow here for: {escape(', '.join(left))})" if left else "")
                      + "; all of them are in summary.csv / summary.md / report.html[/]", highlight=False)
    verdict = verdict_lines(rows)  # one line per class, wrapped to the console's width like the table
    for line in verdict or [conclusion(rows)]:
        console.print(f"- {line}" if verdict else line, highlight=False)
    noise = noise_line(rows)
    if noise:
        console.print(noise, highlight=False)
