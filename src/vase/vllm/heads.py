"""A policy as one tensor-parallel rank sees it: its kept set does not depend on the TP degree.

Under tensor parallelism each rank holds `count` of the model's `total` KV heads (from global
head `start` on). Policies score per KV head, but their random draws are shaped by the heads
they are given (e.g. sampling draws [batch, kv_heads, n] uniforms from the sequence's
generator), so a rank drawing for its own heads would take another head's numbers. `RankPolicy`
runs `select` on all `total` heads instead: the rank's heads in their global places, zeros
elsewhere. Every rank then draws exactly what a single process draws, and head h's kept set is
the one TP = 1 keeps (scores of a head never read another head's keys). The zero heads cost
`total / count` times the selection work, which is small next to the model.

No vLLM import: the tests compare ranks against TP = 1 directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.policies import Policy


@dataclass(frozen=True)
class RankHeads:
    """The KV heads of one rank: global heads start .. start + count - 1 of `total`."""

    start: int
    count: int
    total: int

    @classmethod
    def of_rank(cls, rank: int, world: int, total: int) -> "RankHeads":
        """vLLM's split: `total // world` heads per rank, or one replicated head per rank when total < world."""
        if total >= world:
            if total % world:
                raise ValueError(f"{total} KV heads do not split over tensor_parallel_size={world}")
            return cls(rank * (total // world), total // world, total)
        return cls(rank * total // world, 1, total)


def _pad(x: torch.Tensor, heads: RankHeads, group: int = 1) -> torch.Tensor:
    """[b, count * group, ...] -> [b, total * group, ...], the rank's rows in their global places."""
    out = x.new_zeros((x.shape[0], heads.total * group, *x.shape[2:]))
    out[:, heads.start * group:(heads.start + heads.count) * group] = x
    return out


class RankPolicy:
    """`policy` with `select` run over all global KV heads (see the module docstring); the rest delegates."""

    def __init__(self, policy: Policy, heads: RankHeads):
        self.policy = policy
        self.heads = heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def init_layer_state(self, batch: int, kv_heads: int, head_dim: int, generators, device) -> dict:
        """Drawn for all global heads, as a single process draws it."""
        return self.policy.init_layer_state(batch, self.heads.total, head_dim, generators, device)

    def select(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None, n_keep: int,
               generator=None, budget: int | None = None, **state) -> torch.Tensor:
        """keys, values: [b, count, n, d]; queries: [b, count * group, w, d] or None; slot state [b, count, n].
        Returns the kept candidate indices of this rank's heads [b, count, n_keep]."""
        h = self.heads
        lo, hi = h.start, h.start + h.count
        group = queries.shape[1] // keys.shape[1] if queries is not None else 1
        slots = set(self.policy.slot_state)  # per-slot state has a head dim; per-layer state is drawn for all heads
        padded = {name: (_pad(t, h) if name in slots else t) for name, t in state.items()}
        kept = self.policy.select(_pad(keys, h), _pad(values, h),
                                  _pad(queries, h, group) if queries is not None else None, n_keep,
                                  generator=generator, budget=budget, **padded)
        for name, t in state.items():  # per-slot state updated in place: the rank's rows go back
            if padded[name] is not t:
                t.copy_(padded[name][:, lo:hi])
        return kept[:, lo:hi]


def rank_policy(policy: Policy, heads: RankHeads) -> Policy | RankPolicy:
    """`policy` itself when the rank holds every head (TP = 1), else its `RankPolicy`."""
    return policy if heads.count == heads.total else RankPolicy(policy, heads)
