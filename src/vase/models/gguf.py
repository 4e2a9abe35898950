"""Reading a GGUF file: dequantised into a dense float32 transformers model and its tokenizer (slow: 10+ s).

Only the model store calls this, once per GGUF file; the result is saved as a plain checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .errors import ModelLoadError, first_line
from .options import accelerate_available

__all__ = ["load_gguf"]

logger = logging.getLogger(__name__)


def _clear_quantizer(model: PreTrainedModel) -> None:
    """Drop what marks a GGUF-loaded model as quantized, so ``save_pretrained`` accepts it.

    ``save_pretrained`` refuses any model whose ``hf_quantizer`` is not serializable, and the GGUF
    quantizer never is. With ``GgufConfig(dequantize=True)`` transformers already removes it; this is
    the fallback for a quantizer that is still attached (its weights are dense by then).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _load_gguf_legacy(gguf: Path) -> PreTrainedModel:
    """Dequantise a GGUF without ``from_pretrained``, for installs without ``accelerate``.

    transformers refuses ``from_pretrained(gguf_file=...)`` unless accelerate is installed, although
    it does not use it for a dense CPU load; vase does not depend on accelerate. This builds the
    model from the GGUF's config and fills it with transformers' own GGUF reader, the same reader
    ``from_pretrained`` uses for architectures such as llama (the weights come out bit-identical).
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older layout: a random init is only slower
        from contextlib import nullcontext as no_init_weights
    # Skip the random init: every weight is overwritten below, and it costs ~8 s for 135M params.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    model.tie_weights()
    if result.unexpected_keys:
        raise ModelLoadError(f"{gguf} has tensors the model does not: {result.unexpected_keys[:5]}")
    # A key the file lacks is fine only if it is tied to one it has (lm_head <- embed_tokens);
    # anything else would be uninitialised memory.
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(result.missing_keys)
    loaded_ids = {id(p) for name, p in params.items() if name not in missing}
    # (Buffers are computed at construction, not initialised, so a missing buffer is harmless.)
    untied = sorted(k for k in missing if k in params and id(params[k]) not in loaded_ids)
    if untied:
        raise ModelLoadError(f"{gguf} lacks weights the model needs: {untied[:5]}")
    return model


_GGUF_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _shared_gguf_parsing() -> Iterator[None]:
    """Parse each GGUF file once while transformers reads it several times over.

    For architectures on transformers' legacy GGUF loader (llama among them) the config, the
    tokenizer and the weights each construct a fresh ``gguf.GGUFReader`` -- ~5 s apiece for the
    49k-token vocabulary -- and the weight-name mapping rebuilds ``gguf.get_tensor_name_map`` for
    every one of the model's ~400 modules. Both are looked up on the ``gguf`` module at call time,
    so memoising them for the duration of one load cuts a cold build about threefold; the readers
    are memory maps used read-only, and everything is restored on exit. Should transformers stop
    calling them this way, this silently becomes a no-op.
    """
    try:
        import gguf as gguf_module
    except ImportError:  # transformers will report the missing package itself
        yield
        return
    original_reader = getattr(gguf_module, "GGUFReader", None)
    original_name_map = getattr(gguf_module, "get_tensor_name_map", None)
    if original_reader is None or original_name_map is None:
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    with _GGUF_PATCH_LOCK:
        gguf_module.GGUFReader = shared_reader
        gguf_module.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
        try:
            yield
        finally:
            gguf_module.GGUFReader = original_reader
            gguf_module.get_tensor_name_map = original_name_map
            readers.clear()


def load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Read and dequantise a GGUF file into a float32 model and its tokenizer (slow: 10+ s)."""
    logger.info("dequantising %s (one-off, takes a while)", gguf)
    with _shared_gguf_parsing():
        return _load_gguf_unshared(gguf)


def _load_gguf_unshared(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        if accelerate_available():
            from transformers.utils.quantization_config import GgufConfig

            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                dtype=torch.float32,
                # dense weights (not packed GGUF blocks), so that the saved copy is a plain checkpoint
                quantization_config=GgufConfig(dequantize=True),
            )
        else:
            model = _load_gguf_legacy(gguf)
        _clear_quantizer(model)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ModelLoadError:
        raise
    except Exception as exc:  # a damaged or unsupported file fails in many ways, all reported alike
        unsupported = isinstance(exc, NotImplementedError) or "architecture" in str(exc).lower()
        hint = (
            " (installing `accelerate` enables transformers' newer GGUF loader, which knows more architectures)"
            if unsupported and not accelerate_available()
            else ""
        )
        if "cannot reshape array" in str(exc) or isinstance(exc, (EOFError, struct.error)):
            hint = f" (the file is {gguf.stat().st_size} bytes and looks truncated or damaged: download it again)"
        raise ModelLoadError(f"could not read the GGUF file {gguf}: {first_line(exc)}{hint}") from exc
    return model, tokenizer
