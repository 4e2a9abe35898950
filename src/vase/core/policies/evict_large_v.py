"""Evict-Large-V (paper ablation): keep the candidates with the smallest value magnitude."""

from dataclasses import dataclass

from .base import Policy, value_magnitude


@dataclass(frozen=True)
class EvictLargeV(Policy):
    name = "evict-large-v"
    summary = "Ablation: always evict the largest-magnitude values (drives models into loops)."
    nonnegative_scores = False

    def score(self, keys, values, queries, generator=None, **extra):
        return -value_magnitude(values, self.metric)
