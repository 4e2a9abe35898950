"""R-KV: attention importance minus key redundancy."""

from dataclasses import dataclass

from .scores import AttentionScored, key_redundancy, window_attention


@dataclass(frozen=True)
class RKV(AttentionScored):
    rkv_lambda: float = 0.5
    name = "rkv"
    summary = "Keep the top-k by lambda * attention - (1 - lambda) * key redundancy."
    nonnegative_scores = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"rkv_lambda must be in [0, 1], got {self.rkv_lambda}")

    def score(self, keys, values, queries, generator=None, **extra):
        importance = window_attention(keys, queries, self.temperature, self.smooth_kernel)
        return self.rkv_lambda * importance - (1 - self.rkv_lambda) * key_redundancy(keys)
