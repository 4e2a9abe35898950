"""The summary rows as PNG plots (matplotlib's Agg canvas, no global backend change)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vase.eval.config import FULL
from vase.eval.paired import first_divergence, pair_records
from vase.eval.table import row_label

__all__ = ["PLOT_FILES", "figures", "write_plots"]

PLOT_FILES = {"accuracy": "accuracy_vs_budget.png", "fidelity": "fidelity_kl_vs_budget.png",
              "failures": "failures.png", "length": "length.png", "divergence": "first_divergence.png"}


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


def _accuracy(by_method: Mapping[str, list[Mapping[str, Any]]], full_row: Mapping[str, Any] | None,
              budgets: list[int]):
    """Accuracy vs budget, full as a horizontal line with its standard error band."""
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
    return fig


def _fidelity(rows: Sequence[Mapping[str, Any]], by_method: Mapping[str, list[Mapping[str, Any]]],
              full_row: Mapping[str, Any] | None, budgets: list[int]):
    """Fidelity (KL after the first eviction, 95% interval) vs budget; None without fidelity rows."""
    fid = {m: [r for r in rs if r["kl_evicted"] is not None and r["budget"] is not None] for m, rs in by_method.items()}
    fid = {m: rs for m, rs in fid.items() if rs}
    if not fid:
        return None
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
    return fig


def _bar_labels(bars: Sequence[Mapping[str, Any]]) -> list[str]:
    return [r["method"] if r["budget"] is None else f"{r['method']}\nB={r['budget']}" for r in bars]


def _failures(bars: Sequence[Mapping[str, Any]]):
    """Failure classes per (method, budget): stacked bars."""
    x = list(range(len(bars)))
    fig = _figure(max(6.0, 0.6 * len(bars) + 2), 4.5)
    ax = fig.add_subplot(111)
    bottom = [0.0] * len(bars)
    colors = {"ok": "#4c9f70", "truncated": "#e0b040", "phrase_loop": "#d0603a", "garbage": "#7a4ea3"}
    for c in ("ok", "truncated", "phrase_loop", "garbage"):
        vals = [r.get(f"{c}_pct") or 0.0 for r in bars]
        ax.bar(x, vals, bottom=bottom, label=c, color=colors.get(c))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x)
    ax.set_xticklabels(_bar_labels(bars), fontsize=7)
    ax.set_ylabel("share of completions (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Failure classes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def _length(bars: Sequence[Mapping[str, Any]], full_row: Mapping[str, Any] | None):
    """Output length per (method, budget): the mean, full's as a line."""
    x = list(range(len(bars)))
    fig = _figure(max(6.0, 0.6 * len(bars) + 2), 4.0)
    ax = fig.add_subplot(111)
    ax.bar(x, [r["mean_length"] or 0.0 for r in bars], color="#6a8caf")
    if full_row is not None and full_row.get("mean_length") is not None:
        ax.axhline(full_row["mean_length"], color="black", linestyle="--", label="full")
    ax.set_xticks(x)
    ax.set_xticklabels(_bar_labels(bars), fontsize=7)
    ax.set_ylabel("mean generated tokens")
    ax.set_title("Output length")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _divergence(bars: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]]):
    """First divergence from full's same-seed completion: distribution per (method, budget); None if none."""
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
            series.append((row_label(r), divs))
    if not series:
        return None
    fig = _figure(max(6.0, 0.8 * len(series) + 2), 4.0)
    ax = fig.add_subplot(111)
    ax.boxplot([d for _, d in series], showmeans=False)
    ax.set_xticks(range(1, len(series) + 1))
    ax.set_xticklabels([lab.replace(" ", "\n") for lab, _ in series], fontsize=7)
    ax.set_ylabel("first differing generated token")
    ax.set_title("First divergence from full's same-seed text")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


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
    figs["accuracy"] = _accuracy(by_method, full_row, budgets)
    fidelity = _fidelity(rows, by_method, full_row, budgets)
    if fidelity is not None:
        figs["fidelity"] = fidelity
    bars = [r for r in rows if r["n_samples"]]
    if bars:
        figs["failures"] = _failures(bars)
        figs["length"] = _length(bars, full_row)
    if samples:
        divergence = _divergence(bars, samples)
        if divergence is not None:
            figs["divergence"] = divergence
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
