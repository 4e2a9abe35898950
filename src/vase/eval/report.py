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
    kv_byte_steps,
    length_stats,
    pass_at_1,
)
from vase.eval.paired import (
    bootstrap_ci,
    discordant,
    first_divergence,
    pair_records,
    paired_problem_diffs,
    sign_flip_test,
)
from vase.eval.config import FULL, records_of_run
from vase.eval.store import FIDELITY, SAMPLES, atomic_write_text
from vase.units import human_bytes

__all__ = [
    "COLUMNS",
    "PERCENT_COLUMNS",
    "summarize",
    "summary_rows",
    "conclusion",
    "parse_reference",
    "reference_name",
    "run_header",
    "table_cells",
    "fit_columns",
    "column_widths",
    "DEFAULT_CELLS",
    "write_csv",
    "write_markdown",
    "print_table",
    "write_plots",
    "figures",
    "PLOT_FILES",
]


#: summary.csv columns, in order. ``*_pct`` are percentages; ``*_lo`` / ``*_hi`` bound 95 % bootstrap
#: intervals over problems; ``d_*`` are paired differences method - full; budget is empty for ``full``.
#: ``keys_match``: the row's (problem, sample) keys are the reference's; ``n_paired`` counts the row's
#: records with a partner in the reference (pass@1 and every paired column use those only).
COLUMNS: tuple[str, ...] = (
    "method", "budget", "window", "reference", "n_problems", "n_samples", "n_paired", "keys_match",
    "pass_at_1_pct", "pass_at_1_stderr_pct", "answered_pct", "cap_pct", "acc_finished_pct", "acc_truncated_pct",
    "d_acc_pct", "d_acc_lo_pct", "d_acc_hi_pct", "only_method_right", "only_full_right", "paired_p",
    "paired_p_exact",
    "agree_pct", "agree_n_both", "both_none_pct", "only_method_answered_pct", "only_full_answered_pct",
    *(f"{c}_{k}" for c in FAILURE_CLASSES for k in ("pct", "lo_pct", "hi_pct")),
    "mean_length", "median_length", "d_length", "d_length_lo", "d_length_hi",
    "identical_pct", "first_div_median", "first_div_q25", "first_div_q75",
    "kv_peak_ratio", "kv_sum_ratio", "kv_bytes_peak_mean", "kv_bytes_time_mean", "kv_bytes_allocated_mean",
    "evictions_mean", "batch_tokens_per_s",
    "kl_evicted", "kl_evicted_lo", "kl_evicted_hi", "top1_agree_evicted_pct", "dnll_evicted", "kl_all",
    "noise_kl", "noise_kl_evicted", "fidelity_problems", "fidelity_tokens_evicted",
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
    d_acc = list(paired_problem_diffs(recs, full, key="correct").values())
    _ci_into(row, d_acc, "d_acc_pct", "d_acc_lo_pct", "d_acc_hi_pct", 100.0)
    # Tested on problems (the sampled unit), as the interval: samples of one problem are not independent.
    row["paired_p"], row["paired_p_exact"] = sign_flip_test(d_acc)
    row["only_method_right"], row["only_full_right"] = discordant(recs, full)
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
    # Peak: each sequence against full's for the same (problem, sample), averaged over sequences.
    row["kv_peak_ratio"] = _mean([_ratio(m.get("kv_bytes_peak"), f.get("kv_bytes_peak")) for m, f in pairs])
    # Held bytes summed over every decode step of every paired sequence, over the reference's same sum: a
    # sequence that runs to the cap counts with all its steps (a mean of per-sequence ratios would not).
    steps = [(kv_byte_steps(m), kv_byte_steps(f)) for m, f in pairs]
    steps = [(a, b) for a, b in steps if a is not None and b is not None]
    row["kv_sum_ratio"] = _ratio(sum(a for a, _ in steps), sum(b for _, b in steps)) if steps else None


def _noise_evicted(ev: Sequence[Mapping[str, Any]], noise: Mapping[str, Sequence[float]]) -> float | None:
    """The noise floor over the same targets as the KL: per problem, the mean of full's per-target noise KL
    from the row's first evicted target on, then the mean over problems (the KL's own weighting). None
    unless every problem has its per-target noise (``noise_kl_tokens`` of full's fidelity record)."""
    per = []
    for r in ev:
        tok = noise.get(str(r["problem_id"]))
        t0 = r.get("first_evicted")
        if tok is None or t0 is None or int(t0) >= len(tok):
            return None
        tail = tok[int(t0):]
        per.append(sum(float(v) for v in tail) / len(tail))
    return statistics.fmean(per) if per else None


def _fidelity_columns(row: dict[str, Any], fid: Sequence[Mapping[str, Any]],
                      noise: Mapping[str, Sequence[float]]) -> None:
    """Fidelity over the targets after each sequence's first eviction, per problem, bootstrapped; the noise
    floor over those same targets (``noise``: full's per-target noise KL by problem)."""
    ev = [r for r in fid if int(r.get("n_tokens_evicted") or 0) > 0 and r.get("kl_mean_evicted") is not None]
    if ev:
        row["noise_kl_evicted"] = _noise_evicted(ev, noise)
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
    full_keys = {(str(r["problem_id"]), int(r["sample"])) for r in full}
    # Full's per-target noise KL (full vs full fed in chunks of w), whatever the reference: the noise floor.
    noise = {str(r["problem_id"]): r["noise_kl_tokens"] for r in fid_groups.get((FULL, None), [])
             if r.get("noise_kl_tokens") is not None}
    rows = []
    for method, budget in sorted(set(groups) | set(fid_groups), key=lambda k: _group_key(*k)):
        recs = groups.get((method, budget), [])
        row: dict[str, Any] = {c: None for c in COLUMNS}
        row["method"], row["budget"], row["window"] = method, budget, window
        row["reference"] = _label({"method": reference[0], "budget": reference[1]})
        row["n_problems"] = len({r["problem_id"] for r in recs})
        row["n_samples"] = len(recs)
        # A partial run (a missing sample of a present problem too) is flagged: compare (problem, sample) keys.
        row["keys_match"] = {(str(r["problem_id"]), int(r["sample"])) for r in recs} == full_keys
        paired = [m for m, _ in pair_records(recs, full)] if full else list(recs)
        row["n_paired"] = len(paired) if full else None
        if recs:
            # pass@1 on the records with a partner, so it is measured on the reference's (problem, sample) set.
            p1, se = pass_at_1(paired or recs)
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
                    for c in COLUMNS[COLUMNS.index("d_acc_pct"):COLUMNS.index("garbage_pct")]:  # incl. paired_p
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
            _fidelity_columns(row, fid, noise)
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


def reference_name(reference: tuple[str, int | None] | str | None) -> str:
    """The reference as ``--against`` spells it: ``full``, ``snapkv:128`` (also from a row's ``reference`` label)."""
    if reference is None:
        return FULL
    if isinstance(reference, str):  # a row's label: "snapkv B=128" or "full"
        method, _, budget = reference.partition(" B=")
        return f"{method}:{budget}" if budget else method
    method, budget = reference
    return method if budget is None else f"{method}:{budget}"


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
    flagged = [_label(r) for r in rows if r.get("keys_match") is False]
    line = "; ".join(parts) + "."
    if flagged:
        line += (f" Rows marked * hold other (problem, sample) pairs than {ref} (a partial run); their pass@1 "
                 f"and paired columns use the shared pairs only: " + ", ".join(flagged) + ".")
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


def _interval(r: Mapping[str, Any], mean: str, lo: str, hi: str, fmt: str) -> str:
    if r.get(mean) is None:
        return "-"
    return f"{r[mean]:{fmt}} [{r[lo]:{fmt}}, {r[hi]:{fmt}}]"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else f"{v:{fmt}}"


def _p_value(r: Mapping[str, Any]) -> str:
    # "~": a Monte Carlo p-value (more than SIGN_FLIP_EXACT_MAX problems differ), else enumerated exactly.
    if r.get("paired_p") is None:
        return "-"
    return f"{r['paired_p']:.3f}" + ("" if r.get("paired_p_exact", True) else "~")


def _kl_cell(r: Mapping[str, Any]) -> str:
    # n: the problems behind the point (those whose full sample outlasts the budget's first eviction).
    cell = _interval(r, "kl_evicted", "kl_evicted_lo", "kl_evicted_hi", ".3f")
    return cell if r.get("kl_evicted") is None else f"{cell} ({r.get('fidelity_problems')})"


Cell = tuple[str, str, Callable[[Mapping[str, Any]], str]]


def table_cells(reference: str = FULL) -> tuple[Cell, ...]:
    """(key, header, formatter) of the table columns; ``reference`` (``full``, ``snapkv:128``) names the
    reference in the headers of the ratios. Composite cells show a value with its interval."""
    return (
        ("method", "method", lambda r: r["method"]),
        ("bw", "B / w", lambda r: "full" if r.get("budget") is None
            else f"{r['budget']} / {r['window']}" if r.get("window") is not None else str(r["budget"])),
        ("n", "n", lambda r: f"{r['n_samples']}" + ("" if r.get("keys_match", True) else "*")),
        ("pass1", "pass@1 %", lambda r: _num(r.get("pass_at_1_pct"), ".1f")),
        ("answered", "answered %", lambda r: _num(r.get("answered_pct"), ".0f")),
        ("d_acc", "Δ pass@1 pts [95% CI]", lambda r: _interval(r, "d_acc_pct", "d_acc_lo_pct", "d_acc_hi_pct", "+.1f")),
        ("paired_p", "paired p (problems)", _p_value),
        ("agree", "agree % (n both)", lambda r: "-" if r.get("agree_pct") is None
            else f"{r['agree_pct']:.0f} ({r['agree_n_both']})"),
        ("loop", "loop %", lambda r: _num(r.get("phrase_loop_pct"), ".0f")),
        ("cap", "at cap %", lambda r: _num(r.get("cap_pct"), ".0f")),
        ("len", "mean len", lambda r: _num(r.get("mean_length"), ".0f")),
        ("d_len", "Δ len [95% CI]", lambda r: _interval(r, "d_length", "d_length_lo", "d_length_hi", "+.0f")),
        ("div", "1st div. tok (median)", lambda r: _num(r.get("first_div_median"), ".0f")),
        ("kv_peak", f"KV peak / {reference}", lambda r: _num(r.get("kv_peak_ratio"), ".2f")),
        ("kv_avg", f"KV avg / {reference}", lambda r: _num(r.get("kv_sum_ratio"), ".2f")),
        ("evictions", "evictions / seq", lambda r: _num(r.get("evictions_mean"), ".1f")),
        ("kl", "KL after 1st evict. [95% CI] (n)", _kl_cell),
        ("top1", "top-1 % after evict.", lambda r: _num(r.get("top1_agree_evicted_pct"), ".1f")),
        ("tok_s", "batch tok/s", lambda r: _num(r.get("batch_tokens_per_s"), ".1f")),
    )


_CELLS: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = tuple((h, f) for _, h, f in table_cells())
#: The console's default columns (the README's table), in the order they are dropped last to first when
#: the terminal is too narrow; ``--wide`` shows every column. The CSV, Markdown and HTML hold all of them.
DEFAULT_CELLS: tuple[str, ...] = ("method", "bw", "pass1", "d_acc", "paired_p", "kv_avg", "kl", "n", "answered",
                                  "evictions")

LEGEND = (
    "Δ columns: method minus the reference (full unless said otherwise) on the same (problem, sample) seeds, averaged per problem, 95% paired "
    "bootstrap interval over problems; paired p: sign-flip permutation test on those per-problem differences "
    "(exact; ~ = Monte Carlo, 20000 sign draws, seed 0, above 20 problems that differ), McNemar's exact test "
    "when there is one sample per problem. "
    "agree: same answer as full (math-verify) among pairs where both answered. at cap: hit the token cap. "
    "1st div.: first generated token where the text leaves full's same-seed text. KV peak over the reference: "
    "each sequence's peak K/V bytes over the reference's for the same (problem, sample), averaged; KV avg: K/V "
    "bytes held summed over every decode step of every paired sequence over the reference's same sum. KL, top-1: "
    "full's sample 0 teacher-forced through the method, over the targets after the first eviction only; (n) = "
    "problems whose full sample outlasts that budget's first eviction. "
    "batch tok/s: throughput of this run's batches, not a speed comparison (use `vase bench`). "
    "* = other (problem, sample) pairs than the reference (a partial run): pass@1 and Δ use the shared pairs."
)


def _noise_line(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The noise floor: over each row's own KL targets when measured per target, else over all targets."""
    same = [r["noise_kl_evicted"] for r in rows if r.get("noise_kl_evicted") is not None]
    full = next((r["noise_kl"] for r in rows if r["method"] == FULL and r.get("noise_kl") is not None), None)
    if same:
        return (f"KL noise floor (full vs full teacher-forced in chunks of w) over each row's KL targets: at most "
                f"{max(same):.2e} nats/token (noise_kl_evicted in the CSV)"
                + (f"; over all targets {full:.2e}" if full is not None else "")
                + ". ΔNLL is measured on full's own sample.")
    if full is not None:
        return (f"KL noise floor (full vs full teacher-forced in chunks of w): {full:.2e} nats/token over all "
                "targets; ΔNLL is measured on full's own sample.")
    return None


def _reference_of(rows: Sequence[Mapping[str, Any]]) -> str:
    return reference_name(next((r.get("reference") for r in rows if r.get("reference")), FULL))


def write_markdown(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str | None = None) -> Path:
    cells = table_cells(_reference_of(rows))
    lines = []
    if title:
        lines += [f"# {title}", ""]
    lines.append("| " + " | ".join(h for _, h, _ in cells) + " |")
    lines.append("|" + "|".join("---" if k == "method" else "---:" for k, _, _ in cells) + "|")
    for r in rows:
        lines.append("| " + " | ".join(f(r) for _, _, f in cells) + " |")
    lines += ["", conclusion(rows), ""]
    noise = _noise_line(rows)
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
        if not console.is_terminal:  # a log file: do not squeeze the table into 80 columns
            console = Console(width=max(console.width, 240))
    ref = _reference_of(rows)
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
            for r, v in zip(rs, y):  # the problems behind each point differ with the budget: say how many
                ax.annotate(f"n={r.get('fidelity_problems')}", (r["budget"], v), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
        same = [r["noise_kl_evicted"] for r in rows if r.get("noise_kl_evicted") is not None]
        if same:
            ax.axhline(max(same), color="grey", linestyle=":", label="noise floor (same targets, max)")
        elif full_row is not None and full_row.get("noise_kl") is not None:
            ax.axhline(full_row["noise_kl"], color="grey", linestyle=":", label="noise floor (all targets)")
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
                         f"choose one of {', '.join(_label(r) for r in rows)}")
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
