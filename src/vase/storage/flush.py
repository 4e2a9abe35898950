"""The quantized flush, one function for the eager and the fixed-shape store: which entries of the
full-precision store (the window and the reserve) stay exact, which leave for packed low-bit codes.

`QuantStorage._flush` (eager: sizes by host reads, rebinds its stores) and `StaticQuant._flush` (compiled
step: every size at its upper bound, writes in place) both call `split_flush` and `pack_into`; what differs
between them is only how many entries leave (`n_out`) and how the results land in their stores.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.policies.base import top_k_indices
from .packing import Packed, quantize


def gather_entries(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t [b, h, n, ...] reordered along n by order [b, h, m] -> [b, h, m, ...]."""
    if t.dim() == 3:
        return t.gather(2, order)
    return t.gather(2, order[..., None].expand(*order.shape, t.shape[-1]))


def left_pack(mask: torch.Tensor, m: int) -> torch.Tensor:
    """Indices [b, h, m] of the entries of mask [b, h, n] that are True, first, in their order."""
    return torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :m]


def flush_split(slots: torch.Tensor, rank: torch.Tensor, old_below, guard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of a flush: which entries stay in full precision and which are quantized.

    slots [b, h, n] (-1 = empty), rank [b, h, n] (the reserve ranking); entries whose slot is below
    `old_below` (an int, or [b, 1, 1] per row) are old. Returns (keep, quant) masks [b, h, n]: the
    window and the top-`guard` old entries by rank are kept, the other old ones quantized."""
    valid = slots >= 0
    old = valid & (slots < old_below)
    reserve = torch.zeros_like(old)
    if guard:
        top = top_k_indices(rank.masked_fill(~old, float("-inf")), min(guard, slots.shape[2]))
        reserve.scatter_(-1, top, True)
        reserve &= old
    return valid & ~(old & ~reserve), old & ~reserve


class Kept(NamedTuple):
    """The new full-precision store, left-packed: keys, values [b, h, n_fp, d], slots, rank [b, h, n_fp]
    (-1 / stale past each head's count), count [b, h]."""
    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    rank: torch.Tensor
    count: torch.Tensor


class Leaving(NamedTuple):
    """The entries a flush quantizes, left-packed: exact keys, values [b, h, n, d], slots [b, h, n] (-1 where
    `chosen` [b, h, n] is False), how many per head [b, h]; and the whole candidate set (keys [b, h, N, d],
    slots [b, h, N]) for the first key scale."""
    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    chosen: torch.Tensor
    count: torch.Tensor
    all_keys: torch.Tensor
    all_slots: torch.Tensor
    quant: torch.Tensor


def split_flush(fk: torch.Tensor, fv: torch.Tensor, fslot: torch.Tensor, frank: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, slots: torch.Tensor, rank: torch.Tensor, old_below, guard: int,
                n_out: int | None) -> tuple[Kept, Leaving | None]:
    """One flush: the full-precision store fk, fv [b, h, n_fp, d], fslot, frank [b, h, n_fp] joined by the new
    tokens k, v [b, h, q, d], slots, rank [b, h, q]; entries with a slot below `old_below` are old
    (`flush_split`). Returns the kept store (n_fp entries, left-packed) and the leaving entries, `n_out` of
    them per head (None: as many as the fullest head has, a host read; None returned when that is 0)."""
    n_fp = fk.shape[2]
    ck, cv = torch.cat([fk, k], 2), torch.cat([fv, v], 2)
    cs, cr = torch.cat([fslot.long(), slots], 2), torch.cat([frank, rank], 2)
    keep, quant = flush_split(cs, cr, old_below, guard)
    order = left_pack(keep, n_fp)
    kept = keep.gather(-1, order)
    out = Kept(gather_entries(ck, order), gather_entries(cv, order),
               gather_entries(cs, order).masked_fill(~kept, -1).to(fslot.dtype), gather_entries(cr, order),
               keep.sum(-1))
    m = quant.sum(-1)
    n = int(m.max()) if n_out is None else n_out
    if n == 0:
        return out, None
    order = left_pack(quant, n)
    chosen = quant.gather(-1, order)
    leaving = Leaving(gather_entries(ck, order), gather_entries(cv, order),
                      gather_entries(cs, order).masked_fill(~chosen, -1), chosen, m, ck, cs, quant)
    return out, leaving


def key_scale_of(keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The per-channel key scale [b, h, 1, d] (float16) of the live entries of keys [b, h, N, d] (slots [b, h, N],
    -1 = empty): each channel's absolute maximum, at least 1e-4."""
    live = keys.float().abs().masked_fill((slots < 0)[..., None], 0)
    return live.amax(2, keepdim=True).clamp(min=1e-4).to(torch.float16)


def pack_into(qk: Packed, qv: Packed, qslot: torch.Tensor, dest: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, slots: torch.Tensor, bits: int, group: int) -> None:
    """Quantize keys, values [b, h, n, d] and write codes, scales, zeros and slots [b, h, n] into the packed
    stores (qk, qv [b, h, C, ...], qslot [b, h, C]) at entries dest [b, h, n], in place."""
    b, h, n = dest.shape
    for store, src in ((qk, keys), (qv, values)):
        p = quantize(src, bits, group)
        for name in ("codes", "scale", "zero"):
            buf = getattr(store, name)
            buf.scatter_(2, dest[..., None].expand(b, h, n, buf.shape[-1]), getattr(p, name))
    qslot.scatter_(2, dest, slots.to(qslot.dtype))
