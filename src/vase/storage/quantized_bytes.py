"""The byte model of the quantized storage: the narrowest slot tag, the bytes of one entry (packed or full
precision), how many entries stay in full precision, and `QuantBytes`, the bytes a quantized cache holds
for one sequence from its configuration and stored length (the eval's and the bench's accounting).
`vase.storage.quantized.QuantStorage` counts its own bytes with the same entry sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.policies import Policy
from ..core.schedule import physical_length, placeholder_budget
from ..core.storage_specs import QuantConfig, QuantSpec, quant_config
from ..hf.hybrid import full_attention_layers
from .packing import packed_bytes


def slot_dtype(capacity: int) -> torch.dtype:
    """The narrowest signed integer type that holds the slot tags -1 .. capacity (capacity = the trash entry),
    among int16 and int64: inductor's AVX2 code (torch 2.13) widens int8 and int32 tags to int64 wrongly in the
    compiled step (index out of bounds, or a crash; `tests/test_compile.py::test_tag_widening_is_exact`), int16
    and int64 correctly. One byte more per entry below 127 slots, four more above 32,767."""
    return torch.int16 if capacity <= torch.iinfo(torch.int16).max else torch.int64


def _itemsize(dtype: torch.dtype) -> int:
    return (torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)).bits // 8


RANK_DTYPE = torch.float32  # the reserve ranking of each full-precision entry (value magnitude, or random)


def entry_bytes(head_dim: int, v_head_dim: int, bits: int, group: int, full_element_bytes: int,
                capacity: int) -> tuple[int, int]:
    """Bytes of one (token, KV head) entry of a quantized layer with `capacity` slots, tags included.

    Returns (quantized: packed K and V codes, scales and zeros, and the slot tag;
             full precision: K and V at `full_element_bytes` per element, the slot tag and the reserve rank)."""
    tag = _itemsize(slot_dtype(capacity))
    quant = packed_bytes(1, head_dim, bits, group) + packed_bytes(1, v_head_dim, bits, group) + tag
    return quant, (head_dim + v_head_dim) * full_element_bytes + tag + _itemsize(RANK_DTYPE)


def full_precision_entries(length: int, unflushed: int, window: int, guard: int) -> int:
    """Entries per KV head a quantized layer holds in full precision with `length` tokens stored.

    The window, the `unflushed` tokens fed since the last flush that left it, and the reserve
    (`guard` of the older tokens, all of them when fewer). Exact while no full-precision token has
    been evicted (always for `full`); after an eviction that dropped some, the layer holds fewer."""
    recent = min(length, window + unflushed)
    return recent + min(guard, length - recent)


@dataclass(frozen=True)
class QuantBytes:
    """The bytes a quantized cache holds for one sequence (all layers), from its configuration and stored length.

    The same entry sizes as `QuantStorage.held_bytes` (tags included), for the eval's per-sequence
    accounting where only the eviction schedule is known (`vase.core.schedule`)."""

    cfg: QuantConfig
    window: int
    layers: int
    kv_heads: int
    head_dim: int
    full_element_bytes: int  # the model's dtype (2 for bf16, 4 for fp32)

    @property
    def group(self) -> int:
        return self.cfg.group or min(32, self.head_dim)

    def held(self, length: int, steps: int, capacity: int) -> int:
        """Bytes held with `length` tokens stored (per KV head), `steps` tokens fed after the prompt."""
        quant, full = entry_bytes(self.head_dim, self.head_dim, self.cfg.bits, self.group, self.full_element_bytes,
                                  capacity)
        fp = full_precision_entries(length, steps % self.cfg.flush_every, self.window, self.cfg.guard)
        scales = self.head_dim * _itemsize(torch.float16) if self.cfg.key_scale else 0
        return self.layers * self.kv_heads * (fp * full + (length - fp) * quant + scales)

    def byte_steps(self, prompt_len: int, n_generated: int, capacity: int, budget: int | None = None,
                   evicts: bool = False) -> int:
        """Bytes held summed over the decode steps 1..n_generated (the stored length from `vase.core.schedule`)."""
        total = 0
        for step in range(1, n_generated + 1):
            length = physical_length(prompt_len, budget, self.window, step) if evicts and budget else prompt_len + step
            total += self.held(length, step, capacity)
        return total

    @classmethod
    def for_model(cls, model, policy: Policy, budget: int | None, window: int,
                  storage: QuantSpec | Mapping[str, Any] | None) -> "QuantBytes | None":
        """The accounting of an `EvictionCache(model, policy, budget, window, storage=storage)`; None when it is
        not quantized (no storage, or 16 bits). `storage` may also be keyword options (`kv_bits=...`), method
        parameters among them (only the storage ones are read)."""
        spec = QuantSpec.from_options(storage) if isinstance(storage, Mapping) else storage
        if spec is None or int(spec.bits) == 16 or model is None:
            return None
        cfg = quant_config(policy, budget or placeholder_budget(window), window, int(spec.bits), spec.guard, spec.group,
                           spec.select, spec.flush_every, 0, spec.key_scale)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        dtype = next(model.parameters()).dtype
        layers = len(full_attention_layers(text))  # a hybrid model quantizes its evicting (full-attention) layers
        return cls(cfg, window, layers, int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim, _itemsize(dtype))

    def write_bytes(self, capacity: int) -> int:
        """Bytes one token's codes take once flushed (all layers and KV heads): what a step writes besides the
        full-precision token (the bench's traffic model)."""
        codes, _ = entry_bytes(self.head_dim, self.head_dim, self.cfg.bits, self.group, self.full_element_bytes,
                               capacity)
        return self.layers * self.kv_heads * codes

    def allocated(self, capacity: int) -> int:
        """Bytes a layer set with `capacity` slots allocates (`QuantStorage.capacity_bytes`, all layers)."""
        quant, full = entry_bytes(self.head_dim, self.head_dim, self.cfg.bits, self.group, self.full_element_bytes,
                                  capacity)
        n_fp = self.cfg.guard + self.window + self.cfg.flush_every
        scales = self.head_dim * _itemsize(torch.float16) if self.cfg.key_scale else 0
        counters = 2 * _itemsize(torch.long)  # qn, fn
        return self.layers * self.kv_heads * ((capacity + 1) * quant + n_fp * full + counters + scales)
