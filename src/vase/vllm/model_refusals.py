"""The models the vLLM plugin refuses by their layers, one line each (duck-typed: no vLLM import).

vase's vLLM plugin evicts one KV cache group of full-attention layers. vLLM 0.32 gives a hybrid model
several groups: beside sliding-window groups (Gemma 3, gpt-oss) the plugin evicts the full-attention
group only (`vase.vllm.groups`); beside recurrent/Mamba-style state groups (Qwen3-Next's gated-delta-net
linear attention, which vLLM's CPU build runs only in bf16) likewise, the state left to vLLM. Only the
linear-attention hybrids compared end to end are taken (`LINEAR_COMPARED`: Qwen3-Next); other recurrent
hybrids (Qwen3.5, whose vLLM module needs torchvision; Jamba, Falcon-H1, ...) are refused here and run with
vase's transformers engine instead, which evicts their full-attention layers (docs/models.md). Llama 4's chunked-local layers get a group of their own
(`ChunkedLocalAttentionSpec`), left to vLLM at the logical lengths like a sliding-window group. A model sliding every layer has nothing
growing to evict. MLA models (DeepSeek-V2/V3, Kimi K2) get their latent cache evicted, one kept set per layer
shared by every head (`vase.vllm.latent`); other MLA variants are refused there.
"""

from __future__ import annotations

from typing import Any

from vase.hf.hybrid import FULL, LINEAR, SLIDING, layer_types

from .config import VaseConfigError
from .latent import is_latent_model, latent_model_refusal

#: `hf_text_config.model_type` of the linear-attention hybrids whose plugin runs were compared with stock vLLM and
#: the transformers engine (tests/test_vllm_linear.py).
LINEAR_COMPARED = ("qwen3_next",)

_INSTEAD = ("run it with vase's transformers engine (--engine transformers), which evicts its full-attention "
            "layers (docs/models.md)")


def model_refusal(model_config: Any) -> str | None:
    """Why the plugin cannot evict in this vLLM `ModelConfig`'s model, in one line (None: it can)."""
    name = model_config.model
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    kind = getattr(text, "model_type", None) or "this model"
    if is_latent_model(model_config):  # the latent cache, one kept set per layer (`vase.vllm.latent`)
        return latent_model_refusal(model_config)
    types = set(layer_types(text))
    recurrent = getattr(model_config, "is_hybrid", False) or getattr(model_config, "has_inner_state", False)
    if (recurrent or LINEAR in types) and not (kind in LINEAR_COMPARED and types == {LINEAR, FULL}):
        return (f"{name} ({kind}) has recurrent (linear-attention or Mamba) layers, and vase's vLLM plugin evicts "
                f"beside them only in {', '.join(LINEAR_COMPARED)} (compared end to end): {_INSTEAD}")
    if (model_config.get_sliding_window() is not None or SLIDING in types) and FULL not in types:
        return (f"{name} ({kind}) has sliding-window attention in every layer: its cache is already bounded and "
                f"there is no full-attention layer to evict in; use a model with full-attention layers")
    # sliding-window layers beside full attention (Gemma 3, gpt-oss): the plugin evicts the full-attention
    # KV cache group and leaves the sliding-window groups to vLLM (vase.vllm.groups)
    return None


#: What to change when vLLM puts local-attention layers in the evicted group.
_HYBRID_ON = ("leave disable_hybrid_kv_cache_manager unset (or False) and drop what turned vLLM's hybrid KV cache "
              "manager off (a KV connector, a non-CUDA/CPU platform's default, ...) or drop additional_config['vase']")


def local_layers_refusal(model_config: Any, hybrid_manager_off: bool) -> str | None:
    """Why the plugin cannot evict when vLLM's hybrid KV cache manager is off (`disable_hybrid_kv_cache_manager`)
    and the model has local-attention layers (sliding-window: Gemma 3, gpt-oss; chunked-local: Llama 4): vLLM then
    puts them in the one full-attention KV cache group, where the plugin would evict them too and each kernel would
    apply its window or chunks to physical slots (silent wrong tokens). One line, or None."""
    if not hybrid_manager_off:
        return None
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    types = set(layer_types(text))
    chunk = getattr(text, "attention_chunk_size", None)
    local = sorted(t for t in types if t != FULL) + (["chunked local attention"] if chunk else [])
    if model_config.get_sliding_window() is not None and SLIDING not in local:
        local.append(SLIDING)
    if not local:
        return None
    return (f"{model_config.model} has {', '.join(local)} layers, and with vLLM's hybrid KV cache manager off they "
            f"share the full-attention KV cache group vase evicts (their windows would slide over evicted slots): "
            f"{_HYBRID_ON}")


def check_model_layers(model_config: Any) -> None:
    """Raise VaseConfigError with `model_refusal`'s line, if any."""
    problem = model_refusal(model_config)
    if problem:
        raise VaseConfigError(problem)
