"""The files a run folder holds that the run writes itself: ``config.json`` (created once, never overwritten: a
different identity is a RunConflictError) and the appended lines of ``starts.jsonl``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from vase.eval.config import ConfigError
from vase.eval.identity import identity_changes
from vase.eval.store import FIDELITY, SAMPLES, create_once, rank_files

__all__ = ["RunConflictError", "write_run_config", "append_line"]


class RunConflictError(ConfigError):
    """The run directory holds a run with a different identity: it is never overwritten."""


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True))


def write_run_config(run_dir: Path, meta: dict[str, Any]) -> None:
    """Create ``config.json`` atomically, or check that the one there has the same identity.

    Raises RunConflictError naming the settings that differ; the file is never overwritten.
    """
    path = run_dir / "config.json"
    text = json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    orphans = [p.name for kind in (SAMPLES, FIDELITY) for p in rank_files(run_dir, kind)]
    if orphans and not os.path.lexists(path):  # results whose settings are unknown: never adopt them
        raise RunConflictError(f"{run_dir} holds {orphans[0]} but no config.json, so the settings of those results "
                               f"are unknown: restore config.json, or move the folder away (or use another run "
                               f"name) to start afresh")
    create_once(path, text)  # temp + fsync + link: appears whole, never overwritten
    for _ in range(50):  # the file appears whole (link / exclusive create); retry a read that races a writer
        try:
            existing = json.loads(path.read_text(encoding="utf-8"))
            break
        except json.JSONDecodeError:
            time.sleep(0.1)
    else:
        raise RunConflictError(f"{path} is not valid JSON: move it away or use another --output-dir")
    if not isinstance(existing, dict):
        raise RunConflictError(f"{path} is not a vase run config (a JSON {type(existing).__name__}, not an "
                               f"object): move it away or use another --output-dir")
    old, new = existing.get("identity"), _json_roundtrip(meta["identity"])
    if old != new:
        changes = identity_changes(old, new)
        detail = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        raise RunConflictError(
            f"{run_dir} already holds a run with different settings ({detail}). It is never overwritten: "
            f"choose another run name or output dir")


def append_line(path: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
