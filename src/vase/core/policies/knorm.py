"""KNorm: keep the candidates with the smallest key L2 norm."""

from dataclasses import dataclass

from .base import Policy


@dataclass(frozen=True)
class KNorm(Policy):
    name = "knorm"
    summary = "Keep the candidates whose keys have the smallest L2 norm."
    nonnegative_scores = False

    def score(self, keys, values, queries, generator=None, **extra):
        return -keys.float().norm(dim=-1)
