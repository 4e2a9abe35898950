"""The dense storage: preallocated full-precision K/V buffers [b, kv_heads, capacity, d] behind
`vase.storage.protocol.KVStorage` (what a cache layer holds when no storage is asked for)."""

from __future__ import annotations

import torch

from ..core.kernel import compact_slots
from .protocol import Rows

__all__ = ["DenseStorage"]


class DenseStorage:
    """Full-precision K/V in preallocated buffers [b, kv_heads, capacity, d], compacted in place."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, capacity, d)
        self.values = value_states.new_zeros(b, h, capacity, value_states.shape[-1])

    def grow(self, capacity: int, length: int) -> None:
        for attr in ("keys", "values"):
            old = getattr(self, attr)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :length] = old[:, :, :length]
            setattr(self, attr, new)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states

    def commit(self, positions: torch.Tensor, pad0: list[int], prompt: bool) -> None:
        pass  # written in place already

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :end], self.values[:, :, :end]

    def candidates(self, rows: Rows, pad: int, n_cand: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[rows, :, pad:n_cand], self.values[rows, :, pad:n_cand]

    def attention_mask(self, mask, query: torch.Tensor, kind: str, length: int):
        return mask

    def compact(self, index: torch.Tensor, pad: list[int]) -> None:
        for buf in (self.keys, self.values):  # the eviction kernel's compaction (`vase.core.kernel`)
            compact_slots(buf, index)

    def take_rows(self, rows: list[int]) -> None:
        self.keys, self.values = self.keys[rows], self.values[rows]

    def held_bytes(self, slots: int, row: int | None) -> int:
        b, h, _, d = self.keys.shape
        per_token = h * (d + self.values.shape[-1]) * self.keys.element_size()
        return slots * per_token if row is not None else b * slots * per_token

    def capacity_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def truncate(self, length: int) -> None:
        """Forget the slots from `length` on (a crop of the last forward's tokens): nothing to do, each slot is
        held on its own and the layer's length says which are stored."""

