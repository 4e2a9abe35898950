"""TOVA: keep the candidates with the largest attention from the current (last) query."""

from dataclasses import dataclass

from .scores import AttentionScored, window_attention


@dataclass(frozen=True)
class TOVA(AttentionScored):
    smooth_kernel: int = 1
    name = "tova"
    summary = "Keep the top-k by attention from the last query only."

    def score(self, keys, values, queries, generator=None, **extra):
        return window_attention(keys, queries[:, :, -1:], self.temperature, self.smooth_kernel)
