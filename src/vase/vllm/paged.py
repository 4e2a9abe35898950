"""Eviction inside a paged KV cache: gather a request's slots, ask the policy, compact in place.

No vLLM import: the tests run it against the dense `EvictionLayer` without an engine.

Layout (one attention layer): `key_cache`, `value_cache`: [num_blocks, kv_heads, block_size, head_dim]
(views of vLLM's cache tensor); a request's slot s lives in block `block_ids[s // block_size]` at
offset `s % block_size`. Slots are physical: slot s holds the s-th stored token, whatever its
logical position (RoPE was applied before the keys were written).

Inside one (block, KV head) the kernel may store its `block_size x head_dim` elements in its own
order (vLLM's CPU kernel packs keys for its dot products): a `Layout` gives, for each
(offset, dim), the element's index in that block's storage, so reads and writes go through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policies import Policy


def slot_index(block_ids: torch.Tensor, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of slots 0..n-1 of a request whose blocks are `block_ids` [n_blocks]: two [n] int64."""
    slots = torch.arange(n, device=block_ids.device)
    return block_ids.long()[slots // block_size], slots % block_size


@dataclass(frozen=True)
class Layout:
    """Where element (offset, dim) of a block's key (value) rows sits in that block's storage: [block_size, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def plain(cls, block_size: int, head_dim: int) -> "Layout":
        index = torch.arange(block_size * head_dim).view(block_size, head_dim)
        return cls(index, index)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    nb, h, bs, d = cache.shape
    return cache.view(nb, h, bs * d)  # each (block, head) is bs*d contiguous elements


def gather(cache: torch.Tensor, where: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Slots (`blocks`, `offsets`) [n] of `cache` [num_blocks, h, bs, d] as plain rows [1, h, n, d].

    `where`: the layout's [bs, d] storage index of each (offset, dim) (`Layout.key` or `.value`)."""
    rows = _flat(cache)[blocks[:, None], :, where[offsets]]  # [n, d, h]
    return rows.permute(2, 0, 1).unsqueeze(0)


def scatter(cache: torch.Tensor, where: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
            rows: torch.Tensor) -> None:
    """Write plain `rows` [h, n, d] into slots (`blocks`, `offsets`) [n] of `cache`, in its layout."""
    _flat(cache)[blocks[:, None], :, where[offsets]] = rows.permute(1, 2, 0).to(cache.dtype)


@dataclass
class RequestPolicyState:
    """What one request carries between evictions: its generator and the policy's state hooks, per layer."""

    generator: torch.Generator
    layer_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # layer -> name -> [1, ...]
    slot_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # layer -> name -> [1, h, slots]
    evictions: int = 0


def evict_paged(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                queries: torch.Tensor | None, policy: Policy, budget: int, window: int, state: RequestPolicyState,
                layer: int, sort_kept: bool = False, layout: Layout | None = None) -> torch.Tensor:
    """Evict one request in one layer: its `length` stored slots become `budget`, compacted in place.

    Candidates are slots 0..length-w-1 (sinks first); the policy keeps B - w of them and the w
    most recent follow, exactly as `EvictionLayer.evict` does for one row without padding.
    queries: [1, q_heads, w, head_dim] post-RoPE, in time order (None when the policy needs none).
    Returns the kept slot indices [1, kv_heads, B] (in their new order).
    """
    bs = key_cache.shape[2]
    layout = layout or Layout.plain(bs, key_cache.shape[3])
    n_cand = length - window
    blocks, offsets = slot_index(block_ids, length, bs)
    keys = gather(key_cache, layout.key, blocks, offsets)
    values = gather(value_cache, layout.value, blocks, offsets)
    h = keys.shape[1]
    extra: dict[str, torch.Tensor] = {}
    slot_state = state.slot_state.setdefault(layer, {})
    for name in policy.slot_state:
        if name not in slot_state:  # zero for every token written since: nothing scored it yet
            slot_state[name] = torch.zeros(1, h, length, dtype=torch.float32, device=keys.device)
        extra[name] = slot_state[name][:, :, :n_cand]
    if layer not in state.layer_state:  # hook 2: drawn once per layer, right before its first eviction
        init = getattr(policy, "init_layer_state", None)
        state.layer_state[layer] = init(1, h, keys.shape[-1], [state.generator], keys.device) if init else {}
    extra.update(state.layer_state[layer])
    generator = [state.generator] if policy.stochastic else None
    kept = policy.select(keys[:, :, :n_cand], values[:, :, :n_cand], queries if policy.needs_queries else None,
                         budget - window, generator=generator, budget=budget, **extra)
    if sort_kept:
        kept = kept.sort(-1).values
    recent = torch.arange(n_cand, length, device=kept.device).expand(1, h, window)
    index = torch.cat([kept, recent], dim=-1)  # [1, h, B]
    head = torch.arange(h, device=index.device)[:, None]
    new_blocks, new_offsets = blocks[:budget], offsets[:budget]
    # Read every survivor before writing: the targets (slots 0..B-1) overlap the sources.
    for cache, where, rows in ((key_cache, layout.key, keys), (value_cache, layout.value, values)):
        scatter(cache, where, new_blocks, new_offsets, rows[0, head, index[0]])  # survivors [h, B, d]
    for name, tensor in slot_state.items():  # moves with its slot; slots B.. are new tokens from now on
        moved = torch.zeros_like(tensor)
        moved[0, :, :budget] = tensor[0, head, index[0]]
        slot_state[name] = moved
    return index
