"""The model store: dequantised copies of GGUF files in the vase cache, each verified by its manifest.

An entry (a ``save_pretrained`` folder) is written in a temp folder, given a manifest (sha256 of every
file) last and renamed into place; it is only ever loaded after every file matches the manifest, so a
partial or corrupted entry is rebuilt instead of silently giving a different model. Killed builds leave
temp folders that a later load removes, once no process holds them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import torch

from .default import default_model_path
from .errors import ModelLoadError, first_line
from ..files.atomic import atomic_write_text, unique_sibling
from .hashing import sha256_file

__all__ = ["model_cache_dir", "gguf_entry", "ensure_entry"]

logger = logging.getLogger(__name__)

_MANIFEST_NAME = "vase-manifest.json"
# Bump when the layout or the way entries are produced changes, so old entries get rebuilt.
_CACHE_FORMAT = 1


def model_cache_dir() -> Path:
    """Where dequantised copies of GGUF models live.

    ``$VASE_CACHE_DIR`` wins; else ``$XDG_CACHE_HOME/vase``; else ``~/.cache/vase``. Empty variables
    count as unset. The folder is not created here, only when something is written into it.
    """
    explicit = os.environ.get("VASE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "vase"
    return Path.home() / ".cache" / "vase"


def _entry_files(entry: Path) -> list[str]:
    return sorted(
        str(p.relative_to(entry).as_posix()) for p in entry.rglob("*") if p.is_file() and p.name != _MANIFEST_NAME
    )


def _entry_problem(entry: Path, source_sha: str) -> str | None:
    """Why a cache entry must not be loaded, or None when every file matches its manifest."""
    manifest_path = entry / _MANIFEST_NAME
    if not manifest_path.is_file():
        return "no manifest (partial or interrupted write)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != _CACHE_FORMAT:
            return f"cache format {manifest.get('format')!r}, expected {_CACHE_FORMAT}"
        if manifest.get("source_sha256") != source_sha:
            return "built from a different source file"
        if sorted(files) != _entry_files(entry):
            return "its files do not match the manifest's list"
        for name, info in files.items():
            path = entry / name
            if path.stat().st_size != info["size"]:
                return f"{name} has the wrong size"
            if sha256_file(path) != info["sha256"]:
                return f"{name} has the wrong sha256"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable manifest or file ({first_line(exc)})"
    return None


def _write_manifest(folder: Path, source: Path, source_sha: str) -> None:
    """The manifest goes in last: its presence is what marks an entry complete."""
    import transformers

    files = {}
    for name in _entry_files(folder):
        path = folder / name
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {
        "format": _CACHE_FORMAT,
        "source": source.name,
        "source_sha256": source_sha,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "files": files,
    }
    atomic_write_text(folder / _MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))


def _build_entry(gguf: Path, source_sha: str, entry: Path) -> None:
    """Dequantise ``gguf`` into ``entry``: written in a temp folder, renamed into place when complete."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(entry)
    tmp = unique_sibling(entry)
    tmp.mkdir()  # not mkdtemp: that makes it owner-only, which a shared cache should not be
    lock = _lock_folder(tmp)  # tells a cleaner in another process that this build is alive
    try:
        from .gguf import load_gguf  # transformers: only a build needs it, never a warm load

        model, tokenizer = load_gguf(gguf)
        # float32, so that the copy is faithful to the dequantised values; casting happens at load.
        model.to(torch.float32).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _apply_umask(tmp)  # safetensors writes 0600 files: a shared cache needs the usual permissions
        _write_manifest(tmp, gguf, source_sha)
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another process finished the same entry first; keep theirs if it is sound.
            if entry.is_dir() and _entry_problem(entry, source_sha) is None:
                return
            _remove(entry)
            os.rename(tmp, entry)
    finally:
        if lock is not None:
            os.close(lock)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    with _UMASK_LOCK:  # os.umask can only be read by setting it: keep other threads out meanwhile
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _apply_umask(folder: Path) -> None:
    """Give every file under ``folder`` mode 0666 & ~umask and every folder 0777 & ~umask."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _lock_folder(folder: Path) -> int | None:
    """An exclusive flock on ``folder`` held until the returned descriptor is closed (None where unsupported)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_locked(folder: Path) -> bool:
    fd = _lock_folder(folder)
    if fd is None:
        return True  # held by someone (or cannot tell): leave it alone
    os.close(fd)
    return False


def _remove_stale_temps(entry: Path, min_age_s: float = 3600.0) -> None:
    """Delete temp folders that a killed build of ``entry`` left behind (run on every load).

    Only folders that are an hour old, whose writer process is gone and that no process holds
    locked: the age guards against a build still running on another machine that shares the cache.
    """
    now = time.time()
    for tmp in entry.parent.glob(f".{entry.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 2)[-2])
            age = now - tmp.stat().st_mtime
        except (ValueError, IndexError, OSError):
            continue
        if age < min_age_s or _pid_alive(pid) or (tmp.is_dir() and _is_locked(tmp)):
            continue
        logger.info("removing %s, left behind by a build that was killed", tmp)
        _remove(tmp)


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":
        return True  # os.kill(pid, 0) would send CTRL_C there; leave the folder alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, but not ours to signal
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "model"


def gguf_entry(gguf: Path, source_sha: str, cache_dir: Path, stem: str | None = None) -> Path:
    """The store folder of a GGUF file with sha256 ``source_sha`` (named after ``stem``, else the file)."""
    return cache_dir / "models" / f"{stem or _slug(gguf.stem)}-{source_sha[:12]}"


def ensure_entry(entry: Path, source_sha: str, gguf: Path | None) -> Path:
    """Return a verified cache entry, (re)building it from ``gguf`` when missing or unsound.

    ``gguf`` may be None, meaning "find it only if needed" (the default model's warm path never
    touches the package).
    """
    if entry.parent.is_dir():
        _remove_stale_temps(entry)
    if entry.exists():
        problem = _entry_problem(entry, source_sha)
        if problem is None:
            return entry
        logger.warning("cache entry %s is unusable (%s); rebuilding it", entry, problem)
        _remove(entry)
    if gguf is None:
        gguf = default_model_path()
    try:
        _build_entry(gguf, source_sha, entry)
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(
            f"could not write the model cache at {entry.parent} ({first_line(exc)}): set VASE_CACHE_DIR "
            "to a writable folder"
        ) from exc
    problem = _entry_problem(entry, source_sha)
    if problem is not None:  # pragma: no cover - would mean the disk changed under us
        raise ModelLoadError(f"the freshly built cache entry {entry} does not verify: {problem}")
    return entry
