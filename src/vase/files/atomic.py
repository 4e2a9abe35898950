"""The one way vase replaces a file: readers see the old file or the new one, never a mix, and a crash leaves no
half-written file (the run store, the model store's manifest and memo files, results files).
Standard library only."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["atomic_write_text", "fsync_dir", "unique_sibling", "write_temp"]


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so that files created or renamed in it survive a power cut."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def unique_sibling(path: Path) -> Path:
    """A hidden, unused name next to ``path`` for writing before an atomic rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def write_temp(path: Path, data: bytes) -> Path:
    """``data`` in a fresh, fsync'ed hidden file next to ``path`` (mode "x", so umask permissions); its path."""
    tmp = unique_sibling(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically; its folder is created if missing.

    Written to a temp file in the same folder, fsync'ed, renamed over ``path``, then the folder fsync'ed."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_temp(p, text.encode("utf-8"))
    try:
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)
    return p
