"""SnapKV-style attention scoring, and the VaSE-AttnV family built on it.

`snapkv` keeps the top-k by windowed attention; `snapkv-sample` samples by it;
`snapkv-v` adds a deterministic value reserve; `vase-attnv` = sinks + value reserve + sampling.
"""

from dataclasses import dataclass

from .scores import AttentionScored  # noqa: F401  (its home was here: keep `from .snapkv import AttentionScored`)


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
