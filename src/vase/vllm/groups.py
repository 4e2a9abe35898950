"""Which KV cache group the plugin evicts in: the full-attention one, beside any sliding-window groups.

vLLM 0.32's hybrid KV cache manager gives a model with sliding-window layers (Gemma 3, gpt-oss)
several groups of layers, each with its own block table, slot mapping and block list per request
(one `SingleTypeKVCacheManager` per group in the scheduler). Only the full-attention group's cache
grows with the sequence; a sliding-window group's blocks outside the window are already returned
by vLLM (`SlidingWindowManager.remove_skipped_blocks`). So the plugin evicts, trims and allocates
by physical length in the one full-attention group and leaves the sliding groups to vLLM, which
keeps their logical positions, slots and sequence lengths. A linear-attention hybrid (Qwen3-Next,
Qwen3.5) gets Mamba-style state groups (`MambaSpec`: one recurrent state per request and layer, which
does not grow with the sequence) beside its full-attention group: also left to vLLM, read at the
logical lengths. Llama 4's chunked-local layers get a `ChunkedLocalAttentionSpec` group: left to vLLM likewise
(its chunks follow the logical positions), the global NoPE layers' full-attention group evicted.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec,
                                        UniformTypeKVCacheSpecs)

from .config import VaseConfigError


def full_attention_group(kv_cache_config) -> int:
    """Index of the one full-attention group of `kv_cache_config.kv_cache_groups`; every other group must be a
    sliding-window group or a recurrent-state (`MambaSpec`) group, and the full-attention group's spec plain full attention (an allow-list: exactly
    `FullAttentionSpec`, no window or chunk recorded on it), or an MLA model's one group of latent caches
    (`MLAAttentionSpec`, `vase.vllm.latent`). VaseConfigError in one line otherwise."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec) for g in groups]
    if [kind.__name__ for kind in kinds] == ["MLAAttentionSpec"]:  # an MLA model's latent caches (`vase.vllm.latent`)
        return 0
    full = [i for i, kind in enumerate(kinds) if kind is FullAttentionSpec]
    other = [kind.__name__ for kind in kinds if kind is not FullAttentionSpec
             and not issubclass(kind, (SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec))]
    if UniformTypeKVCacheSpecs in kinds:  # one group of full-attention layers with different KV specs
        raise VaseConfigError("vase evicts a full-attention KV cache group whose layers share one KV spec, and this "
                              "engine's mixes specs (UniformTypeKVCacheSpecs: e.g. a draft model with other KV heads, "
                              "head size or dtype than the target's): use a draft model with the target's, or drop "
                              "speculative_config or additional_config['vase']")
    if len(full) != 1 or other:
        raise VaseConfigError(f"vase evicts in one full-attention KV cache group beside sliding-window or recurrent-"
                              f"state groups; this model's groups are {[k.__name__ for k in kinds]}: use a model "
                              f"with full attention (and optionally sliding-window or linear-attention layers)")
    spec = groups[full[0]].kv_cache_spec
    local = [f"{field}={getattr(spec, field)}" for field in ("sliding_window", "attention_chunk_size")
             if getattr(spec, field, None) is not None]
    if local or getattr(spec, "non_causal", False):
        # vLLM records a sliding or chunked layer's window on the full-attention spec when its hybrid KV cache manager
        # is off: those layers would be evicted with the rest, their kernels sliding over physical slots
        raise VaseConfigError(f"vase evicts the full-attention KV cache group, and this one holds local-attention "
                              f"layers ({', '.join(local) or 'non_causal'}): leave disable_hybrid_kv_cache_manager "
                              f"unset (or False), or drop additional_config['vase']")
    return full[0]
