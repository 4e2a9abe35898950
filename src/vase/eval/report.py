"""Summaries of a run, rebuilt from its JSONL files alone (this backs ``vase summarize RUN_DIR``).

    rows = summarize("runs/arith-n6-s1-3f2a9c1d")

One row per (method, budget): pass@1 and its standard error, agreement with the full cache,
failure classes, output lengths and inflation, compression ratio, throughput, KV memory, and
the fidelity means when the run measured them. Written as ``summary.csv`` and ``summary.md``,
printed as a rich table, and plotted (PNG, matplotlib's Agg canvas, no global backend change).
Rows are ordered ``full`` first, then method labels alphabetically, budgets ascending, and every
number is computed from records sorted by key, so the files do not depend on how the work was
split across processes.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vase.eval.failures import FAILURE_CLASSES
from vase.eval.metrics import (
    agreement,
    aggregate_fidelity,
    compression_ratio,
    failure_shares,
    inflation,
    length_stats,
    pass_at_1,
)
from vase.eval.store import FIDELITY, SAMPLES, read_all

__all__ = [
    "COLUMNS",
    "PERCENT_COLUMNS",
    "summarize",
    "summary_rows",
    "write_csv",
    "write_markdown",
    "print_table",
    "write_plots",
    "PLOT_FILES",
]

FULL = "full"

#: summary.csv columns, in order. ``*_pct`` are percentages; budget is empty for ``full``.
COLUMNS: tuple[str, ...] = (
    "method", "budget", "n_problems", "n_samples",
    "pass_at_1_pct", "pass_at_1_stderr_pct", "agreement_pct",
    *(f"{c}_pct" for c in FAILURE_CLASSES),
    "mean_length", "median_length", "inflation", "compression_ratio", "tokens_per_s",
    "kv_bytes_mean", "kv_bytes_peak_mean", "kv_bytes_full_mean", "kv_ratio", "evictions_mean",
    "kl_mean", "top1_agree_pct", "dnll_mean", "top1_disagree_pct", "fidelity_problems", "fidelity_tokens",
)
PERCENT_COLUMNS = tuple(c for c in COLUMNS if c.endswith("_pct"))
PLOT_FILES = {"accuracy": "accuracy_vs_budget.png", "fidelity": "fidelity_kl_vs_budget.png",
              "failures": "failures.png"}

# Columns of the markdown / terminal table (the CSV has them all).
_TABLE = (
    ("method", "method"), ("budget", "B"), ("n_samples", "n"), ("pass_at_1_pct", "pass@1 %"),
    ("pass_at_1_stderr_pct", "± %"), ("agreement_pct", "agree %"), ("garbage_pct", "garbage %"),
    ("phrase_loop_pct", "loop %"), ("truncated_pct", "trunc %"), ("mean_length", "mean len"),
    ("median_length", "median len"), ("inflation", "inflation"), ("compression_ratio", "compr."),
    ("tokens_per_s", "tok/s"), ("kv_bytes_mean", "KV held"), ("kv_ratio", "KV/full"),
    ("evictions_mean", "evictions"), ("kl_mean", "KL"), ("top1_agree_pct", "top-1 %"), ("dnll_mean", "ΔNLL"),
)
# The terminal table leaves out what the markdown has room for.
_TERMINAL = ("method", "budget", "n_samples", "pass_at_1_pct", "pass_at_1_stderr_pct", "agreement_pct",
             "phrase_loop_pct", "truncated_pct", "mean_length", "inflation", "compression_ratio", "tokens_per_s",
             "kv_ratio", "kl_mean", "top1_agree_pct")


def _budget_sort(b: Any) -> tuple[int, float]:
    return (0, -1.0) if b is None else (1, float(b))


def _sort_key(r: Mapping[str, Any]) -> tuple:
    return (str(r.get("method")), _budget_sort(r.get("budget")), str(r.get("problem_id")), int(r.get("sample", 0)))


def _group_key(method: str, budget: Any) -> tuple:
    return (0 if method == FULL else 1, method, _budget_sort(budget))


def _mean(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else None


def _throughput(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Generated tokens per second of decode, each batch's decode time shared among its rows."""
    tokens = 0.0
    seconds = 0.0
    for r in records:
        s, pre, rows = r.get("seconds"), r.get("prefill_seconds"), r.get("batch_rows") or 1
        if s is None:
            continue
        tokens += float(r.get("length", 0))
        seconds += (float(s) - float(pre or 0.0)) / float(rows)
    return tokens / seconds if seconds > 0 else None


def summary_rows(samples: Sequence[Mapping[str, Any]], fidelity: Sequence[Mapping[str, Any]] = ()
                 ) -> list[dict[str, Any]]:
    """One row per (method, budget) of the records (see :data:`COLUMNS`)."""
    samples = sorted(samples, key=_sort_key)
    groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in samples:
        groups[(r["method"], r.get("budget"))].append(r)
    fid_groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in sorted(fidelity, key=lambda r: (str(r.get("method")), _budget_sort(r.get("budget")),
                                            str(r.get("problem_id")))):
        if int(r.get("n_tokens") or 0) > 0:
            fid_groups[(r["method"], r.get("budget"))].append(r)

    full = groups.get((FULL, None), [])
    full_mean = length_stats(full)[0] if full else None
    rows = []
    for method, budget in sorted(set(groups) | set(fid_groups), key=lambda k: _group_key(*k)):
        recs = groups.get((method, budget), [])
        row: dict[str, Any] = {c: None for c in COLUMNS}
        row["method"], row["budget"] = method, budget
        row["n_problems"] = len({r["problem_id"] for r in recs})
        row["n_samples"] = len(recs)
        if recs:
            p1, se = pass_at_1(recs)
            row["pass_at_1_pct"], row["pass_at_1_stderr_pct"] = 100 * p1, 100 * se
            if full:
                try:
                    # Neither completion having an answer is the same outcome: it counts as agreeing.
                    row["agreement_pct"] = 100 * agreement(recs, full, none_matches=True)
                except ValueError:  # no (problem, sample) in common yet
                    pass
            for c, share in failure_shares(recs).items():
                row[f"{c}_pct"] = 100 * share
            mean_len, median_len = length_stats(recs)
            row["mean_length"], row["median_length"] = mean_len, median_len
            if full_mean:
                row["inflation"] = inflation(mean_len, full_mean)
                if budget is not None:
                    row["compression_ratio"] = compression_ratio(full_mean, int(budget))
            row["tokens_per_s"] = _throughput(recs)
            row["kv_bytes_mean"] = _mean([r.get("kv_bytes") for r in recs])
            row["kv_bytes_peak_mean"] = _mean([r.get("kv_bytes_peak") for r in recs])
            row["kv_bytes_full_mean"] = _mean([r.get("kv_bytes_full") for r in recs])
            if row["kv_bytes_mean"] is not None and row["kv_bytes_full_mean"]:
                row["kv_ratio"] = row["kv_bytes_mean"] / row["kv_bytes_full_mean"]
            row["evictions_mean"] = _mean([r.get("evictions") for r in recs])
        fid = fid_groups.get((method, budget))
        if fid:
            agg = aggregate_fidelity(fid)
            row["kl_mean"] = agg["kl_mean"]
            row["top1_agree_pct"] = 100 * agg["top1_agree"]
            row["dnll_mean"] = agg["dnll_mean"]
            row["top1_disagree_pct"] = 100 * agg["top1_disagree_share"]
            row["fidelity_problems"] = agg["n_problems"]
            row["fidelity_tokens"] = agg["n_tokens"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- files


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
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_csv_value(r.get(c)) for c in COLUMNS])
    p = Path(path)
    p.write_text(buf.getvalue(), encoding="utf-8")
    return p


def _fmt(col: str, v: Any) -> str:
    if v is None:
        return "-" if col != "budget" else "full"
    if col == "kv_bytes_mean":
        return _human_bytes(float(v))
    if isinstance(v, float):
        if col in ("kl_mean", "dnll_mean"):
            return f"{v:.4f}"
        if col in ("inflation", "compression_ratio", "kv_ratio"):
            return f"{v:.2f}"
        if col in ("mean_length", "median_length", "tokens_per_s", "evictions_mean"):
            return f"{v:.1f}"
        return f"{v:.1f}"
    return str(v)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def write_markdown(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str | None = None) -> Path:
    lines = []
    if title:
        lines += [f"# {title}", ""]
    lines.append("| " + " | ".join(h for _, h in _TABLE) + " |")
    lines.append("|" + "|".join("---" if c == "method" else "---:" for c, _ in _TABLE) + "|")
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, r.get(c)) for c, _ in _TABLE) + " |")
    lines += ["", "pass@1: mean over problems of the per-problem accuracy (± = standard error); agree: same "
              "extracted answer as the full cache on the same seed (both without an answer counts as "
              "agreeing); compr.: mean full-cache length / B; KV held: K/V bytes a sequence holds when it ends; KL, top-1, ΔNLL: the full cache's first "
              "sample teacher-forced through the method (KL(full || method) per token).", ""]
    p = Path(path)
    p.write_text("\n".join(lines), encoding="utf-8")
    return p


def print_table(rows: Sequence[Mapping[str, Any]], title: str | None = None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = [(c, h) for c, h in _TABLE if c in _TERMINAL]
    table = Table(title=title)
    for c, h in cols:
        table.add_column(h, justify="left" if c == "method" else "right", no_wrap=c == "method")
    for r in rows:
        table.add_row(*(_fmt(c, r.get(c)) for c, _ in cols))
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: do not squeeze the table into 80 columns
            console = Console(width=max(console.width, 160))
    console.print(table)


# ----------------------------------------------------------------------------- plots


def _figure(width: float = 7.0, height: float = 4.5):
    # The object-oriented Agg canvas: no pyplot state, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _budget_axis(ax, budgets: list[int]) -> None:
    """Ticks at the measured budgets, on a log2 scale when they span 4x or more."""
    if not budgets:
        return
    if len(budgets) > 1 and budgets[-1] / budgets[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])


def write_plots(rows: Sequence[Mapping[str, Any]], run_dir: str | Path) -> list[Path]:
    """accuracy_vs_budget.png, failures.png and (with fidelity) fidelity_kl_vs_budget.png."""
    run_dir = Path(run_dir)
    written: list[Path] = []
    if not rows:
        return written
    by_method: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    full_row = None
    for r in rows:
        if r["method"] == FULL:
            full_row = r
        else:
            by_method[r["method"]].append(r)

    # Accuracy vs budget, full as a horizontal line (with its standard error band).
    fig = _figure()
    ax = fig.add_subplot(111)
    for m, rs in by_method.items():
        rs = [r for r in rs if r["pass_at_1_pct"] is not None and r["budget"] is not None]
        if rs:
            ax.errorbar([r["budget"] for r in rs], [r["pass_at_1_pct"] for r in rs],
                        yerr=[r["pass_at_1_stderr_pct"] or 0.0 for r in rs], marker="o", capsize=3, label=m)
    if full_row is not None and full_row["pass_at_1_pct"] is not None:
        y, se = full_row["pass_at_1_pct"], full_row["pass_at_1_stderr_pct"] or 0.0
        ax.axhline(y, color="black", linestyle="--", label="full")
        if se:
            ax.axhspan(y - se, y + se, color="black", alpha=0.08)
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    _budget_axis(ax, budgets)
    ax.set_xlabel("KV budget B (tokens per layer and KV head)")
    ax.set_ylabel("pass@1 (%)")
    ax.set_ylim(0, 102)
    ax.set_title("Accuracy vs budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(run_dir / PLOT_FILES["accuracy"])
    fig.savefig(written[-1])

    # Fidelity (KL) vs budget, when measured.
    fid = {m: [r for r in rs if r["kl_mean"] is not None and r["budget"] is not None] for m, rs in by_method.items()}
    fid = {m: rs for m, rs in fid.items() if rs}
    if fid:
        fig = _figure()
        ax = fig.add_subplot(111)
        for m, rs in fid.items():
            ax.plot([r["budget"] for r in rs], [r["kl_mean"] for r in rs], marker="o", label=m)
        _budget_axis(ax, budgets)
        ax.set_xlabel("KV budget B")
        ax.set_ylabel("KL(full || method) per token (nats)")
        ax.set_title("Fidelity to the full cache (teacher-forced)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(run_dir / PLOT_FILES["fidelity"])
        fig.savefig(written[-1])

    # Failure classes per (method, budget): stacked bars.
    bars = [r for r in rows if r["n_samples"]]
    if bars:
        fig = _figure(max(6.0, 0.6 * len(bars) + 2), 4.5)
        ax = fig.add_subplot(111)
        labels = [r["method"] if r["budget"] is None else f"{r['method']}\nB={r['budget']}" for r in bars]
        x = list(range(len(bars)))
        bottom = [0.0] * len(bars)
        colors = {"ok": "#4c9f70", "truncated": "#e0b040", "phrase_loop": "#d0603a", "garbage": "#7a4ea3"}
        for c in ("ok", "truncated", "phrase_loop", "garbage"):
            vals = [r.get(f"{c}_pct") or 0.0 for r in bars]
            ax.bar(x, vals, bottom=bottom, label=c, color=colors.get(c))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("share of completions (%)")
        ax.set_ylim(0, 100)
        ax.set_title("Failure classes")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        written.append(run_dir / PLOT_FILES["failures"])
        fig.savefig(written[-1])
    return written


# ----------------------------------------------------------------------------- entry point


def summarize(run_dir: str | Path, *, print_table: bool = True, plots: bool = True) -> list[dict[str, Any]]:
    """Rebuild the summary of a run from its ``samples.rank*.jsonl`` / ``fidelity.rank*.jsonl`` files.

    Writes ``summary.csv``, ``summary.md`` and the PNG plots into ``run_dir``; prints a rich
    table when ``print_table``. Returns the rows (see :data:`COLUMNS`).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    samples = read_all(run_dir, SAMPLES)
    fidelity = read_all(run_dir, FIDELITY)
    if not samples and not fidelity:
        raise FileNotFoundError(f"{run_dir} holds no samples.rank*.jsonl records yet")
    rows = summary_rows(samples, fidelity)
    write_csv(rows, run_dir / "summary.csv")
    write_markdown(rows, run_dir / "summary.md", title=run_dir.name)
    if plots:
        write_plots(rows, run_dir)
    if print_table:
        _print_table(rows, title=run_dir.name)
    return rows


_print_table = print_table  # summarize's keyword of the same name hides the function
