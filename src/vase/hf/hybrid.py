"""Which layers of a model vase evicts, and what the other layers hold: pure config reading.

A hybrid model mixes full-attention layers with layers whose cache is already bounded:

- ``full_attention``: K/V grow with every token. vase evicts here (B, w and the schedule per layer).
- ``sliding_attention``: transformers' own sliding layer keeps the last ``window - 1`` tokens between
  forwards (a step reads those and the new one); vase leaves it to the model.
- ``chunked_attention`` (Llama 4's chunked-local RoPE layers): a query attends to the tokens of its own
  chunk of ``attention_chunk_size`` only; transformers caches it in the same sliding layer with the chunk
  size as window (the last ``chunk - 1`` tokens) and masks the chunks itself; vase leaves it to the model.
- ``linear_attention``: a recurrent state (Qwen3-Next / Qwen3.5 gated delta net: a short causal-conv
  state and one [heads, key_dim, value_dim] matrix), fixed in size; vase leaves it to the model.

No torch or transformers import: the CLI, the bench and the eval read it from a config alone.
"""

from __future__ import annotations

from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"
CHUNKED = "chunked_attention"
#: the layer types vase knows what to do with; anything else (MLA-indexed, conv, ...) is refused
KNOWN = (FULL, SLIDING, CHUNKED, LINEAR)
#: local-attention layers: a bounded K/V window in transformers' own sliding layer, masked by the model
LOCAL = (SLIDING, CHUNKED)


def text_config(config: Any) -> Any:
    """The decoder's config of a (possibly multimodal) config."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except (TypeError, ValueError):
            return config
    return config


def layer_types(config: Any) -> list[str]:
    """One entry per decoder layer: ``full_attention``, ``sliding_attention``, ``chunked_attention``,
    ``linear_attention`` or another name transformers uses (which vase refuses). A config without ``layer_types`` is full attention on every
    layer, unless it slides every layer (a Mistral-style ``sliding_window``, or ``use_sliding_window``)."""
    cfg = text_config(config)
    n = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    types = getattr(cfg, "layer_types", None)
    if types:
        return [str(t) for t in types]
    window = getattr(cfg, "sliding_window", None)
    slides = bool(cfg.use_sliding_window) if hasattr(cfg, "use_sliding_window") else True
    return [SLIDING if window and slides else FULL] * n


def is_hybrid(config: Any) -> bool:
    """Whether some layer is not full attention (vase evicts only the full-attention ones)."""
    return any(t != FULL for t in layer_types(config))


def full_attention_layers(config: Any) -> list[int]:
    """Indices of the layers vase evicts."""
    return [i for i, t in enumerate(layer_types(config)) if t == FULL]


def sliding_window(config: Any) -> int | None:
    """The sliding layers' window (``config.sliding_window``), or None."""
    w = getattr(text_config(config), "sliding_window", None)
    return int(w) if w else None


def local_window(config: Any, kind: str) -> int | None:
    """The K/V window transformers' own cache layer gives a local layer of type `kind`: ``sliding_window``
    for ``sliding_attention``, ``attention_chunk_size`` for ``chunked_attention`` (its layer keeps the
    last ``window - 1`` tokens either way); None for other types or when unset."""
    name = {SLIDING: "sliding_window", CHUNKED: "attention_chunk_size"}.get(kind)
    w = getattr(text_config(config), name, None) if name else None
    return int(w) if w else None


def _attention_dims(cfg: Any) -> tuple[int, int]:
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return kv_heads, head_dim


def kv_bytes_per_layer_token(config: Any, element_bytes: int) -> int:
    """K and V bytes one token takes in one attention layer (full or sliding): 2 x kv_heads x head_dim x bytes;
    for multi-head latent attention (DeepSeek-V2/V3, Kimi K2: a config with ``kv_lora_rank``), the latent
    cache a serving engine keeps, one vector shared by every head: (kv_lora_rank + qk_rope_head_dim) x bytes."""
    cfg = text_config(config)
    if getattr(cfg, "kv_lora_rank", None):
        return (int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)) * element_bytes
    kv_heads, head_dim = _attention_dims(cfg)
    return 2 * kv_heads * head_dim * element_bytes


#: transformers' gated-delta-rule kernels (its torch fallback and flash-linear-attention) keep the recurrent
#: state in float32 whatever the model's dtype
RECURRENT_STATE_BYTES = 4


def recurrent_state_bytes(config: Any, element_bytes: int) -> int:
    """Bytes of one ``linear_attention`` layer's state for one sequence (Qwen3-Next / Qwen3.5 gated delta net):
    the causal-conv state [conv_dim, kernel] in the model's dtype (`element_bytes`), with conv_dim =
    2 x key_heads x key_dim + value_heads x value_dim, and the recurrent state [value_heads, key_dim,
    value_dim] in float32."""
    cfg = text_config(config)
    nk, dk = int(cfg.linear_num_key_heads), int(cfg.linear_key_head_dim)
    nv, dv = int(cfg.linear_num_value_heads), int(cfg.linear_value_head_dim)
    conv = (2 * nk * dk + nv * dv) * int(cfg.linear_conv_kernel_dim)
    return conv * element_bytes + nv * dk * dv * RECURRENT_STATE_BYTES


def bounded_bytes(config: Any, element_bytes: int, length: int) -> int:
    """Bytes one sequence of `length` tokens holds in the layers vase does not evict: each sliding layer
    min(window - 1, length) tokens (what transformers' sliding layer keeps between forwards), each chunked
    layer min(chunk - 1, length) tokens (the same layer, the chunk size as window), each linear-attention
    layer its fixed state. 0 for a model with full attention on every layer."""
    types = layer_types(config)
    total = 0
    for kind in LOCAL:
        n_local = sum(t == kind for t in types)
        if n_local:
            total += n_local * min((local_window(config, kind) or 1) - 1, length) * kv_bytes_per_layer_token(
                config, element_bytes)
    n_linear = sum(t == LINEAR for t in types)
    if n_linear:
        total += n_linear * recurrent_state_bytes(config, element_bytes)
    return total


def bounded_bytes_mean(config: Any, element_bytes: int, prompt_length: int, seen: int) -> float:
    """`bounded_bytes` averaged over the tokens fed after the prompt (lengths prompt + 1 .. seen), the
    convention of the eval's time-averaged K/V (`kv_bytes_time_mean`); at the prompt length when nothing
    was fed after it."""
    if seen <= prompt_length:
        return float(bounded_bytes(config, element_bytes, prompt_length))
    types = layer_types(config)
    per_token = kv_bytes_per_layer_token(config, element_bytes)
    total = float(bounded_bytes(config, element_bytes, 0))  # the recurrent states, there from the first token
    lo, hi = prompt_length + 1, seen
    for kind in LOCAL:
        n_local = sum(t == kind for t in types)
        if not n_local:
            continue
        window = (local_window(config, kind) or 1) - 1
        # sum over t of min(window, t) for t = prompt + 1 .. seen
        below = max(0, min(hi, window) - lo + 1)  # t < window: t itself
        below_sum = (lo + lo + below - 1) * below // 2 if below else 0
        held = below_sum + (hi - lo + 1 - below) * window
        total += n_local * per_token * held / (hi - lo + 1)
    return total


def layer_type_problem(config: Any) -> str | None:
    """Why vase cannot evict this config's layer mix, if it cannot (None when it can)."""
    types = layer_types(config)
    shared = getattr(text_config(config), "num_kv_shared_layers", None)
    if shared:
        return (f"config.num_kv_shared_layers={shared}: layers that read another layer's K/V (Gemma 3n) are not "
                f"supported by vase's evicting cache")
    other = sorted(set(types) - set(KNOWN))
    if other:
        return (f"config.layer_types has {', '.join(other)} layers (vase runs full_attention layers, evicting them, "
                f"beside sliding_attention, chunked_attention and linear_attention layers)")
    if CHUNKED in types and not local_window(config, CHUNKED):
        return "config.layer_types has chunked_attention layers but config.attention_chunk_size is not set"
    if types and FULL not in types:
        if SLIDING in types and LINEAR not in types:
            return (f"every layer uses sliding-window attention (sliding_window={sliding_window(config)}): its cache is "
                    "already bounded, there is no full-attention layer for vase to evict")
        if CHUNKED in types and LINEAR not in types:
            return (f"every layer uses chunked-local attention (attention_chunk_size={local_window(config, CHUNKED)}): "
                    "its cache is already bounded, there is no full-attention layer for vase to evict")
        return "no layer uses full attention: there is no growing cache for vase to evict"
    return None
