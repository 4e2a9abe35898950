"""Summaries of a run, rebuilt from its JSONL files alone (this backs ``vase summarize RUN_DIR``).

    rows = summarize("runs/arith-n6-s1-3f2a9c1d")

One row per (method, budget), every comparison with the full cache *paired*: sample ``s`` of a
problem has the same seed under every method, so each completion is compared with full's
completion of the same (problem, sample), and intervals come from a bootstrap over problems.
The columns are defined in the README ("What the numbers mean") and in :data:`COLUMNS`.
Written as ``summary.csv`` and ``summary.md``, printed as a rich table, and plotted (PNG,
matplotlib's Agg canvas, no global backend change). Rows are ordered ``full`` first, then method
labels alphabetically, budgets ascending; every number is computed from records sorted by key
with a fixed bootstrap seed, so the files do not depend on how the work was split.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vase.eval.failures import FAILURE_CLASSES
from vase.eval.metrics import (
    accuracy_split,
    agreement_split,
    answered_share,
    cap_share,
    failure_shares,
    length_stats,
    pass_at_1,
)
from vase.eval.paired import (
    bootstrap_ci,
    discordant,
    first_divergence,
    mcnemar_exact,
    pair_records,
    paired_problem_diffs,
)
from vase.eval.store import FIDELITY, SAMPLES, atomic_write_text, read_all

__all__ = [
    "COLUMNS",
    "PERCENT_COLUMNS",
    "summarize",
    "summary_rows",
    "conclusion",
    "parse_reference",
    "write_csv",
    "write_markdown",
    "print_table",
    "write_plots",
    "figures",
    "PLOT_FILES",
]

FULL = "full"

#: summary.csv columns, in order. ``*_pct`` are percentages; ``*_lo`` / ``*_hi`` bound 95 % bootstrap
#: intervals over problems; ``d_*`` are paired differences method - full; budget is empty for ``full``.
COLUMNS: tuple[str, ...] = (
    "method", "budget", "window", "reference", "n_problems", "n_samples", "problems_match",
    "pass_at_1_pct", "pass_at_1_stderr_pct", "answered_pct", "cap_pct", "acc_finished_pct", "acc_truncated_pct",
    "d_acc_pct", "d_acc_lo_pct", "d_acc_hi_pct", "only_method_right", "only_full_right", "mcnemar_p",
    "agree_pct", "agree_n_both", "both_none_pct", "only_method_answered_pct", "only_full_answered_pct",
    *(f"{c}_{k}" for c in FAILURE_CLASSES for k in ("pct", "lo_pct", "hi_pct")),
    "mean_length", "median_length", "d_length", "d_length_lo", "d_length_hi",
    "identical_pct", "first_div_median", "first_div_q25", "first_div_q75",
    "kv_peak_ratio", "kv_time_ratio", "kv_bytes_peak_mean", "kv_bytes_time_mean", "kv_bytes_allocated_mean",
    "evictions_mean", "batch_tokens_per_s",
    "kl_evicted", "kl_evicted_lo", "kl_evicted_hi", "top1_agree_evicted_pct", "dnll_evicted", "kl_all",
    "noise_kl", "fidelity_problems", "fidelity_tokens_evicted",
)
PERCENT_COLUMNS = tuple(c for c in COLUMNS if c.endswith("_pct"))
PLOT_FILES = {"accuracy": "accuracy_vs_budget.png", "fidelity": "fidelity_kl_vs_budget.png",
              "failures": "failures.png", "length": "length.png", "divergence": "first_divergence.png"}


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
    """Generated tokens per second of decode over the batches (each batch's decode time shared among its
    rows): a batch throughput of this run, not a speed comparison (that is `vase bench`)."""
    tokens = 0.0
    seconds = 0.0
    for r in records:
        s, pre, rows = r.get("seconds"), r.get("prefill_seconds"), r.get("batch_rows") or 1
        if s is None:
            continue
        tokens += float(r.get("length", 0))
        seconds += (float(s) - float(pre or 0.0)) / float(rows)
    return tokens / seconds if seconds > 0 else None


def _per_problem(records: Sequence[Mapping[str, Any]], value: Callable[[Mapping[str, Any]], float | None]
                 ) -> list[float]:
    """One number per problem: the mean of ``value`` over its records (None values left out)."""
    per: dict[str, list[float]] = defaultdict(list)
    for r in records:
        v = value(r)
        if v is not None:
            per[str(r["problem_id"])].append(float(v))
    return [sum(v) / len(v) for _, v in sorted(per.items())]


def _ci_into(row: dict[str, Any], values: Sequence[float], mean_col: str, lo_col: str, hi_col: str,
             scale: float = 1.0) -> None:
    ci = bootstrap_ci(values)
    if ci is not None:
        row[mean_col], row[lo_col], row[hi_col] = (scale * v for v in ci)


def _ratio(a: Any, b: Any) -> float | None:
    return float(a) / float(b) if a is not None and b not in (None, 0) else None


def _paired_columns(row: dict[str, Any], recs: Sequence[Mapping[str, Any]], full: Sequence[Mapping[str, Any]]
                    ) -> None:
    """Everything measured against full's completion of the same (problem, sample)."""
    pairs = pair_records(recs, full)
    if not pairs:
        return
    _ci_into(row, list(paired_problem_diffs(recs, full, key="correct").values()),
             "d_acc_pct", "d_acc_lo_pct", "d_acc_hi_pct", 100.0)
    b, c = discordant(recs, full)
    row["only_method_right"], row["only_full_right"], row["mcnemar_p"] = b, c, mcnemar_exact(b, c)
    _ci_into(row, list(paired_problem_diffs(recs, full, key="length").values()),
             "d_length", "d_length_lo", "d_length_hi")
    ag = agreement_split(recs, full)
    row["agree_pct"] = None if ag["agree"] is None else 100 * ag["agree"]
    row["agree_n_both"] = ag["n_both"]
    row["both_none_pct"] = 100 * ag["both_none"]
    row["only_method_answered_pct"] = 100 * ag["only_method"]
    row["only_full_answered_pct"] = 100 * ag["only_full"]
    # First divergence from full's same-seed completion, in generated tokens.
    divs = [first_divergence(m["token_ids"], f["token_ids"]) for m, f in pairs
            if m.get("token_ids") is not None and f.get("token_ids") is not None]
    if divs:
        row["identical_pct"] = 100 * sum(d is None for d in divs) / len(divs)
        diverged = [d for d in divs if d is not None]
        if diverged:
            q25, med, q75 = np.quantile(np.asarray(diverged, dtype=np.float64), [0.25, 0.5, 0.75])
            row["first_div_q25"], row["first_div_median"], row["first_div_q75"] = float(q25), float(med), float(q75)
    # Compression of each sequence against full's bytes for the same (problem, sample).
    row["kv_peak_ratio"] = _mean([_ratio(m.get("kv_bytes_peak"), f.get("kv_bytes_peak")) for m, f in pairs])
    row["kv_time_ratio"] = _mean([_ratio(m.get("kv_bytes_time_mean"), f.get("kv_bytes_time_mean"))
                                  for m, f in pairs])


def _fidelity_columns(row: dict[str, Any], fid: Sequence[Mapping[str, Any]]) -> None:
    """Fidelity over the targets after each sequence's first eviction, per problem, bootstrapped."""
    ev = [r for r in fid if int(r.get("n_tokens_evicted") or 0) > 0 and r.get("kl_mean_evicted") is not None]
    if ev:
        _ci_into(row, _per_problem(ev, lambda r: r["kl_mean_evicted"]), "kl_evicted", "kl_evicted_lo",
                 "kl_evicted_hi")
        row["top1_agree_evicted_pct"] = 100 * statistics.fmean(_per_problem(ev, lambda r: r["top1_agree_evicted"]))
        row["dnll_evicted"] = statistics.fmean(_per_problem(ev, lambda r: r["dnll_mean_evicted"]))
        row["fidelity_problems"] = len({r["problem_id"] for r in ev})
        row["fidelity_tokens_evicted"] = sum(int(r["n_tokens_evicted"]) for r in ev)
    scored = [r for r in fid if int(r.get("n_tokens") or 0) > 0 and r.get("kl_mean") is not None]
    if scored:
        total = sum(int(r["n_tokens"]) for r in scored)
        row["kl_all"] = sum(float(r["kl_mean"]) * int(r["n_tokens"]) for r in scored) / total
    row["noise_kl"] = _mean([r.get("noise_kl_mean") for r in fid])


def summary_rows(samples: Sequence[Mapping[str, Any]], fidelity: Sequence[Mapping[str, Any]] = (), *,
                 window: int | None = None, reference: tuple[str, int | None] = (FULL, None)
                 ) -> list[dict[str, Any]]:
    """One row per (method, budget) of the records (see :data:`COLUMNS`); ``window`` fills its column.

    The paired columns compare each row with ``reference`` (method, budget), full by default.
    """
    samples = sorted(samples, key=_sort_key)
    groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in samples:
        groups[(r["method"], r.get("budget"))].append(r)
    fid_groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in sorted(fidelity, key=lambda r: (str(r.get("method")), _budget_sort(r.get("budget")),
                                            str(r.get("problem_id")))):
        fid_groups[(r["method"], r.get("budget"))].append(r)

    reference = (reference[0], None if reference[1] is None else int(reference[1]))
    full = groups.get(reference, [])
    full_problems = {r["problem_id"] for r in full}
    rows = []
    for method, budget in sorted(set(groups) | set(fid_groups), key=lambda k: _group_key(*k)):
        recs = groups.get((method, budget), [])
        row: dict[str, Any] = {c: None for c in COLUMNS}
        row["method"], row["budget"], row["window"] = method, budget, window
        row["reference"] = _label({"method": reference[0], "budget": reference[1]})
        problems = {r["problem_id"] for r in recs}
        row["n_problems"] = len(problems)
        row["n_samples"] = len(recs)
        row["problems_match"] = problems == full_problems
        if recs:
            p1, se = pass_at_1(recs)
            row["pass_at_1_pct"], row["pass_at_1_stderr_pct"] = 100 * p1, 100 * se
            row["answered_pct"] = 100 * answered_share(recs)
            if all("finished" in r for r in recs):
                row["cap_pct"] = 100 * cap_share(recs)
                split = accuracy_split(recs)
                for k in ("finished", "truncated"):
                    v = split[f"acc_{k}"]
                    row[f"acc_{k}_pct"] = None if v is None else 100 * v
            failure_shares(recs)  # checks every class is known
            for c in FAILURE_CLASSES:
                _ci_into(row, _per_problem(recs, lambda r, c=c: float(r["failure"] == c)),
                         f"{c}_pct", f"{c}_lo_pct", f"{c}_hi_pct", 100.0)
            row["mean_length"], row["median_length"] = length_stats(recs)
            if full:
                _paired_columns(row, recs, full)
                if (method, budget) == reference:  # against itself: the paired columns say nothing
                    for c in COLUMNS[COLUMNS.index("d_acc_pct"):COLUMNS.index("garbage_pct")]:
                        row[c] = None
                    for c in ("d_length", "d_length_lo", "d_length_hi", "identical_pct", "first_div_median",
                              "first_div_q25", "first_div_q75"):
                        row[c] = None
            row["kv_bytes_peak_mean"] = _mean([r.get("kv_bytes_peak") for r in recs])
            row["kv_bytes_time_mean"] = _mean([r.get("kv_bytes_time_mean") for r in recs])
            row["kv_bytes_allocated_mean"] = _mean([r.get("kv_bytes_allocated") for r in recs])
            row["evictions_mean"] = _mean([r.get("evictions") for r in recs])
            row["batch_tokens_per_s"] = _throughput(recs)
        fid = fid_groups.get((method, budget))
        if fid:
            _fidelity_columns(row, fid)
        rows.append(row)
    return rows


def parse_reference(text: str) -> tuple[str, int | None]:
    """``"snapkv:64"`` -> ("snapkv", 64); ``"full"`` -> ("full", None)."""
    method, _, budget = text.partition(":")
    if not method.strip():
        raise ValueError(f"bad reference {text!r}: write METHOD:BUDGET, e.g. snapkv:64, or full")
    try:
        return method.strip(), (int(budget) if budget.strip() else None)
    except ValueError:
        raise ValueError(f"bad reference {text!r}: the budget after ':' must be an integer, e.g. snapkv:64") from None


def _label(r: Mapping[str, Any]) -> str:
    return r["method"] if r.get("budget") is None else f"{r['method']} B={r['budget']}"


def conclusion(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line: what the paired 95 % intervals of the accuracy difference allow one to conclude."""
    worse, better, unclear = [], [], []
    ref = next((r["reference"] for r in rows if r.get("reference")), FULL)
    for r in rows:
        if _label(r) == ref or r.get("d_acc_lo_pct") is None:
            continue
        if r["d_acc_hi_pct"] < 0:
            worse.append(f"{_label(r)} ({r['d_acc_pct']:+.0f} pts)")
        elif r["d_acc_lo_pct"] > 0:
            better.append(f"{_label(r)} ({r['d_acc_pct']:+.0f} pts)")
        else:
            unclear.append(_label(r))
    n = max((r["n_problems"] for r in rows), default=0)
    parts = []
    if worse:
        parts.append(f"less accurate than {ref} (95% interval below 0): " + ", ".join(worse))
    if better:
        parts.append(f"more accurate than {ref}: " + ", ".join(better))
    if unclear:
        parts.append(f"not distinguishable from {ref} on accuracy at n = {n} problems (interval contains 0): "
                     + ", ".join(unclear))
    if not parts:
        return f"No paired comparison with {ref} yet."
    flagged = [_label(r) for r in rows if r.get("problems_match") is False]
    line = "; ".join(parts) + "."
    if flagged:
        line += f" Rows marked * were measured on a different problem set than {ref} (partial run): " \
                + ", ".join(flagged) + "."
    return line


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
    atomic_write_text(p, buf.getvalue())  # a reader never sees half a summary, a crash never leaves one
    return p


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _interval(r: Mapping[str, Any], mean: str, lo: str, hi: str, fmt: str) -> str:
    if r.get(mean) is None:
        return "-"
    return f"{r[mean]:{fmt}} [{r[lo]:{fmt}}, {r[hi]:{fmt}}]"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else f"{v:{fmt}}"


# (header, formatter) of the table columns; composite cells show a value with its interval.
_CELLS: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("method", lambda r: r["method"]),
    ("B / w", lambda r: "full" if r.get("budget") is None
        else f"{r['budget']} / {r['window']}" if r.get("window") is not None else str(r["budget"])),
    ("n", lambda r: f"{r['n_samples']}" + ("" if r.get("problems_match", True) else "*")),
    ("pass@1 %", lambda r: _num(r.get("pass_at_1_pct"), ".1f")),
    ("answered %", lambda r: _num(r.get("answered_pct"), ".0f")),
    ("Δ pass@1 pts [95% CI]", lambda r: _interval(r, "d_acc_pct", "d_acc_lo_pct", "d_acc_hi_pct", "+.1f")),
    ("McNemar p", lambda r: _num(r.get("mcnemar_p"), ".3f")),
    ("agree % (n both)", lambda r: "-" if r.get("agree_pct") is None
        else f"{r['agree_pct']:.0f} ({r['agree_n_both']})"),
    ("loop %", lambda r: _num(r.get("phrase_loop_pct"), ".0f")),
    ("at cap %", lambda r: _num(r.get("cap_pct"), ".0f")),
    ("mean len", lambda r: _num(r.get("mean_length"), ".0f")),
    ("Δ len [95% CI]", lambda r: _interval(r, "d_length", "d_length_lo", "d_length_hi", "+.0f")),
    ("1st div. tok (median)", lambda r: _num(r.get("first_div_median"), ".0f")),
    ("KV peak / full", lambda r: _num(r.get("kv_peak_ratio"), ".2f")),
    ("KV avg / full", lambda r: _num(r.get("kv_time_ratio"), ".2f")),
    ("evictions / seq", lambda r: _num(r.get("evictions_mean"), ".1f")),
    ("KL after 1st evict. [95% CI]", lambda r: _interval(r, "kl_evicted", "kl_evicted_lo", "kl_evicted_hi", ".3f")),
    ("top-1 % after evict.", lambda r: _num(r.get("top1_agree_evicted_pct"), ".1f")),
    ("batch tok/s", lambda r: _num(r.get("batch_tokens_per_s"), ".1f")),
)

LEGEND = (
    "Δ columns: method minus the reference (full unless said otherwise) on the same (problem, sample) seeds, averaged per problem, 95% paired "
    "bootstrap interval over problems; McNemar: exact test on the pairs where exactly one side is right. "
    "agree: same answer as full (math-verify) among pairs where both answered. at cap: hit the token cap. "
    "1st div.: first generated token where the text leaves full's same-seed text. KV peak/avg over full: "
    "each sequence's peak and time-averaged K/V bytes over full's for the same (problem, sample). KL, top-1: "
    "full's sample 0 teacher-forced through the method, over the targets after the first eviction only. "
    "batch tok/s: throughput of this run's batches, not a speed comparison (use `vase bench`). "
    "* = measured on a different problem set than full."
)


def _noise_line(rows: Sequence[Mapping[str, Any]]) -> str | None:
    for r in rows:
        if r["method"] == FULL and r.get("noise_kl") is not None:
            return (f"KL noise floor (full vs full teacher-forced in chunks of w): {r['noise_kl']:.2e} nats/token; "
                    "ΔNLL is measured on full's own sample.")
    return None


def write_markdown(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str | None = None) -> Path:
    lines = []
    if title:
        lines += [f"# {title}", ""]
    lines.append("| " + " | ".join(h for h, _ in _CELLS) + " |")
    lines.append("|" + "|".join("---" if h == "method" else "---:" for h, _ in _CELLS) + "|")
    for r in rows:
        lines.append("| " + " | ".join(f(r) for _, f in _CELLS) + " |")
    lines += ["", conclusion(rows), ""]
    noise = _noise_line(rows)
    if noise:
        lines += [noise, ""]
    lines += [LEGEND, ""]
    p = Path(path)
    atomic_write_text(p, "\n".join(lines))
    return p


def print_table(rows: Sequence[Mapping[str, Any]], title: str | None = None, console=None) -> None:
    """The summary as a rich table, with the conclusion line and the noise floor under it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h, _ in _CELLS:
        table.add_column(h, justify="left" if h == "method" else "right", no_wrap=h == "method")
    for r in rows:
        table.add_row(*(f(r) for _, f in _CELLS))
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: do not squeeze the table into 80 columns
            console = Console(width=max(console.width, 240))
    console.print(table)
    console.print(conclusion(rows), soft_wrap=True)
    noise = _noise_line(rows)
    if noise:
        console.print(noise, soft_wrap=True)


# ----------------------------------------------------------------------------- plots


def _figure(width: float = 7.0, height: float = 4.5):
    # The object-oriented Agg canvas: no pyplot state, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
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


def figures(rows: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The run's matplotlib figures by name (keys of :data:`PLOT_FILES`); only those with data."""
    figs: dict[str, Any] = {}
    if not rows:
        return figs
    by_method: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    full_row = None
    for r in rows:
        if r["method"] == FULL:
            full_row = r
        else:
            by_method[r["method"]].append(r)
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})

    # Accuracy vs budget, full as a horizontal line with its standard error band.
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
    _budget_axis(ax, budgets)
    ax.set_xlabel("KV budget B (tokens per layer and KV head)")
    ax.set_ylabel("pass@1 (%)")
    ax.set_ylim(0, 102)
    ax.set_title("Accuracy vs budget (± standard error)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    figs["accuracy"] = fig

    # Fidelity (KL after the first eviction, 95% interval) vs budget.
    fid = {m: [r for r in rs if r["kl_evicted"] is not None and r["budget"] is not None] for m, rs in by_method.items()}
    fid = {m: rs for m, rs in fid.items() if rs}
    if fid:
        fig = _figure()
        ax = fig.add_subplot(111)
        for m, rs in fid.items():
            y = [r["kl_evicted"] for r in rs]
            err = [[v - r["kl_evicted_lo"] for v, r in zip(y, rs)], [r["kl_evicted_hi"] - v for v, r in zip(y, rs)]]
            ax.errorbar([r["budget"] for r in rs], y, yerr=err, marker="o", capsize=3, label=m)
        if full_row is not None and full_row.get("noise_kl") is not None:
            ax.axhline(full_row["noise_kl"], color="grey", linestyle=":", label="noise floor")
        _budget_axis(ax, budgets)
        ax.set_xlabel("KV budget B")
        ax.set_ylabel("KL(full || method) per token (nats)")
        ax.set_title("Fidelity after the first eviction (teacher-forced, 95% CI)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        figs["fidelity"] = fig

    bars = [r for r in rows if r["n_samples"]]
    labels = [r["method"] if r["budget"] is None else f"{r['method']}\nB={r['budget']}" for r in bars]
    x = list(range(len(bars)))
    if bars:  # failure classes per (method, budget): stacked bars
        fig = _figure(max(6.0, 0.6 * len(bars) + 2), 4.5)
        ax = fig.add_subplot(111)
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
        figs["failures"] = fig

        # Output length per (method, budget): mean with the paired difference interval shifted onto full's mean.
        fig = _figure(max(6.0, 0.6 * len(bars) + 2), 4.0)
        ax = fig.add_subplot(111)
        ax.bar(x, [r["mean_length"] or 0.0 for r in bars], color="#6a8caf")
        if full_row is not None and full_row.get("mean_length") is not None:
            ax.axhline(full_row["mean_length"], color="black", linestyle="--", label="full")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("mean generated tokens")
        ax.set_title("Output length")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        figs["length"] = fig

    # First divergence from full's same-seed completion: distribution per (method, budget).
    if samples:
        full_recs = [r for r in samples if r["method"] == FULL]
        series = []
        for r in bars:
            if r["method"] == FULL:
                continue
            recs = [s for s in samples if s["method"] == r["method"] and s.get("budget") == r["budget"]]
            divs = [first_divergence(m["token_ids"], f["token_ids"]) for m, f in pair_records(recs, full_recs)
                    if m.get("token_ids") is not None and f.get("token_ids") is not None]
            divs = [d for d in divs if d is not None]
            if divs:
                series.append((_label(r), divs))
        if series:
            fig = _figure(max(6.0, 0.8 * len(series) + 2), 4.0)
            ax = fig.add_subplot(111)
            ax.boxplot([d for _, d in series], showmeans=False)
            ax.set_xticks(range(1, len(series) + 1))
            ax.set_xticklabels([lab.replace(" ", "\n") for lab, _ in series], fontsize=7)
            ax.set_ylabel("first differing generated token")
            ax.set_title("First divergence from full's same-seed text")
            ax.grid(alpha=0.3, axis="y")
            fig.tight_layout()
            figs["divergence"] = fig
    return figs


def write_plots(rows: Sequence[Mapping[str, Any]], run_dir: str | Path,
                samples: Sequence[Mapping[str, Any]] = ()) -> list[Path]:
    """The PNG files of :func:`figures` in ``run_dir`` (names in :data:`PLOT_FILES`)."""
    run_dir = Path(run_dir)
    written = []
    for name, fig in figures(rows, samples).items():
        path = run_dir / PLOT_FILES[name]
        fig.savefig(path)
        written.append(path)
    return written


# ----------------------------------------------------------------------------- entry point


def run_window(run_dir: str | Path) -> int | None:
    """The run's window ``w`` from its config.json (None when absent)."""
    try:
        meta = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        w = (meta.get("config") or {}).get("window")
        return int(w) if w is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def summarize(run_dir: str | Path, *, print_table: bool = True, plots: bool = True,
              reference: tuple[str, int | None] = (FULL, None)) -> list[dict[str, Any]]:
    """Rebuild the summary of a run from its ``samples.rank*.jsonl`` / ``fidelity.rank*.jsonl`` files.

    Writes ``summary.csv``, ``summary.md`` and the PNG plots into ``run_dir``; prints a rich
    table when ``print_table``. Returns the rows (see :data:`COLUMNS`). With another ``reference``
    (method, budget) the paired columns compare with it and the files are
    ``summary-vs-<method>-<budget>.csv/md`` (no plots).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    samples = read_all(run_dir, SAMPLES)
    fidelity = read_all(run_dir, FIDELITY)
    if not samples and not fidelity:
        raise FileNotFoundError(f"{run_dir} holds no samples.rank*.jsonl records yet")
    rows = summary_rows(samples, fidelity, window=run_window(run_dir), reference=reference)
    if tuple(reference) != (FULL, None) and not any((r["method"], r["budget"]) == tuple(reference) for r in rows):
        raise ValueError(f"no rows of the reference {reference[0]} B={reference[1]} in {run_dir}: "
                         f"choose one of {', '.join(_label(r) for r in rows)}")
    if tuple(reference) != (FULL, None):
        stem = f"summary-vs-{reference[0]}-{reference[1]}"
        write_csv(rows, run_dir / f"{stem}.csv")
        write_markdown(rows, run_dir / f"{stem}.md", title=f"{run_dir.name} (against {reference[0]} B={reference[1]})")
        if print_table:
            _print_table(rows, title=f"{run_dir.name}: against {reference[0]} B={reference[1]}")
        return rows
    write_csv(rows, run_dir / "summary.csv")
    write_markdown(rows, run_dir / "summary.md", title=run_dir.name)
    if plots:
        write_plots(rows, run_dir, samples)
    if print_table:
        _print_table(rows, title=run_dir.name)
    return rows


_print_table = print_table  # summarize's keyword of the same name hides the function
