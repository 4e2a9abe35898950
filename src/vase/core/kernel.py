"""The eviction kernel every engine runs: the policy's choice, the keep index, the compaction of slot buffers.

One eviction of a row (per layer) brings `B + w` stored slots (or a longer prompt) down to `B`:
the policy keeps `B - w` of the candidates (every stored slot but the `w` most recent), the `w`
most recent stay, and the survivors move to the front of the row's slots in that order. The three
engines differ only in where the slots live:

- `vase.caches.eager.EvictionLayer` (eager): rows with left padding, compacted in place in growable buffers;
- `vase.caches.static.StaticLayer` (compiled): fixed [b, h, B + w] buffers, every row through one gather;
- `vase.vllm.paged.evict_paged` (vLLM): one request's slots scattered over paged blocks.

Each calls `choose` (the policy's call and its one rule: `B - w` kept among the candidates),
`keep_index` (kept candidates, then the window) and `gather_slots` / `compact_slots` for the
buffers it holds (K/V in a dense buffer, positions, the policy's per-slot state). Torch only.
"""

from __future__ import annotations

from typing import Any

import torch

from .policies import Policy

__all__ = ["choose", "keep_index", "gather_slots", "compact_slots", "flat_slots"]


def choose(policy: Policy, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None, budget: int,
           window: int, generator: Any = None, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The candidates the policy keeps: int64 [b, kv_heads, B - w] indices into the candidates.

    keys, values: the candidates [b, kv_heads, n, d] (real tokens, sinks first); queries: the last w post-RoPE
    queries [b, q_heads, w, d] in time order, passed only to a policy that reads them; generator: the rows'
    generators (a list) or a noise source, passed only to a stochastic policy; state: the policy's per-slot
    ([b, kv_heads, n]) and per-layer state, updated in place by the policy where it keeps any."""
    return policy.select(keys, values, queries if policy.needs_queries else None, budget - window,
                         generator=generator if policy.stochastic else None, budget=budget, **(state or {}))


def keep_index(kept: torch.Tensor, end: int, window: int, sort_kept: bool = False, offset: int = 0) -> torch.Tensor:
    """The gather index of one eviction: int64 [b, kv_heads, k + w]: the kept candidates (`kept` [b, kv_heads, k]
    + `offset`, the slot of candidate 0; in position order when `sort_kept`, else the policy's), then the `w`
    most recent slots `end - w .. end - 1` in order."""
    if offset:
        kept = kept + offset
    if sort_kept:
        kept = kept.sort(-1).values
    b, h = kept.shape[:2]
    recent = torch.arange(end - window, end, device=kept.device).expand(b, h, window)
    return torch.cat([kept, recent], dim=-1)


def flat_slots(index: torch.Tensor, capacity: int) -> torch.Tensor:
    """Flat indices [b * h * n] into a [b, h, capacity] buffer viewed as one axis, of the slots `index` [b, h, n]."""
    b, h, _ = index.shape
    return (index + torch.arange(b * h, device=index.device).view(b, h, 1) * capacity).view(-1)


def gather_slots(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The slots `index` [b, h, n] of `buf` [b, h, capacity] or [b, h, capacity, d]: [b, h, n] or [b, h, n, d].

    Whole rows of head_dim through a flat view of a contiguous buffer: index_select copies rows, much
    faster than gather with an index expanded over head_dim; a strided buffer takes the gather."""
    b, h, n = index.shape
    if not buf.is_contiguous():
        if buf.dim() == 3:
            return buf.gather(2, index)
        return buf.gather(2, index[..., None].expand(-1, -1, -1, buf.shape[-1]))
    flat = flat_slots(index, buf.shape[2])
    if buf.dim() == 3:
        return buf.view(-1).index_select(0, flat).view(b, h, n)
    return buf.view(-1, buf.shape[-1]).index_select(0, flat).view(b, h, n, -1)


def compact_slots(buf: torch.Tensor, index: torch.Tensor) -> None:
    """Move the slots `index` [b, h, n] of `buf` [b, h, capacity(, d)] to its front (slots 0..n-1), in place."""
    buf[:, :, : index.shape[2]] = gather_slots(buf, index)
