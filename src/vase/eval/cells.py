"""The summary table's columns as text: (key, header, formatter) per column, and the legend under it.

One definition for every rendering of the rows: the console table, ``summary.md`` and the HTML report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vase.eval.config import FULL

__all__ = ["Cell", "table_cells", "DEFAULT_CELLS", "LEGEND", "format_p"]


def _interval(r: Mapping[str, Any], mean: str, lo: str, hi: str, fmt: str) -> str:
    if r.get(mean) is None:
        return "-"
    return f"{r[mean]:{fmt}} [{r[lo]:{fmt}}, {r[hi]:{fmt}}]"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else f"{v:{fmt}}"


def format_p(p: float) -> str:
    """A p-value as text: three decimals from 0.001 up, else two significant digits (1.2e-4, never 0.000)."""
    if p >= 0.001 or p <= 0:
        return f"{p:.3f}"
    mantissa, exponent = f"{p:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _p_value(r: Mapping[str, Any]) -> str:
    # "~": a Monte Carlo p-value (more than SIGN_FLIP_EXACT_MAX problems differ), else enumerated exactly.
    if r.get("paired_p") is None:
        return "-"
    return format_p(r["paired_p"]) + ("" if r.get("paired_p_exact", True) else "~")


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
