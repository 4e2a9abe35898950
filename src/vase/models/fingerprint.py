"""Content hashes naming a model: from its files without loading it, or from a loaded model's tensors."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .default import DEFAULT_GGUF_SHA256
from .errors import ModelLoadError, hub_error
from .hashing import source_sha256
from .resolve import looks_like_path, model_name
from .store import model_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["model_fingerprint", "loaded_model_fingerprint"]

# What in a model folder determines its outputs: config, weights, tokenizer (not READMEs or licences).
_MODEL_FILE_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth",
    "tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "*.model", "chat_template*",
)


def _folder_sha256(folder: Path, cache_dir: Path | None) -> str:
    """sha256 over (name, sha256) of the model files of ``folder`` (each file's hash memoised)."""
    names = sorted({p.name for pattern in _MODEL_FILE_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    if "config.json" not in names:
        raise ModelLoadError(f"{folder} is not a transformers model directory: no config.json")
    digest = hashlib.sha256()
    for name in names:
        digest.update(f"{name}\t{source_sha256(folder / name, cache_dir)}\n".encode())
    return digest.hexdigest()


def model_fingerprint(model: str | os.PathLike[str] | None = None, *, cache_dir: str | Path | None = None) -> str:
    """sha256 naming the model that ``load_model(model)`` would load, from its files, without loading it.

    The embedded default model: its pinned GGUF sha256 (its cache entry is verified against it on
    every load). A ``.gguf`` file: the file's sha256. A directory (or a hub id, from its local
    snapshot, downloaded if needed): sha256 over the hashes of its config, weight and tokenizer
    files. File hashes are memoised like the GGUF hashes, so only the first call reads the weights.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    name = model_name(model)
    if name == "default":
        return DEFAULT_GGUF_SHA256
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return source_sha256(path, cache)
    if path.is_file():
        raise ModelLoadError(f"{name} is a file but not a .gguf file: pass a .gguf file or a model directory")
    if path.is_dir():
        return _folder_sha256(path, cache)
    if looks_like_path(name):
        raise ModelLoadError(f"no such file or directory: {name}")
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name, allow_patterns=list(_MODEL_FILE_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types; all become one line
        raise hub_error(name, exc) from exc
    return _folder_sha256(Path(folder), cache)


def loaded_model_fingerprint(model: PreTrainedModel) -> str:
    """sha256 of a model object's class, config and every tensor of its state dict (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256(type(model).__name__.encode())
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("transformers_version", "_attn_implementation", "_attn_implementation_internal",
                           "attn_implementation", "dtype", "torch_dtype", "_name_or_path")}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{key}|{t.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
