"""The evicting KV cache (`EvictionCache`): a transformers `Cache` whose full-attention layers are
`vase.caches.layer.EvictionLayer`s (owned, preallocated storage with in-place compaction; the speculative
crop and deferred eviction in `vase.caches.crop`), and whose sliding-window and linear-attention layers
stay transformers' own. Built from one validated `vase.core.spec.Request`; holds what the layers share
(the config, the per-row generators, the memoised mask) and the stats. Stored tensors: [batch, kv_heads,
length, head_dim].

`EvictionLayer`, `EvictedStateError` and `CacheConfig` are importable from here as before the split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin,
                                      LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs)

from ..hf.attention import install
from ..hf.masks import causal_padding_mask, real_slots
from ..core.errors import SpecError
from ..hf.hybrid import FULL, LINEAR, is_hybrid, text_config
from ..hf.latent import latent_choosers
from ..core.policies import Policy
from ..core.scalars import plain, plain_items, plain_seed
from ..core.spec import Request, RequestSpec, whole_tokens
from ..storage.protocol import KVStorage
from ..storage.registry import eager_storage
from .crop import EvictedStateError
from .layer import CacheConfig, EvictionLayer

__all__ = ["CacheConfig", "EvictedStateError", "EvictionCache", "EvictionLayer", "kept_layer_bytes"]


class EvictionCache(Cache):
    """A transformers `Cache` that keeps at most `budget + window` KV pairs per layer and KV head.

        cache = vase.EvictionCache(model, method="vase-attnv", budget=512)
        model.generate(**inputs, cache=cache, max_new_tokens=2048)   # past_key_values=cache before 5.24

    method:      a registered method name (see `vase.core.policies`) or a Policy instance.
    budget:      B, KV pairs kept per layer and KV head after an eviction (None for a method that keeps every
                 token, e.g. `full`: it gets `vase.core.spec.placeholder_budget`).
    window:      w, recent tokens never evicted; also the eviction interval and query window.
    seed:        one seed, or one per batch row; row r of an int seed uses seed + r.
    sort_kept:   store kept tokens in position order instead of the policy's order.
    max_length:  prompt + new tokens, to preallocate the `full` cache once (a capacity, not a length cap:
                 generation stops at `max_new_tokens`; a longer sequence grows the cache). Evicting methods hold
                 B + w slots and do not read it.
    storage:     how K/V are held: None (full precision), a registered storage spec (`vase.core.storage_specs`:
                 `Fp8Spec(dtype="fp8")`, ...), or `QuantSpec(bits=8 | 4 | 2,
                 guard=R, ...)`: tokens leaving the window are stored as packed codes, except the R old
                 tokens per KV head ranked first by the value guard's ranking (sinks first); see
                 `vase.storage.quantized` and docs/quantization.md. The keywords kv_bits, quant_guard,
                 quant_group, quant_select, flush_every and quant_key_scale are the same request
                 spelled out (`QuantSpec.from_options`), for callers that pass them with a method's
                 parameters; give one or the other.
    Remaining keyword arguments are the method's parameters.

    Building it installs vase's attention function on `model` (see `vase.hf.attention.install`).
    """

    def __init__(self, model=None, method: str | Policy = "vase-attnv", budget: int | None = 512, window: int = 64, *,
                 seed: int | Sequence[int] = 0, sort_kept: bool = False, max_length: int | None = None,
                 num_layers: int | None = None, storage: object | None = None, **method_params):
        # The one request check of every door (types, method, budget rule, reserves, storage): vase.core.spec (numpy
        # scalars read as the numbers they hold, vase.core.scalars).
        budget, window, sort_kept, max_length = plain(budget), plain(window), plain(sort_kept), plain(max_length)
        seed, method_params = plain_seed(seed), plain_items(method_params)
        req = RequestSpec.of(method, budget, window, seed=seed, storage=storage, **method_params).validate()
        self._build(model, req, sort_kept=sort_kept, max_length=max_length, num_layers=num_layers)

    @classmethod
    def from_request(cls, model, request: Request, *, sort_kept: bool = False, max_length: int | None = None,
                     num_layers: int | None = None) -> EvictionCache:
        """The cache for an already validated `Request` (`RequestSpec(...).validate()`): nothing is parsed again.
        The keyword constructor is the door that builds the Request; this is the way down for callers holding one."""
        if not isinstance(request, Request):
            raise SpecError(f"request must be a vase.core.spec.Request (RequestSpec(...).validate()), got "
                            f"{type(request).__name__}")
        cache = cls.__new__(cls)
        cache._build(model, request, sort_kept=plain(sort_kept), max_length=plain(max_length), num_layers=num_layers)
        return cache

    def _build(self, model, req: Request, *, sort_kept: bool, max_length: int | None, num_layers: int | None) -> None:
        """Build the layers from a validated request (the cache's own keywords are checked here)."""
        policy, budget, window, seed = req.policy, req.budget, req.window, req.seed
        if not isinstance(sort_kept, bool):
            raise SpecError(f"sort_kept must be True or False, got {sort_kept!r} ({type(sort_kept).__name__})")
        if max_length is not None:  # a capacity, so -1 or 2.5 is no size (it was accepted and ignored)
            max_length = whole_tokens("max_length", max_length)
        if model is not None:
            install(model)  # the cache needs vase's attention function to mask and score
            num_layers = model.config.get_text_config().num_hidden_layers
        if num_layers is None:
            raise ValueError("pass the model (or num_layers) so the cache knows how many layers to hold")
        #: per layer: `full_attention` (evicted here) or the layer type whose own transformers cache layer is kept
        self.layer_types: list[str] = [FULL] * num_layers
        self._layer_kwargs: list[dict] = [{}] * num_layers
        if model is not None and is_hybrid(model.config):  # `install` refused the mixes vase cannot run
            self.layer_types, self._layer_kwargs = get_layer_types_and_kwargs(text_config(model.config))
        self.cfg = CacheConfig(policy=policy, budget=budget, window=window, sort_kept=sort_kept,
                               max_length=max_length)
        self.seed = seed
        self.generators: list[torch.Generator] | None = None
        #: (tokens seen before a verification forward, row 0's generator state then): see `EvictionLayer._defer`
        self.rewind: tuple[int, list[torch.Tensor]] | None = None
        self._mask_memo: tuple | None = None
        #: the storage's validated configuration (QuantConfig, Fp8Config, ...); None: full precision (`DenseStorage`)
        self.storage_config = req.storage_config
        #: MLA layers (`vase.hf.latent`): layer index -> the chooser scoring the heads' up-projections of the latent
        self.latent = latent_choosers(model, policy, req.storage_config)
        super().__init__(layers=[self._new_layer(i) for i in range(num_layers)])

    def _new_layer(self, i: int) -> CacheLayerMixin | LinearAttentionCacheLayerMixin:
        """Layer i's cache: vase's evicting layer for full attention, else transformers' own layer for its type
        (the sliding window's `DynamicSlidingWindowLayer`, the linear attention's `LinearAttentionLayer`), so
        the model runs those layers exactly as with its DynamicCache."""
        if self.layer_types[i] == FULL:
            return EvictionLayer(self, i)
        return DYNAMIC_LAYER_TYPE_MAPPING[self.layer_types[i]](**self._layer_kwargs[i])

    @property
    def evicting_layers(self) -> list[EvictionLayer]:
        """The full-attention layers, the ones vase evicts (every layer of a non-hybrid model)."""
        return [l for l in self.layers if isinstance(l, EvictionLayer)]

    @property
    def kept_layers(self) -> list:
        """The sliding-window and linear-attention layers, left to transformers' own cache layers."""
        return [l for l in self.layers if not isinstance(l, EvictionLayer)]

    @property
    def needs_padding_mask(self) -> bool:
        """Whether every forward needs the model's 2-D padding mask: transformers' sliding layers mask left
        padding from it at each step (vase's own layers learn the padding once, at the prefill)."""
        return any(t != FULL and t != LINEAR for t in self.layer_types)

    @property
    def policy(self) -> Policy:
        return self.cfg.policy

    @property
    def quant(self):
        """The old name of `storage_config` (any storage's configuration, not only the quantized one's)."""
        return self.storage_config

    def new_storage(self, layer_idx: int) -> KVStorage:
        """The empty K/V storage of layer `layer_idx` (allocated at its first update)."""
        return eager_storage(self.storage_config, self.cfg.window, layer_idx)  # by the storage registry (`vase.storage.registry`)

    def ensure_generators(self, batch: int, device: torch.device) -> None:
        """One generator per batch row, seeded from the user seed (row r: seed + r, or seed[r])."""
        if self.generators is not None:
            return
        seeds = list(self.seed) if isinstance(self.seed, Sequence) else [self.seed + r for r in range(batch)]
        if len(seeds) != batch:
            raise ValueError(f"got {len(seeds)} seeds for a batch of {batch} rows")
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        for layer in self.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):  # transformers' linear layer has no row selection
                _select_state_rows(layer, rows)
            else:
                layer.batch_select_indices(indices)
        if self.generators is not None:
            self.generators = [self.generators[r] for r in rows]
        self._mask_memo = None

    def reset(self) -> None:
        """Empty the cache for a new generation: same method, budget, window and seeds, nothing stored."""
        super().reset()
        # transformers' reset zeroes a sliding layer's tensors but keeps their length: start those afresh
        self.layers = [l if isinstance(l, EvictionLayer) else self._new_layer(i) for i, l in enumerate(self.layers)]
        self.generators = None
        self.rewind = None
        self._mask_memo = None

    # transformers' `generate` marks a cache the caller passed in at the start of every call. A filled
    # cache would silently carry the previous generation's context into the new one: refuse it.
    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        filled = [layer for layer in self.evicting_layers if layer.is_initialized]
        if value and filled:
            raise EvictedStateError(
                f"this EvictionCache already holds a generation ({filled[0].seen} tokens): it is one-shot; build "
                f"a new EvictionCache for each generate call, or call cache.reset() first")
        self.__dict__["_user_defined"] = value

    def attention_mask(self, layer: EvictionLayer, q_len: int, dtype: torch.dtype, kind: str):
        """The mask for `q_len` new queries over `layer`'s stored slots, in the form `kind` of
        `vase.hf.masks` ([b, 1, q_len, L] bool/additive, or [b, L] for flash); None when nothing is
        masked. Memoised across layers (they share lengths and padding)."""
        pad = layer.pad or []
        L = layer.length
        if q_len == 1 and not any(pad):  # the decode hot path: nothing to mask
            return None
        key = (L, q_len, tuple(pad), dtype, kind)
        if self._mask_memo is not None and self._mask_memo[0] == key:
            return self._mask_memo[1]
        real = real_slots(pad, L, layer.device) if any(pad) else None
        mask = causal_padding_mask(real, q_len, L, kind, dtype, layer.device)
        self._mask_memo = (key, mask)
        return mask

    def row_stats(self) -> list[dict]:
        """Per batch row (current rows): evictions and the K/V bytes it holds now, at its peak, and in full.

        The peak is the bytes held at the row's peak stored length (just before its first eviction, else now).
        With quantized storage a row also has ``kv_byte_steps``: the evicting layers' bytes held after each
        write after the prompt (one per decode step), summed (the eval's time-averaged K/V).

        Every layer counts: an evicting layer its stored real tokens, a sliding layer the real tokens of its
        window, a linear-attention layer its state (the same in a full cache: only the evicting layers differ)."""
        layers = [l for l in self.evicting_layers if l.is_initialized and l.pad is not None]
        if not layers:
            return []
        rows = []
        for r in range(len(layers[0].pad)):
            now = peak = full = 0
            steps: int | None = 0
            for l in layers:
                per_token = l.keys.shape[1] * (l.keys.shape[3] + l.values.shape[3]) * l.keys.element_size()
                held = l.held_bytes(r)
                now += held
                # the peak stored length is reached just before the first eviction (else it is now)
                peak += l.row_peak_bytes[r] if l.row_evictions[r] else held
                full += (l.seen - l.row_pad0[r]) * per_token
                own = l.step_bytes  # quantized storage: bytes summed over the decode steps
                steps = None if own is None or steps is None else steps + int(own[r])
            bounded = sum(kept_layer_bytes(k, r, layers[0].seen - layers[0].row_pad0[r]) for k in self.kept_layers)
            row = {"evictions": layers[0].row_evictions[r], "kv_bytes": now + bounded,
                   "kv_bytes_peak": peak + bounded, "kv_bytes_full": full + bounded}
            if steps is not None:  # the evicting layers' own (a schedule cannot tell which exact entries survived)
                row["kv_byte_steps"] = steps
            rows.append(row)
        return rows

    def stats(self) -> dict:
        """Counters that prove what happened: evictions, evicted tokens, lengths and bytes.

        Counters and lengths are the evicting (full-attention) layers'; the bytes count every layer, the
        sliding and linear-attention layers' own caches included (`kv_bytes_kept`, the same in a full cache)."""
        layers = [l for l in self.evicting_layers if l.is_initialized]
        kept = sum(kept_layer_bytes(k) for k in self.kept_layers)
        if not layers:
            return {"method": self.policy.name, "budget": self.cfg.budget, "window": self.cfg.window,
                    "evictions": 0, "tokens_evicted": 0, "kv_bytes": kept, "kv_bytes_capacity": kept,
                    "kv_bytes_full": kept, "kv_bytes_kept": kept, "stored_length": 0, "seen_length": 0,
                    "capacity": 0}

        def kv_bytes(l: EvictionLayer, length: int) -> int:
            b, h, _, d = l.keys.shape
            return b * h * length * (d + l.values.shape[3]) * l.keys.element_size()

        first = layers[0]
        return {
            "method": self.policy.name,
            "budget": self.cfg.budget,
            "window": self.cfg.window,
            "evictions": first.evictions,
            "layer_evictions": sum(l.evictions for l in layers),
            "tokens_evicted": first.tokens_evicted,
            "stored_length": first.length,
            "seen_length": first.seen,
            "capacity": first.capacity,
            "kv_bytes": sum(l.held_bytes() for l in layers) + kept,
            "kv_bytes_capacity": sum(l.capacity_bytes() for l in layers) + kept,
            "kv_bytes_full": sum(kv_bytes(l, l.seen) for l in layers) + kept,
            "kv_bytes_kept": kept,
        }


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def kept_layer_bytes(layer, row: int | None = None, real_seen: int | None = None) -> int:
    """Bytes one transformers cache layer that vase does not evict holds: a sliding layer's K/V (its last
    `window - 1` tokens), a linear-attention layer's conv and recurrent states. `row`: that batch row's
    share (a sliding layer then counts only its real tokens, `real_seen` of them seen by the row)."""
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
        total = sum(_tensor_bytes(t) for t in states)
        if row is None or total == 0:
            return total
        return total // next(t.shape[0] for t in states if isinstance(t, torch.Tensor))
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if row is None or not isinstance(keys, torch.Tensor):
        return _tensor_bytes(keys) + _tensor_bytes(values)
    per_token = (keys[0, :, :1].numel() + values[0, :, :1].numel()) * keys.element_size()
    held = keys.shape[2] if real_seen is None else min(keys.shape[2], real_seen)
    return held * per_token


def _select_state_rows(layer: LinearAttentionCacheLayerMixin, rows: list[int]) -> None:
    """Keep the batch rows `rows` of a linear-attention layer's conv and recurrent states."""
    for states in (layer.conv_states, layer.recurrent_states):
        for i, t in states.items():
            if isinstance(t, torch.Tensor):
                states[i] = t[rows]
