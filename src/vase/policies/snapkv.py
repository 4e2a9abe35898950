"""SnapKV-style attention scoring, and the VaSE-AttnV family built on it.

`snapkv` keeps the top-k by windowed attention; `snapkv-sample` samples by it;
`snapkv-v` adds a deterministic value reserve; `vase-attnv` = sinks + value reserve + sampling.
"""

from dataclasses import dataclass

from .base import Policy
from .scores import window_attention


@dataclass(frozen=True)
class AttentionScored(Policy):
    """A policy scored by the attention of the query window (ALGORITHMS.md section 2)."""

    temperature: float = 1.0
    smooth_kernel: int = 5
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.smooth_kernel < 1 or self.smooth_kernel % 2 == 0:
            raise ValueError(f"smooth_kernel must be an odd number >= 1 (1 = no smoothing), got {self.smooth_kernel}")

    def score(self, keys, values, queries, generator=None, **extra):
        return window_attention(keys, queries, self.temperature, self.smooth_kernel)


@dataclass(frozen=True)
class SnapKV(AttentionScored):
    name = "snapkv"
    summary = "Keep the top-k candidates by (smoothed) attention from the recent query window."


@dataclass(frozen=True)
class SnapKVSample(AttentionScored):
    sample: bool = True
    name = "snapkv-sample"
    summary = "Ablation: SnapKV scores, kept by sampling proportional to attention."


@dataclass(frozen=True)
class SnapKVValueReserve(AttentionScored):
    value_guard: float = 0.25
    name = "snapkv-v"
    summary = "Ablation: reserve the largest-value slots (n_large), then SnapKV top-k."


@dataclass(frozen=True)
class VaseAttnV(AttentionScored):
    protect_sinks: bool = True
    value_guard: float = 0.25
    sample: bool = True
    name = "vase-attnv"
    summary = "VaSE: keep sinks and the largest values (B/4), sample the rest by attention."
