"""CurDKV and VaSE-DKV: query-free scores from random projections of keys and values.

c_i = ||k_i G||^2 * ||v_i G||^2 (normalised per head), G: [head_dim, rank] with entries
N(0, 1/rank), one G per layer and batch row shared by its KV heads. CurDKV draws G once
(the cache keeps it); VaSE-DKV redraws it at every eviction (stochastic, value-aware).
"""

from dataclasses import dataclass

import torch

from .base import Policy, normal_noise


@dataclass(frozen=True)
class CurDKV(Policy):
    protect_sinks: bool = True
    rank: int = 20
    name = "curdkv"
    shared_heads_refusal = "its score multiplies each head's key and value by one projection (they differ in width)"
    summary = "Keep the top-k by ||kG||^2 ||vG||^2 with one random projection G per layer."

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")

    def draw_projection(self, batch: int, head_dim: int, generator, device) -> torch.Tensor:
        """A fresh G: [batch, head_dim, rank] with N(0, 1/rank) entries, one per row generator."""
        return normal_noise((batch, head_dim, self.rank), generator, device) / self.rank ** 0.5

    def init_layer_state(self, batch, kv_heads, head_dim, generators, device):
        """Hook 2: one projection per layer and sequence, drawn once, shared by the KV heads."""
        return {"projection": self.draw_projection(batch, head_dim, generators, device)}

    def score(self, keys, values, queries, generator=None, projection=None, **extra):
        b, h, n, d = keys.shape
        if projection is None:
            projection = self.draw_projection(b, d, generator, keys.device)
        if projection.shape != (b, d, self.rank):
            raise ValueError(f"projection must be [batch, head_dim, rank] = {(b, d, self.rank)}, "
                             f"got {tuple(projection.shape)}")
        g = projection.float().unsqueeze(1)  # shared by the KV heads of the row
        c = (keys.float() @ g).square().sum(-1) * (values.float() @ g).square().sum(-1)
        return c / c.sum(-1, keepdim=True).clamp(min=1e-30)


@dataclass(frozen=True)
class VaseDKV(CurDKV):
    name = "vase-dkv"
    summary = "VaSE-DKV: CurDKV with G redrawn at every eviction (query-free)."

    def init_layer_state(self, batch, kv_heads, head_dim, generators, device):
        return {}  # no kept projection: `score` draws a fresh one at every eviction

    @property
    def stochastic(self) -> bool:
        return True
