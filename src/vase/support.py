"""Which models vase can run: decoder-only, full attention on every layer, attention through
transformers' AttentionInterface. Checked on a config before weights load, and on a model."""

from __future__ import annotations

from typing import Any


class UnsupportedModelError(ValueError):
    """A model loads, but vase's KV-cache eviction cannot work with it."""


def sliding_window_problem(config: Any) -> str | None:
    """Why this config's attention is not plain full causal attention on every layer, if it is not."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({str(t) for t in layer_types} - {"full_attention"})
        if other:
            return f"config.layer_types has {', '.join(other)} layers (vase needs full_attention on every layer)"
    sliding_window = getattr(config, "sliding_window", None)
    if hasattr(config, "use_sliding_window"):
        if config.use_sliding_window and sliding_window:
            return f"config.use_sliding_window is set with sliding_window={sliding_window}"
    elif sliding_window and not layer_types:
        # Mistral-style configs have no switch: a set sliding_window slides every layer.
        return f"config.sliding_window={sliding_window} applies to every layer"
    return None


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
        problem = sliding_window_problem(cfg)
        if problem:
            return f"it uses sliding-window attention: {problem}"
    return None


def check_model_supported(model: Any) -> None:
    """Refuse a model whose attention vase cannot hook into.

    vase's policies plug into transformers' attention interface and assume one full-attention KV
    cache per layer, so the model class must support the attention backend, the model must be
    decoder-only, and no layer may use sliding-window (or other non-full) attention.

    Raises:
        UnsupportedModelError: naming the model class and the reason.
    """
    cls_name = type(model).__name__
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{cls_name} is not supported: {config_problem(config)}")
    if not getattr(type(model), "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{cls_name} is not supported: it does not use transformers' attention interface "
            "(_supports_attention_backend is False), which vase hooks into"
        )
    if config is not None:
        problem = config_problem(config)
        if problem:
            raise UnsupportedModelError(f"{cls_name} is not supported: {problem}")
