"""Benchmark output: a rich table in the terminal, CSV, markdown and PNG plots.

    paths = write_report(rows, "bench-results/run1")   # prints the table, writes every file

Rows are `run_bench`'s dicts. A row whose eviction never fired (`eviction_fired` False) is
marked in the table ("NO EVICTION"), in the plots (red x), and carries no speed-up ratios.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CSV_COLUMNS", "label", "plot", "print_table", "read_csv", "to_markdown", "write_csv", "write_report",
           "write_results_file"]

#: every column of the CSV, in order (see `vase.bench.runner` for their meaning)
CSV_COLUMNS = [
    "model", "device", "dtype", "attn", "batch", "method", "compiled", "budget", "window", "prompt_length",
    "new_tokens", "repeats", "tok_s", "vs_full", "vs_dynamic", "seg_tok_s", "seg_ratio", "steady_ratio", "step_ms", "decode_s", "prefill_s", "evictions",
    "expected_evictions", "eviction_fired", "evict_ms", "evict_step_ms", "evict_share", "kv_bytes", "kv_bytes_alloc",
    "kv_bytes_full", "kv_vs_full", "stored_length", "peak_mem_bytes", "peak_mem_delta_bytes", "mem_method", "flag",
    # the ceiling (docs/bench.md) and the paired repeats
    "clock", "tok_s_runs", "vs_full_lo", "vs_full_hi", "vs_dynamic_lo", "vs_dynamic_hi", "bytes_step", "bytes_weights", "bytes_kv",
    "bandwidth_gbs", "roofline_tok_s", "roofline_share", "ceiling_vs_full", "gain_vs_full", "ceiling_vs_dynamic",
    "gain_vs_dynamic",
]

_MIB = 1024 * 1024


def _missing(v) -> bool:
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def _fmt(v, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if _missing(v) else f"{float(v):{spec}}{suffix}"


def label(row: dict) -> str:
    """A row's method with its budget: `vase-attnv B=512`, `full`, `dynamic`, `full compiled`."""
    name = row["method"] if _missing(row.get("budget")) else f"{row['method']} B={int(row['budget'])}"
    return name + " compiled" if row.get("compiled") else name


def write_csv(rows: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if _missing(row.get(k)) else row.get(k)) for k in CSV_COLUMNS})
    return path


def read_csv(path: str | Path) -> list[dict]:
    """Rows back from `write_csv`, numbers as numbers and empty cells as None."""
    rows = []
    with Path(path).open(newline="") as f:
        for raw in csv.DictReader(f):
            row: dict = {}
            for k, v in raw.items():
                if v == "":
                    row[k] = None
                elif v in ("True", "False"):
                    row[k] = v == "True"
                else:
                    try:
                        row[k] = int(v)
                    except ValueError:
                        try:
                            row[k] = float(v)
                        except ValueError:
                            row[k] = v
            rows.append(row)
    return rows


def _mib(v) -> float | None:
    return None if _missing(v) else v / _MIB


def _table_cells(row: dict) -> list[str]:
    no_evict = row.get("eviction_fired") is False
    ratio = (lambda v: "n/a" if no_evict else _fmt(v, ".2f", "x"))
    return [
        str(row["batch"]), label(row), str(row["new_tokens"]), _fmt(row["tok_s"]),
        ratio(row.get("vs_full")) + _range(row, "vs_full"), _ceiling_cell(row, "full", no_evict),
        ratio(row.get("vs_dynamic")) + _range(row, "vs_dynamic"), _ceiling_cell(row, "dynamic", no_evict),
        _pct(row.get("roofline_share")), _quarters(row), _fmt(row.get("seg_ratio"), ".2f"),
        _fmt(row.get("step_ms"), ".2f"),
        "-" if row.get("eviction_fired") is None else str(row.get("evictions")),
        _fmt(row.get("evict_ms"), ".2f"), _pct(row.get("evict_share"), ".1f"), _fmt(_mib(row.get("kv_bytes")), ".2f"),
        _fmt(_mib(row.get("peak_mem_delta_bytes")), ".2f"),
        "NO EVICTION (P+N <= B+w)" if no_evict else (row.get("flag") or ""),
    ]


def _pct(v, spec: str = ".0f") -> str:
    return "-" if _missing(v) else f"{100 * float(v):{spec}}%"


def _range(row: dict, key: str) -> str:
    """ ` [lo-hi]` of a paired ratio over more than one round."""
    lo, hi = row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if _missing(lo) or _missing(hi) or (row.get("repeats") or 1) < 2:
        return ""
    return f" [{float(lo):.2f}-{float(hi):.2f}]"


def _ceiling_cell(row: dict, ref: str, no_evict: bool) -> str:
    """The ceiling the traffic model allows beside a ratio, and the share of its gain reached: `1.45x 80%`."""
    ceiling = row.get(f"ceiling_vs_{ref}")
    if no_evict or _missing(ceiling):
        return "-"
    gain = row.get(f"gain_vs_{ref}")
    return f"{float(ceiling):.2f}x" + ("" if _missing(gain) else f" {100 * float(gain):.0f}%")


def _quarters(row: dict) -> str:
    """The per-part rates (first to last part of the output), as in `seg_tok_s`."""
    segs = row.get("seg_tok_s")
    if _missing(segs):
        return "-"
    return " ".join(f"{float(v):.1f}" for v in str(segs).split(";") if v)


_HEADERS = ["batch", "method", "new tok", "tok/s", "vs full", "ceil gain", "vs dyn", "ceil gain",
            "roofline", "tok/s per part", "last/first", "step ms", "evicts", "ms/evict", "evict%",
            "KV MiB", "peak +MiB", "flag"]


def print_table(rows: Sequence[dict], console=None, title: str | None = None) -> None:
    """The rows as a rich table (flagged rows in red)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=230)  # logs and pipes: one line per row
    if rows and not title:
        r = rows[0]
        title = (f"decode throughput: {r.get('model')} {r.get('dtype')} {r.get('attn')} on {r.get('device')}, "
                 f"prompt {r.get('prompt_length')}, median of {r.get('repeats')}")
    table = Table(title=title)
    for h in _HEADERS:
        table.add_column(h, justify="left" if h in ("method", "flag") else "right", overflow="fold")
    for row in rows:
        style = "red" if row.get("eviction_fired") is False or row.get("flag") else None
        table.add_row(*_table_cells(row), style=style)
    console.print(table)
    if rows and rows[0].get("mem_method"):
        console.print(f"peak +MiB: peak memory during the run minus memory before it ({rows[0]['mem_method']}); "
                      "ms/evict: time of one eviction event, all layers; evict%: share of decode time in them")
    bw = next((r.get("bandwidth_gbs") for r in rows if not _missing(r.get("bandwidth_gbs"))), None)
    console.print("ceiling: the speed-up the traffic model allows (reference's bytes per step / the row's), gain: "
                  "share of (ceiling - 1) reached; roofline: tok/s over bandwidth x batch / bytes per step"
                  + (f" (bandwidth {float(bw):.1f} GB/s, measured)" if bw else "") + "; docs/bench.md")


def to_markdown(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(_HEADERS) + " |", "|" + "---|" * len(_HEADERS)]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _table_cells(row)) + " |")
    return "\n".join(lines) + "\n"


def _series(rows: Sequence[dict], batch: int) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for row in rows:
        if row["batch"] == batch:
            series.setdefault(label(row), []).append(row)
    return {k: sorted(v, key=lambda r: r["new_tokens"]) for k, v in series.items()}


def _style(name: str) -> dict:
    if name == "full":
        return {"color": "black", "linestyle": "-", "linewidth": 2}
    if name == "dynamic":
        return {"color": "gray", "linestyle": "--", "linewidth": 2}
    return {}


def _plot_metric(ax, rows: Sequence[dict], batch: int, metric: str, scale: float, ylabel: str) -> None:
    lengths = sorted({r["new_tokens"] for r in rows})
    for name, series in _series(rows, batch).items():
        pts = [(r["new_tokens"], r[metric] / scale) for r in series if not _missing(r.get(metric))]
        if not pts:
            continue
        ax.plot(*zip(*pts), marker="o", label=name, **_style(name))
        bad = [(r["new_tokens"], r[metric] / scale) for r in series
               if r.get("eviction_fired") is False and not _missing(r.get(metric))]
        if bad:
            ax.plot(*zip(*bad), "x", color="red", markersize=10, markeredgewidth=2,
                    label=f"{name}: no eviction" if name else None)
    if len(lengths) > 1 and lengths[-1] / max(lengths[0], 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(f"batch {batch}")
    ax.grid(True, alpha=0.3)


def plot(rows: Sequence[dict], out_dir: str | Path) -> list[Path]:
    """throughput.png (tok/s), memory.png (KV held and peak memory) against output length, one line per
    method and budget, a panel per batch size; segments.png (tok/s along the longest run)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend switch, no GUI

    def figure(nrows: int, ncols: int, size: tuple[float, float]):
        fig = Figure(figsize=size)
        FigureCanvasAgg(fig)
        return fig, fig.subplots(nrows, ncols, squeeze=False)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not rows:
        return []
    batches = sorted({r["batch"] for r in rows})
    paths = []

    fig, axes = figure(1, len(batches), (6 * len(batches), 4.5))
    for ax, batch in zip(axes[0], batches):
        _plot_metric(ax, rows, batch, "tok_s", 1.0, "decode tokens/s")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"decode throughput ({rows[0].get('model')}, {rows[0].get('device')})")
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=110)

    fig, axes = figure(len(batches), 2, (12, 4.5 * len(batches)))
    for (ax_kv, ax_peak), batch in zip(axes, batches):
        _plot_metric(ax_kv, rows, batch, "kv_bytes", _MIB, "KV cache held at the end (MiB)")
        _plot_metric(ax_peak, rows, batch, "peak_mem_delta_bytes", _MIB,
                     f"peak memory over the run's start (MiB, {rows[0].get('mem_method')})")
    axes[0][1].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "memory.png")
    fig.savefig(paths[-1], dpi=110)

    fig, axes = figure(1, len(batches), (6 * len(batches), 4.5))
    for ax, batch in zip(axes[0], batches):
        longest = max(r["new_tokens"] for r in rows if r["batch"] == batch)
        for row in rows:
            if row["batch"] != batch or row["new_tokens"] != longest or _missing(row.get("seg_tok_s")):
                continue
            rates = [float(x) for x in str(row["seg_tok_s"]).split(";") if x]
            xs = [(i + 0.5) * longest / len(rates) for i in range(len(rates))]
            ax.plot(xs, rates, marker="o", label=label(row), **_style(label(row)))
        ax.set_xlabel(f"position in the {longest}-token output")
        ax.set_ylabel("decode tokens/s in the segment")
        ax.set_title(f"batch {batch}")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "segments.png")
    fig.savefig(paths[-1], dpi=110)
    return paths


def write_results_file(rows: Sequence[dict], path: str | Path, record: dict) -> Path:
    """The rows (one flat dict per table row, NaN as null) with their provenance record
    (`vase.files.provenance.provenance()`, taken before the run) through `vase.files.provenance.write_results`."""
    from ..files.provenance import write_results

    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()} for row in rows]
    return write_results(path, clean, record)


def write_report(rows: Sequence[dict], out_dir: str | Path, console=None, show: bool = True) -> dict[str, Path]:
    """Print the table (unless show=False) and write bench.csv, bench.md and the PNGs to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if show:
        print_table(rows, console)
    paths = {"csv": write_csv(rows, out / "bench.csv")}
    (out / "bench.md").write_text(to_markdown(rows))
    paths["md"] = out / "bench.md"
    for p in plot(rows, out):
        paths[p.stem] = p
    return paths
