"""The summary rows of a run: one per (method, budget), every comparison paired with the reference.

    rows = summary_rows(samples, fidelity, window=16)

Sample ``s`` of a problem has the same seed under every method, so each completion is compared with
the reference's (full's, by default) completion of the same (problem, sample), and intervals come
from a bootstrap over problems. The columns are defined in docs/eval.md ("What the numbers mean") and
in :data:`COLUMNS`. Rows are ordered ``full`` first, then method labels alphabetically, budgets
ascending; every number is computed from records sorted by key with a fixed bootstrap seed. Also the
words under a table: :func:`conclusion` and :func:`noise_line`. Pure arithmetic: no files, no output.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from vase.eval.config import FULL
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

__all__ = [
    "COLUMNS",
    "PERCENT_COLUMNS",
    "summary_rows",
    "parse_reference",
    "reference_name",
    "reference_of",
    "row_label",
    "conclusion",
    "noise_line",
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


def _budget_sort(b: Any) -> tuple[int, float]:
    return (0, -1.0) if b is None else (1, float(b))


def _sort_key(r: Mapping[str, Any]) -> tuple:
    return (str(r.get("method")), _budget_sort(r.get("budget")), str(r.get("problem_id")), int(r.get("sample", 0)))


def _group_key(method: str, budget: Any) -> tuple:
    return (0 if method == FULL else 1, method, _budget_sort(budget))


def _mean(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else None


def _mean_all(values: Sequence[Any]) -> float | None:
    """The mean, or None when a value is missing: a K/V column the eval could not know for some sequence
    (`EvalRunner._row_stats`) is left empty, not averaged over the sequences it knows."""
    return None if any(v is None for v in values) else _mean(values)


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
    known = all(a is not None and b is not None for a, b in steps)  # else empty: a partial sum is another number
    row["kv_sum_ratio"] = _ratio(sum(a for a, _ in steps), sum(b for _, b in steps)) if steps and known else None


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
        row["reference"] = row_label({"method": reference[0], "budget": reference[1]})
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
            row["kv_bytes_peak_mean"] = _mean_all([r.get("kv_bytes_peak") for r in recs])
            row["kv_bytes_time_mean"] = _mean_all([r.get("kv_bytes_time_mean") for r in recs])
            row["kv_bytes_allocated_mean"] = _mean_all([r.get("kv_bytes_allocated") for r in recs])
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


def reference_of(rows: Sequence[Mapping[str, Any]]) -> str:
    """The reference the rows were paired with, as ``--against`` spells it (``full`` when none is named)."""
    return reference_name(next((r.get("reference") for r in rows if r.get("reference")), FULL))


def row_label(r: Mapping[str, Any]) -> str:
    """A row's (or a record's) name in text: ``full``, ``snapkv B=128``."""
    return r["method"] if r.get("budget") is None else f"{r['method']} B={r['budget']}"


# A row is called below (or above) the reference only when both the bootstrap interval and the exact paired
# test say so: at n = 16 a bootstrap interval can exclude 0 where the sign-flip test gives p = 0.125 (4 problems
# worse, none better), and the interval alone would then call a difference that the test does not support.
ALPHA = 0.05


def _verdict(r: Mapping[str, Any]) -> str:
    """``worse``, ``better`` or ``unclear`` for one row: a side only when the 95 % interval excludes 0 on it
    *and* the exact paired test's p is below :data:`ALPHA`."""
    p = r.get("paired_p")
    significant = p is not None and p < ALPHA
    if r["d_acc_hi_pct"] < 0 and significant:
        return "worse"
    if r["d_acc_lo_pct"] > 0 and significant:
        return "better"
    return "unclear"


def _p_text(r: Mapping[str, Any]) -> str:
    from vase.eval.cells import format_p

    p = r.get("paired_p")
    return "p n/a" if p is None else f"p = {format_p(p)}" + ("" if r.get("paired_p_exact", True) else "~")


def _merged(items: list[tuple[str, str]]) -> str:
    """Rows that share the same figures named once with them: 'a B=12, b B=12 (-88 pts, p = 1.2e-4); c (...)'."""
    by: dict[str, list[str]] = defaultdict(list)
    for label, figures in items:
        by[figures].append(label)
    return "; ".join(f"{', '.join(labels)} ({figures})" for figures, labels in by.items())


def verdict_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The verdict as short lines, one per class (less / more accurate than the reference, not distinguishable),
    rows with the same change and p named together; then a line on partial rows, if any. Empty without rows to
    compare. `conclusion` joins them into the console's one line; the docs print them as a list.

    A row is below (above) only when its 95 % bootstrap interval lies below (above) 0 and the paired
    sign-flip test gives p < 0.05; every other row is "not distinguishable at n = N problems", with its
    interval and p, so no line claims what one of the two does not support.
    """
    worse, better, unclear = [], [], []
    ref = next((r["reference"] for r in rows if r.get("reference")), FULL)
    for r in rows:
        if row_label(r) == ref or r.get("d_acc_lo_pct") is None:
            continue
        verdict = _verdict(r)
        if verdict in ("worse", "better"):
            (worse if verdict == "worse" else better).append((row_label(r), f"{r['d_acc_pct']:+.0f} pts, {_p_text(r)}"))
        else:
            unclear.append((row_label(r), f"[{r['d_acc_lo_pct']:+.1f}, {r['d_acc_hi_pct']:+.1f}] pts, {_p_text(r)}"))
    n = max((r["n_problems"] for r in rows), default=0)
    rule = f"95% interval and exact paired test, p < {ALPHA:g}"
    lines = []
    if worse:
        lines.append(f"less accurate than {ref} ({rule}): " + _merged(worse))
    if better:
        lines.append(f"more accurate than {ref} ({rule}): " + _merged(better))
    if unclear:
        lines.append(f"not distinguishable from {ref} on accuracy at n = {n} problems (the interval contains 0 "
                     "or the paired test does not reject): " + _merged(unclear))
    flagged = [row_label(r) for r in rows if r.get("keys_match") is False]
    if lines and flagged:
        lines.append(f"Rows marked * hold other (problem, sample) pairs than {ref} (a partial run); their pass@1 "
                     f"and paired columns use the shared pairs only: " + ", ".join(flagged))
    return lines


def conclusion(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line: which rows the paired comparison puts below or above the reference on accuracy
    (:func:`verdict_lines` joined)."""
    lines = verdict_lines(rows)
    if not lines:
        ref = next((r["reference"] for r in rows if r.get("reference")), FULL)
        return f"No paired comparison with {ref} yet."
    if lines[-1].startswith("Rows marked *"):
        return "; ".join(lines[:-1]) + ". " + lines[-1] + "."
    return "; ".join(lines) + "."


def noise_line(rows: Sequence[Mapping[str, Any]]) -> str | None:
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
