"""Which KV cache group the plugin evicts in: the full-attention one, beside any sliding-window groups.

vLLM 0.32's hybrid KV cache manager gives a model with sliding-window layers (Gemma 3, gpt-oss)
several groups of layers, each with its own block table, slot mapping and block list per request
(one `SingleTypeKVCacheManager` per group in the scheduler). Only the full-attention group's cache
grows with the sequence; a sliding-window group's blocks outside the window are already returned
by vLLM (`SlidingWindowManager.remove_skipped_blocks`). So the plugin evicts, trims and allocates
by physical length in the one full-attention group and leaves the sliding groups to vLLM, which
keeps their logical positions, slots and sequence lengths.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from .config import VaseConfigError


def full_attention_group(kv_cache_config) -> int:
    """Index of the one full-attention group of `kv_cache_config.kv_cache_groups`; every other group must be a
    sliding-window group. VaseConfigError in one line otherwise."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec) for g in groups]
    full = [i for i, kind in enumerate(kinds) if kind is FullAttentionSpec]
    other = [kind.__name__ for kind in kinds if kind is not FullAttentionSpec and not issubclass(kind, SlidingWindowSpec)]
    if len(full) != 1 or other:
        raise VaseConfigError(f"vase evicts in one full-attention KV cache group beside sliding-window groups; this "
                              f"model's groups are {[k.__name__ for k in kinds]}: use a model with full attention "
                              f"(and optionally sliding-window layers)")
    return full[0]
