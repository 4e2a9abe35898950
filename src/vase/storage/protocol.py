"""Where one cache layer keeps its K/V: the storage protocol every storage implements.

`vase.caches.eager.EvictionLayer` owns the bookkeeping of a layer (positions, padding, the eviction
schedule, the policy's state) and composes one `KVStorage` for the K/V themselves. The layer
says which slots to write, read, keep or drop; the storage decides how they are held and counts
its own bytes. The storages implement it, one module each:

- `vase.storage.dense.DenseStorage`: preallocated full-precision buffers [b, kv_heads, capacity, d];
- `vase.storage.quantized.QuantStorage`: packed low-bit codes plus a full-precision reserve;
- `vase.storage.fp8.Fp8Storage`: float8 rows with per-layer scales.

A storage may also have `truncate(length)` (forget the slots from `length` on): the layer's `crop` of
speculative drafts needs it (`DenseStorage` has it; the quantized storage, whose slots leave the window into
shared codes, does not, so a cache over it refuses crops).

Which one a cache builds is the storage registry's (`vase.storage.registry`). Torch only: no transformers here, so a storage can be checked or counted without a model.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

Rows = list[int] | slice  # batch rows: a list of row indices, or every row (slice(None))


@runtime_checkable
class KVStorage(Protocol):
    """What an `EvictionLayer` asks of its K/V storage. Slots are indices along the capacity axis.

    `keys` / `values` [b, kv_heads, capacity, d] carry the batch, heads, capacity, head_dim and
    dtype the layer reads (the data itself for the dense storage, a zero-stride carrier for a
    storage that holds something else); None before `allocate`.
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """Allocate `capacity` slots for K/V shaped like the first ones written ([b, kv_heads, q, d])."""

    def grow(self, capacity: int, length: int) -> None:
        """Grow to `capacity` slots, keeping slots 0..length-1 (the full cache without max_length)."""

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        """Store new K/V [b, kv_heads, end - start, d] in slots start..end-1."""

    def commit(self, positions: torch.Tensor, pad0: list[int], prompt: bool) -> None:
        """The positions of the slots written last are final (padding is known): hold them for good.

        positions: [b, kv_heads, capacity] sequence index of each slot (-1 = padding); pad0: each
        row's prompt padding; prompt: the first forward (the prompt), else a write after it."""

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads: K/V [b, kv_heads, end (+ extra), d] each, slots 0..end-1 first."""

    def candidates(self, rows: Rows, pad: int, n_cand: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [len(rows), kv_heads, n_cand - pad, d] of slots pad..n_cand-1 of `rows`, for the policy
        (`length`: slots stored)."""

    def attention_mask(self, mask, query: torch.Tensor, kind: str, length: int):
        """The layer's mask for `query` [b, q_heads, q, d] over `length` stored slots, adjusted to what
        `read` returned (the mask itself when `read` returned exactly the stored slots)."""

    def compact(self, index: torch.Tensor, pad: list[int]) -> None:
        """Move the slots `index` [b, kv_heads, n] to the front (0..n-1), in place; the others are dropped.

        pad: each row's padding slots after the move (0..pad[r]-1): the index fills them with any slots, so a
        storage that keeps entries per token must hold nothing for them."""

    def take_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows `rows`."""

    def held_bytes(self, slots: int, row: int | None) -> int:
        """K/V bytes held now: of batch row `row` storing `slots` real tokens, or of every row when `row`
        is None (`slots` then counts every stored slot of a row, padding included)."""

    def capacity_bytes(self) -> int:
        """K/V bytes allocated."""
