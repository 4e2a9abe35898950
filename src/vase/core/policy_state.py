"""The one driver of a policy's state hooks (`vase.core.policies.base.Policy`, hooks 1 and 2), for every
engine: the eager cache, the static (compiled) cache and the vLLM paged eviction keep their state in
their own layouts and call these two functions to create it, so each hook runs the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .policies.base import Policy


def ensure_slot_state(policy: Policy, slot_state: dict[str, torch.Tensor], batch: int, kv_heads: int, slots: int,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """Hook 1: a zero float32 tensor [batch, kv_heads, slots] for each of `policy.slot_state`'s names that
    `slot_state` lacks (nothing has scored those tokens yet), added in place; returns `slot_state`."""
    for name in policy.slot_state:
        if name not in slot_state:
            slot_state[name] = torch.zeros(batch, kv_heads, slots, dtype=torch.float32, device=device)
    return slot_state


def draw_layer_state(policy: Policy, layer_state: dict[str, torch.Tensor], ready: list[bool], rows: Sequence[int],
                     generators: Sequence, batch: int, kv_heads: int, head_dim: int, device: torch.device) -> None:
    """Hook 2: draw the per-layer state of the rows of `rows` not yet `ready` (right before their first
    eviction), each from its own generator (`generators[r]`), into `layer_state` (name -> [batch, ...],
    a zero buffer made at the first draw), in place; marks those rows ready."""
    fresh = [r for r in rows if not ready[r]]
    if not fresh:
        return
    state = policy.init_layer_state(len(fresh), kv_heads, head_dim, [generators[r] for r in fresh], device)
    for name, value in state.items():
        if name not in layer_state:
            layer_state[name] = value.new_zeros(batch, *value.shape[1:])
        layer_state[name][fresh] = value
    for r in fresh:
        ready[r] = True
