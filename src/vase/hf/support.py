"""Which models vase can run: decoder-only, attention through transformers' AttentionInterface, at least
one full-attention layer (evicted) and otherwise only sliding-window, chunked-local (Llama 4) or
linear-attention layers (left to the model, `vase.hf.hybrid`). Checked on a config before weights load, and on a model."""

from __future__ import annotations

import sys
from typing import Any

from .hybrid import layer_type_problem
from .latent import latent_problem


class UnsupportedModelError(ValueError):
    """A model loads, but vase's KV-cache eviction cannot work with it."""


def sliding_window_problem(config: Any) -> str | None:
    """Why this config's layer mix cannot be evicted, if it cannot (`vase.hf.hybrid.layer_type_problem`).

    Full-attention layers are evicted; sliding-window, chunked-local and linear-attention (recurrent) layers
    beside them keep transformers' own cache. A model with no full-attention layer has nothing to evict."""
    return layer_type_problem(config)


def config_problem(config: Any) -> str | None:
    """What in a config alone rules a model out (checked before any weights are loaded)."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model (vase evicts a decoder-only self-attention cache)"
    configs = [config]
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            text_config = get_text_config(decoder=True)
        except (TypeError, ValueError):
            text_config = None
        if text_config is not None and text_config is not config:
            configs.append(text_config)
    for cfg in configs:
        problem = sliding_window_problem(cfg) or latent_problem(cfg)
        if problem:
            return f"its layers cannot be evicted: {problem}"
    return None


def check_model_supported(model: Any) -> None:
    """Refuse a model whose attention vase cannot hook into.

    vase's policies plug into transformers' attention interface, so the model's attention must go
    through it (`_supports_attention_backend`, or a modeling file that dispatches through
    `ALL_ATTENTION_FUNCTIONS`, as Qwen3-Next and Qwen3.5 do), the model must be decoder-only, and its
    layers must be full attention, sliding window, chunked-local or linear attention with at least one
    full-attention layer (`vase.hf.hybrid`).

    Raises:
        UnsupportedModelError: naming the model class and the reason.
    """
    cls_name = type(model).__name__
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{cls_name} is not supported: {config_problem(config)}")
    if not getattr(type(model), "_supports_attention_backend", False) and not _dispatches_attention(model):
        raise UnsupportedModelError(
            f"{cls_name} is not supported: it does not use transformers' attention interface "
            "(_supports_attention_backend is False), which vase hooks into"
        )
    if config is not None:
        problem = config_problem(config)
        if problem:
            raise UnsupportedModelError(f"{cls_name} is not supported: {problem}")


def _dispatches_attention(model: Any) -> bool:
    """Whether the model's modeling file calls its attention through transformers' `ALL_ATTENTION_FUNCTIONS`
    (some hybrid models, e.g. Qwen3-Next, do without setting `_supports_attention_backend`). The cache
    checks at run time that every update of an evicting layer is followed by a call of vase's attention."""
    name = type(model).__module__
    return name.startswith("transformers.models.") and hasattr(sys.modules.get(name), "ALL_ATTENTION_FUNCTIONS")
