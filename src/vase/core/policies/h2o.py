"""H2O: keep the heavy hitters, the candidates with the largest accumulated attention.

Per-step attention weights are not available with fused kernels, so the windowed scores
of docs/methods.md are accumulated at each eviction (see H2O there). The cache keeps
the accumulator aligned with the stored slots and passes it as `accumulated`.
"""

from dataclasses import dataclass

from .scores import AttentionScored, window_attention


@dataclass(frozen=True)
class H2O(AttentionScored):
    smooth_kernel: int = 1
    name = "h2o"
    summary = "Keep the top-k by attention mass accumulated over all evictions so far."
    slot_state = ("accumulated",)

    def score(self, keys, values, queries, generator=None, accumulated=None, **extra):
        scores = window_attention(keys, queries, self.temperature, self.smooth_kernel)
        if accumulated is None:
            return scores
        # In place: the cache's accumulator for these candidates carries over to the next eviction.
        accumulated.add_(scores)
        return accumulated.clone()
