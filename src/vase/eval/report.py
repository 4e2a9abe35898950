"""Summaries of a run, rebuilt from its JSONL files alone (this backs ``vase summarize RUN_DIR``).

    rows = summarize("runs/arith-n6-s1-3f2a9c1d")

One row per (method, budget), every comparison with the full cache *paired* (:mod:`vase.eval.table`,
which also defines the columns, :data:`COLUMNS`). Written as ``summary.csv`` and ``summary.md`` and
printed as a rich table (:mod:`vase.eval.render`, the columns' text from :mod:`vase.eval.cells`),
and plotted (:mod:`vase.eval.plots`). This module reads the run folder and writes into it; the
names of those modules are re-exported here, so ``from vase.eval.report import ...`` keeps working.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vase.eval.cells import DEFAULT_CELLS, LEGEND, table_cells
from vase.eval.config import FULL
from vase.eval.identity import records_of_run
from vase.eval.plots import PLOT_FILES, figures, write_plots
from vase.eval.render import column_widths, fit_columns, print_table, write_csv, write_markdown
from vase.eval.store import FIDELITY, SAMPLES
from vase.eval.table import (COLUMNS, PERCENT_COLUMNS, conclusion, parse_reference, reference_name, row_label,
                             summary_rows)

__all__ = [
    "COLUMNS",
    "PERCENT_COLUMNS",
    "summarize",
    "summary_rows",
    "conclusion",
    "parse_reference",
    "reference_name",
    "run_header",
    "run_window",
    "table_cells",
    "fit_columns",
    "column_widths",
    "DEFAULT_CELLS",
    "LEGEND",
    "write_csv",
    "write_markdown",
    "print_table",
    "write_plots",
    "figures",
    "PLOT_FILES",
]


def run_window(run_dir: str | Path) -> int | None:
    """The run's window ``w`` from its config.json (None when absent)."""
    try:
        meta = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        w = (meta.get("config") or {}).get("window")
        return int(w) if w is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def run_header(run_dir: str | Path) -> str:
    """The run's settings in one line from its config.json: task, model (named, with its sha256), ...

    The embedded default model (``model`` None in the config) is named, not shown as None; the hash is
    the model's content hash recorded in the run's identity (``model_sha256``). Empty without config.json.
    """
    try:
        meta = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        c = meta.get("config") or {}
        ident = meta.get("identity") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(c, dict) or not isinstance(ident, dict):
        return ""
    model = c.get("model")
    if model in (None, "default"):
        from vase.models import DEFAULT_MODEL

        model = DEFAULT_MODEL
    sha = ident.get("model_sha256")
    parts = []
    for k in ("task", "model", "limit", "samples", "budgets", "window", "max_new_tokens", "greedy", "temperature",
              "top_p", "seed"):
        if k == "model":
            parts.append(f"model {model}" + (f" (sha256 {str(sha)[:12]})" if sha else ""))
        elif k in c and (k not in ("temperature", "top_p") or not c.get("greedy")):
            parts.append(f"{k} {c.get(k)}")
    return " · ".join(parts)


def summarize(run_dir: str | Path, *, print_table: bool = True, plots: bool = True,
              reference: tuple[str, int | None] = (FULL, None), wide: bool = False) -> list[dict[str, Any]]:
    """Rebuild the summary of a run from its ``samples.rank*.jsonl`` / ``fidelity.rank*.jsonl`` files.

    Writes ``summary.csv``, ``summary.md`` and the PNG plots into ``run_dir``; prints a rich
    table when ``print_table`` (the default columns that fit the terminal; all of them with ``wide``).
    Returns the rows (see :data:`COLUMNS`). With another ``reference``
    (method, budget) the paired columns compare with it and the files are
    ``summary-vs-<method>-<budget>.csv/md`` (no plots).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    samples = records_of_run(run_dir, SAMPLES)  # only the run's own records (config.json)
    fidelity = records_of_run(run_dir, FIDELITY)
    if not samples and not fidelity:
        raise FileNotFoundError(f"{run_dir} holds no samples.rank*.jsonl records yet")
    rows = summary_rows(samples, fidelity, window=run_window(run_dir), reference=reference)
    if tuple(reference) != (FULL, None) and not any((r["method"], r["budget"]) == tuple(reference) for r in rows):
        raise ValueError(f"no rows of the reference {reference[0]} B={reference[1]} in {run_dir}: "
                         f"choose one of {', '.join(row_label(r) for r in rows)}")
    if tuple(reference) != (FULL, None):
        stem = f"summary-vs-{reference[0]}-{reference[1]}"
        write_csv(rows, run_dir / f"{stem}.csv")
        write_markdown(rows, run_dir / f"{stem}.md", title=f"{run_dir.name} (against {reference[0]} B={reference[1]})")
        if print_table:
            _print_table(rows, title=_title(run_dir, f"against {reference_name(reference)}"), wide=wide)
        return rows
    write_csv(rows, run_dir / "summary.csv")
    write_markdown(rows, run_dir / "summary.md", title=run_dir.name)
    if plots:
        write_plots(rows, run_dir, samples)
    if print_table:
        _print_table(rows, title=_title(run_dir), wide=wide)
    return rows


def _title(run_dir: Path, what: str = "") -> str:
    header = run_header(run_dir)
    return f"{run_dir.name}" + (f": {what}" if what else "") + (f"\n{header}" if header else "")


_print_table = print_table  # summarize's keyword of the same name hides the function
