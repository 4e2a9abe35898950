"""What a vLLM bench run records and reports: its rows (one per engine run, with their decode steps), paired
into ratios against stock vLLM (the results file's summary), the CSV and markdown tables and the plot of
`vase bench --engine vllm`."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .paired import paired_ratio


#: Stock vLLM rows: at its own defaults (the baseline, ``full``) and at the plugin's engine settings (V1 model
#: runner, plus ``vase_kwargs``: on a GPU piecewise CUDA graphs and no async scheduling), the second one only when
#: ``vase_kwargs`` is given.
STOCK_AT_VASE = "full@vase-settings"
STOCK_METHODS = ("full", STOCK_AT_VASE)


@dataclass
class Step:
    """One engine step as the stat logger saw it."""

    t: float  # seconds since the requests were submitted
    running: int
    waiting: int
    blocks: int  # KV blocks in use (all requests)
    preempted: int  # requests preempted in this step
    tokens: int  # output tokens produced in this step


@dataclass
class VllmBenchRow:
    """One configuration: a method at a budget (``full``: stock vLLM) under one KV pool."""

    regime: str
    method: str
    budget: int | None
    window: int | None
    n_requests: int
    prompt_len: int
    new_tokens: int
    pool_bytes: int
    pool_blocks: int
    block_size: int
    seconds: float  # submit -> last request finished
    output_tokens: int
    tokens_per_s: float
    running_peak: int
    running_mean: float  # time-weighted over the run
    preemptions: int
    blocks_peak: int
    blocks_mean: float  # time-weighted over the run
    evictions: int | None  # eviction events counted by the plugin's worker (None: stock vLLM)
    engine_start_s: float
    #: tokens the plugin's worker prefilled again to replay preempted requests (None: stock vLLM, which does not
    #: count them; vLLM's prompt-token stats do not see recomputes)
    recomputed_tokens: int | None = None
    vs_full_tok_s: float | None = None
    vs_full_time: float | None = None  # full's seconds / this one's (> 1: finishes sooner)
    same_as_ample: int | None = None  # requests whose tokens equal the ample run's (None: no ample run to compare)
    first_diff_median: float | None = None  # median first differing token index vs the ample run
    round: int = 0  # the paired round this run belongs to (0 .. repeats - 1)
    timeline: list[Step] = field(default_factory=list, repr=False)
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # token ids per request, in request order

    def as_record(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        d.pop("outputs")
        return d



#: How `scripts/render_docs.py` draws `paired_summary`'s rows in the docs (the results file's "table").
SUMMARY_TABLE = {
    "columns": ["pool", "method", "B", "rounds", "tok/s (median)", "vs stock (median of round ratios)", "lowest",
                "highest", "seconds (median)", "requests running (mean)", "preemptions (each round)", "blocks peak",
                "pool blocks", "same tokens as ample (worst round)"],
    "keys": ["regime", "method", "budget", "repeats", "tokens_per_s", "vs_full_tok_s", "vs_full_tok_s_lo",
             "vs_full_tok_s_hi", "seconds", "running_mean", "preemptions_runs", "blocks_peak", "pool_blocks",
             "same_as_ample"],
    "align": "lllrrrrrrrlrrr",
    "formats": {"tokens_per_s": ".1f", "vs_full_tok_s": ".2f", "vs_full_tok_s_lo": ".2f", "vs_full_tok_s_hi": ".2f",
                "seconds": ".0f", "running_mean": ".1f"},
}


def paired_summary(rows: Sequence[VllmBenchRow]) -> list[dict[str, Any]]:
    """One dict per (regime, method, budget) over its rounds: median rate and seconds, and each ratio to stock
    vLLM as the median of the rounds' own ratios with its range (``_lo`` .. ``_hi``, `paired_ratio`);
    ``same_as_ample`` / ``first_diff_median`` are the worst round's (fewest identical requests)."""
    stock = {(r.regime, r.round): r for r in rows if r.method == "full"}
    groups: dict[tuple, list[VllmBenchRow]] = {}
    for r in rows:
        groups.setdefault((r.regime, r.method, r.budget), []).append(r)
    out = []
    for (regime, method, budget), runs in groups.items():
        refs = [stock.get((regime, r.round)) for r in runs]
        tok = paired_ratio([r.tokens_per_s for r in runs], [f.tokens_per_s if f else None for f in refs])
        time_ = paired_ratio([f.seconds if f else None for f in refs], [r.seconds for r in runs])
        compared = [r for r in runs if r.same_as_ample is not None]
        worst = min(compared, key=lambda r: (r.same_as_ample, r.first_diff_median)) if compared else None
        evictions = [r.evictions for r in runs if r.evictions is not None]
        recomputed = [r.recomputed_tokens for r in runs if r.recomputed_tokens is not None]
        r0 = runs[0]
        out.append({
            "regime": regime, "method": method, "budget": budget, "window": r0.window, "n_requests": r0.n_requests,
            "prompt_len": r0.prompt_len, "new_tokens": r0.new_tokens, "pool_blocks": r0.pool_blocks,
            "block_size": r0.block_size, "repeats": len(runs),
            "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
            "tokens_per_s_runs": ";".join(f"{r.tokens_per_s:.2f}" for r in runs),
            "seconds": statistics.median(r.seconds for r in runs),
            "vs_full_tok_s": None if method == "full" or math.isnan(tok[0]) else tok[0],
            "vs_full_tok_s_lo": None if method == "full" or math.isnan(tok[1]) else tok[1],
            "vs_full_tok_s_hi": None if method == "full" or math.isnan(tok[2]) else tok[2],
            "vs_full_time": None if method == "full" or math.isnan(time_[0]) else time_[0],
            "vs_full_time_lo": None if method == "full" or math.isnan(time_[1]) else time_[1],
            "vs_full_time_hi": None if method == "full" or math.isnan(time_[2]) else time_[2],
            "running_mean": statistics.median(r.running_mean for r in runs),
            "preemptions": statistics.median(r.preemptions for r in runs),
            "preemptions_runs": ";".join(str(r.preemptions) for r in runs),
            "blocks_peak": max(r.blocks_peak for r in runs),
            "evictions": statistics.median(evictions) if evictions else None,
            "recomputed_tokens": max(recomputed) if recomputed else None,
            "same_as_ample": None if worst is None else worst.same_as_ample,
            "first_diff_median": None if worst is None else worst.first_diff_median,
        })
    return out


_COLUMNS = ("round", "regime", "method", "budget", "n_requests", "new_tokens", "pool_blocks", "tokens_per_s", "vs_full_tok_s",
            "seconds", "vs_full_time", "running_peak", "running_mean", "preemptions", "blocks_peak", "blocks_mean",
            "evictions", "recomputed_tokens", "same_as_ample", "first_diff_median")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def write_vllm_report(rows: Sequence[VllmBenchRow], out: str | Path) -> dict[str, Path]:
    """``vllm_bench.csv`` (every field, one row per configuration and round), ``vllm_bench.md`` (the table, and
    with several rounds the paired summary), ``vllm_timeline.csv`` (every step) and ``vllm_bench.png`` (requests
    running and blocks in use over time, full vs each method, per regime; the first round)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "vllm_bench.csv", "md": out / "vllm_bench.md", "timeline": out / "vllm_timeline.csv",
             "png": out / "vllm_bench.png"}
    records = [r.as_record() for r in rows]
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records)
    with paths["timeline"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "regime", "method", "budget", *Step.__dataclass_fields__])
        for r in rows:
            for s in r.timeline:
                w.writerow([r.round, r.regime, r.method, r.budget, *asdict(s).values()])
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_fmt(rec[c]) for c in _COLUMNS) + " |" for rec in records]
    r0 = rows[0]
    if any(r.round > 0 for r in rows):  # several rounds: the paired medians and ranges first
        summary = paired_summary(rows)
        cols = ("regime", "method", "budget", "repeats", "tokens_per_s", "vs_full_tok_s", "seconds", "vs_full_time",
                "preemptions", "same_as_ample")
        paired = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for rec in summary:
            cells = []
            for c in cols:
                v = _fmt(rec[c])
                if c.startswith("vs_full") and rec[c] is not None:
                    v += f" ({rec[c + '_lo']:.2f}-{rec[c + '_hi']:.2f})"
                cells.append(v)
            paired.append("| " + " | ".join(cells) + " |")
        lines = ["Paired rounds: medians over rounds; each ratio the median of the rounds' own ratios (range).", "",
                 *paired, "", "Every round:", "", *lines]
    paths["md"].write_text(f"vLLM, {r0.n_requests} requests x {r0.new_tokens} new tokens (prompt {r0.prompt_len}), "
                           f"block size {r0.block_size}\n\n" + "\n".join(lines) + "\n\n"
                           "same_as_ample: requests whose tokens equal the same configuration's ample run (nothing "
                           "preempted there); first_diff_median: median first differing token index (new_tokens: "
                           "none differs).\n", encoding="utf-8")
    _plot(rows, paths["png"])
    return paths


def _plot(rows: Sequence[VllmBenchRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.round == 0]  # one round: the timelines of later ones look alike
    regimes = list(dict.fromkeys(r.regime for r in rows))
    fig, axes = plt.subplots(2, len(regimes), figsize=(6 * len(regimes), 7), squeeze=False)
    for j, regime in enumerate(regimes):
        for r in (x for x in rows if x.regime == regime):
            label = {"full": "full (stock vLLM)", STOCK_AT_VASE: "stock vLLM at vase's settings"}.get(
                r.method, f"{r.method} B={r.budget}")
            ts = [s.t for s in r.timeline]
            axes[0][j].step(ts, [s.running for s in r.timeline], where="post", label=label)
            axes[1][j].step(ts, [s.blocks for s in r.timeline], where="post", label=label)
        pool = next(x.pool_blocks for x in rows if x.regime == regime)
        axes[1][j].axhline(pool, color="grey", linestyle=":", label="pool")
        axes[0][j].set_title(f"{regime}: requests running")
        axes[1][j].set_title(f"{regime}: KV blocks in use")
        axes[1][j].set_xlabel("seconds since submit")
        axes[0][j].legend(fontsize=8)
        axes[1][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
