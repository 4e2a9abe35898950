"""sha256 of files (memoised for multi-GB sources) and atomic writes: what the model store verifies with."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..files.atomic import atomic_write_text, unique_sibling  # noqa: F401 - unique_sibling re-exported

__all__ = ["sha256_file", "source_sha256", "unique_sibling"]

_HASH_CHUNK = 1 << 20

# In-process memo of source-file hashes, keyed by (path, size, mtime_ns, ctime_ns, device, inode):
# a replacement with the same size and mtime (cp -p, rsync -t) still changes the inode or ctime.
_SHA_MEMO: dict[tuple[str, int, int, int, int, int], str] = {}
_MEMO_FIELDS = ("path", "size", "mtime_ns", "ctime_ns", "dev", "ino")


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks so a multi-GB file does not need the memory."""
    digest = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def _stat_key(path: Path) -> tuple[str, int, int, int, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)


def _hash_memo_file(cache_dir: Path, key: tuple) -> Path:
    return cache_dir / "hashes" / (hashlib.sha256(key[0].encode()).hexdigest()[:24] + ".json")


def source_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """sha256 of a source file (a GGUF), memoised by (path, size, mtime_ns, ctime_ns, device, inode).

    The memo lives in this process and, when ``cache_dir`` is given, on disk there too, so a
    multi-GB user GGUF is not rehashed on every warm load. Any change to the file, including a
    replacement with the same size and mtime (a new inode, or at least a new ctime), invalidates it.
    """
    key = _stat_key(path)
    if key in _SHA_MEMO:
        return _SHA_MEMO[key]
    memo_file = _hash_memo_file(cache_dir, key) if cache_dir is not None else None
    if memo_file is not None:
        try:
            saved = json.loads(memo_file.read_text())
            if [saved.get(f) for f in _MEMO_FIELDS] == list(key):
                _SHA_MEMO[key] = str(saved["sha256"])
                return _SHA_MEMO[key]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no memo or an unreadable one: just hash
    sha = sha256_file(path)
    _SHA_MEMO[key] = sha
    if memo_file is not None:
        record = {**dict(zip(_MEMO_FIELDS, key)), "sha256": sha}
        try:
            atomic_write_text(memo_file, json.dumps(record))
        except OSError:
            pass  # a read-only cache only costs a rehash next time
    return sha
