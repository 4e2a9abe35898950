"""Append-only JSONL stores of finished work, safe against kills, one file per process rank.

Each finished record is written as one line, flushed and fsync'ed before the next one starts,
so a run killed at any moment loses at most the record being written. On open, a torn final
line (one without its newline: the write never finished) is dropped and cut off the file before
anything is appended; a newline-ended line that does not parse is an error naming the file and
line, never cut. The file is opened with ``O_NOFOLLOW`` and must be a regular file, so a symlink
never leads the store to truncate or fill some other file. Rank ``R`` of a multi-process run writes only ``<kind>.rank{R}.jsonl``;
:func:`read_all` merges every rank's file, keeping the first record of each key.

    with JsonlStore(run_dir / "samples.rank0.jsonl", SAMPLE_KEY) as store:
        if key not in store:
            store.append(record)
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vase.files.atomic import atomic_write_text, fsync_dir, write_temp  # noqa: F401 - the first two re-exported

try:  # advisory lock so two processes never append to the same rank file
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "SAMPLE_KEY",
    "FIDELITY_KEY",
    "SAMPLES",
    "FIDELITY",
    "StoreError",
    "JsonlStore",
    "record_key",
    "read_jsonl",
    "read_all",
    "rank_path",
    "rank_files",
    "fsync_dir",
    "atomic_write_text",
    "create_once",
]

log = logging.getLogger(__name__)

#: A finished sample: one completion of one problem by one method at one budget.
SAMPLE_KEY: tuple[str, ...] = ("method", "budget", "problem_id", "sample")
#: A finished fidelity measurement: one problem's reference trajectory through one method/budget.
FIDELITY_KEY: tuple[str, ...] = ("method", "budget", "problem_id")
SAMPLES = "samples"
FIDELITY = "fidelity"
_KEYS = {SAMPLES: SAMPLE_KEY, FIDELITY: FIDELITY_KEY}
_RANK_RE = re.compile(r"\.rank(\d+)\.jsonl$")
#: Fields that must be numbers (or null) when a record has them: a summary computes with them.
_BOOL_FIELDS = ("correct", "finished")
_NUMBER_FIELDS = ("length", "prompt_length", "kv_bytes", "kv_bytes_peak", "kv_bytes_full", "evictions",
                  "kv_bytes_time_mean", "kv_bytes_allocated", "seconds", "prefill_seconds", "tokens_per_s",
                  "n_tokens", "kl_mean", "top1_agree", "top1_disagree_share", "dnll_mean")


class StoreError(RuntimeError):
    """A results file that cannot be used as it is (corrupt line, locked by another process, deleted)."""


def create_once(path: str | Path, text: str) -> bool:
    """Create ``path`` holding ``text`` atomically unless it exists; True if this call created it.

    Temp file + fsync + hard link (fails if another process won the race), so the file only ever
    appears whole; never overwrites.
    """
    p = Path(path)
    if p.exists():
        return False
    tmp = write_temp(p, text.encode("utf-8"))
    try:
        os.link(tmp, p)
        created = True
    except FileExistsError:
        created = False
    except OSError:  # filesystems without hard links: an exclusive create (not atomic, still no overwrite)
        try:
            with open(p, "x", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            created = True
        except FileExistsError:
            created = False
    finally:
        tmp.unlink(missing_ok=True)
    if created:
        fsync_dir(p.parent)
    return created


def record_key(record: dict[str, Any], key_fields: Sequence[str]) -> tuple:
    return tuple(record.get(k) for k in key_fields)


def rank_path(run_dir: str | Path, kind: str, rank: int) -> Path:
    return Path(run_dir) / f"{kind}.rank{int(rank)}.jsonl"


def rank_files(run_dir: str | Path, kind: str) -> list[Path]:
    """Every ``<kind>.rank<R>.jsonl`` in ``run_dir``, by rank."""
    found = []
    for p in Path(run_dir).glob(f"{kind}.rank*.jsonl"):
        m = _RANK_RE.search(p.name)
        if m and p.name == f"{kind}.rank{m.group(1)}.jsonl":
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON: store them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _parse(data: bytes, path: Path, line_numbers: list[int] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Records of a JSONL file's bytes and how many leading bytes are intact.

    Only a last line without its newline is torn (a record is written as one line ending in a
    newline, so an unfinished write never ends in one): it is left out and the intact length stops
    before it. A newline-ended line that is not a JSON object is corruption and raises StoreError
    naming the file and line: it may be someone's data, so it is never cut.
    """
    records: list[dict[str, Any]] = []
    pos = 0
    n = len(data)
    lineno = 0
    while pos < n:
        nl = data.find(b"\n", pos)
        lineno += 1
        if nl < 0:  # no newline: the write of this line never finished
            log.warning("%s: ignoring a torn last line %d (%d bytes without a newline)", path, lineno, n - pos)
            return records, pos
        line = data[pos:nl]
        if line.strip():
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                raise StoreError(f"{path}: line {lineno} is not a valid record ({e}); the file is corrupt: remove that "
                                 f"line to resume (it is left as it is; vase never cuts a complete line)") from e
            records.append(rec)
            if line_numbers is not None:
                line_numbers.append(lineno)
        pos = nl + 1
    return records, pos


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every intact record of a JSONL file (a torn last line is ignored, the file is not changed)."""
    p = Path(path)
    if not p.exists():
        return []
    records, _ = _parse(p.read_bytes(), p)
    return records


def read_all(run_dir: str | Path, kind: str = SAMPLES, key_fields: Sequence[str] | None = None
             ) -> list[dict[str, Any]]:
    """Records of every rank file of ``kind`` (``samples`` or ``fidelity``), first of each key kept.

    Files are read in rank order, records in file order. Reading never modifies a file, so it is
    safe while other processes are still appending.
    """
    fields = tuple(key_fields) if key_fields is not None else _KEYS[kind]
    seen: set[tuple] = set()
    out: list[dict[str, Any]] = []
    for path in rank_files(run_dir, kind):
        lines: list[int] = []
        records, _ = _parse(path.read_bytes(), path, lines)
        for n, (rec, lineno) in enumerate(zip(records, lines), start=1):
            missing = [f for f in fields if f not in rec]
            if missing:
                raise StoreError(f"{path}: record {n} lacks the field(s) {', '.join(map(repr, missing))}: it was not "
                                 f"written by `vase eval`; remove that line (or the file)")
            for f in _NUMBER_FIELDS:
                v = rec.get(f)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise StoreError(f"{path}: line {lineno}: {f!r} is {json.dumps(v)}, not a number: fix that line or "
                                     f"remove it (vase writes numbers there)")
            for f in _BOOL_FIELDS:  # "correct": "no" is truthy: it would count as correct (or fail deep in a sum)
                v = rec.get(f)
                if v is not None and not isinstance(v, bool):
                    raise StoreError(f"{path}: line {lineno}: {f!r} is {json.dumps(v)}, not true or false: fix that "
                                     f"line or remove it (vase writes true or false there)")
            k = record_key(rec, fields)
            if k not in seen:
                seen.add(k)
                out.append(rec)
    return out


_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_regular(path: Path) -> tuple[int, bool]:
    """``path`` opened for reading and appending, never through a symlink; (fd, created).

    StoreError (one line) when it is a symlink, a folder or anything but a regular file.
    """
    existed = os.path.lexists(path)
    try:
        fd = os.open(path, _OPEN_FLAGS | (0 if existed else os.O_EXCL), 0o666)
    except FileExistsError:  # created by someone else between the two calls: open it as it is
        existed = True
        fd = os.open(path, _OPEN_FLAGS, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise StoreError(f"{path} is a symbolic link: vase writes results only to a regular file it owns; "
                             f"remove the link (its target is left alone) or use another --output-dir") from None
        if e.errno == errno.EISDIR:
            raise StoreError(f"{path} is a folder, not a results file: move it away or use another "
                             f"--output-dir") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StoreError(f"{path} is not a regular file: vase writes results only to a regular file; move it "
                         f"away or use another --output-dir")
    return fd, not existed


def _read_fd(fd: int) -> bytes:
    chunks = []
    offset = 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


class JsonlStore:
    """One process's append-only JSONL file of finished records, keyed by ``key_fields``.

    Opening (``O_NOFOLLOW``, regular files only) locks the file (exclusively, non-blocking: a
    second writer fails loudly), reads the keys of what is there, cuts off a torn last line, and
    remembers where the file ends. ``append`` writes one record with ``os.write`` (no buffer that a
    later ``close`` could fail to flush) and makes it durable (fsync) before returning; records are
    not kept in memory (use :func:`read_jsonl` / :func:`read_all`). Before each append and on exit
    the file is checked: still the same file at ``path`` and at least as long as this store wrote.
    """

    def __init__(self, path: str | Path, key_fields: Sequence[str] = SAMPLE_KEY, *, fsync: bool = True):
        self.path = Path(path)
        self.key_fields = tuple(key_fields)
        self.fsync = fsync
        self.keys: set[tuple] = set()
        self.n_read = 0  # records found in the file when it was opened
        self._fd: int | None = None
        self._end = 0  # bytes the file holds by this store's account (what was there + what it appended)
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self) -> "JsonlStore":
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, created = _open_regular(self.path)
        try:
            if created:  # the new directory entry must survive a crash too
                fsync_dir(self.path.parent)
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    raise StoreError(f"{self.path} is being written by another process (same rank twice?)") from e
            data = _read_fd(fd)
            records, intact = _parse(data, self.path)
            if intact < len(data):
                os.ftruncate(fd, intact)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._end = st.st_size
        self._fd = fd
        # Only the keys stay in memory (records hold whole completions; read_jsonl gives them back).
        self.keys = {record_key(rec, self.key_fields) for rec in records}
        self.n_read = len(records)
        return self

    def close(self) -> None:
        """Close the file (releasing the lock). Nothing is buffered, so closing cannot lose a record."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:  # every record was fsync'ed already; an error here must not hide the first one
                log.warning("%s: error while closing (every record was already saved)", self.path)

    def __enter__(self) -> "JsonlStore":
        return self.open()

    def __exit__(self, exc_type, *exc: object) -> None:
        try:
            if exc_type is None and self._fd is not None:
                self.check_still_there()  # records appended last must not vanish silently either
        finally:
            self.close()

    # -- use -------------------------------------------------------------------------------------
    def key(self, record: dict[str, Any]) -> tuple:
        return record_key(record, self.key_fields)

    def __contains__(self, key: tuple) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, record: dict[str, Any]) -> bool:
        """Write ``record`` durably; False (and nothing written) if its key is already stored."""
        if self._fd is None:
            raise StoreError(f"{self.path}: store is not open")
        k = self.key(record)
        if k in self.keys:
            return False
        self.check_still_there()
        data = (json.dumps(_clean(record), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                if n <= 0:  # pragma: no cover - a write that makes no progress
                    raise OSError(errno.EIO, "write made no progress")
                view = view[n:]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:  # disk full, file too large, I/O error: name the file and the fix
            self._cut_back()
            raise StoreError(f"cannot write to {self.path}: {e.strerror or e}; every earlier record is saved: "
                             f"free space (or move --output-dir), then rerun the same command to resume") from None
        self._end += len(data)
        self.keys.add(k)
        return True

    def _cut_back(self) -> None:
        """After a failed write: cut a partial line off again, so the file ends where the last record did."""
        try:
            if os.fstat(self._fd).st_size > self._end:
                os.ftruncate(self._fd, self._end)
        except OSError:  # a torn line left behind is cut on the next open anyway
            pass

    def check_still_there(self) -> None:
        """Raise StoreError if the file at ``path`` is no longer the file this store holds open, or holds
        fewer bytes than this store has written (emptied or truncated by someone else).

        A run folder deleted or moved while a run writes would otherwise swallow every later record
        into an unlinked file (lost, with exit 0); an emptied file would lose the records before.
        """
        try:
            st = os.stat(self.path, follow_symlinks=False)
            now = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            now = None
        if now != self._identity:
            what = "was deleted or moved" if now is None else "was replaced by another file"
            raise StoreError(f"{self.path} {what} while this run was writing to it: stopped so that no result "
                             f"goes to a file that is gone; rerun the same command to redo what is missing")
        size = os.fstat(self._fd).st_size if self._fd is not None else st.st_size
        if size < self._end:
            raise StoreError(f"{self.path} was emptied or truncated while this run was writing to it ({size} bytes, "
                             f"{self._end} expected): stopped so that no result is lost silently; rerun the same "
                             f"command to redo what is missing")

    def extend(self, records: Iterable[dict[str, Any]]) -> int:
        return sum(self.append(r) for r in records)
