"""A fixed-shape evicting cache whose decode step (eviction included) compiles.

`StaticEvictionCache` holds, per layer, buffers of one shape for its whole life:

    keys, values:  [batch, kv_heads, B + w, head_dim]
    positions:     [batch, kv_heads, B + w]   sequence index of each slot (-1 = empty)
    length:        [batch] long tensor        slots in use per row (row r's are 0 .. length[r] - 1)
    queries:       [batch, q_heads, w, head_dim] ring buffer of the last w post-RoPE queries

Row r's real tokens sit at the front (no padding is stored); attention reads all B + w slots
under the mask `slot < length[r]`. A row evicts when its length is B + w: the policy keeps
B - w of its first B slots, the w most recent stay, and one fixed-size gather (B + w slots out
of B + w, the kept ones first) compacts them: no shape depends on the step. Rows due at the
same step evict together; the others pass through the gather unchanged (`torch.where`).

The step comes in two variants (`evicting` False / True; with quantized storage each also with
`flushing`, the storage's flush every `flush_every` tokens), each one graph; the host picks the
variant from the schedule (`vase.core.schedule`: it knows each row's length without reading the
device), so neither recompiles as the sequence grows and an eviction is no graph break.
Random draws of stochastic policies (sampling, VaSE-DKV's projection) are made on the host
with each row's own generator, in the order the eager cache draws them, into fixed buffers
the step reads (`NoiseReplay`): the compiled step keeps the eager cache's kept sets.

It is built from an `EvictionCache` once every row is in the steady schedule (limit B + w:
right after the prefill when the prompt is at most B tokens, else after the row's first
eviction, which runs eagerly): `StaticEvictionCache.from_eager(cache)`.
The K/V live in one fixed-shape store (`vase.storage.static`): dense, or packed low-bit codes with
a full-precision reserve (`kv_bits`, the same stores and rules as `vase.storage.quantized.QuantStorage`).
Selection methods (Quest) and `full` have no static form here; nor does the reserve's random
control (`quant_select="random"`).
"""

from __future__ import annotations


import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.utils import is_torch_greater_or_equal

from ..hf.attention import KERNELS, STATIC_PREFIX, stock_kernel, base_kernel
from .eager import EvictionCache, EvictionLayer
from ..core.kernel import choose, compact_slots, keep_index
from ..core.ring import new_ring, ring_read, ring_write
from ..core.policy_state import draw_layer_state
from .noise_replay import NoiseReplay, Recorder, fill
from ..storage.static import front_index
from ..storage.registry import static_refusal, static_store

#: the cache whose layers the static attention function reads (set by `activate`)
_ACTIVE: list[StaticEvictionCache | None] = [None]


class CompileUnsupportedError(ValueError):
    """A configuration the compiled decode step does not run."""


def check_no_kept_layers(cache: EvictionCache) -> None:
    """Refuse a hybrid model's cache: the static buffers hold full-attention layers only (`vase.hf.hybrid`)."""
    other = sorted({t for t in cache.layer_types if t != "full_attention"})
    if other:
        raise CompileUnsupportedError(f"compile=True has no static form for {', '.join(other)} layers (this model "
                                      f"is hybrid): use compile=False, which evicts its full-attention layers")


def check_compilable(cache: EvictionCache, kernel: str) -> None:
    """Raise CompileUnsupportedError (one line saying what to change) when `cache` has no static form."""
    check_no_kept_layers(cache)
    if cache.latent:  # `vase.hf.latent`: the static step has no shared-heads chooser
        raise CompileUnsupportedError("compile=True has no static form for multi-head latent attention (MLA): use "
                                      "compile=False, which evicts its latent cache")
    policy = cache.policy
    refusal = static_refusal(cache.storage_config)  # the storage's own (`vase.storage.registry`)
    if refusal:
        raise CompileUnsupportedError(refusal)
    if not policy.evicts and not policy.selects and cache.storage_config is not None:  # the quantized one: the others
        # have no static form and were refused above; name the storage, not only the method
        raise CompileUnsupportedError(f"method {policy.name!r} with kv_bits={cache.storage_config.bits} has no compiled form: "
                                      f"compile=True runs {policy.name!r} through transformers' StaticCache, which "
                                      f"holds K/V in full precision; drop kv_bits, or use compile=False (the eager "
                                      f"cache quantizes)")
    if not policy.evicts or policy.selects:
        raise CompileUnsupportedError(f"method {policy.name!r} has no static evicting form: compile=True supports "
                                      f"the evicting methods (and 'full' through transformers' StaticCache)")
    if kernel not in ("sdpa", "eager"):
        raise CompileUnsupportedError(f"compile=True needs attn_implementation 'sdpa' or 'eager', not {kernel!r}")


# -- one layer ---------------------------------------------------------------------------------------
class StaticLayer(CacheLayerMixin):
    """One layer's fixed buffers (see the module docstring); built by `from_eager`."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: StaticEvictionCache, src: EvictionLayer):
        super().__init__()
        self.cache, self.cfg, self.layer_idx = cache, cache.cfg, src.layer_idx
        B, w = self.cfg.budget, self.cfg.window
        cap = B + w
        b, h = src.keys.shape[:2]
        d = src.keys.shape[3]
        device = src.keys.device
        pads = torch.tensor(src.pad, device=device)
        reals = src.length - pads
        if int(reals.max()) > cap:
            raise RuntimeError(f"layer {src.layer_idx} stores {int(reals.max())} tokens in a row, more than B + w "
                               f"= {cap}: convert only once every row is in the steady schedule")
        # Row r's real slots pad[r] .. length-1 move to the front; slots past its length are never read.
        index = front_index(pads, cap, src.capacity, h)
        self.store = static_store(src.cache.quant, src.storage, index, pads, src.row_pad0, cap)  # `vase.storage.registry`
        valid = torch.arange(cap, device=device)[None, None, :] < reals[:, None, None]
        self.positions = src.positions.gather(2, index).masked_fill(~valid, -1).contiguous()
        self.slot_state = {k: v.gather(2, index).masked_fill(~valid, 0).contiguous()
                           for k, v in src.slot_state.items()}
        self.length = reals.to(torch.long).clone()
        self.seen = torch.tensor(src.seen, dtype=torch.long, device=device)
        hq = cache.q_heads
        if src.queries is not None:
            self.queries = src.queries.clone()
        else:
            self.queries = new_ring(b, hq, w, d, src.keys)
        self.queries_seen = torch.tensor(src.queries_seen, dtype=torch.long, device=device)
        self.layer_state = {k: v.clone() for k, v in src.layer_state.items()}
        self.state_ready = list(src.state_ready)
        self.noise: list[torch.Tensor] = []
        self.device = device
        self.is_initialized = True
        # host mirrors (the schedule): no device reads in the decode loop
        self.host_length = reals.tolist()
        self.host_seen = src.seen
        self.evictions = src.evictions
        self.tokens_evicted = src.tokens_evicted
        self.row_evictions = list(src.row_evictions)
        self.row_peak = list(src.row_peak)
        self.row_peak_bytes = list(src.row_peak_bytes)  # as `EvictionLayer.row_peak_bytes`
        # as `EvictionLayer.step_bytes` (quantized storage only): bytes after each decode step, summed
        self.step_bytes = src.step_bytes.clone() if src.step_bytes is not None else None
        self.row_pad0 = list(src.row_pad0)

    # transformers' layer protocol reads `keys` / `values` [b, kv_heads, B + w, d]: the store's (the buffers
    # themselves for dense storage, zero-stride carriers of the shapes and dtype for quantized storage)
    @property
    def keys(self) -> torch.Tensor:
        return self.store.keys

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ sets None; the store owns the buffers
        pass

    @property
    def values(self) -> torch.Tensor:
        return self.store.values

    @values.setter
    def values(self, value) -> None:
        pass

    # -- the step (traced) ------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append one token per row (key/value_states [b, kv_heads, 1, d]); evict first when the step does.

        Returns the whole buffers [b, kv_heads, B + w, d]; `step_mask` masks the unused slots."""
        if key_states.shape[2] != 1:
            raise ValueError("the static cache takes one token per row per step (prefill runs eagerly)")
        if self.cache.evicting:
            self._evict()
        b, h = self.keys.shape[:2]
        self.store.write(self.length, key_states, value_states, self.seen, flush=self.cache.flushing)
        slot = self.length.view(b, 1, 1)
        self.positions.scatter_(2, slot.expand(b, h, 1), self.seen.view(1, 1, 1).expand(b, h, 1))
        for state in self.slot_state.values():
            state.scatter_(2, slot.expand(b, h, 1), 0.0)
        self.length.add_(1)
        self.seen.add_(1)
        return self.store.step_kv()

    def step_mask(self, query: torch.Tensor, kind: str) -> torch.Tensor:
        """Record the query [b, q_heads, 1, d] and return the mask [b, 1, 1, B + w] over the valid prefix."""
        if self.cfg.policy.needs_queries:
            ring_write(self.queries, self.queries_seen, query)  # the one query ring (`vase.core.ring`)
            self.queries_seen.add_(1)
        cap = self.keys.shape[2]
        valid = torch.arange(cap, device=query.device)[None, :] < self.length[:, None]
        valid = valid[:, None, None, :]
        if kind == "additive":
            return torch.zeros(valid.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~valid, torch.finfo(query.dtype).min)
        return valid

    def _query_window(self) -> torch.Tensor:
        return ring_read(self.queries, self.queries_seen, self.cfg.window)

    def _evict(self) -> None:
        """Rows at B + w keep B slots: B - w chosen by the policy among the first B, then the w most recent."""
        cfg, policy = self.cfg, self.cfg.policy
        B, w = cfg.budget, cfg.window
        b, h, cap, d = self.keys.shape
        device = self.keys.device
        due = self.length >= cap  # [b]
        extra = {name: state[:, :, :B].clone() for name, state in self.slot_state.items()}
        extra.update(self.layer_state)
        queries = self._query_window() if policy.needs_queries else None
        noise = NoiseReplay(self.noise) if policy.stochastic else None
        keys, values = self.store.candidates(B)
        # one eviction kernel for every engine (`vase.core.kernel`); the last w slots are free after the gather
        index = keep_index(choose(policy, keys, values, queries, B, w, noise, extra), cap, w, cfg.sort_kept)
        index = torch.cat([index, index[..., B - w:]], dim=-1)  # B + w: the recent ones fill the free slots
        index = torch.where(due[:, None, None], index, torch.arange(cap, device=device).expand(b, h, cap))
        for name, state in self.slot_state.items():  # the policy's updates (H2O's accumulator), due rows only
            state[:, :, :B].copy_(torch.where(due[:, None, None], extra[name], state[:, :, :B]))
        self.store.compact(index, torch.where(due, B, cap))
        for buf in (self.positions, *self.slot_state.values()):
            compact_slots(buf, index)
        # freed slots: empty position, zero state
        free = torch.arange(cap, device=device)[None, None, :] >= B
        free = free & due[:, None, None]
        self.positions.masked_fill_(free, -1)
        for buf in self.slot_state.values():
            buf.masked_fill_(free, 0.0)
        self.length.copy_(torch.where(due, torch.full_like(self.length, B), self.length))

    # -- host side: the schedule and the random draws, before a step --------------------------------
    def due_rows(self) -> list[int]:
        cap = self.cfg.budget + self.cfg.window
        return [r for r, n in enumerate(self.host_length) if n >= cap]

    def prepare(self, due: list[int]) -> None:
        """Before an evicting step: draw fresh rows' per-layer state, then the policy's noise, per row generator."""
        for r in due:
            if self.row_evictions[r] == 0:  # the first eviction runs at the row's peak stored length
                self.row_peak_bytes[r] = self.store.held_bytes(self.host_length[r], r)
        gens = self.cache.generators
        policy = self.cfg.policy
        b, h, _, d = self.keys.shape
        draw_layer_state(policy, self.layer_state, self.state_ready, due, gens, b, h, d, self.device)
        if policy.stochastic:
            fill(self.noise, self.cache.draws, due, gens)

    def advance(self, due: list[int]) -> None:
        """After a step: the host mirror of lengths and the counters."""
        B = self.cfg.budget
        h = self.keys.shape[1]
        for r in due:
            self.tokens_evicted += (self.host_length[r] - B) * h
            self.row_evictions[r] += 1
            self.row_peak[r] = max(self.row_peak[r], self.host_length[r])
            self.host_length[r] = B
        if due:
            self.evictions += 1
        self.host_length = [n + 1 for n in self.host_length]
        self.host_seen += 1
        self.store.advance()
        if self.step_bytes is not None:
            self.step_bytes += self.store.row_bytes()

    # -- transformers' layer interface ------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:  # built initialised
        return None

    def get_seq_length(self) -> int:
        return self.host_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticEvictionCache(Cache):
    """The fixed-shape form of an `EvictionCache` (see the module docstring): `from_eager(cache)`."""

    def __init__(self, eager: EvictionCache, q_heads: int):
        self.cfg = eager.cfg
        self.policy = eager.policy
        self.generators = eager.generators
        self.q_heads = q_heads
        self.evicting = False
        self.flushing = False  # quantized storage: this step flushes (its own graph variant, as `evicting`)
        self.draws: list[tuple[str, tuple[int, ...]]] = []
        super().__init__(layers=[StaticLayer(self, l) for l in eager.layers])
        if self.policy.stochastic:
            self.draws = self._record_draws()
            first = self.layers[0]
            b = first.keys.shape[0]
            for layer in self.layers:
                layer.noise = [torch.zeros(b, *shape, device=first.device) for _, shape in self.draws]
        self._alloc_layer_state()

    @classmethod
    def from_eager(cls, cache: EvictionCache, q_heads: int, static_addresses: bool = False) -> StaticEvictionCache:
        """Build from `cache` once `ready(cache)`; the eager cache is not used afterwards.

        static_addresses: mark every buffer with `torch._dynamo.mark_static_address` (CUDA graphs,
        `mode="reduce-overhead"`, need it; without it a new cache of the same shapes reuses the graphs)."""
        if not ready(cache):
            raise RuntimeError("convert only once every row is in the steady schedule (limit B + w)")
        static = cls(cache, q_heads)
        if static_addresses:
            for layer in static.layers:
                for t in (*layer.store.tensors(), layer.positions, layer.length, layer.seen, layer.queries,
                          layer.queries_seen, *layer.slot_state.values(), *layer.layer_state.values(), *layer.noise):
                    torch._dynamo.mark_static_address(t)
        return static

    def _alloc_layer_state(self) -> None:
        """Fixed buffers for the policy's per-layer state (CurDKV's projection), filled row by row later."""
        first = self.layers[0]
        b, h, _, d = first.keys.shape
        probe = self.policy.init_layer_state(1, h, d, [torch.Generator(device=first.device)], first.device)
        for layer in self.layers:
            for name, value in probe.items():
                if name not in layer.layer_state:
                    layer.layer_state[name] = value.new_zeros(b, *value.shape[1:])

    def _record_draws(self) -> list[tuple[str, tuple[int, ...]]]:
        """What the policy draws at one eviction of one row (shapes only depend on B, w and the head sizes)."""
        first = self.layers[0]
        B, w = self.cfg.budget, self.cfg.window
        _, h, _, d = first.keys.shape
        dev = first.device
        # A private generator: converting must not move the global one (transformers samples tokens from it).
        gen = torch.Generator(device=dev).manual_seed(0)
        keys = torch.randn(1, h, B, d, device=dev, generator=gen)
        queries = torch.randn(1, self.q_heads, w, d, device=dev, generator=gen)
        extra = {name: torch.zeros(1, h, B, device=dev) for name in self.policy.slot_state}
        extra.update(self.policy.init_layer_state(1, h, d, [torch.Generator(device=dev)], dev))
        rec = Recorder(gen)
        self.policy.select(keys, keys.clone(), queries if self.policy.needs_queries else None, B - w,
                           generator=rec, budget=B, **extra)
        return rec.draws

    # -- host side ------------------------------------------------------------------------------------------
    def due_rows(self) -> list[int]:
        return self.layers[0].due_rows()

    def begin_step(self) -> list[int]:
        """Host side before a step: the rows that evict in it, with their random draws made and
        `evicting` and `flushing` (the flags the compiled graph is specialised on) set. After the step:
        `evicting = False`, then `advance(due)`."""
        due = self.due_rows()
        if due:
            self.prepare(due)
        self.evicting = bool(due)
        self.flushing = self.layers[0].store.flush_due()  # every layer's store flushes at the same step
        return due

    def prepare(self, due: list[int]) -> None:
        for layer in self.layers:  # layer order = the eager cache's draw order per row generator
            layer.prepare(due)

    def advance(self, due: list[int]) -> None:
        for layer in self.layers:
            layer.advance(due)

    def kept_positions(self, layer: int = 0) -> list[list[list[int]]]:
        """Per row and KV head: the sorted sequence indices stored in `layer` (for comparisons)."""
        lay = self.layers[layer]
        pos = lay.positions.cpu()
        out = []
        for r, n in enumerate(lay.host_length):
            out.append([sorted(pos[r, k, :n].tolist()) for k in range(pos.shape[1])])
        return out

    def stats(self) -> dict:
        first = self.layers[0]
        b, h, cap, d = first.keys.shape
        per_token = h * 2 * d * first.keys.element_size()
        return {
            "method": self.policy.name, "budget": self.cfg.budget, "window": self.cfg.window,
            "evictions": first.evictions, "layer_evictions": sum(l.evictions for l in self.layers),
            "tokens_evicted": first.tokens_evicted, "stored_length": max(first.host_length),
            "seen_length": first.host_seen, "capacity": cap,
            "kv_bytes": sum(l.store.held_bytes(n, r) for l in self.layers for r, n in enumerate(l.host_length)),
            "kv_bytes_capacity": sum(l.store.capacity_bytes() for l in self.layers),
            "kv_bytes_full": sum(b * l.host_seen * per_token for l in self.layers),
        }

    def row_stats(self) -> list[dict]:
        rows = []
        first = self.layers[0]
        for r in range(len(first.host_length)):
            now = peak = full = 0
            steps: int | None = 0
            for l in self.layers:
                per_token = 2 * l.keys.shape[1] * l.keys.shape[3] * l.keys.element_size()
                held = l.store.held_bytes(l.host_length[r], r)
                now += held
                peak += l.row_peak_bytes[r] if l.row_evictions[r] else held  # as `EvictionCache.row_stats`
                full += (l.host_seen - l.row_pad0[r]) * per_token
                steps = None if l.step_bytes is None or steps is None else steps + int(l.step_bytes[r])
            row = {"evictions": first.row_evictions[r], "kv_bytes": now, "kv_bytes_peak": peak,
                   "kv_bytes_full": full}
            if steps is not None:
                row["kv_byte_steps"] = steps
            rows.append(row)
        return rows

    def batch_select_indices(self, indices) -> None:
        raise RuntimeError("the compiled decode keeps every row in the batch (a finished row's tokens are ignored)")


def ready(cache: EvictionCache) -> bool:
    """Whether every row of every layer is in the steady schedule (limit B + w) and fits B + w slots."""
    cap = cache.cfg.budget + cache.cfg.window
    for layer in cache.layers:
        if not layer.is_initialized or layer.pad is None:
            return False
        if any(lim != cap for lim in layer.limit) or max(layer.real_lengths()) > cap:
            return False
    return True


# -- the attention function of the static step --------------------------------------------------------------
#: torch's SDPA reads grouped KV heads in place (`enable_gqa`, torch >= 2.5)
_SDPA_GQA = is_torch_greater_or_equal("2.5")


def _sdpa_grouped(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The decode query [b, q_heads, 1, d] over the static buffers [b, kv_heads, B + w, d] under the bool mask
    [b, 1, 1, B + w]: SDPA reading the grouped KV heads in place. transformers' kernel copies K and V once
    per query head whenever a mask is given (`repeat_kv`); on a CPU that copy of the whole B + w buffers
    dominated the compiled step (4x the attention at batch 4). Returns [b, 1, q_heads, d] as the stock kernel."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _plain_attention(kwargs: dict) -> bool:
    """Whether the attention call asks for nothing beyond softmax(q k / scale) v (a store's own `attend`)."""
    return (not kwargs.get("dropout") and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and kwargs.get("position_bias") is None)


def _make_static_attention(kernel: str):
    kind = "additive" if kernel == "eager" else "bool"

    def vase_static_attention(module, query, key, value, attention_mask, **kwargs):
        cache = _ACTIVE[0]
        layer = cache.layers[module.layer_idx]
        mask = layer.step_mask(query, kind)
        if layer.store.attends_itself:  # `key`/`value` are carriers: attend the store where it lies
            if _plain_attention(kwargs):
                return layer.store.attend(query, layer.length, kwargs.get("scaling")), None
            key, value = layer.store.read()
        # On a CPU, SDPA with a mask reads grouped heads in place; on CUDA a mask with grouped heads would take
        # the math kernel, so the stock kernel (its copy, then a fused kernel) stays.
        if kernel == "sdpa" and _SDPA_GQA and query.device.type == "cpu" and kwargs.get("position_bias") is None:
            return _sdpa_grouped(module, query, key, value, mask, **kwargs)
        return stock_kernel(kernel, module)(module, query, key, value, mask, **kwargs)

    vase_static_attention.__name__ = f"{STATIC_PREFIX}{kernel}"
    return vase_static_attention


def register_static() -> None:
    """Register `vase_static_sdpa` / `vase_static_eager` (idempotent). No mask function is registered:
    transformers then hands the attention function no mask of its own, and the cache supplies it."""
    for kernel in ("sdpa", "eager"):
        if STATIC_PREFIX + kernel not in AttentionInterface._global_mapping:
            AttentionInterface.register(STATIC_PREFIX + kernel, _make_static_attention(kernel))


def activate(model, cache: StaticEvictionCache | None) -> None:
    """Point the model's attention at `cache`'s static layers (None: back to vase's eager kernel)."""
    kernel = base_kernel(model)
    if cache is None:
        _ACTIVE[0] = None
        if model.config._attn_implementation != "vase_" + kernel:
            model.set_attn_implementation("vase_" + kernel)
        return
    if kernel not in KERNELS[:2]:
        raise CompileUnsupportedError(f"compile=True needs attn_implementation 'sdpa' or 'eager', not {kernel!r}")
    register_static()
    _ACTIVE[0] = cache
    if model.config._attn_implementation != STATIC_PREFIX + kernel:
        model.set_attn_implementation(STATIC_PREFIX + kernel)
