"""The query ring every engine keeps: the last `w` post-RoPE queries, in a preallocated tensor.

A ring is a tensor [rows, q_heads, w, head_dim]; the query of logical token t sits at ring
position `t % w`. `seen` counts the queries recorded so far (an int on the host, or a 0-dim
long tensor inside the compiled step). Used by `vase.caches.eager.EvictionLayer` (one ring row per
batch row), `vase.caches.static.StaticLayer` (the same, in the compiled step) and
`vase.vllm.capture.QueryRing` (one ring row per running request, written from the flat tokens
of a step by its capture plan). Torch only.
"""

from __future__ import annotations

import torch

__all__ = ["new_ring", "ring_slots", "ring_write", "ring_put", "ring_read", "ring_gather"]


def new_ring(rows: int, q_heads: int, window: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """An empty ring [rows, q_heads, window, head_dim] with `like`'s dtype and device."""
    return like.new_zeros(rows, q_heads, window, head_dim)


def ring_slots(seen: int | torch.Tensor, n: int, window: int, device: torch.device) -> torch.Tensor:
    """Ring positions [n] of the last `n` of `seen` recorded queries, oldest first."""
    return (seen - n + torch.arange(n, device=device)) % window


def ring_write(ring: torch.Tensor, seen: int | torch.Tensor, query: torch.Tensor) -> None:
    """Record `query` [rows, q_heads, q, head_dim] (tokens seen .. seen + q - 1) into `ring` [rows, q_heads, w, d]:
    its last min(q, w) tokens. `seen`: queries recorded before these (an int, or a 0-dim tensor in a graph)."""
    w, q = ring.shape[2], query.shape[2]
    if q == 1:  # the decode hot path
        if isinstance(seen, torch.Tensor):  # in the compiled step: no host read of `seen`
            ring.index_copy_(2, (seen % w).view(1), query.to(ring.dtype))
        else:
            ring[:, :, seen % w] = query[:, :, 0]
        return
    take = min(q, w)
    ring[:, :, ring_slots(seen + q, take, w, query.device)] = query[:, :, q - take:]


def ring_put(ring: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, query: torch.Tensor) -> None:
    """Write query k (`query` [k, q_heads, head_dim]) at ring row `rows[k]`, position `slots[k]` ([k] int64 each):
    the vLLM step's flat tokens, each to its request's ring at its logical position modulo w."""
    ring[rows, :, slots] = query.to(ring.dtype)


def ring_read(ring: torch.Tensor, seen: int | torch.Tensor, n: int | None = None) -> torch.Tensor:
    """The last `n` recorded queries in time order: [rows, q_heads, n, head_dim] (n: min(seen, w) by default)."""
    w = ring.shape[2]
    if n is None:
        n = min(int(seen), w)
    return ring.index_select(2, ring_slots(seen, n, w, ring.device))


def ring_gather(ring: torch.Tensor, rows: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """The last w recorded queries of ring rows `rows` [k] (each having recorded `seen` [k] queries, >= w), in time
    order: [k, q_heads, w, head_dim], `ring_read` of each row at once."""
    w = ring.shape[2]
    slots = (seen[:, None] - w + torch.arange(w, device=ring.device)) % w  # [k, w]
    return ring[rows[:, None], :, slots].permute(0, 2, 1, 3)  # advanced indices first: [k, w, q_heads, d]
