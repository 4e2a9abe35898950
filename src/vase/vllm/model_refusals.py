"""The models the vLLM plugin refuses by their layers, one line each (duck-typed: no vLLM import).

vase's vLLM plugin evicts one KV cache group of full-attention layers. vLLM 0.32 gives a hybrid model
several groups: beside sliding-window groups (Gemma 3, gpt-oss) the plugin evicts the full-attention
group only (`vase.vllm.groups`); beside recurrent/Mamba-style state (Qwen3-Next, Qwen3.5, whose
linear attention vLLM's CPU build runs only in bf16) it is not written yet, so those models are
refused here and run with vase's transformers engine instead, which evicts their full-attention
layers (docs/models.md). A model sliding every layer has nothing growing to evict. MLA's latent
cache has no per-KV-head tokens to evict.
"""

from __future__ import annotations

from typing import Any

from vase.hybrid import FULL, LINEAR, SLIDING, layer_types

from .config import VaseConfigError

_INSTEAD = ("run it with vase's transformers engine (--engine transformers), which evicts its full-attention "
            "layers (docs/models.md)")


def model_refusal(model_config: Any) -> str | None:
    """Why the plugin cannot evict in this vLLM `ModelConfig`'s model, in one line (None: it can)."""
    name = model_config.model
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    kind = getattr(text, "model_type", None) or "this model"
    if getattr(model_config, "use_mla", False):
        return (f"{name} uses MLA (a compressed latent cache) that vase cannot evict per KV head: use a model with "
                f"standard attention")
    types = set(layer_types(text))
    if getattr(model_config, "is_hybrid", False) or getattr(model_config, "has_inner_state", False) or LINEAR in types:
        return (f"{name} ({kind}) has linear-attention (recurrent) layers beside full attention, which vase's vLLM "
                f"plugin does not evict in yet: {_INSTEAD}")
    if (model_config.get_sliding_window() is not None or SLIDING in types) and FULL not in types:
        return (f"{name} ({kind}) has sliding-window attention in every layer: its cache is already bounded and "
                f"there is no full-attention layer to evict in; use a model with full-attention layers")
    # sliding-window layers beside full attention (Gemma 3, gpt-oss): the plugin evicts the full-attention
    # KV cache group and leaves the sliding-window groups to vLLM (vase.vllm.groups)
    return None


def check_model_layers(model_config: Any) -> None:
    """Raise VaseConfigError with `model_refusal`'s line, if any."""
    problem = model_refusal(model_config)
    if problem:
        raise VaseConfigError(problem)
