"""Where an eval run ran: the commit (and dirty flag), machine, versions and load when each process starts and ends.

Appended to ``provenance.jsonl`` in the run folder by the runner (one ``start`` line when a process begins,
one ``end`` line when it has finished its share), so a results file made from the run later
(``scripts/eval_results.py``) carries the run's own commit and load, not the commit of whoever rendered it.
A resumed run adds lines: :func:`run_provenance` folds them into one record (the first start, the last end,
and every commit seen, with ``dirty`` true if any process ran from a checkout with uncommitted changes).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from vase.files.provenance import finish, provenance

FILE = "provenance.jsonl"


def _append(run_dir: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode("utf-8")
    fd = os.open(Path(run_dir) / FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def record_start(run_dir: Path, rank: int, command: str | None = None) -> dict[str, Any]:
    """Append this process's start (commit, dirty, machine with load, versions, command); returns the record."""
    if command is None and Path(sys.argv[0]).name in ("__main__.py", "cli.py", "main.py", "vase"):
        command = shlex.join(["vase", *sys.argv[1:]])  # `python -m vase.cli eval ...` is `vase eval ...`
    rec = {"event": "start", "rank": rank, "pid": os.getpid(), **provenance(command)}
    _append(run_dir, rec)
    return rec


def record_end(run_dir: Path, start: dict[str, Any]) -> None:
    """Append this process's end: the date and the load average now (after `start`'s own measurement)."""
    done = finish({"machine": dict(start.get("machine") or {})})
    _append(run_dir, {"event": "end", "rank": start.get("rank"), "pid": start.get("pid"),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                      "loadavg_1m": done["machine"]["loadavg_1m_after"]})


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's provenance lines, in order; a line cut short by a crash is skipped."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def run_provenance(run_dir: Path) -> dict[str, Any] | None:
    """One provenance record for the whole run (None when the run recorded none: made before this file existed).

    date, commit, machine, versions and command: the first start's; ``dirty``: true if any start was dirty;
    ``commits``: every distinct commit, when a resume ran another one; ``machine.loadavg_1m_after`` and
    ``finished``: the last end's (absent when no process has ended yet, e.g. a killed run).
    """
    events = read_events(run_dir)
    starts = [e for e in events if e.get("event") == "start"]
    if not starts:
        return None
    first = starts[0]
    record: dict[str, Any] = {k: first[k] for k in ("date", "commit", "dirty", "machine", "versions", "command")
                              if k in first}
    record["machine"] = dict(record.get("machine") or {})
    record["dirty"] = any(bool(s.get("dirty")) for s in starts) or (None if first.get("dirty") is None else False)
    commits = list(dict.fromkeys(s.get("commit") for s in starts))
    if len(commits) > 1:
        record["commits"] = commits
    ends = [e for e in events if e.get("event") == "end"]
    if ends:
        record["finished"] = ends[-1].get("date")
        record["machine"]["loadavg_1m_after"] = ends[-1].get("loadavg_1m")
    record["processes"] = len(starts)
    return record
