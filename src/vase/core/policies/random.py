"""Random: keep candidates uniformly at random per head (a strong sanity baseline, arXiv 2609.03430)."""

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class RandomKeep(Policy):
    sample: bool = True
    name = "random"
    summary = "Keep candidates uniformly at random, independently per head."

    def score(self, keys, values, queries, generator=None, **extra):
        b, h, n, _ = keys.shape
        return torch.ones(b, h, n, device=keys.device)
