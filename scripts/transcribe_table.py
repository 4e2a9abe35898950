"""Move a hand-typed figure table of a doc into a results file, marked as transcribed and not rerun.

    python scripts/transcribe_table.py DOC LINE docs/results/NAME.json --date 2026-12-02 \
        --commit 1a73df5 --command "python benchmarks/x.py ..." --machine "2-core CPU, ..." [--status TEXT]

reads the Markdown table whose header is on LINE of DOC, writes its cells (as printed) to the results
file through `vase.files.provenance.write_results` with `"source": "transcribed, not rerun"`, the date and
commit at which it was measured (as the docs and git log give them) and when it was transcribed, and
replaces the table in DOC by its results block (rendered by scripts/render_docs.py). For a figure
that cannot be rerun now; a rerun writes its own results file with full provenance instead.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render_docs import ROOT, SEPARATOR, render_block  # noqa: E402

from vase.files.provenance import git_commit, write_results  # noqa: E402


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("doc")
    ap.add_argument("line", type=int, help="the table's header line (1-based)")
    ap.add_argument("out", help="the results file, e.g. docs/results/name.json")
    ap.add_argument("--date", required=True, help="when it was measured (as the docs / git log say)")
    ap.add_argument("--commit", required=True, help="the commit it was measured at (or first published in)")
    ap.add_argument("--command", required=True)
    ap.add_argument("--machine", required=True, help="the machine and its load, as the docs describe them")
    ap.add_argument("--status", help="e.g. 'Stale: measured before ...'")
    ap.add_argument("--note", help="a sentence printed after the provenance")
    args = ap.parse_args(argv)

    doc = (ROOT / args.doc).resolve()
    lines = doc.read_text().split("\n")
    head = args.line - 1
    if not (lines[head].startswith("|") and SEPARATOR.match(lines[head + 1])):
        raise SystemExit(f"{args.doc}:{args.line}: no Markdown table header here")
    end = head + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    columns = _cells(lines[head])
    align = "".join("r" if c.strip().endswith(":") else "l" for c in lines[head + 1].strip().strip("|").split("|"))
    keys = []  # unique row keys: a repeated header ("ratio" twice) gets its column number
    for i, c in enumerate(columns):
        keys.append(c if c not in keys else f"{c} (column {i + 1})")
    rows = [dict(zip(keys, _cells(line))) for line in lines[head + 2:end]]
    now = git_commit(ROOT)
    record = {"source": "transcribed, not rerun", "date": args.date, "commit": args.commit,
              "machine": args.machine, "command": args.command,
              "transcribed": {"date": dt.date.today().isoformat(), "commit": now["commit"], "from": args.doc}}
    if args.status:
        record["status"] = args.status
    if args.note:
        record["note"] = args.note
    out = ROOT / args.out
    write_results(out, rows, record, table={"columns": columns, "align": align, **({"keys": keys} if keys != columns else {})})
    rel = out.relative_to(ROOT).as_posix()
    block = f"<!-- results: {rel} -->\n{render_block(rel, doc)}<!-- /results -->"
    doc.write_text("\n".join(lines[:head] + [block] + lines[end:]))
    print(f"{args.doc}:{args.line}: {len(rows)} rows -> {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
