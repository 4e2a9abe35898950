"""Quantized storage for the evicting cache, with one outlier reserve shared with eviction.

`EvictionCache(model, method, budget, storage=QuantSpec(bits=8|4|2, guard=R))` (or the same
request spelled `kv_bits=..., quant_guard=R`) gives each `EvictionLayer` a `QuantStorage`: the
layer keeps its slot bookkeeping (positions, padding, eviction schedule) and the storage, one
`vase.storage.protocol.KVStorage`, holds K/V in two stores instead of one full-precision buffer:

- full precision: the recent window (the last `w` slots, plus up to `flush_every` tokens that
  left it since the last flush) and the reserve: per KV head, the `R` old tokens ranked first
  by the value guard's ranking (sinks first, then `value_magnitude` with the method's metric);
- packed low-bit codes (`vase.storage.packing`, per token, groups along head_dim): every other token,
  quantized once when it leaves the window (or loses its reserve place to a larger one).

Stores are rectangular per (row, KV head) with a slot number per entry (-1 = empty) and are
left-packed after each compaction. Attention and the policy read `materialize()`: a fresh
[b, h, L, d] tensor with dequantized codes and exact reserve/window rows, built per call and
never kept, so between steps only the packed codes and the full-precision reserve are held.

A multi-token write (teacher forcing) stores its tokens one after the other as token-by-token
decoding does; a flush that falls inside the chunk quantizes tokens the chunk's earlier queries
must still read exact, so their exact copies follow the stored slots and `attention_mask`
gives each query the copy or the codes, as decoding at its position had them. Slot tags are
stored in the narrowest integer type for the capacity and counted in the bytes; `QuantBytes`
gives the same count from a stored length (the eval's per-sequence accounting).

Keys are quantized per token like values. KIVI groups keys per channel across tokens; such a
group would be broken up by eviction (survivors of one group end up scattered, and requantizing
them adds error at every eviction), so each token carries its own scales here. KIVI's reason
for per-channel keys (a few key channels are much larger than the rest) is met, optionally, by
`quant_key_scale=True`: keys are divided by a per-channel scale (the absolute maximum of each
channel over the prompt, per KV head, fixed at the first flush) before the per-token groups,
and multiplied back on reading.
"""

from __future__ import annotations


import torch

from ..hf.masks import causal_padding_mask
from ..core.policies import value_magnitude
from ..core.storage_specs import (BITS, CACHE_STORAGE_OPTIONS, SELECT, QuantConfig, QuantSpec,  # noqa: F401
                                  bits_problem, check_format, quant_config)  # the rules: importable here too
from .packing import Packed, dequantize, packed_bytes, quant_kwargs, quantize  # noqa: F401
from .protocol import Rows
from .flush import flush_split, gather_entries, key_scale_of, left_pack, pack_into, split_flush  # noqa: F401
from .quantized_bytes import (RANK_DTYPE, QuantBytes, entry_bytes, full_precision_entries,  # noqa: F401
                              slot_dtype)  # the byte model: importable here too


def slot_map(index: torch.Tensor, live: torch.Tensor, capacity: int) -> torch.Tensor:
    """Where a compaction moves each slot: [b, h, capacity + 1], old slot -> new slot (-1 = dropped).

    index [b, h, n]: entry j moves slot index[..., j] to slot j, where `live` [b, h, n] (or broadcastable);
    the other entries (padding, filler) move nothing. The extra last column maps slot `capacity`, the
    tag of "no slot", to -1."""
    b, h, n = index.shape
    to = torch.arange(n, device=index.device).expand(b, h, n)
    table = torch.full((b, h, capacity + 1), -1, dtype=torch.long, device=index.device)
    table.scatter_(-1, torch.where(live, index, capacity), to)  # not live: to the extra column ...
    table[:, :, capacity] = -1  # ... which maps to nothing
    return table


def renumber(slots: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Store entries' slots [b, h, m] (-1 = empty) through a `slot_map` table: [b, h, m] long."""
    slots = slots.long()
    return table.gather(-1, torch.where(slots >= 0, slots, table.shape[-1] - 1))


def place(out_k: torch.Tensor, out_v: torch.Tensor, length: int, slots: torch.Tensor, k_rows: torch.Tensor,
          v_rows: torch.Tensor) -> None:
    """Write store entries into slot order: out_k/out_v [b, h, length + 1, d] (the last row takes every entry
    aimed at no slot); slots [b, h, m] (-1 = empty), k_rows/v_rows [b, h, m, d]."""
    b, h, rows, d = out_k.shape
    dv = out_v.shape[-1]
    base = torch.arange(b * h, device=out_k.device).view(b, h, 1) * rows
    slots = slots.long()
    idx = (base + torch.where((slots >= 0) & (slots < length), slots, length)).view(-1)
    out_k.view(-1, d).index_copy_(0, idx, k_rows.reshape(-1, d).to(out_k.dtype))
    out_v.view(-1, dv).index_copy_(0, idx, v_rows.reshape(-1, dv).to(out_v.dtype))


class QuantStorage:
    """A `vase.storage.protocol.KVStorage` whose K/V live in packed low-bit codes plus a full-precision reserve.

    `keys` / `values` are zero-stride carriers of shape [b, h, capacity, d] holding one element
    (the layer reads shapes and dtypes from them); the data is in the stores below.
    """

    def __init__(self, qcfg: QuantConfig, window: int, layer_idx: int):
        self.qcfg = qcfg
        self.window = window
        self.layer_idx = layer_idx  # seeds the random control's draws per layer
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.device: torch.device | None = None
        self.fk = self.fv = self.fslot = self.frank = self.fn = None  # full-precision entries
        self.qk: Packed | None = None
        self.qv: Packed | None = None
        self.qslot = self.qn = None
        self.kscale: torch.Tensor | None = None  # [b, h, 1, d] float16 per-channel key scale (key_scale only)
        self.q_hi = 0  # an upper bound on the live quantized entries of any (row, head)
        self.pending: tuple | None = None
        self.view: tuple | None = None  # a chunk's exact copies of tokens it quantized partway (`_ingest`)
        self.unflushed = 0
        self.rank_gen: torch.Generator | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    # -- allocation --------------------------------------------------------------------------------
    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        b, h, _, d = key_states.shape
        cap = capacity
        self.device = key_states.device
        self.group = self.qcfg.group or min(32, d)
        check_format(self.qcfg.bits, self.group, d)
        self.keys = key_states.new_zeros(()).expand(b, h, cap, d)
        self.values = value_states.new_zeros(()).expand(b, h, cap, value_states.shape[-1])
        n_fp = self.qcfg.guard + self.window + self.qcfg.flush_every
        self.fk = key_states.new_zeros(b, h, n_fp, d)
        self.fv = value_states.new_zeros(b, h, n_fp, value_states.shape[-1])
        self.fslot = torch.full((b, h, n_fp), -1, dtype=slot_dtype(cap), device=self.device)
        self.frank = torch.zeros(b, h, n_fp, dtype=torch.float32, device=self.device)
        self.fn = torch.zeros(b, h, dtype=torch.long, device=self.device)
        self._alloc_quantized(cap)
        self.rank_gen = torch.Generator(device=self.device).manual_seed(
            self.qcfg.seed * 1_000_003 + 7919 * self.layer_idx + 1)

    def _alloc_quantized(self, cap: int) -> None:
        """Packed stores of `cap` entries plus one trash entry (cap) that absorbs masked writes."""
        b, h, _, d = self.keys.shape
        dv = self.values.shape[-1]
        bits, g = self.qcfg.bits, self.group

        def store(dim):
            return Packed(torch.zeros(b, h, cap + 1, dim * bits // 8, dtype=torch.uint8, device=self.device),
                          torch.zeros(b, h, cap + 1, dim // g, dtype=torch.float16, device=self.device),
                          torch.zeros(b, h, cap + 1, dim // g, dtype=torch.float16, device=self.device), bits, g)

        old = (self.qk, self.qv, self.qslot)
        self.qk, self.qv = store(d), store(dv)
        # Slot tags in the narrowest type for slots -1 .. cap (they are held between steps, and counted)
        tags = slot_dtype(cap)
        self.qslot = torch.full((b, h, cap + 1), -1, dtype=tags, device=self.device)
        if self.fslot is not None and self.fslot.dtype != tags:  # grown past the old type's range
            self.fslot = self.fslot.to(tags)
        if old[0] is not None:  # growing (the full cache without max_length): keep what is stored
            n = old[2].shape[2] - 1
            for new, prev in ((self.qk, old[0]), (self.qv, old[1])):
                for name in ("codes", "scale", "zero"):
                    getattr(new, name)[:, :, :n] = getattr(prev, name)[:, :, :n]
            self.qslot[:, :, :n] = old[2][:, :, :n]
        else:
            self.qn = torch.zeros(b, h, dtype=torch.long, device=self.device)

    def grow(self, capacity: int, length: int) -> None:
        b, h, _, d = self.keys.shape
        self.keys = self.keys[:, :, :1].expand(b, h, capacity, d)
        self.values = self.values[:, :, :1].expand(b, h, capacity, self.values.shape[-1])
        self._alloc_quantized(capacity)

    # -- the KVStorage protocol ---------------------------------------------------------------------
    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        # Stored by `commit`, once the positions of the new slots are written (on the first
        # forward: once the attention function has told the layer the padding).
        self.pending = (key_states, value_states, start, end)

    def commit(self, positions: torch.Tensor, pad0: list[int], prompt: bool) -> None:
        if self.pending is not None:  # the prompt: quantize all but the window and the reserve at once
            self._ingest(positions, pad0, flush=prompt)

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.materialize(end)
        if self.view is None:
            return keys, values
        # Teacher forcing: the exact copies of tokens a flush inside the chunk quantized follow the
        # stored slots; `attention_mask` shows each query either the copy or the codes.
        ek, ev = self.view[:2]
        return torch.cat([keys, ek.to(keys.dtype)], 2), torch.cat([values, ev.to(values.dtype)], 2)

    def attention_mask(self, mask, query: torch.Tensor, kind: str, length: int):
        """The layer's mask, and after a chunk whose flushes quantized tokens partway through it, a per-head mask
        [b, q_heads, q, L + E]: query i reads a token's exact copy (columns L..) while decoding at i held it
        exact, its codes (its slot) once decoding had quantized it."""
        view, self.view = self.view, None
        if view is None:
            return mask
        if kind == "flash":
            raise ValueError("a quantized cache fed several tokens at once after the prompt needs a per-head mask, "
                             "which flash_attention_2 does not take: load the model with attn_implementation="
                             "'sdpa' or 'eager', or feed one token per call")
        _, _, eslot, estep = view
        b, h, E = eslot.shape
        q, L = query.shape[2], length
        if mask is None:
            base = causal_padding_mask(None, q, L, "bool", query.dtype, self.device)
        else:
            base = mask if mask.dtype == torch.bool else mask == 0
        base = base.expand(b, h, q, L)
        step = torch.arange(q, device=self.device).view(1, 1, q, 1)
        # per head and slot, the first chunk step that reads its codes (0: held as it is for the whole chunk)
        at = torch.zeros(b, h, L + 1, dtype=torch.long, device=self.device)
        at.scatter_(-1, torch.where(eslot >= 0, eslot, L), estep.clamp(min=0))
        codes = base & (step >= at[:, :, None, :L])
        copies = base.gather(-1, eslot.clamp(min=0)[:, :, None, :].expand(b, h, q, E)) & \
            (step < estep[:, :, None, :]) & (eslot >= 0)[:, :, None, :]
        full = torch.cat([codes, copies], -1).repeat_interleave(query.shape[1] // h, dim=1)
        if kind == "additive":
            return torch.zeros(full.shape, dtype=query.dtype, device=self.device).masked_fill_(
                ~full, torch.finfo(query.dtype).min)
        return full

    def candidates(self, rows: Rows, pad: int, n_cand: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.materialize(length)
        return keys[rows, :, pad:n_cand], values[rows, :, pad:n_cand]

    def take_rows(self, rows: list[int]) -> None:
        b = len(rows)
        _, h, cap, d = self.keys.shape
        self.keys = self.keys[:1].expand(b, h, cap, d)
        self.values = self.values[:1].expand(b, h, cap, self.values.shape[-1])
        for name in ("fk", "fv", "fslot", "frank", "fn", "qslot", "qn", "kscale"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])
        for p in (self.qk, self.qv):
            p.codes, p.scale, p.zero = p.codes[rows], p.scale[rows], p.zero[rows]

    # -- storing new tokens ------------------------------------------------------------------------
    def _rank(self, values: torch.Tensor, positions: torch.Tensor, pad0: list[int]) -> torch.Tensor:
        """Reserve ranking of new tokens [b, h, q] (positions [b, h, q], -1 = padding; pad0: each row's prompt
        padding): sinks +inf, padding -inf, else magnitude (or random)."""
        if self.qcfg.select == "value":
            rank = value_magnitude(values, self.qcfg.metric)
        else:  # one draw per token, in order: a chunk draws what token-by-token decoding draws
            rank = torch.cat([torch.rand((*positions.shape[:2], 1), generator=self.rank_gen, device=self.device)
                              for _ in range(positions.shape[2])], dim=2)
        pad = torch.tensor(pad0, device=self.device).view(-1, 1, 1)
        rank = rank.masked_fill((positions >= 0) & (positions - pad < self.qcfg.sinks), float("inf"))
        return rank.masked_fill(positions < 0, float("-inf"))

    def _ingest(self, all_positions: torch.Tensor, pad0: list[int], flush: bool) -> None:
        """Move the pending new tokens into the stores; quantize what left the window when due.

        all_positions: the layer's [b, h, capacity] sequence index per slot; pad0: each row's prompt padding.

        flush=True (the prompt): quantize at once. Otherwise the tokens are stored one after the
        other exactly as token-by-token decoding stores them (a flush every `flush_every` tokens,
        each with the window as it stood at that token), so a multi-token write (teacher forcing)
        leaves the same stores as decoding. A flush after the chunk's first token quantizes tokens
        that the chunk's earlier queries saw exact: their exact copies go to `self.view` for
        `attention_mask` (each query then reads what decoding at its position read)."""
        k, v, start, end = self.pending
        self.pending = None
        b, h, q, _ = k.shape
        positions = all_positions[:, :, start:end]
        slots = torch.arange(start, end, device=self.device).expand(b, h, q).masked_fill(positions < 0, -1)
        rank = self._rank(v, positions, pad0)
        if flush:  # the prompt: everything written so far is stored (slots 0..end-1)
            self._flush(k, v, slots, rank, end)
            self.unflushed = 0
            return
        F = self.qcfg.flush_every
        moved = []  # (chunk step, quantized slots [b, h, n], their exact keys, values) for flushes after step 0
        i = 0
        while i < q:
            due = i + F - 1 - self.unflushed  # the chunk step whose token makes the next flush
            n = min(due, q) - i
            if n:  # tokens that only join the full-precision store
                self._append(k[:, :, i:i + n], v[:, :, i:i + n], slots[:, :, i:i + n], rank[:, :, i:i + n])
                self.unflushed += n
                i += n
            if i == due < q:  # the length as decoding had it at this token decides what left the window
                exact = self._flush(k[:, :, i:i + 1], v[:, :, i:i + 1], slots[:, :, i:i + 1], rank[:, :, i:i + 1],
                                    start + i + 1, keep_exact=i > 0)
                if exact is not None:
                    moved.append((i, *exact))
                self.unflushed = 0
                i += 1
        self.view = self._chunk_view(moved, start) if moved else None

    def _append(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rank: torch.Tensor) -> None:
        """Append n new tokens [b, h, n, d] after each head's live full-precision entries."""
        b, h, n, _ = k.shape
        at = self.fn[..., None] + torch.arange(n, device=self.device)
        self.fk.scatter_(2, at[..., None].expand(b, h, n, k.shape[-1]), k)
        self.fv.scatter_(2, at[..., None].expand(b, h, n, v.shape[-1]), v)
        self.fslot.scatter_(2, at, slots.to(self.fslot.dtype))
        self.frank.scatter_(2, at, rank)
        self.fn += n

    def _chunk_view(self, moved: list, start: int) -> tuple[torch.Tensor, ...]:
        """Exact copies of the tokens quantized by flushes inside a chunk, and when: for the per-query mask.

        Returns keys, values [b, h, E, d], their slots [b, h, E] (-1 = none) and the chunk step
        of the flush that quantized each one [b, h, E]."""
        steps = [torch.where(s >= 0, i, -1) for i, s, _, _ in moved]
        return (torch.cat([m[2] for m in moved], 2), torch.cat([m[3] for m in moved], 2),
                torch.cat([m[1] for m in moved], 2), torch.cat(steps, 2))

    def _flush(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rank: torch.Tensor, length: int,
               keep_exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Keep the window and the top-R old tokens in full precision, quantize the other old ones
        (`vase.storage.flush`).

        `length`: the stored length when decoding made this flush (slots below `length - w` are old).
        keep_exact: return the quantized entries' slots [b, h, n] (-1 = none) and exact keys and values."""
        n_fp = self.fk.shape[2]
        kept, out = split_flush(self.fk, self.fv, self.fslot, self.frank, k, v, slots, rank, length - self.window,
                                self.qcfg.guard, None)
        n_keep = int(kept.count.max())
        if n_keep > n_fp:
            raise RuntimeError(f"full-precision store overflow ({n_keep} > {n_fp}): the window holds more tokens "
                               "than expected")
        self.fk, self.fv, self.fslot, self.frank, self.fn = kept
        if out is None:
            return None
        n_q = out.slots.shape[2]
        trash = self.qslot.shape[2] - 1
        dest = torch.where(out.chosen, self.qn[..., None] + torch.arange(n_q, device=self.device), trash)
        if int((self.qn + out.count).max()) > trash:
            raise RuntimeError("quantized store overflow: more old tokens than the cache capacity")
        keys = out.keys
        exact = (out.slots, keys, out.values) if keep_exact else None
        if self.qcfg.key_scale:
            if self.kscale is None:  # fixed at the first flush (the prompt): codes never need rescaling
                self.kscale = key_scale_of(out.all_keys, out.all_slots)
            keys = keys / self.kscale.to(keys.dtype)
        pack_into(self.qk, self.qv, self.qslot, dest, keys, out.values, out.slots, self.qcfg.bits, self.group)
        self.qn += out.count
        self.q_hi = min(self.q_hi + n_q, trash)
        return exact

    # -- reading -------------------------------------------------------------------------------------
    def materialize(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layer holds as K/V [b, h, length, d]: dequantized codes and exact full-precision rows.

        A new tensor per call (the caller drops it after attention); empty and padding slots are zero."""
        b, h, _, d = self.keys.shape
        dv = self.values.shape[-1]
        rows = length + 1  # one spare row per head takes every write aimed at no slot
        out_k = torch.zeros(b, h, rows, d, dtype=self.keys.dtype, device=self.device)
        out_v = torch.zeros(b, h, rows, dv, dtype=self.values.dtype, device=self.device)
        if self.q_hi:
            n = self.q_hi

            def head(p: Packed) -> Packed:
                return Packed(p.codes[:, :, :n], p.scale[:, :, :n], p.zero[:, :, :n], p.bits, p.group)

            keys = dequantize(head(self.qk))
            if self.kscale is not None:
                keys = keys * self.kscale.float()
            place(out_k, out_v, length, self.qslot[:, :, :n], keys, dequantize(head(self.qv)))
        place(out_k, out_v, length, self.fslot, self.fk, self.fv)
        if self.pending is not None:
            k, v, start, end = self.pending
            place(out_k, out_v, length, torch.arange(start, end, device=self.device).expand(b, h, end - start), k, v)
        return out_k[:, :, :length], out_v[:, :, :length]

    # -- compaction ----------------------------------------------------------------------------------
    def compact(self, index: torch.Tensor, pad: list[int]) -> None:
        """Slots `index` [b, h, n] move to the front: renumber the store entries, drop the evicted ones and
        those that land on a row's padding (slots below pad[r]: the index fills them with real slots of a
        row that evicted, whose tokens must not stay held, nor compete for the reserve, as ghosts)."""
        b, h, n = index.shape
        pads = torch.tensor(pad, dtype=torch.long, device=self.device).view(b, 1, 1)
        table = slot_map(index, torch.arange(n, device=self.device) >= pads, self.capacity)

        fslot = renumber(self.fslot, table)
        live = fslot >= 0
        order = left_pack(live, fslot.shape[2])
        self.fk, self.fv, self.frank = gather_entries(self.fk, order), gather_entries(self.fv, order), gather_entries(self.frank, order)
        self.fslot, self.fn = gather_entries(fslot, order).to(self.fslot.dtype), live.sum(-1)

        trash = self.qslot.shape[2] - 1
        qslot = renumber(self.qslot[:, :, :trash], table)
        live = qslot >= 0
        self.qn = live.sum(-1)
        self.q_hi = int(self.qn.max())
        order = left_pack(live, trash)
        self.qslot[:, :, :trash] = gather_entries(qslot, order)  # (cast to the narrow tag type)
        for p in (self.qk, self.qv):
            for name in ("codes", "scale", "zero"):
                buf = getattr(p, name)
                buf[:, :, :trash] = gather_entries(buf[:, :, :trash], order)

    # -- bytes -----------------------------------------------------------------------------------------
    def _entry_bytes(self) -> tuple[int, int]:
        """Bytes of one (token, KV head) entry with its tags: (quantized, full precision)."""
        return entry_bytes(self.keys.shape[-1], self.values.shape[-1], self.qcfg.bits, self.group,
                           self.fk.element_size(), self.qslot.shape[2] - 1)

    def held_bytes(self, slots: int | None = None, row: int | None = None) -> int:
        """K/V bytes held now (one batch row, or all): live quantized entries and live full-precision entries,
        each with its slot tag (and a full-precision entry with its reserve rank), plus the key scales.
        `slots` (the layer's count of stored slots) is not read: the stores count their live entries."""
        quant, full = self._entry_bytes()
        qn, fn = (self.qn, self.fn) if row is None else (self.qn[row], self.fn[row])
        scales = 0 if self.kscale is None else self.kscale[0].numel() * self.kscale.element_size() * \
            (self.kscale.shape[0] if row is None else 1)
        return int(qn.sum()) * quant + int(fn.sum()) * full + scales

    def row_bytes(self) -> torch.Tensor:
        """`held_bytes` of every batch row at once, on the device: [b] long."""
        quant, full = self._entry_bytes()
        scales = 0 if self.kscale is None else self.kscale[0].numel() * self.kscale.element_size()
        return self.qn.sum(-1) * quant + self.fn.sum(-1) * full + scales

    def capacity_bytes(self) -> int:
        """Bytes allocated: every tensor of `held_tensors` (stores, tags, ranks, counters, key scales)."""
        return sum(t.numel() * t.element_size() for t in self.held_tensors())

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps between steps for its K/V (for memory checks)."""
        out = [self.qk.codes, self.qk.scale, self.qk.zero, self.qv.codes, self.qv.scale, self.qv.zero, self.qslot,
               self.qn, self.fk, self.fv, self.fslot, self.frank, self.fn]
        return out + ([self.kscale] if self.kscale is not None else [])

    def precision_map(self, length: int) -> torch.Tensor:
        """Per stored slot 0..length-1: 1 = held in full precision, 0 = quantized, -1 = not held: [b, h, length]."""
        b, h = self.keys.shape[:2]
        out = torch.full((b, h, length + 1), -1, dtype=torch.long, device=self.device)
        for slot, val in ((self.qslot, 0), (self.fslot, 1)):
            idx = torch.where((slot >= 0) & (slot < length), slot, length).long()
            out.scatter_(-1, idx, torch.full_like(idx, val))
        return out[:, :, :length]
