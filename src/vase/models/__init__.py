"""Model loading: the embedded default model, hub ids, local directories and GGUF files.

Every model comes back as a dense ``transformers`` causal LM plus a tokenizer that pads on the left
(the library decodes left-padded batches). GGUF files are dequantised once into a plain
``save_pretrained`` copy in the vase cache, because reading a GGUF through transformers takes 15+ s
while the saved copy loads in one or two. A cache entry is only ever loaded after its manifest
(sha256 of every file, written last) has been checked, so a partial or corrupted entry is rebuilt
instead of silently giving a different model.

The rooms: :mod:`.load` (``load_model``, the only one that imports transformers at import time),
:mod:`.gguf` (reading GGUF files, imported by a store build only), :mod:`.store` (the verified
cache entries), :mod:`.resolve` (what a model spec names; ``model_dir`` for another engine),
:mod:`.fingerprint` (content hashes), :mod:`.options` (device, dtype, kernel), :mod:`.default`
(the embedded model), :mod:`.hashing` and :mod:`.errors`. Everything but ``load_model`` imports
without transformers, so ``vase serve`` and config checks stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hf.support import UnsupportedModelError, check_model_supported
# The default model's constants and the load options are re-exported too (callers import them from here).
from .default import (DEFAULT_GGUF_FILENAME, DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_REQUIREMENT, DEFAULT_GGUF_SHA256,
                      DEFAULT_MODEL, default_model_path)
from .errors import ModelLoadError
from .fingerprint import loaded_model_fingerprint, model_fingerprint
from .options import resolve_device, resolve_dtype
from .resolve import model_dir
from .store import model_cache_dir

__all__ = [
    "DEFAULT_MODEL",
    "ModelLoadError",
    "UnsupportedModelError",
    "check_model_supported",
    "default_model_path",
    "load_model",
    "model_cache_dir",
    "model_fingerprint",
    "loaded_model_fingerprint",
    "model_dir",
]

if TYPE_CHECKING:
    from .load import load_model


def __getattr__(name: str):
    if name == "load_model":  # imported on first use: it brings transformers
        from .load import load_model

        globals()[name] = load_model  # later lookups skip __getattr__
        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
