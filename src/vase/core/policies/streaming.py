"""StreamingLLM: keep the attention sinks and the most recent tokens."""

from dataclasses import dataclass

import torch

from .base import Policy


@dataclass(frozen=True)
class StreamingLLM(Policy):
    protect_sinks: bool = True
    name = "streamingllm"
    summary = "Keep the first `sinks` tokens and the most recent ones."
    nonnegative_scores = False

    def score(self, keys, values, queries, generator=None, **extra):
        b, h, n, _ = keys.shape
        return torch.arange(n, device=keys.device, dtype=torch.float32).expand(b, h, n)
