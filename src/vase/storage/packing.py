"""Group quantization with real packed storage: 8, 4 or 2 bits per element.

Asymmetric min/max quantization in groups of `group` consecutive elements along the last
axis, codes packed `8 // bits` to a byte, one float16 scale and zero point per group:

    x ~ zero + scale * q,   q in 0 .. 2**bits - 1,   |x - x_hat| <= scale / 2

The zero point is rounded down and the scale up to float16, so every element of a group
lies inside the representable range and the half-step bound holds exactly (up to float32
arithmetic in the reconstruction). Used by `vase.storage.quantized` per token (each stored
K/V vector is its own set of groups along head_dim), which keeps quantized tokens
independent of each other, so eviction can drop and compact them without requantizing.

Bytes of one quantized vector of `d` elements: `d * bits / 8` (codes) + `4 * d / group`
(float16 scale and zero per group); see `packed_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.storage_specs import BITS, CACHE_STORAGE_OPTIONS, bits_problem, check_format  # noqa: F401

SCALE_DTYPE = torch.float16


def packed_bytes(n_vectors: int, dim: int, bits: int, group: int) -> int:
    """Bytes that `n_vectors` quantized vectors of `dim` elements hold (codes + scales + zeros)."""
    return n_vectors * (dim * bits // 8 + 2 * (dim // group) * torch.finfo(SCALE_DTYPE).bits // 8)


@dataclass
class Packed:
    """Quantized vectors: codes uint8 [..., d * bits / 8]; scale, zero float16 [..., d / group]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def _next_f16(h: torch.Tensor, up: bool) -> torch.Tensor:
    """The float16 next to `h` toward +inf (`up`) or -inf, by its bits (`torch.nextafter` on float16 is not
    exact under torch.compile's inductor, which computes it in float32 and rounds back)."""
    bits = h.view(torch.int16)
    away_from_zero = (h > 0) if up else (h < 0)
    toward_zero = (h < 0) if up else (h > 0)
    tiny = torch.tensor(1 if up else -32767, dtype=torch.int16, device=h.device)  # +-smallest subnormal
    step = torch.where(away_from_zero, bits + 1, torch.where(toward_zero, bits - 1, tiny))
    return step.view(SCALE_DTYPE)


def _round_down(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the largest float16 <= x."""
    h = x.to(SCALE_DTYPE)
    return torch.where(h.float() > x, _next_f16(h, up=False), h)


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the smallest float16 >= x."""
    h = x.to(SCALE_DTYPE)
    return torch.where(h.float() < x, _next_f16(h, up=True), h)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [..., n] (each < 2**bits) into uint8 [..., n * bits / 8], lowest bits first."""
    per = 8 // bits
    if per == 1:
        return codes.to(torch.uint8)
    c = codes.to(torch.uint8).view(*codes.shape[:-1], -1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., m] -> uint8 codes [..., m * 8 / bits]."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).view(*packed.shape[:-1], -1)


def quantize(x: torch.Tensor, bits: int, group: int) -> Packed:
    """Quantize `x` [..., d] in groups of `group` elements along the last axis."""
    check_format(bits, group, x.shape[-1])
    levels = (1 << bits) - 1
    g = x.float().view(*x.shape[:-1], -1, group)
    zero = _round_down(g.amin(-1))
    scale = _round_up((g.amax(-1) - zero.float()) / levels)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = ((g - zero.float()[..., None]) / safe[..., None]).round_().clamp_(0, levels)
    return Packed(pack(q.view(x.shape), bits), scale, zero, bits, group)


def dequantize(p: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed vectors -> [..., d] in `dtype`."""
    q = unpack(p.codes, p.bits).view(*p.codes.shape[:-1], -1, p.group).float()
    x = p.zero.float()[..., None] + q * p.scale.float()[..., None]
    return x.flatten(-2).to(dtype)


def quant_kwargs(kv_bits: int, quant_guard: int | None = None) -> dict:
    """EvictionCache keywords for `kv_bits` / `quant_guard` (the CLI's --kv-bits / --quant-guard). Not checked
    here: the request spec (`vase.core.spec.RequestSpec.validate`) checks them once, for every door."""
    out: dict = {"kv_bits": kv_bits}
    if quant_guard is not None:
        out["quant_guard"] = quant_guard
    return out
