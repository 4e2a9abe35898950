"""What the randomness study writes and prints: randomness.json / .csv, the attention-error and mechanism plots,
and the console table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch



CSV_COLUMNS = ("method", "stochastic", "kl_after_eviction", "top1_agree", "attn_err_mean", "coverage", "overlap",
               "evictions", "ensemble_kl_mixture", "ensemble_kl_single_mean", "ensemble_ratio", "ensemble_ratio_lo",
               "ensemble_ratio_hi", "loop_share")


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def write_files(report: dict, per_arm: dict, out_dir: Path) -> None:
    (out_dir / "randomness.json").write_text(json.dumps(report, indent=2))
    lines = [",".join(CSV_COLUMNS)]
    for row in report["methods"] + report.get("controls", []):  # controls: the ensemble columns only
        lines.append(",".join(_fmt(row.get(c)) for c in CSV_COLUMNS))
    (out_dir / "randomness.csv").write_text("\n".join(lines) + "\n")
    plot_randomness(report, per_arm, out_dir)


def plot_randomness(report: dict, per_arm: dict, out_dir: Path) -> list[Path]:
    """attn_error.png (per layer; over time) and mechanisms.png (coverage, overlap, ensemble KL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["methods"]
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for row in rows:
        style = "-" if row["stochastic"] else "--"
        ax1.plot(row["attn_err_per_layer"], style, label=row["method"])
        curves = per_arm[row["method"]]["err_time"]
        if curves:
            n = min(len(c) for c in curves)
            ax2.plot(torch.stack([c[:n] for c in curves]).mean(0).numpy(), style, label=row["method"], lw=1)
    ax1.set_xlabel("layer")
    ax1.set_ylabel("attention-output error vs full")
    ax1.set_title("after the first eviction, per layer")
    ax2.set_xlabel("generated token")
    ax2.set_title("over time (mean over layers)")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "attn_error.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 4, figsize=(14.5, 3.4))
    names = [r["method"] for r in rows]
    x = range(len(rows))
    colors = ["tab:orange" if r["stochastic"] else "tab:blue" for r in rows]
    axes[0].bar(x, [r["coverage"] or 0 for r in rows], color=colors)
    axes[0].set_title("coverage (ever kept / ever offered)")
    axes[1].bar(x, [r["overlap"] or 0 for r in rows], color=colors)
    axes[1].set_title("overlap of consecutive kept sets")
    single = [r["ensemble_kl_single_mean"] or r["kl_after_eviction"] or 0 for r in rows]
    mix = [r["ensemble_kl_mixture"] if r["ensemble_kl_mixture"] is not None else float("nan") for r in rows]
    axes[2].bar([i - 0.2 for i in x], single, width=0.4, label="single seed (mean)", color="tab:gray")
    axes[2].bar([i + 0.2 for i in x], mix, width=0.4, label="seed mixture", color="tab:green")
    axes[2].set_title("KL(full || .) after first eviction")
    axes[2].legend(fontsize=7)
    for ax in axes[:3]:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    # Mixture / single with bootstrap intervals: seed mixtures (orange) against the top-k controls (blue).
    ratios = [r for r in rows if r.get("ensemble_ratio") is not None] + \
        [c for c in report.get("controls", []) if c.get("ensemble_ratio") is not None]
    for i, r in enumerate(ratios):
        lo, hi = r.get("ensemble_ratio_lo"), r.get("ensemble_ratio_hi")
        err = [[r["ensemble_ratio"] - lo], [hi - r["ensemble_ratio"]]] if lo is not None and not math.isnan(lo) else None
        axes[3].bar(i, r["ensemble_ratio"], yerr=err, capsize=3, color="tab:orange" if r.get("stochastic") else "tab:blue")
    axes[3].axhline(1.0, color="k", lw=0.5)
    axes[3].set_xticks(range(len(ratios)))
    axes[3].set_xticklabels([r["method"] for r in ratios], rotation=30, ha="right", fontsize=8)
    axes[3].set_title("mixture / single KL (95% bootstrap)")
    fig.tight_layout()
    paths.append(out_dir / "mechanisms.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def print_report(report: dict, console) -> None:
    """The study's table on a rich console."""
    from rich.table import Table

    c = report["config"]
    table = Table(title=f"B={c['budget']}, w={c['window']}, {len(report['problems'])} trajectories, "
                        f"{c['seeds']} seeds for stochastic methods ({report['seconds']:.0f} s)")
    cols = [("method", "method", None), ("KL", "kl_after_eviction", ".4f"), ("top-1", "top1_agree", ".3f"),
            ("attn err", "attn_err_mean", ".4f"), ("coverage", "coverage", ".3f"), ("overlap", "overlap", ".3f"),
            ("KL mixture", "ensemble_kl_mixture", ".4f"), ("mix/single", "ensemble_ratio", ".3f"),
            ("lo", "ensemble_ratio_lo", ".3f"), ("hi", "ensemble_ratio_hi", ".3f"),
            ("loops", "loop_share", ".2f")]
    for name, _, _ in cols:
        table.add_column(name)
    for row in report["methods"]:
        table.add_row(*[str(row[k]) if f is None else ("-" if row[k] is None else format(row[k], f))
                        for _, k, f in cols])
    console.print(table)
    for c in report.get("controls", []):
        if c.get("ensemble_ratio") is not None:
            console.print(f"control {c['method']} (top-k at B = {', '.join(map(str, c['budgets']))}): mixture / single "
                          f"{c['ensemble_ratio']:.3f} [{c['ensemble_ratio_lo']:.3f}, {c['ensemble_ratio_hi']:.3f}]")
    for c in report.get("comparisons", []):
        console.print(f"{c['arm']} seeds vs {c['control']} on the same rows: ratio {c['arm_ratio']:.3f} vs "
                      f"{c['control_ratio']:.3f}, difference {c['difference']:+.3f} "
                      f"[{c['difference_lo']:+.3f}, {c['difference_hi']:+.3f}] ({c['problems']} problems)")
