"""Eviction inside a paged KV cache: gather a request's slots, ask the policy, compact in place.

No vLLM import: the tests run it against the dense `EvictionLayer` without an engine.

Layout (one attention layer): `key_cache`, `value_cache`: the logical view
[num_blocks, kv_heads, block_size, head_dim] of vLLM's cache, with any strides. vLLM 0.32 gives
every GPU backend (FlashAttention, FlashInfer, Triton attention) one logical per-layer tensor
[num_blocks, kv_heads, block_size, 2 * head_dim] whose memory order is one of six
`KVCacheLayout`s; `vase.vllm.layouts.split_kv` cuts it into the two views used here. Reads and
writes index the view directly (no `.view`), so they land where the kernel reads, whatever the
memory order.

A request's slot s lives in block `block_ids[s // block_size]` at offset `s % block_size`, with
`block_size` the scheduler's (manager) block size. When vLLM splits each manager block into
kernel blocks (the cache's dim 2 is smaller), manager block b is kernel blocks b * ratio ..
b * ratio + ratio - 1, so slot s is at flat position `block * block_size + offset` either way.
Slots are physical: slot s holds the s-th stored token, whatever its logical position (RoPE was
applied before the keys were written).

vLLM's CPU kernel packs the `block_size x head_dim` elements of each (block, KV head) in its own
order: a `Layout` gives, for each (offset, dim), the element's index in that block's storage,
and `gather`/`scatter` go through it. That packed adapter is the only path that reshapes.

An fp8 cache (uint8 codes, `vase.vllm.fp8`) is compacted as bytes; only the policy's copy of the
candidates is decoded (`codec`), with the layer's scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.kernel import choose, gather_slots, keep_index
from ..core.policies import Policy
from ..core.policy_state import draw_layer_state, ensure_slot_state


def slot_index(block_ids: torch.Tensor, n: int, block_size: int,
               cache_block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) in the cache of slots 0..n-1 of a request whose blocks are `block_ids` [n_blocks]: two [n] int64.

    `block_size`: the block size of `block_ids` (the scheduler's); `cache_block_size`: the cache's
    dim 2 when vLLM split blocks into smaller kernel blocks (default: the same)."""
    slots = torch.arange(n, device=block_ids.device)
    flat = block_ids.long()[slots // block_size] * block_size + slots % block_size
    cbs = cache_block_size or block_size
    if block_size % cbs:
        raise ValueError(f"cache block size {cbs} must divide the scheduler's block size {block_size}")
    return flat // cbs, flat % cbs


@dataclass(frozen=True)
class Layout:
    """Where element (offset, dim) of a block's key (value) rows sits in that block's storage: [block_size, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def plain(cls, block_size: int, head_dim: int) -> "Layout":
        index = torch.arange(block_size * head_dim).view(block_size, head_dim)
        return cls(index, index)


def _packed(cache: torch.Tensor) -> torch.Tensor:
    """The packed adapter: each (block, head) of `cache` as its bs*d storage elements (CPU kernel caches only)."""
    nb, h, bs, d = cache.shape
    return cache.view(nb, h, bs * d)  # raises unless each (block, head) is bs*d contiguous elements


def gather(cache: torch.Tensor, where: torch.Tensor | None, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Slots (`blocks`, `offsets`) [n] of `cache` [num_blocks, h, bs, d] as plain rows [1, h, n, d].

    `where`: None for a logical view (any strides, indexed directly), or a packed layout's [bs, d]
    storage index of each (offset, dim) (`Layout.key` or `.value`)."""
    if where is None:
        rows = cache[blocks, :, offsets]  # [n, h, d]: advanced indices split by a slice go first
        return rows.permute(1, 0, 2).unsqueeze(0)
    rows = _packed(cache)[blocks[:, None], :, where[offsets]]  # [n, d, h]
    return rows.permute(2, 0, 1).unsqueeze(0)


def scatter(cache: torch.Tensor, where: torch.Tensor | None, blocks: torch.Tensor, offsets: torch.Tensor,
            rows: torch.Tensor) -> None:
    """Write plain `rows` [h, n, d] into slots (`blocks`, `offsets`) [n] of `cache`, in place (see `gather`)."""
    if where is None:
        cache[blocks, :, offsets] = rows.permute(1, 0, 2).to(cache.dtype)
        return
    _packed(cache)[blocks[:, None], :, where[offsets]] = rows.permute(1, 2, 0).to(cache.dtype)


@dataclass
class RequestPolicyState:
    """What one request carries between evictions: its generator and the policy's state hooks, per layer."""

    generator: torch.Generator
    layer_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # layer -> name -> [1, ...]
    slot_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # layer -> name -> [1, h, slots]
    evictions: int = 0


def evict_paged(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                queries: torch.Tensor | None, policy: Policy, budget: int, window: int, state: RequestPolicyState,
                layer: int, sort_kept: bool = False, layout: Layout | None = None,
                block_size: int | None = None, target_block_ids: torch.Tensor | None = None,
                codec: Any = None) -> torch.Tensor:
    """Evict one request in one layer: its `length` stored slots become `budget`, compacted in place.

    key_cache, value_cache: [num_blocks, kv_heads, cache_block_size, head_dim] logical views (any
    strides), or the CPU kernel's packed blocks when `layout` is given. block_ids: [n_blocks] the
    request's blocks, of `block_size` tokens (default: the cache's dim 2). target_block_ids: [n_blocks]
    the blocks the kept slots are written to (copy-on-write: a shared block is read, never written; default
    `block_ids`, in place). codec: None, or an fp8 cache's `vase.vllm.fp8.Fp8Codec`: the policy reads the
    decoded keys and values ([1, h, n, d] in the model dtype), the compaction moves the codes unchanged.
    Candidates are slots 0..length-w-1 (sinks first); the policy keeps B - w of them and the w
    most recent follow, exactly as `EvictionLayer.evict` does for one row without padding.
    queries: [1, q_heads, w, head_dim] post-RoPE, in time order (None when the policy needs none).
    Returns the kept slot indices [1, kv_heads, B] (in their new order).
    """
    cache_bs = key_cache.shape[2]
    where_k, where_v = (None, None) if layout is None else (layout.key, layout.value)
    n_cand = length - window
    blocks, offsets = slot_index(block_ids, length, block_size or cache_bs, cache_bs)
    stored_k = gather(key_cache, where_k, blocks, offsets)  # as stored: moved unchanged by the compaction
    stored_v = gather(value_cache, where_v, blocks, offsets)
    keys, values = (stored_k, stored_v) if codec is None else (codec.keys(stored_k), codec.values(stored_v))
    h = keys.shape[1]
    extra: dict[str, torch.Tensor] = {}
    # the policy's state hooks (`vase.core.policy_state`): zero for every token written since, nothing scored it
    slot_state = ensure_slot_state(policy, state.slot_state.setdefault(layer, {}), 1, h, length, keys.device)
    for name in policy.slot_state:
        extra[name] = slot_state[name][:, :, :n_cand]
    _draw_layer_state(policy, state, layer, h, keys.shape[-1], keys.device)
    extra.update(state.layer_state[layer])
    # one eviction kernel for every engine (`vase.core.kernel`): the policy's choice, then the window; [1, h, B]
    kept = choose(policy, keys[:, :, :n_cand], values[:, :, :n_cand], queries, budget, window, [state.generator],
                  extra)
    index = keep_index(kept, length, window, sort_kept)
    if target_block_ids is None:
        new_blocks, new_offsets = blocks[:budget], offsets[:budget]
    else:  # copy-on-write: the kept slots go to the fresh blocks the scheduler gave for shared ones
        new_blocks, new_offsets = slot_index(target_block_ids, budget, block_size or cache_bs, cache_bs)
    # Read every survivor before writing: the targets (slots 0..B-1) overlap the sources.
    for cache, where, rows in ((key_cache, where_k, stored_k), (value_cache, where_v, stored_v)):
        scatter(cache, where, new_blocks, new_offsets, gather_slots(rows, index)[0])  # survivors [h, B, d]
    for name, tensor in slot_state.items():  # moves with its slot; slots B.. are new tokens from now on
        moved = torch.zeros_like(tensor)
        moved[:, :, :budget] = gather_slots(tensor, index)
        slot_state[name] = moved
    return index


def _draw_layer_state(policy: Policy, state: RequestPolicyState, layer: int, kv_heads: int, head_dim: int,
                      device: torch.device) -> None:
    """Hook 2 for one request's `layer` (a batch of one row): drawn once, right before its first eviction there."""
    ready = [layer in state.layer_state]
    draw_layer_state(policy, state.layer_state.setdefault(layer, {}), ready, [0], [state.generator], 1, kv_heads,
                     head_dim, device)


@dataclass
class EvictionJob:
    """One request of a batched eviction (`evict_paged_batch`): its blocks [n_blocks], where its kept slots go
    (None: in place; else the fresh blocks of copy-on-write) and its policy state."""

    block_ids: torch.Tensor
    state: RequestPolicyState
    target_block_ids: torch.Tensor | None = None


def evict_paged_batch(key_cache: torch.Tensor, value_cache: torch.Tensor, jobs: list[EvictionJob], length: int,
                      queries: torch.Tensor | None, policy: Policy, budget: int, window: int, layer: int,
                      sort_kept: bool = False, layout: Layout | None = None,
                      block_size: int | None = None, codec: Any = None, write: bool = True) -> torch.Tensor:
    """Evict k requests of one length in one layer at once: one gather of all their slots, one policy call over a
    batch of k rows, one scatter of all survivors. Each row is `evict_paged` of that request (same kept slots,
    same draws from its own generator, same state hooks); the requests' blocks never overlap where written.

    jobs: the k requests, each with `length` stored slots; queries: [k, q_heads, w, head_dim] in time order (None
    when the policy needs none); codec: as `evict_paged`'s (the policy reads decoded K/V, the codes move); write:
    False runs the policy (its draws and state hooks under `layer`) and moves nothing in the cache (a pipeline
    stage replaying another stage's layer: `vase.vllm.stages`). Returns the kept slot indices [k, kv_heads, B] (in
    their new order)."""
    cache_bs = key_cache.shape[2]
    bs = block_size or cache_bs
    k, n_cand = len(jobs), length - window
    where_k, where_v = (None, None) if layout is None else (layout.key, layout.value)
    where = [slot_index(job.block_ids, length, bs, cache_bs) for job in jobs]
    blocks, offsets = torch.cat([w[0] for w in where]), torch.cat([w[1] for w in where])

    def rows_of(cache, where_x):  # [1, h, k * length, d] -> [k, h, length, d]
        rows = gather(cache, where_x, blocks, offsets)[0]
        return rows.reshape(rows.shape[0], k, length, -1).transpose(0, 1).contiguous()

    stored_k, stored_v = rows_of(key_cache, where_k), rows_of(value_cache, where_v)  # moved unchanged
    keys, values = (stored_k, stored_v) if codec is None else (codec.keys(stored_k), codec.values(stored_v))
    h, device = keys.shape[1], keys.device
    extra: dict[str, torch.Tensor] = {}
    for job in jobs:  # the state hooks (`vase.core.policy_state`), per request: hook 2 before its first eviction
        ensure_slot_state(policy, job.state.slot_state.setdefault(layer, {}), 1, h, length, device)
        _draw_layer_state(policy, job.state, layer, h, keys.shape[-1], device)
    for name in policy.slot_state:  # per-slot state: each request's own, stacked (a copy, written back below)
        extra[name] = torch.cat([job.state.slot_state[layer][name][:, :, :n_cand] for job in jobs])
    for name in jobs[0].state.layer_state[layer]:
        extra[name] = torch.cat([job.state.layer_state[layer][name] for job in jobs])
    generators = [job.state.generator for job in jobs]
    kept = choose(policy, keys[:, :, :n_cand], values[:, :, :n_cand], queries, budget, window, generators, extra)
    index = keep_index(kept, length, window, sort_kept)  # [k, h, B]
    targets = [(w[0][:budget], w[1][:budget]) if job.target_block_ids is None
               else slot_index(job.target_block_ids, budget, bs, cache_bs) for job, w in zip(jobs, where)]
    new_blocks, new_offsets = torch.cat([t[0] for t in targets]), torch.cat([t[1] for t in targets])
    # Every survivor is read (the gather above) before any is written: targets overlap the sources.
    for cache, where_x, rows in ((key_cache, where_k, stored_k), (value_cache, where_v, stored_v)) if write else ():
        survivors = gather_slots(rows, index)  # [k, h, B, d]
        scatter(cache, where_x, new_blocks, new_offsets, survivors.transpose(0, 1).reshape(h, k * budget, -1))
    for name in policy.slot_state:
        for j, job in enumerate(jobs):
            tensor = job.state.slot_state[layer][name]
            tensor[:, :, :n_cand] = extra[name][j:j + 1]  # the policy's in-place update, back to the request
            moved = torch.zeros_like(tensor)
            moved[:, :, :budget] = gather_slots(tensor, index[j:j + 1])
            job.state.slot_state[layer][name] = moved
    return index
