"""What a model spec names (the default, a .gguf file, a folder or a hub id), and the folder to hand an engine."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .default import DEFAULT_ENTRY_STEM, DEFAULT_GGUF_FILENAME, DEFAULT_GGUF_SHA256
from .errors import ModelLoadError
from .hashing import source_sha256
from .store import ensure_entry, gguf_entry, model_cache_dir

__all__ = ["model_name", "looks_like_path", "model_dir"]

# "owner/name" or a bare legacy name such as "gpt2"; anything else cannot be a hub repository.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def model_name(model: str | os.PathLike[str] | None) -> str:
    """The model spec as a string ("default" for None); ModelLoadError for an empty one (``-m ''``)."""
    name = "default" if model is None else os.fspath(model)
    if not isinstance(name, str) or not name.strip():
        raise ModelLoadError(f"the model is empty ({name!r}): give a hub id, a model folder or a .gguf file with "
                             f"--model, or leave --model out for the default")
    return name


def looks_like_path(name: str) -> bool:
    """Whether a name that exists nowhere on disk can only have been meant as a path."""
    return name.startswith((".", "/", "~")) or name.lower().endswith(".gguf") or not _HUB_ID_RE.match(name)


def model_dir(model: str | os.PathLike[str] | None = None, *, cache_dir: str | Path | None = None) -> str:
    """What to hand another engine (vLLM) for ``model``: a transformers directory or a hub id.

    None / "default" and ``.gguf`` files give their verified, dequantised cache entry (built once,
    as :func:`load_model` does); a directory or a hub id is returned as given.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    name = model_name(model)
    if name == "default":
        entry = gguf_entry(Path(DEFAULT_GGUF_FILENAME), DEFAULT_GGUF_SHA256, cache, stem=DEFAULT_ENTRY_STEM)
        return str(ensure_entry(entry, DEFAULT_GGUF_SHA256, gguf=None))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        sha = source_sha256(path, cache)
        return str(ensure_entry(gguf_entry(path, sha, cache), sha, gguf=path))
    if path.exists() or looks_like_path(name):
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name} is not a transformers model directory (no config.json): pass a model "
                                 f"directory, a .gguf file or a hub id")
        return str(path)
    return name
