"""``vase report RUN_DIR``: a run as one self-contained HTML page (no network at view time).

    path = write_report("runs/recall-n12-s1-1a2b3c4d")          # -> runs/.../report.html

The page holds the summary table with the paired intervals (the same cells as ``summary.md``),
the conclusion line, the plots as base64 PNG (accuracy and KL vs budget, failure classes, output
length, first divergence), and per problem a drill-down: full's text beside each method's text
for each sample, the first differing character highlighted, the failure class, the extracted
answer, and the kept-token map of any ``vase inspect`` output (``kept.png`` + ``inspect.json``)
found under ``RUN_DIR/inspect/`` or given with ``inspect_dirs`` whose text matches a completion.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vase.eval.cells import LEGEND, table_cells
from vase.eval.config import FULL
from vase.eval.identity import records_of_run
from vase.eval.paired import first_divergence
from vase.eval.plots import figures
from vase.eval.report import run_header, run_window
from vase.eval.store import FIDELITY, SAMPLES
from vase.eval.table import conclusion, noise_line, row_label, summary_rows

__all__ = ["write_report", "render_report", "common_prefix"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1800px}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:28px}
table.summary{border-collapse:collapse;font-size:12px} table.summary th,table.summary td{border:1px solid #ccc;
padding:3px 6px;text-align:right;white-space:nowrap} table.summary td:first-child,table.summary th:first-child{
text-align:left} table.summary th{background:#f3f3f3}
.note{font-size:12px;color:#555;max-width:1200px} .conclusion{font-weight:600;max-width:1200px}
.plots img{max-width:640px;margin:6px;border:1px solid #eee}
details{margin:6px 0;border:1px solid #ddd;border-radius:4px;padding:4px 8px} summary{cursor:pointer}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:8px;margin:6px 0}
.cell{border:1px solid #e3e3e3;border-radius:4px;padding:6px;font-size:12px}
.cell pre{white-space:pre-wrap;word-break:break-word;font-size:12px;margin:4px 0;max-height:420px;overflow:auto}
.div{background:#ffd6d6} .badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:11px;margin-left:4px}
.ok{background:#d8f0dd} .phrase_loop{background:#f7d0c0} .truncated{background:#f6e7b0} .garbage{background:#e2d4f0}
.right{color:#1a7f37;font-weight:600} .wrong{color:#b42318;font-weight:600}
.kept img{max-width:900px}
"""

_PLOT_TITLES = {"accuracy": "Accuracy vs budget", "fidelity": "KL after the first eviction vs budget",
                "failures": "Failure classes", "length": "Output length",
                "divergence": "First divergence from full's same-seed text"}


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (the first differing character)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _file_png(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


def _table(rows: Sequence[Mapping[str, Any]]) -> str:
    cells = table_cells()  # every column (the console shows a subset by default)
    head = "".join(f"<th>{_e(h)}</th>" for _, h, _ in cells)
    body = "".join("<tr>" + "".join(f"<td>{_e(f(r))}</td>" for _, _, f in cells) + "</tr>" for r in rows)
    return f'<table class="summary" id="summary"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _highlighted(text: str, start: int | None) -> str:
    """The text with everything from ``start`` on marked (None: identical to full's, nothing marked)."""
    if start is None or start >= len(text):
        return _e(text)
    return _e(text[:start]) + '<span class="div">' + _e(text[start:]) + "</span>"


def _inspect_entries(dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """``vase inspect`` outputs: each folder with inspect.json and kept.png."""
    found = []
    for d in dirs:
        for js in sorted(Path(d).rglob("inspect.json")):
            png = js.parent / "kept.png"
            try:
                meta = json.loads(js.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if png.is_file() and isinstance(meta, dict):
                found.append({"dir": js.parent, "meta": meta, "png": png})
    return found


def _problem_section(pid: str, recs: Sequence[Mapping[str, Any]], question: str | None,
                     inspects: Sequence[dict[str, Any]]) -> str:
    full = {r["sample"]: r for r in recs if r["method"] == FULL}
    others = sorted((r for r in recs if r["method"] != FULL),
                    key=lambda r: (r["method"], r.get("budget") or 0, r["sample"]))
    n_right = sum(bool(r.get("correct")) for r in recs)
    head = (f"<summary><b>{_e(pid)}</b> gold {_e(recs[0].get('gold'))} · {n_right}/{len(recs)} completions right"
            "</summary>")
    parts = [head]
    if question:
        parts.append(f'<p class="note">{_e(question)}</p>')
    for s in sorted({r["sample"] for r in recs}):
        ref = full.get(s)
        cells = []
        for r in ([ref] if ref else []) + [o for o in others if o["sample"] == s]:
            start = None
            tok = None
            if r is not ref and ref is not None:
                start = common_prefix(r.get("text") or "", ref.get("text") or "")
                if (r.get("text") or "") == (ref.get("text") or ""):
                    start = None
                if r.get("token_ids") is not None and ref.get("token_ids") is not None:
                    tok = first_divergence(r["token_ids"], ref["token_ids"])
            right = "right" if r.get("correct") else "wrong"
            div = "" if r is ref else (" · identical to full" if start is None else
                                       f" · leaves full at token {tok}" if tok is not None else "")
            kept = [e for e in inspects if (e["meta"].get("text") or "") == (r.get("text") or "")
                    and e["meta"].get("budget") == r.get("budget")]
            kept_html = "".join(
                f'<div class="kept"><img alt="kept-token map" src="data:image/png;base64,{_file_png(e["png"])}"></div>'
                for e in kept[:1])
            cells.append(
                f'<div class="cell"><b>{_e(row_label(r))}</b><span class="badge {_e(r.get("failure"))}">'
                f'{_e(r.get("failure"))}</span> · answer <span class="{right}">{_e(r.get("answer"))}</span>'
                f' · {_e(r.get("length"))} tokens · {_e(r.get("evictions") or 0)} evictions{_e(div)}'
                f"<pre>{_highlighted(r.get('text') or '', start)}</pre>{kept_html}</div>")
        parts.append(f"<div>sample {s}</div><div class=\"grid\">{''.join(cells)}</div>")
    return f'<details class="problem" id="p-{_e(pid)}">{"".join(parts)}</details>'


def _questions(run_dir: Path) -> dict[str, str]:
    """Problem texts, regenerated from config.json when the task can be loaded here (else empty)."""
    try:
        meta = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        c = meta.get("config") or {}
        from vase.eval.tasks import load_task

        task = c.get("task") or "arith"
        problems = load_task(task, data_dir=c.get("data_dir"), task_file=c.get("task_file"),
                             question_field=c.get("question_field"), answer_field=c.get("answer_field"),
                             limit=c.get("limit"), seed=int(c.get("seed") or 0))
        return {p.id: p.question for p in problems}
    except Exception:  # noqa: BLE001 - the page works without the questions
        return {}


def render_report(run_dir: str | Path, *, inspect_dirs: Sequence[str | Path] = ()) -> str:
    """The HTML text of the report of ``run_dir`` (see the module docstring)."""
    run_dir = Path(run_dir)
    samples = records_of_run(run_dir, SAMPLES)  # only the run's own records (config.json)
    if not samples:
        raise FileNotFoundError(f"{run_dir} holds no samples.rank*.jsonl records: run `vase eval` first")
    fidelity = records_of_run(run_dir, FIDELITY)
    rows = summary_rows(samples, fidelity, window=run_window(run_dir))
    figs = figures(rows, samples)
    plots = "".join(f'<figure><img class="plot" alt="{_e(_PLOT_TITLES[k])}" src="data:image/png;base64,{_png(f)}">'
                    f"</figure>" for k, f in figs.items())
    noise = noise_line(rows)
    by_problem: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in samples:
        by_problem[str(r["problem_id"])].append(r)
    questions = _questions(run_dir)
    dirs = [Path(d) for d in inspect_dirs] + ([run_dir / "inspect"] if (run_dir / "inspect").is_dir() else [])
    inspects = _inspect_entries(dirs)
    problems = "".join(_problem_section(pid, by_problem[pid], questions.get(pid), inspects)
                       for pid in sorted(by_problem))
    config = _e(run_header(run_dir))  # names the model (the embedded default too) with its sha256
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vase report: {_e(run_dir.name)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>
<body>
<h1>vase report: {_e(run_dir.name)}</h1>
<p class="note">{config}</p>
<h2>Summary (paired with full on the same seeds)</h2>
{_table(rows)}
<p class="conclusion">{_e(conclusion(rows))}</p>
{f'<p class="note">{_e(noise)}</p>' if noise else ''}
<p class="note">{_e(LEGEND)}</p>
<h2>Plots</h2>
<div class="plots">{plots}</div>
<h2>Problems ({len(by_problem)}): full's text beside each method's, the first difference highlighted</h2>
{problems}
<script>
// Marks for headless checks: every image decoded, and no script error on the page.
window.addEventListener("load", function () {{
  var imgs = Array.prototype.slice.call(document.images);
  document.body.setAttribute("data-images-ok", String(imgs.length > 0 && imgs.every(function (i) {{
    return i.complete && i.naturalWidth > 0; }})));
  document.body.setAttribute("data-rows", String(document.querySelectorAll("#summary tbody tr").length));
}});
</script>
</body></html>
"""


def write_report(run_dir: str | Path, out: str | Path | None = None, *,
                 inspect_dirs: Sequence[str | Path] = ()) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``); returns the path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}: give the folder `vase eval` printed")
    path = Path(out) if out is not None else run_dir / "report.html"
    path.write_text(render_report(run_dir, inspect_dirs=inspect_dirs), encoding="utf-8")
    return path
