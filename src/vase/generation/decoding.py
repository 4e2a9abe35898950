"""The pieces every decode loop shares (`vase.generation.generate`'s eager loop and `vase.generation.compiled`'s compiled one):
the next-token sampler, the per-row sampling generators and the prefill. Both loops take them from here,
so they sample the same tokens from the same seeds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..hf.compat import cache_kwargs


@dataclass(frozen=True)
class Sampler:
    """Next-token choice: greedy, or temperature / top-p / top-k sampling with per-row generators."""

    greedy: bool = False
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int | None = None

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def __call__(self, logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """logits [b, vocab] -> next token ids [b]."""
        if self.greedy:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= self.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])


def sampler_generators(seeds: Sequence[int], device: torch.device) -> list[torch.Generator]:
    """One sampling generator per row, seeded apart from the cache's eviction generators (same seeds).

    Shared by the eager and the compiled decode, so both sample the same tokens."""
    return [torch.Generator(device=device).manual_seed(s + 1_000_003) for s in seeds]


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor,
                                                                                           float]:
    """Run the prompt through `model` into `cache`.

    input_ids, attention_mask: [b, P] (left padding). Returns the positions [b, P] (padding at 0),
    the last position's logits [b, vocab] and the prefill's wall seconds."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    start = time.perf_counter()
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **cache_kwargs(cache),
                use_cache=True, logits_to_keep=1)
    return positions, out.logits[:, -1], time.perf_counter() - start
