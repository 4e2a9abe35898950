"""What an evicting layer can take back: the last forward's drafts (`crop`, transformers' speculative
decoding drops rejected drafts) and an eviction deferred to a cut inside a forward (`_defer`, `_settle`),
with `vase.hf.verify`'s records; `EvictedStateError` for what it cannot (evicted tokens, beam search).

`CropLayer` is a mixin of `vase.caches.layer.EvictionLayer`: its methods read and write that layer's
bookkeeping (length, seen, pad, limit, storage, query ring, policy state). Stored tensors: [batch, kv_heads,
length, head_dim].
"""

from __future__ import annotations

import torch

from ..core.kernel import keep_index
from ..core.schedule import first_limit, steady_limit
from ..hf.verify import Pending, Snapshot, cut_mask


class EvictedStateError(RuntimeError):
    """An operation that would need evicted tokens back (crop, beam search)."""


class CropLayer:
    """The speculative part of an `EvictionLayer`: crop the last forward, defer and settle an eviction."""

    # -- speculative verification (`vase.hf.verify`) ------------------------------------------------------
    def _defer(self, query: torch.Tensor, kind: str) -> torch.Tensor:
        """Run, inside this forward, the eviction token-by-token decoding runs at the cut, without compacting:
        returns the mask [1, q_heads, q, L] that hides what it drops from the queries at and after the cut."""
        if kind == "flash":
            raise ValueError("speculative decoding across an eviction point needs a per-query mask, which "
                             "flash_attention_2 does not take: load the model with attn_implementation='sdpa' or 'eager'")
        limit, self._defer_at = self._defer_at, None
        cfg, q = self.cfg, query.shape[2]
        pad = self.pad[0]
        first_cut = limit - (self.length - q - pad)  # this forward's tokens before the cut
        window = None
        if cfg.policy.needs_queries:  # the w queries before the cut: the ring's, then this forward's first ones
            window = torch.cat([self.query_window(), query[:, :, :first_cut]], 2)[:, :, -cfg.window:]
        # the row's generator is shared by the layers: every layer rewinds it to where the forward's first
        # deferred selection found it
        start = self.seen - q
        if self.cache.rewind is None or self.cache.rewind[0] != start:
            self.cache.rewind = (start, [g.get_state() for g in self.cache.generators[:1]])
        snapshot = Snapshot.take(self.cache.rewind[1], self.slot_state, self.layer_state, self.state_ready)
        n_cand = limit - cfg.window
        keep = self._select([0], pad, pad + n_cand, queries=window)
        self._pending = Pending(limit=limit, keep=keep, snapshot=snapshot)
        return cut_mask(keep, n_cand, pad, self.length, q, first_cut, query.shape[1])

    def _settle(self) -> None:
        """Apply the deferred eviction when the token at its cut stands (row 0 stores more than `limit` real
        tokens), else drop it and put the policy's state back."""
        pending, self._pending = self._pending, None
        cfg = self.cfg
        pad, real = self.pad[0], self.length - self.pad[0]
        if real <= pending.limit:
            self.state_ready = pending.snapshot.restore(self.cache.generators[:1], self.slot_state, self.layer_state)
            return
        B, w, h = cfg.budget, cfg.window, self.keys.shape[1]
        cut = pad + pending.limit
        head = keep_index(pending.keep, cut, w, cfg.sort_kept, offset=pad)  # as `evict` at the cut
        tail = torch.arange(cut, self.length, device=self.device).expand(1, h, -1)
        self.row_peak_bytes[0] = self.storage.held_bytes(pending.limit, 0)
        self._compact(torch.cat([head, tail], -1), [0])
        self.tokens_evicted += (pending.limit - B) * h
        self.row_evictions[0] += 1
        self.row_peak[0] = max(self.row_peak[0], pending.limit)
        self.limit[0] = steady_limit(B, w)
        self.pad = [0]
        self.length = B + self.length - cut
        self._reschedule()
        self.evictions += 1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' speculative decoding drops rejected drafts;
        a positive value is the legacy form, the length to keep). Only tokens of the last forward can go, none an
        eviction compacted; the query ring gets back the queries of the tokens that stay (`vase.hf.verify`)."""
        if not self.is_initialized:
            return
        n = -tokens_to_remove if tokens_to_remove <= 0 else max(self.seen - tokens_to_remove, 0)
        if n > 0:
            last = self._last
            if last is None or n > last.tokens - 1 or self.seen != last.start + last.tokens or not self.is_croppable:
                raise EvictedStateError(
                    "an evicting cache cannot be cropped: evicted tokens cannot be restored (only the drafts of the "
                    "last forward can be taken back, on storage that holds each slot on its own). Disable "
                    "assisted/speculative decoding, or use method='full'")
            self.length -= n
            self.seen -= n
            self.storage.truncate(self.length)
            if last.queries is not None:  # the ring as before the forward, then the accepted tokens' queries
                if last.ring is None:
                    self.queries.zero_()
                else:
                    self.queries.copy_(last.ring)
                self.queries_seen = last.queries_seen
                self.record_queries(last.queries[:, :, : last.tokens - n])
            self._last = None
            if last.start == 0:  # the prefill's drafts: the cache counts what stands as the prompt
                self.limit = [first_limit(k, self.cfg.budget, self.cfg.window) for k in self.real_lengths()]
            self._reschedule()
        if self._pending is not None:
            self._settle()
