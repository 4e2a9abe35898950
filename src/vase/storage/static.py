"""Fixed-shape K/V storage of the static (compiled) cache: dense, or packed low-bit codes.

`vase.caches.static.StaticLayer` owns the slot bookkeeping of one layer (positions, lengths, the
policy's state) and composes one of these for the K/V themselves. Row r's real tokens sit in
slots 0 .. length[r] - 1 of a capacity of B + w slots; every tensor keeps its shape for the
cache's life, and every method below runs inside the compiled step (no host reads):

- `StaticDense`: keys, values [b, kv_heads, B + w, d], written and compacted in place;
- `StaticQuant`: the fixed-shape form of `vase.storage.quantized.QuantStorage`, the same two stores
  (packed codes for old tokens, full precision for the window and the reserve) with the same
  rules, so the compiled step keeps what the eager quantized cache keeps. The eager storage
  sizes some operations by host reads (`int(m.max())`, `q_hi`); here they run at their upper
  bound instead (every store entry). The flush that falls every `flush_every` tokens is its own
  graph variant: the host knows when it is due (`flush_due`, a host counter, as the eviction
  schedule) and sets the flag the step is specialised on; the other steps only append.
  Attention (`attend`) reads the packed codes and the full-precision entries where they lie
  (entry order, masked by their slot tags), dequantizing inside the reduction, so the compiled
  step never builds the dequantized [b, h, B + w, d] K/V; only the policy at an eviction does (`read`).
"""

from __future__ import annotations

import torch

from ..core.policies import value_magnitude
from .flush import gather_entries, key_scale_of, left_pack, pack_into, split_flush
from .packing import Packed, dequantize
from .quantized import QuantStorage, entry_bytes, place, renumber, slot_dtype, slot_map
from ..core.kernel import compact_slots, flat_slots, gather_slots


def front_index(pads: torch.Tensor, cap: int, src_capacity: int, heads: int) -> torch.Tensor:
    """Index [b, heads, cap] that moves row r's slots pad[r] .. pad[r] + cap - 1 to the front (clamped)."""
    index = (torch.arange(cap, device=pads.device)[None, :] + pads[:, None]).clamp(max=src_capacity - 1)
    return index[:, None, :].expand(pads.shape[0], heads, cap)


def plane_order(dim: int, bits: int, device: torch.device) -> torch.Tensor:
    """The element order of `planes` [dim]: position i * (dim / per) + j holds element per * j + i
    (per = 8 / bits codes to a byte)."""
    per = 8 // bits
    return torch.arange(dim, device=device).view(-1, per).t().reshape(-1)


def planes(p: Packed, key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`vase.storage.packing.dequantize` of p [..., n] -> float32 [..., d], each value computed as there (zero + q * scale,
    then times `key_scale` [..., 1, d] when given), the elements in `plane_order`: the codes at bits 0.. of
    every byte, then those at bits `bits`.., ...; no interleaving, so it vectorizes."""
    per = 8 // p.bits
    groups = p.scale.shape[-1]
    zero, scale = p.zero.float()[..., None], p.scale.float()[..., None]
    out = []
    for i in range(per):
        codes = p.codes if per == 1 else (p.codes >> (i * p.bits)) & ((1 << p.bits) - 1)
        out.append((zero + codes.view(*codes.shape[:-1], groups, -1).float() * scale).flatten(-2))
    x = torch.cat(out, -1) if per > 1 else out[0]
    if key_scale is not None:
        x = x * key_scale.float().index_select(-1, plane_order(x.shape[-1], p.bits, x.device))
    return x


class StaticDense:
    """Full-precision K/V buffers [b, kv_heads, B + w, d]."""

    #: the compiled attention reads `read()` and runs the stock kernel (True: the store's own `attend`)
    attends_itself = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    @classmethod
    def from_eager(cls, src_keys: torch.Tensor, src_values: torch.Tensor, index: torch.Tensor) -> StaticDense:
        """Row r's slots `index` [b, h, cap] of the eager buffers [b, h, capacity, d], moved to the front."""
        return cls(gather_slots(src_keys, index).contiguous(), gather_slots(src_values, index).contiguous())

    def write(self, slot: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
              seen: torch.Tensor, flush: bool = False) -> None:
        """Store one token per row: key/value_states [b, h, 1, d] at slot [b] (`seen`: its sequence index;
        `flush` is the quantized storage's and means nothing here)."""
        b, h, cap, _ = self.keys.shape
        # index_copy_ into a flat view of whole head_dim rows: inductor writes it in place (a scatter_ over
        # [b, h, 1, d] it did not, and copied both buffers of every layer at every step)
        flat = flat_slots(slot.view(b, 1, 1).expand(b, h, 1), cap)
        for buf, new in ((self.keys, key_states), (self.values, value_states)):
            buf.view(-1, buf.shape[-1]).index_copy_(0, flat, new.reshape(-1, buf.shape[-1]))

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [b, h, B + w, d] for attention (slots past a row's length are masked by the layer)."""
        return self.keys, self.values

    step_kv = read  # what the layer's `update` hands the attention function: the buffers themselves

    def flush_due(self) -> bool:
        return False

    def advance(self) -> None:
        pass

    def candidates(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [b, h, n, d] of slots 0 .. n - 1, for the policy."""
        return self.keys[:, :, :n], self.values[:, :, :n]

    def compact(self, index: torch.Tensor, kept: torch.Tensor) -> None:
        """Slots `index` [b, h, cap] move to the front (the first `kept` [b] of a row survive, the rest of
        the row's index is filler)."""
        for buf in (self.keys, self.values):
            compact_slots(buf, index)

    def held_bytes(self, slots: int, row: int | None) -> int:
        """K/V bytes of `slots` stored tokens of one row (`row` given) or of every row."""
        b, h, _, d = self.keys.shape
        per_token = h * (d + self.values.shape[-1]) * self.keys.element_size()
        return slots * per_token if row is not None else b * slots * per_token

    def capacity_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer held between steps."""
        return [self.keys, self.values]


class StaticQuant:
    """Packed low-bit codes plus a full-precision reserve, in fixed shapes (see the module docstring).

    Stores as `QuantStorage`'s: full precision fk, fv [b, h, R + w + F, d], fslot, frank, fn; packed
    qk, qv (codes, scale, zero) [b, h, B + w + 1, ...] (the last entry is the trash that absorbs
    writes aimed at no slot), qslot, qn; `unflushed` (host int) tokens appended since the last flush."""

    attends_itself = True  # `attend` over the packed store, never the whole dequantized K/V

    def __init__(self, src: QuantStorage, pads: torch.Tensor, pad0: list[int], cap: int):
        cfg = src.qcfg
        self.bits, self.guard, self.flush_every = cfg.bits, cfg.guard, cfg.flush_every
        self.metric, self.sinks, self.group = cfg.metric, cfg.sinks, src.group
        self.window = src.window
        device = src.device
        b, h, _, d = src.keys.shape
        dv = src.values.shape[-1]
        # zero-stride carriers: the layer reads batch, heads, capacity, head_dim and dtype from them
        self.keys = src.keys[:, :, :1].expand(b, h, cap, d)
        self.values = src.values[:, :, :1].expand(b, h, cap, dv)
        tags = slot_dtype(cap)
        shift = pads.view(b, 1, 1)

        def to_front(slot: torch.Tensor) -> torch.Tensor:  # eager slot -> front-packed slot (-1 stays)
            slot = slot.long()
            return torch.where(slot >= 0, slot - shift, -1).to(tags)

        self.fk, self.fv, self.frank, self.fn = src.fk.clone(), src.fv.clone(), src.frank.clone(), src.fn.clone()
        self.fslot = to_front(src.fslot)
        n = min(src.qslot.shape[2] - 1, cap)  # live entries are the first qn <= cap of each head

        def store(p: Packed) -> Packed:
            out = Packed(*(t.new_zeros(b, h, cap + 1, t.shape[-1]) for t in (p.codes, p.scale, p.zero)), p.bits,
                         p.group)
            for name in ("codes", "scale", "zero"):
                getattr(out, name)[:, :, :n] = getattr(p, name)[:, :, :n]
            return out

        self.qk, self.qv = store(src.qk), store(src.qv)
        self.qslot = torch.full((b, h, cap + 1), -1, dtype=tags, device=device)
        self.qslot[:, :, :n] = to_front(src.qslot[:, :, :n])
        self.qn = src.qn.clone()
        self.key_scale = cfg.key_scale
        self.kscale = src.kscale.clone() if src.kscale is not None else \
            torch.ones(b, h, 1, d, dtype=torch.float16, device=device)
        self.kscale_set = torch.tensor(src.kscale is not None, device=device)
        self.unflushed = src.unflushed  # host counter: tokens appended since the last flush (`flush_due`)
        self.pad0 = torch.tensor(pad0, dtype=torch.long, device=device)
        # `attend`: the query's columns in the keys' plane order, and the values' plane order undone
        self.k_order = plane_order(d, self.bits, device)
        self.v_unorder = torch.argsort(plane_order(dv, self.bits, device))

    # -- host side: the flush schedule ---------------------------------------------------------------
    def flush_due(self) -> bool:
        """Whether the next step's token makes a flush: as `QuantStorage._ingest`, every `flush_every` tokens
        (a host counter, the same for every row and layer: no device read)."""
        return self.unflushed == self.flush_every - 1

    def advance(self) -> None:
        """After a step: one more token appended, or (a flush step) none left unflushed."""
        self.unflushed = (self.unflushed + 1) % self.flush_every

    # -- the step (traced) ---------------------------------------------------------------------------
    def write(self, slot: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
              seen: torch.Tensor, flush: bool = False) -> None:
        """Store one token per row (`QuantStorage._ingest` of one token): key/value_states [b, h, 1, d] at
        slot [b], sequence index `seen` []. Appended to the full-precision store, or, when `flush` (the host's
        `flush_due`; its own graph), a flush: the window and the top-R old tokens stay exact, the other old
        ones are quantized."""
        b, h = key_states.shape[:2]
        slots = slot.view(b, 1, 1).expand(b, h, 1)
        rank = value_magnitude(value_states, self.metric)
        rank = rank.masked_fill(((seen - self.pad0) < self.sinks).view(b, 1, 1), float("inf"))
        if flush:
            self._flush(slot, key_states, value_states, slots, rank)
            return
        # append after each head's live full-precision entries (index_copy_ into a flat view: in place)
        n_fp = self.fk.shape[2]
        flat = flat_slots(self.fn[..., None].clamp(max=n_fp - 1), n_fp)
        for buf, new in ((self.fk, key_states), (self.fv, value_states)):
            buf.view(-1, buf.shape[-1]).index_copy_(0, flat, new.reshape(-1, buf.shape[-1]).to(buf.dtype))
        self.fslot.view(-1).index_copy_(0, flat, slots.reshape(-1).to(self.fslot.dtype))
        self.frank.view(-1).index_copy_(0, flat, rank.reshape(-1).to(self.frank.dtype))
        self.fn.add_(1)

    def _flush(self, slot: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, slots: torch.Tensor,
               rank: torch.Tensor) -> None:
        """`QuantStorage._flush` (`vase.storage.flush`) with this row's length after the write (the new token
        [b, h, 1, d] included), every entry at its upper bound, in place (non-chosen ones go to the trash)."""
        b, h = key_states.shape[:2]
        n_q = self.fslot.shape[2] + slots.shape[2]
        kept, out = split_flush(self.fk, self.fv, self.fslot, self.frank, key_states, value_states, slots, rank,
                                (slot + 1 - self.window).view(b, 1, 1), self.guard, n_q)
        for store, new in zip((self.fk, self.fv, self.fslot, self.frank, self.fn), kept):
            store.copy_(new)
        trash = self.qslot.shape[2] - 1
        dest = torch.where(out.chosen, self.qn[..., None] + torch.arange(n_q, device=out.slots.device), trash)
        keys = out.keys
        if self.key_scale:  # fixed at the first flush that quantizes anything, as the eager storage
            first = ~self.kscale_set & out.quant.any()
            self.kscale.copy_(torch.where(first, key_scale_of(out.all_keys, out.all_slots), self.kscale))
            self.kscale_set.copy_(self.kscale_set | first)
            keys = keys / self.kscale.to(keys.dtype)
        pack_into(self.qk, self.qv, self.qslot, dest, keys, out.values, out.slots, self.bits, self.group)
        self.qslot[:, :, trash] = -1
        self.qn.add_(out.count)

    def step_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layer's `update` hands the attention function: the zero-stride carriers (shapes and dtype;
        the static attention function calls `attend`, which reads the stores)."""
        return self.keys, self.values

    def attend(self, query: torch.Tensor, length: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of the decode query [b, q_heads, 1, d] over what the stores hold: -> [b, 1, q_heads, dv].

        Reads the entries where they lie: the packed store (B + w + 1 entries) and the full-precision
        store, each entry live where its slot tag is in 0 .. length[r] - 1 (the slots `read` would place
        and the layer's mask keep). Attention does not depend on the order of its keys, so this is the
        attention over `read()` without building it (no zero fill, no scatter into slot order). The codes
        are dequantized plane by plane (`planes`: every element of a byte's low bits, then the next bits,
        ...), which vectorizes, and the query / output columns are permuted to match. On a CPU inductor
        runs the two products as GEMM calls (it fuses no dequantization into them): the dequantized
        planes [b, h, B + w + 1, d] are a temporary of the step, never held. Scores in the query's dtype,
        softmax in at least float32, as transformers' eager kernel."""
        b, hq, _, d = query.shape
        h = self.fk.shape[1]
        qg = query.reshape(b, h, hq // h, d)  # query head i reads KV head i // g
        kq = planes(self.qk, self.kscale if self.key_scale else None).to(query.dtype)  # [b, h, E, d], planes
        vq = planes(self.qv).to(query.dtype)
        scores = torch.cat([qg.index_select(-1, self.k_order) @ kq.transpose(-1, -2),
                            qg @ self.fk.transpose(-1, -2)], -1)
        tags = torch.cat([self.qslot, self.fslot], -1).long()
        live = (tags >= 0) & (tags < length.view(b, 1, 1))
        scores = (scores * (scaling if scaling is not None else d ** -0.5)).masked_fill(~live[:, :, None],
                                                                                        float("-inf"))
        p = torch.softmax(scores, -1, dtype=torch.promote_types(query.dtype, torch.float32)).to(query.dtype)
        n_q = kq.shape[2]
        out = (p[..., :n_q] @ vq).index_select(-1, self.v_unorder) + p[..., n_q:] @ self.fv
        return out.reshape(b, 1, hq, -1)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [b, h, B + w, d]: dequantized codes and exact full-precision rows (a new tensor per call;
        empty slots are zero). The policy's candidates at an eviction, and attention kernels `attend` does
        not replace."""
        b, h, cap, d = self.keys.shape
        dv = self.values.shape[-1]
        rows = cap + 1  # one spare row per head takes every write aimed at no slot
        out_k = torch.zeros(b, h, rows, d, dtype=self.keys.dtype, device=self.keys.device)
        out_v = torch.zeros(b, h, rows, dv, dtype=self.values.dtype, device=self.keys.device)
        keys = dequantize(self.qk)
        if self.key_scale:
            keys = keys * self.kscale.float()
        place(out_k, out_v, cap, self.qslot, keys, dequantize(self.qv))
        place(out_k, out_v, cap, self.fslot, self.fk, self.fv)
        return out_k[:, :, :cap], out_v[:, :, :cap]

    def candidates(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.read()
        return keys[:, :, :n], values[:, :, :n]

    def compact(self, index: torch.Tensor, kept: torch.Tensor) -> None:
        """Slots `index[r, :, :kept[r]]` move to the front (`QuantStorage.compact`); the others are dropped."""
        cap = index.shape[2]
        table = slot_map(index, torch.arange(cap, device=index.device) < kept.view(-1, 1, 1), cap)
        fslot = renumber(self.fslot, table)
        live = fslot >= 0
        order = left_pack(live, fslot.shape[2])
        for buf in (self.fk, self.fv, self.frank):
            buf.copy_(gather_entries(buf, order))
        self.fslot.copy_(gather_entries(fslot, order))
        self.fn.copy_(live.sum(-1))
        trash = self.qslot.shape[2] - 1
        qslot = renumber(self.qslot[:, :, :trash], table)
        live = qslot >= 0
        self.qn.copy_(live.sum(-1))
        order = left_pack(live, trash)
        self.qslot[:, :, :trash] = gather_entries(qslot, order)
        for p in (self.qk, self.qv):
            for name in ("codes", "scale", "zero"):
                buf = getattr(p, name)
                buf[:, :, :trash] = gather_entries(buf[:, :, :trash], order)

    # -- bytes (host side, outside the step) ------------------------------------------------------
    def held_bytes(self, slots: int, row: int | None) -> int:
        """K/V bytes held now, as `QuantStorage.held_bytes`: live entries with their tags, and the key scales
        (`slots` is not read: the stores count their live entries)."""
        quant, full = entry_bytes(self.keys.shape[-1], self.values.shape[-1], self.bits, self.group,
                                  self.fk.element_size(), self.qslot.shape[2] - 1)
        qn, fn = (self.qn, self.fn) if row is None else (self.qn[row], self.fn[row])
        scales = 0
        if self.key_scale and bool(self.kscale_set):
            scales = self.kscale[0].numel() * self.kscale.element_size() * (self.kscale.shape[0] if row is None else 1)
        return int(qn.sum()) * quant + int(fn.sum()) * full + scales

    def row_bytes(self) -> torch.Tensor:
        """`held_bytes` of every row at once, on the device (no sync): [b] long."""
        quant, full = entry_bytes(self.keys.shape[-1], self.values.shape[-1], self.bits, self.group,
                                  self.fk.element_size(), self.qslot.shape[2] - 1)
        out = self.qn.sum(-1) * quant + self.fn.sum(-1) * full
        if self.key_scale:
            out = out + self.kscale_set.long() * (self.kscale[0].numel() * self.kscale.element_size())
        return out

    def capacity_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer held between steps (counted, and marked static for CUDA graphs)."""
        out = [self.qk.codes, self.qk.scale, self.qk.zero, self.qv.codes, self.qv.scale, self.qv.zero, self.qslot,
               self.qn, self.fk, self.fv, self.fslot, self.frank, self.fn, self.pad0]
        return out + ([self.kscale, self.kscale_set] if self.key_scale else [])
