"""fp8 K/V storage: every slot held as float8 (e4m3 or e5m2) with one scale per layer for K and one for V.

    cache = vase.EvictionCache(model, "snapkv", budget=512, kv_dtype="fp8")   # or "fp8_e4m3", "fp8_e5m2"

The same rounding as vLLM's fp8 KV cache (`kv_cache_dtype="fp8"`, per-layer `k_scale` / `v_scale`, 1.0 unless
calibrated): a row is stored as `(x / scale)` cast to float8, saturated at the format's largest finite value,
and read back as `float8 -> model dtype * scale`. The cast rounds to nearest even (torch's cast,
`rounding="nearest"`); vLLM 0.32's CPU kernel (`cpu_attn_reshape_and_cache`) truncates toward zero (and
stores -0.0 as +0), which `Fp8Spec(rounding="zero")` (keyword `kv_rounding="zero"`) reproduces bit for bit
(tests/test_vllm_fp8.py). Everything
the layer reads goes through `read` / `candidates`, so attention and the policies (value guard, key norms, R-KV
redundancy, DKV) see dequantized K/V. Compaction moves the float8 bytes (no scale is involved). One byte per
element, plus the two float32 scales per layer.

The storage registry (`vase.storage.registry`) registers it as the `fp8` kind: the keyword `kv_dtype` passes every door
(`EvictionCache`, `vase.generate`, `RequestSpec.of`, `-p kv_dtype=fp8`); compile=True has no fixed-shape form
of it and refuses in one line. Torch only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..hf.hybrid import full_attention_layers
from ..core.kernel import compact_slots
from ..core.policies import Policy
from ..core.schedule import physical_length
from ..core.storage_specs import FORMATS, ROUNDINGS, Fp8Config, Fp8Spec  # noqa: F401  (importable here)
from .protocol import Rows

__all__ = ["FORMATS", "ROUNDINGS", "Fp8Spec", "Fp8Config", "Fp8Storage", "Fp8Bytes", "to_fp8", "from_fp8"]

SCALE_BYTES = 2 * 4  # k_scale and v_scale, float32, per layer


def to_fp8(x: torch.Tensor, dtype: torch.dtype, scale: float, rounding: str = "nearest") -> torch.Tensor:
    """`x` [..., d] divided by `scale`, saturated to `dtype`'s finite range and cast to it.

    rounding "zero": the largest-magnitude code not above |x / scale| with x's sign (vLLM's CPU kernel: a tiny
    negative becomes -0), and +0 for a zero x of either sign."""
    limit = torch.finfo(dtype).max
    y = (x.float() / scale).clamp_(-limit, limit)
    codes = y.to(dtype)
    if rounding == "nearest":
        return codes
    bits = codes.view(torch.uint8).clone()
    # a magnitude rounded up steps one code toward zero: within one sign, codes are ordered as magnitudes
    bits -= (codes.float().abs() > y.abs()).to(torch.uint8)
    bits[y == 0] = 0  # the kernel's sign is x < 0: -0.0 is stored as +0
    return bits.view(dtype)


def from_fp8(codes: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The dequantized rows of `codes` [..., d]: `codes * scale` in `dtype`."""
    return (codes.to(torch.float32) * scale).to(dtype)


class Fp8Storage:
    """A `vase.storage.protocol.KVStorage` holding K/V as float8 codes [b, kv_heads, capacity, d].

    `keys` / `values` are zero-stride carriers [b, h, capacity, d] in the model's dtype (the layer reads shapes
    and dtypes from them); the codes are `k_codes` / `v_codes`."""

    def __init__(self, config: Fp8Config) -> None:
        self.cfg = config
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.k_codes: torch.Tensor | None = None
        self.v_codes: torch.Tensor | None = None

    def _carriers(self, b: int, h: int, cap: int, dk: int, dv: int, dtype: torch.dtype, device) -> None:
        self.keys = torch.zeros((), dtype=dtype, device=device).expand(b, h, cap, dk)
        self.values = torch.zeros((), dtype=dtype, device=device).expand(b, h, cap, dv)

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.k_codes = torch.zeros(b, h, capacity, dk, dtype=self.cfg.dtype, device=key_states.device)
        self.v_codes = torch.zeros(b, h, capacity, dv, dtype=self.cfg.dtype, device=key_states.device)
        self._carriers(b, h, capacity, dk, dv, key_states.dtype, key_states.device)

    def grow(self, capacity: int, length: int) -> None:
        for attr in ("k_codes", "v_codes"):
            old = getattr(self, attr)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :length] = old[:, :, :length]
            setattr(self, attr, new)
        b, h, _, dk = self.keys.shape
        self._carriers(b, h, capacity, dk, self.values.shape[-1], self.keys.dtype, self.keys.device)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        self.k_codes[:, :, start:end] = to_fp8(key_states, self.cfg.dtype, self.cfg.k_scale, self.cfg.rounding)
        self.v_codes[:, :, start:end] = to_fp8(value_states, self.cfg.dtype, self.cfg.v_scale, self.cfg.rounding)

    def commit(self, positions: torch.Tensor, pad0: list[int], prompt: bool) -> None:
        pass  # each slot is final once written

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.keys.dtype
        return (from_fp8(self.k_codes[:, :, :end], dtype, self.cfg.k_scale),
                from_fp8(self.v_codes[:, :, :end], dtype, self.cfg.v_scale))

    def candidates(self, rows: Rows, pad: int, n_cand: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.keys.dtype
        return (from_fp8(self.k_codes[rows, :, pad:n_cand], dtype, self.cfg.k_scale),
                from_fp8(self.v_codes[rows, :, pad:n_cand], dtype, self.cfg.v_scale))

    def attention_mask(self, mask, query: torch.Tensor, kind: str, length: int):
        return mask

    def compact(self, index: torch.Tensor, pad: list[int]) -> None:
        for buf in (self.k_codes, self.v_codes):  # the bytes move as they are: no scale involved
            compact_slots(buf.view(torch.uint8), index)

    def take_rows(self, rows: list[int]) -> None:
        self.k_codes, self.v_codes = self.k_codes[rows], self.v_codes[rows]
        _, h, cap, dk = self.keys.shape
        self._carriers(len(rows), h, cap, dk, self.values.shape[-1], self.keys.dtype, self.keys.device)

    def truncate(self, length: int) -> None:
        """Forget the slots from `length` on (a crop of speculative drafts): each slot is held on its own."""

    def held_bytes(self, slots: int, row: int | None) -> int:
        """One byte per element; the two per-layer scales count once, in the whole layer's bytes (row None)."""
        b, h, _, dk = self.k_codes.shape
        per_token = h * (dk + self.v_codes.shape[-1])
        return slots * per_token if row is not None else b * slots * per_token + SCALE_BYTES

    def capacity_bytes(self) -> int:
        return self.k_codes.numel() + self.v_codes.numel() + SCALE_BYTES


@dataclass(frozen=True)
class Fp8Bytes:
    """The bytes an fp8 cache holds for one sequence (all evicting layers), from its stored length: the same
    count as `Fp8Storage.held_bytes` (the scales included)."""

    window: int
    layers: int
    kv_heads: int
    head_dim: int

    def held(self, length: int, steps: int, capacity: int) -> int:
        """Bytes held with `length` tokens stored per KV head (`steps`, `capacity`: unused, the protocol's)."""
        return self.layers * (self.kv_heads * length * 2 * self.head_dim + SCALE_BYTES)

    def byte_steps(self, prompt_len: int, n_generated: int, capacity: int, budget: int | None = None,
                   evicts: bool = False) -> int:
        """Bytes held summed over the decode steps 1..n_generated (the stored length from `vase.core.schedule`)."""
        return sum(self.held(physical_length(prompt_len, budget, self.window, step) if evicts and budget
                             else prompt_len + step, step, capacity) for step in range(1, n_generated + 1))

    def write_bytes(self, capacity: int) -> int:
        """Bytes one token's codes take (all layers and KV heads)."""
        return self.layers * self.kv_heads * 2 * self.head_dim

    def allocated(self, capacity: int) -> int:
        """Bytes a layer set with `capacity` slots allocates (`Fp8Storage.capacity_bytes`, all layers)."""
        return self.held(capacity, 0, capacity)

    @classmethod
    def for_model(cls, model, policy: Policy, budget: int | None, window: int, spec: "Fp8Spec") -> "Fp8Bytes | None":
        """The accounting of `EvictionCache(model, ..., kv_dtype=spec.dtype)`; None for "auto" or no model."""
        if model is None or spec.dtype == "auto":
            return None
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        return cls(window, len(full_attention_layers(text)), int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim)
