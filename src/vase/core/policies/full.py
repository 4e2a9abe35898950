"""Full cache: never evicts (the reference for fidelity and accuracy)."""

from dataclasses import dataclass

from .base import Policy


@dataclass(frozen=True)
class Full(Policy):
    name = "full"
    summary = "No eviction: the cache keeps every token (the reference)."
    evicts = False

    def score(self, keys, values, queries, generator=None, **extra):
        raise RuntimeError("the full cache never evicts")
