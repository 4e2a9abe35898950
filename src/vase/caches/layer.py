"""One evicting cache layer (`EvictionLayer`): owned, preallocated storage with in-place compaction.

Each layer owns K/V buffers of capacity `max(P, B) + w` slots, allocated once at prefill
(P = prompt length, B = budget, w = window). Tokens are written in place; when the stored
length reaches `B + w`, the next update first evicts down to `B` (the policy keeps `B - w`
of the older candidates, the `w` most recent stay) by compacting survivors to the front
of the same buffers. Stored tensors: [batch, kv_heads, length, head_dim].

When each row evicts follows `vase.core.schedule` (the same pure functions the vLLM plugin uses);
the policy's own state (per-slot and per-layer) is kept through the hooks documented on
`vase.core.policies.Policy`, with no policy-specific code here. The K/V themselves live in the
layer's `storage`, one `vase.storage.protocol.KVStorage` the storage registry (`vase.storage.registry`) builds from
the cache's `storage` argument: `DenseStorage` (full precision), or `vase.storage.quantized.QuantStorage`
(packed low-bit codes). The eviction itself is the one kernel of every engine (`vase.core.kernel`), the
query window the one ring (`vase.core.ring`).

Logical length (tokens seen, used for positions) and physical length (slots stored, used
for masks) are kept apart. Left padding is owned here: row r's first `pad[r]` slots are
padding; eviction keeps them at the front (and drops them once the row has enough real
tokens), and the registered attention function (`vase.hf.attention`) masks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

# The side channel to the attention function (PENDING_LAYER) lives in vase.hf.attention; the
# layer sets it in `update`, the attention function calls `attention_mask_for` on that layer.
from ..hf.attention import PENDING_LAYER
from ..hf.masks import and_selection
from ..core.kernel import choose, compact_slots, keep_index
from ..core.ring import new_ring, ring_read, ring_write
from ..core.policies import Policy
from ..core.policy_state import draw_layer_state, ensure_slot_state
from ..core.schedule import first_limit, must_evict, room, steady_limit
from ..storage.protocol import KVStorage
from ..hf.verify import LastForward, Pending
from .crop import CropLayer, EvictedStateError


@dataclass
class CacheConfig:
    """What every layer of one cache shares."""

    policy: Policy
    budget: int
    window: int
    sort_kept: bool
    max_length: int | None


class EvictionLayer(CropLayer, CacheLayerMixin):
    """One layer's buffers and bookkeeping.

    Row r stores `pad[r]` padding slots, then its real tokens; the physical length `length`
    is the longest row. Each row evicts on its own schedule (when its real tokens reach
    `max(P_r, B) + w`, then `B + w`), so a row behaves exactly as it would alone.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "EvictionCache", layer_idx: int):
        self.storage: KVStorage = cache.new_storage(layer_idx)  # first: the base class sets keys/values
        super().__init__()
        self.cache = cache
        self.cfg = cache.cfg
        self.layer_idx = layer_idx
        self.length = 0  # physical: slots stored (the longest row)
        self.seen = 0  # logical: tokens seen, padding included
        self.pad: list[int] | None = None  # leading padding slots per row, None until the first forward
        self.limit: list[int] = []  # per row: evict before its real tokens would pass this
        self.until_evict = 1 << 62  # tokens every row can still take before some row must evict
        self.positions: torch.Tensor | None = None  # [b, kv_heads, capacity] sequence index of each slot, -1 = pad
        self.queries: torch.Tensor | None = None  # [b, q_heads, w, d] ring buffer of post-RoPE queries
        self.queries_seen = 0
        self.slot_state: dict[str, torch.Tensor] = {}
        self.layer_state: dict[str, torch.Tensor] = {}  # the policy's per-layer state, batch on dim 0
        self.state_ready: list[bool] = []  # per row: layer_state holds its rows (drawn before its first eviction)
        self.evictions = 0
        self.tokens_evicted = 0
        self.row_evictions: list[int] = []  # per row, for per-sequence stats
        self.row_peak: list[int] = []  # per row: most real tokens ever stored
        # per row: bytes held just before its first eviction, at its peak stored length (quantized storage
        # holds those tokens as codes and exact entries, so the peak is not the peak length x dense bytes)
        self.row_peak_bytes: list[int] = []
        # [b] long, quantized storage only: bytes held after each write after the prompt (a decode step writes
        # one token), summed on the device (no sync per step). Which exact entries survive an eviction is the
        # policy's choice, so the eval's time-averaged bytes of an evicting quantized cache come from here.
        self.step_bytes: torch.Tensor | None = None
        self.row_pad0: list[int] = []  # per row: padding of the prompt (seen - pad0 = real tokens seen)
        self.awaiting_attention = False
        self._served: tuple | None = None  # (data_ptr, shape) of the K the last `update` returned
        # speculative verification (`vase.hf.verify`): the last multi-token forward, for a crop of its tokens; the
        # eviction point inside the current forward (real tokens stored at the cut); a deferred eviction
        self._last: LastForward | None = None
        self._defer_at: int | None = None
        self._pending: Pending | None = None

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can remove the last forward's tokens (the storage holds each slot on its own)."""
        return hasattr(self.storage, "truncate")

    # -- storage -------------------------------------------------------------------------------
    # transformers' CacheLayerMixin protocol has `keys` / `values` attributes: they are the storage's
    # ([b, kv_heads, capacity, d]; a zero-stride shape carrier for the quantized storage).
    @property
    def keys(self) -> torch.Tensor | None:
        return self.storage.keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self.storage.keys = value

    @property
    def values(self) -> torch.Tensor | None:
        return self.storage.values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self.storage.values = value

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, q, _ = key_states.shape
        cfg = self.cfg
        if cfg.policy.evicts:
            capacity = first_limit(q, cfg.budget, cfg.window)  # the prompt, or B, and a window to decode into
        else:
            capacity = max(q, cfg.max_length or 0) or 2 * q
        self.device = key_states.device
        self.storage.allocate(key_states, value_states, capacity)
        self.positions = torch.full((b, h, capacity), -1, dtype=torch.long, device=self.device)
        ensure_slot_state(cfg.policy, self.slot_state, b, h, capacity, self.device)
        self.is_initialized = True
        self.cache.ensure_generators(b, self.device)

    def _grow(self, needed: int) -> None:
        """Only the full cache grows (amortised doubling) when no max_length was given."""
        new_cap = max(needed, 2 * self.capacity)
        self.storage.grow(new_cap, self.length)
        pos = torch.full((*self.positions.shape[:2], new_cap), -1, dtype=torch.long, device=self.device)
        pos[..., : self.length] = self.positions[..., : self.length]
        self.positions = pos
        for name, state in self.slot_state.items():
            grown = state.new_zeros(*state.shape[:2], new_cap)
            grown[..., : self.length] = state[..., : self.length]
            self.slot_state[name] = grown

    def real_lengths(self) -> list[int]:
        """Real (non-padding) tokens stored per row."""
        return [self.length - p for p in (self.pad or [0] * self.keys.shape[0])]

    def _reschedule(self) -> None:
        reals = self.real_lengths()
        self.until_evict = min(room(n, lim) for lim, n in zip(self.limit, reals))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `key_states`/`value_states` [b, kv_heads, q, d]; return what is stored [b, kv_heads, L, d].

        First evicts the rows whose real tokens would pass their limit (`B + w` once decoding).
        """
        if self.awaiting_attention:
            raise RuntimeError(
                f"layer {self.layer_idx} updated the cache but never called the attention function: this model's "
                "attention does not go through transformers' AttentionInterface, so vase cannot mask or score it")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"batch of {key_states.shape[0]} rows fed to a cache holding {self.keys.shape[0]}")
        if self._pending is not None:  # the forward before this one was never cropped: all its tokens stand
            self._settle()
        q = key_states.shape[2]
        cfg = self.cfg
        self._last = None
        if cfg.policy.evicts and q > self.until_evict:
            reals = self.real_lengths()
            due = [r for r, n in enumerate(reals) if must_evict(n, q, self.limit[r], cfg.budget)]
            if due and len(reals) == 1 and reals[0] < self.limit[0] and self.is_croppable:
                # the eviction point falls after this forward's first token: defer it (`vase.hf.verify`)
                if reals[0] + q > self.limit[0] + cfg.window:
                    raise ValueError(f"cannot feed {q} tokens in one forward here: at most w + 1 = {cfg.window + 1} "
                                     f"fit one eviction point (set prompt_lookup_num_tokens / num_assistant_tokens "
                                     f"<= w = {cfg.window})")
                self._defer_at = self.limit[0]
            elif due:
                self.evict(due)
        end = self.length + q
        if end > self.capacity:
            if cfg.policy.evicts and self._defer_at is None:
                raise ValueError(f"cannot append {q} tokens at once after prefill: at most the window "
                                 f"({cfg.window}) fits between evictions; feed fewer tokens per call")
            self._grow(end)
        if q > 1:  # a crop may take these tokens back (assisted decoding's prefill carries the first drafts too)
            ring = self.queries.clone() if self.queries is not None else None
            self._last = LastForward(start=self.seen, tokens=q, ring=ring, queries_seen=self.queries_seen,
                                     queries=None)
        self.storage.write(key_states, value_states, self.length, end)
        if q == 1:  # the decode hot path: a scalar fill instead of a new arange
            self.positions[:, :, self.length].fill_(self.seen)
        else:
            self.positions[:, :, self.length:end] = torch.arange(self.seen, self.seen + q, device=self.device)
        for state in self.slot_state.values():
            state[:, :, self.length:end] = 0
        self.length, self.seen = end, self.seen + q
        self.until_evict -= q
        self.awaiting_attention = True
        PENDING_LAYER.set(self)
        if self.pad is not None:  # the new slots' positions are final (the prompt's wait for its padding)
            self.storage.commit(self.positions, self.row_pad0, prompt=False)
            if self.step_bytes is not None:
                self.step_bytes += self.storage.row_bytes()
        stored = self.storage.read(end)
        self._served = (stored[0].data_ptr(), stored[0].shape)  # what the attention call must receive
        return stored

    def serves(self, key: torch.Tensor) -> bool:
        """Whether `key` [b, kv_heads, L, d] is the K this layer's last `update` returned (by storage and shape; an
        MLA layer's attention gets the heads' keys up-projected from it: by batch and length)."""
        if self.layer_idx in self.cache.latent:
            return self._served is not None and (key.shape[0], key.shape[2]) == (self._served[1][0], self._served[1][2])
        return self._served == (key.data_ptr(), key.shape)

    def held_bytes(self, row: int | None = None) -> int:
        """K/V bytes held now (the storage's own count): one row's real tokens, or every stored slot of every row."""
        return self.storage.held_bytes(self.length - self.pad[row] if row is not None else self.length, row)

    def capacity_bytes(self) -> int:
        """K/V bytes allocated (the storage's own count)."""
        return self.storage.capacity_bytes()

    def room(self) -> int:
        """How many tokens one update can take, evicting exactly as token-by-token decoding would (batch of 1)."""
        if not self.cfg.policy.evicts:
            return 1 << 30
        return self.until_evict if self.until_evict > 0 else self.cfg.window

    # -- what the attention function reports ----------------------------------------------------
    def observe_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Learn each row's left padding from the 2-D mask of the first forward ([b, seen])."""
        if self.pad is not None:
            return
        b = self.keys.shape[0]
        if attention_mask is None or attention_mask.dim() != 2:
            self.pad = [0] * b
        else:
            mask = attention_mask[:, -self.seen:].bool()
            pads = (~mask).sum(-1)
            # Left padding only: every row must be [pads..., tokens...].
            expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= pads[:, None]
            if not torch.equal(expected, mask):
                raise ValueError("vase caches need left padding (tokenizer.padding_side = 'left') and no holes in "
                                 "the attention mask")
            self.pad = pads.tolist()
            self.positions[:, :, : self.length].masked_fill_(~mask[:, None, : self.length].to(self.device), -1)
        w, B = self.cfg.window, self.cfg.budget
        self.limit = [first_limit(n, B, w) for n in self.real_lengths()]
        self.row_evictions = [0] * b
        self.row_peak = [0] * b
        self.row_peak_bytes = [0] * b
        self.step_bytes = torch.zeros(b, dtype=torch.long, device=self.device) \
            if hasattr(self.storage, "row_bytes") else None
        self.row_pad0 = list(self.pad)
        self.state_ready = [False] * b
        self._reschedule()
        self.storage.commit(self.positions, self.row_pad0, prompt=True)

    def record_queries(self, query: torch.Tensor) -> None:
        """Keep the last `w` post-RoPE queries [b, q_heads, q, d] in a ring buffer."""
        if self.queries is None:  # the one query ring of every engine (`vase.core.ring`)
            b, hq, _, d = query.shape
            self.queries = new_ring(b, hq, self.cfg.window, d, query)
        ring_write(self.queries, self.queries_seen, query)
        self.queries_seen += query.shape[2]

    def query_window(self) -> torch.Tensor:
        """The recorded queries in time order: [b, q_heads, min(seen, w), d]."""
        return ring_read(self.queries, self.queries_seen)

    def selection_mask(self, query: torch.Tensor) -> torch.Tensor | None:
        """What a selection policy (Quest) lets the `q` new queries [b, q_heads, q, d] attend:
        bool [b, q_heads, q, L] over the stored slots, or None (other policies, and the dense prefill)."""
        policy = self.cfg.policy
        q = query.shape[2]
        if not policy.selects or self.seen == q:  # the first forward is the prefill
            return None
        if policy.attends_densely(self.layer_idx):
            return None
        b, h_q = query.shape[:2]
        L, h_kv = self.length, self.keys.shape[1]
        pads = self.pad or [0] * b
        if L - min(pads) <= self.cfg.budget:  # every row sees at most B tokens: nothing to restrict
            return None
        mask = torch.zeros(b, h_kv, q, L, dtype=torch.bool, device=query.device)
        for p in sorted(set(pads)):  # rows with the same left padding share page alignment
            rows = [r for r in range(b) if pads[r] == p]
            mask[rows, :, :, p:] = policy.attend_mask(self.keys[rows, :, p:L], query[rows], L - p - q,
                                                      self.cfg.budget, self.cfg.window)
        return mask.repeat_interleave(h_q // h_kv, dim=1)

    def attention_mask_for(self, query: torch.Tensor, attention_mask: torch.Tensor | None, kind: str):
        """The one call vase's attention function makes, right after this layer's `update`.

        query: post-RoPE [b, q_heads, q, d]; attention_mask: the model's 2-D padding mask [b, seen]
        (read once, at the first forward) or None; kind: the kernel's mask form (`vase.hf.masks`).
        Records the query window when the policy scores by attention and returns the mask over
        the stored slots (None when nothing is masked)."""
        self.awaiting_attention = False
        if self.pad is None:
            self.observe_padding(attention_mask)
        selected = self._defer(query, kind) if self._defer_at is not None else None
        if self.cfg.policy.needs_queries:
            if self._last is not None:
                self._last.queries = query
            self.record_queries(query)
        mask = self.cache.attention_mask(self, query.shape[2], query.dtype, kind)
        quest = self.selection_mask(query)  # Quest: per-step page selection, else None
        if quest is not None:
            selected = quest if selected is None else selected & quest
        if selected is not None:
            mask = and_selection(mask, selected, kind, query.dtype)
        return self.storage.attention_mask(mask, query, kind, self.length)

    # -- eviction ---------------------------------------------------------------------------------
    def evict(self, due: list[int]) -> None:
        """Bring rows `due` down to B real tokens, compacting every row's slots in place."""
        cfg, policy = self.cfg, self.cfg.policy
        L, w, B = self.length, cfg.window, cfg.budget
        b, h = self.keys.shape[:2]
        device = self.device
        if policy.needs_queries and self.queries is None:
            raise RuntimeError("this policy scores by attention but no queries were recorded: the model must run "
                               "with vase's attention function (EvictionCache installs it)")
        reals = self.real_lengths()
        new_reals = [B if r in due else n for r, n in enumerate(reals)]
        new_len = max(new_reals)
        # Rows that do not evict keep their last new_len slots (all their real tokens).
        index = torch.arange(L - new_len, L, device=device).expand(b, h, new_len).clone()
        by_pad: dict[int, list[int]] = {}
        for r in due:
            by_pad.setdefault(self.pad[r], []).append(r)
        for p, rows in by_pad.items():  # one eviction kernel for every engine (`vase.core.kernel`)
            index[rows, :, new_len - B:] = keep_index(self._select(rows, p, L - w), L, w, cfg.sort_kept, offset=p)
        for r in due:
            if self.row_evictions[r] == 0:  # the first eviction runs at the row's peak stored length
                self.row_peak_bytes[r] = self.held_bytes(r)
        self.pad = [new_len - n for n in new_reals]
        self._compact(index, self.pad)
        for r in due:
            self.tokens_evicted += (reals[r] - B) * h
            self.row_evictions[r] += 1
            self.row_peak[r] = max(self.row_peak[r], reals[r])
            self.positions[r, :, : self.pad[r]] = -1
            self.limit[r] = steady_limit(B, w)
        self.length = new_len
        self._reschedule()
        self.evictions += 1

    def _select(self, rows: list[int], pad: int, n_cand: int, queries: torch.Tensor | None = None) -> torch.Tensor:
        """Ask the policy which real candidates (slots pad..n_cand-1) of `rows` to keep: [len(rows), h, B - w].

        Padding never reaches the policy: it sees real tokens only, sinks first. `queries`: the window
        [len(rows), q_heads, w, d] when it is not the ring's (a deferred eviction's)."""
        cfg, policy = self.cfg, self.cfg.policy
        sel = rows if len(rows) < self.keys.shape[0] else slice(None)
        keys, values = self.storage.candidates(sel, pad, n_cand, self.length)
        if policy.needs_queries and queries is None:
            queries = self.query_window()[sel]
        generators = [self.cache.generators[r] for r in rows] if policy.stochastic else None
        extra = {name: state[sel, :, pad:n_cand] for name, state in self.slot_state.items()}
        self._init_layer_state(rows)
        extra.update({name: state[sel] for name, state in self.layer_state.items()})
        chooser = self.cache.latent.get(self.layer_idx, choose)  # MLA: one kept set for every head (`vase.hf.latent`)
        keep = chooser(policy, keys, values, queries, cfg.budget, cfg.window, generators, extra)
        if isinstance(sel, list):  # advanced indexing copied the state: write updates back
            for name, state in self.slot_state.items():
                state[rows, :, pad:n_cand] = extra[name]
        return keep

    def _init_layer_state(self, rows: list[int]) -> None:
        """Draw the policy's per-layer state for the rows of `rows` evicting for the first time (hook 2 of Policy)."""
        b, h, _, d = self.keys.shape
        draw_layer_state(self.cfg.policy, self.layer_state, self.state_ready, rows, self.cache.generators, b, h, d,
                         self.device)

    def _compact(self, index: torch.Tensor, pad: list[int]) -> None:
        """Move the slots `index` [b, h, n] to the front of the storage and of every per-slot buffer, in place;
        `pad`: each row's padding slots after the move (their content is never read)."""
        self.storage.compact(index, pad)
        for buf in (self.positions, *self.slot_state.values()):
            compact_slots(buf, index)

    # -- the transformers Cache layer interface --------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise EvictedStateError("beam search is not supported with an evicting cache (each beam would need its "
                                "own evicted history): use sampling or greedy decoding (num_beams=1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            raise EvictedStateError("cannot expand a filled evicting cache; expand the inputs before the first "
                                    "forward instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices` (drop finished rows)."""
        if not self.is_initialized:
            return
        rows = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        self.storage.take_rows(rows)
        self.positions = self.positions[rows]
        self.slot_state = {k: v[rows] for k, v in self.slot_state.items()}
        self.layer_state = {k: v[rows] for k, v in self.layer_state.items()}
        if self.step_bytes is not None:
            self.step_bytes = self.step_bytes[rows]
        if self.queries is not None:
            self.queries = self.queries[rows]
        if self.pad is not None:
            self.pad = [self.pad[r] for r in rows]
            for name in ("limit", "row_evictions", "row_peak", "row_peak_bytes", "row_pad0", "state_ready"):
                setattr(self, name, [getattr(self, name)[r] for r in rows])
            shift = min(self.pad)
            if shift:  # the longest row left: drop the padding columns every remaining row has
                index = torch.arange(shift, self.length, device=self.device).expand(*self.keys.shape[:2], -1)
                self.pad = [p - shift for p in self.pad]
                self._compact(index, self.pad)
                self.length -= shift
            self._reschedule()
