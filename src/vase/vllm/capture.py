"""Query window capture: an attention implementation that records post-RoPE queries, then attends as vLLM does.

`QueryRing` keeps, per layer, the last `w` post-RoPE queries of each running request in a ring
indexed by logical position modulo `w`. The model runner writes a `CapturePlan` for the step
(which flat token goes to which request slot and ring position); `VaseCPUAttentionImpl` copies
those rows of its `query` [num_tokens, q_heads, head_dim] before calling vLLM's CPU kernel.
The plan is None outside `execute_model` (profiling, warm-up): then nothing is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl


@dataclass
class CapturePlan:
    """One step's copies: flat token `src[i]` -> ring slot `slot[i]`, position `pos[i]` (all [k] int64)."""

    src: torch.Tensor
    slot: torch.Tensor
    pos: torch.Tensor


class QueryRing:
    """Per layer, [slots, q_heads, w, head_dim] rings of the last w queries; one slot per running request."""

    def __init__(self, layer_names: list[str], q_heads: int, head_dim: int, window: int, dtype: torch.dtype,
                 device: torch.device):
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.q_heads, self.head_dim, self.window = q_heads, head_dim, window
        self.dtype, self.device = dtype, device
        self.rings: list[torch.Tensor] = [self._empty(0) for _ in layer_names]
        self.free: list[int] = []
        self.plan: CapturePlan | None = None

    def _empty(self, slots: int) -> torch.Tensor:
        return torch.zeros(slots, self.q_heads, self.window, self.head_dim, dtype=self.dtype, device=self.device)

    def acquire(self) -> int:
        """A ring slot for a new request (the rings grow by doubling when full)."""
        if not self.free:
            old = self.rings[0].shape[0]
            new = max(4, 2 * old)
            grown = []
            for ring in self.rings:
                bigger = self._empty(new)
                bigger[:old] = ring
                grown.append(bigger)
            self.rings = grown
            self.free = list(range(new - 1, old - 1, -1))
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def record(self, layer_name: str, query: torch.Tensor) -> None:
        """Copy this step's planned rows of `query` [num_tokens, q_heads, head_dim] into the layer's ring."""
        plan = self.plan
        if plan is None or plan.src.numel() == 0:
            return
        ring = self.rings[self.index[layer_name]]
        ring[plan.slot, :, plan.pos] = query.index_select(0, plan.src).to(ring.dtype)

    def window_of(self, layer: int, slot: int, seen: int) -> torch.Tensor:
        """The last w queries of a request that has written `seen` tokens, in time order: [1, q_heads, w, head_dim]."""
        w = self.window
        order = (seen - w + torch.arange(w, device=self.device)) % w
        return self.rings[layer][slot][:, order].unsqueeze(0)


class VaseCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, recording the query window first (`ring` is set on the instance by the runner)."""

    vase_ring: QueryRing | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        ring = self.vase_ring
        if ring is not None and attn_metadata is not None:
            ring.record(layer.layer_name, query)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
