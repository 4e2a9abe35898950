"""``load_model``: a dense transformers causal LM and a tokenizer that pads on the left, from any model spec.

The embedded default and ``.gguf`` files load from their verified store entry (:mod:`.store`);
directories and hub ids load directly. Support is checked on the config before any weight is read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..hf.support import UnsupportedModelError, check_model_supported, config_problem
from .default import DEFAULT_ENTRY_STEM, DEFAULT_GGUF_FILENAME, DEFAULT_GGUF_SHA256, DEFAULT_MODEL
from .errors import ModelLoadError, first_line, hub_error
from .hashing import source_sha256
from .options import accelerate_available, check_attn_implementation, resolve_device, resolve_dtype
from .resolve import looks_like_path, model_name
from .store import ensure_entry, gguf_entry, model_cache_dir

__all__ = ["load_model"]

logger = logging.getLogger(__name__)

# Any of these in a local directory means it carries a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _finish_tokenizer(tokenizer: PreTrainedTokenizerBase, source: str) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token and left padding, which batched decoding relies on."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"the tokenizer of {source} has neither a pad nor an eos token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _finish_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    model.eval()
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        # Otherwise generate() warns on every call and guesses.
        generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _load_pretrained(
    source: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    local: bool,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a transformers checkpoint: a hub id (``local=False``) or a local directory."""

    def fail(exc: BaseException, what: str) -> ModelLoadError:
        if local:
            return ModelLoadError(f"could not load the {what} from {source}: {first_line(exc)}")
        return hub_error(source, exc)

    # The config is cheap: check support before downloading or reading any weights.
    # Loading failures are caught broadly: the hub stack raises OSError, huggingface_hub and httpx
    # errors, safetensors its own type; all become one line, with the original kept as __cause__.
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=local)
    except Exception as exc:
        raise fail(exc, "config") from exc
    problem = config_problem(config)
    if problem:
        raise UnsupportedModelError(f"{source} ({type(config).__name__}) is not supported: {problem}")

    # transformers 5 quietly builds an empty one-token tokenizer for a folder without tokenizer
    # files, which would then encode every text to nothing; refuse that up front.
    no_tokenizer = ModelLoadError(
        f"no tokenizer found in {source}: save one next to the model with `tokenizer.save_pretrained(...)`"
    )
    if local and not any((Path(source) / name).is_file() for name in _TOKENIZER_FILES):
        raise no_tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except Exception as exc:
        raise fail(exc, "tokenizer") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerBase) or len(tokenizer) <= 1:
        raise no_tokenizer

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    # A device_map loads straight onto the GPU but needs accelerate; without it load, then move.
    if device.type != "cpu" and accelerate_available():
        kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=local, **kwargs)
    except Exception as exc:
        if isinstance(exc, ValueError) and "Unrecognized configuration class" in str(exc):
            raise UnsupportedModelError(
                f"{source} ({type(config).__name__}) is not supported: it is not a causal language model"
            ) from exc
        raise fail(exc, "model") from exc
    model = model.to(device)
    return model, _finish_tokenizer(tokenizer, source)


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for vase.

    Args:
        model: None or "default" for the embedded SmolLM2-135M-Instruct; a hub id such as
            "Qwen/Qwen3-4B"; a local transformers directory; or a path to a ``.gguf`` file.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16", or a
            ``torch.dtype``.
        device: "cpu", "cuda" (or "cuda:N") or "auto" (CUDA when available).
        attn_implementation: "sdpa", "eager" or "flash_attention_2".
        cache_dir: where dequantised GGUF copies live; defaults to :func:`model_cache_dir`.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``device``, the tokenizer padding on the
        left with a pad token.

    Raises:
        ModelLoadError: the model cannot be found, downloaded, verified or read.
        UnsupportedModelError: it loads, but vase cannot evict its cache (see
            :func:`check_model_supported`).
    """
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    check_attn_implementation(attn_implementation, resolved_device)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    options = {"dtype": resolved_dtype, "device": resolved_device, "attn_implementation": attn_implementation}

    name = model_name(model)
    if name == "default":
        entry = gguf_entry(Path(DEFAULT_GGUF_FILENAME), DEFAULT_GGUF_SHA256, cache, stem=DEFAULT_ENTRY_STEM)
        entry = ensure_entry(entry, DEFAULT_GGUF_SHA256, gguf=None)
        loaded = _load_pretrained(str(entry), local=True, **options)
        label = DEFAULT_MODEL
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            source_sha = source_sha256(path, cache)
            entry = ensure_entry(gguf_entry(path, source_sha, cache), source_sha, gguf=path)
            loaded = _load_pretrained(str(entry), local=True, **options)
        elif path.is_file():
            raise ModelLoadError(f"{name} is a file but not a .gguf file: pass a .gguf file or a model directory")
        elif path.is_dir():
            if not (path / "config.json").is_file():
                ggufs = sorted(p.name for p in path.glob("*.gguf"))
                extra = f" (pass one of its .gguf files instead: {', '.join(ggufs[:3])})" if ggufs else ""
                raise ModelLoadError(f"{name} is not a transformers model directory: no config.json{extra}")
            loaded = _load_pretrained(str(path), local=True, **options)
        elif looks_like_path(name):
            raise ModelLoadError(f"no such file or directory: {name}")
        else:
            loaded = _load_pretrained(name, local=False, **options)
        label = name

    loaded_model, tokenizer = loaded
    check_model_supported(loaded_model)
    logger.info("loaded %s as %s (%s, %s)", label, type(loaded_model).__name__, resolved_dtype, resolved_device)
    return _finish_model(loaded_model, tokenizer), tokenizer
