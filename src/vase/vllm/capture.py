"""Query window capture: attention implementations that record post-RoPE queries, then attend as vLLM does.

`QueryRing` keeps, per layer, the last `w` post-RoPE queries of each running request in a ring
indexed by logical position modulo `w`. The model runner writes a `CapturePlan` for the step
(which flat token goes to which request slot and ring position; `vase.vllm.offsets.capture_rows`);
the attention implementation copies those rows of its `query` [num_tokens, q_heads, head_dim]
before calling its kernel. The plan is None outside `execute_model` (profiling, warm-up, CUDA
graph capture): then nothing is recorded.

One mechanism for every backend: `capturing(cls)` is `cls` with a `forward` that records, then
calls `cls.forward`. vLLM's CPU, FlashAttention, FlashInfer and Triton implementations all take
`forward(layer, query, key, value, kv_cache, attn_metadata, output, ...)` with `query`
[num_tokens (maybe padded), q_heads, head_dim] after RoPE, so `install(impl, ring)` swaps the
class of one layer's implementation (not the backend registry, which is per process). With
piecewise CUDA graphs attention runs eagerly, so the Python `forward` runs every step; full CUDA
graphs would replay the kernel without it (the GPU worker refuses them). No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.ring import ring_gather, ring_put, ring_read


@dataclass
class CapturePlan:
    """One step's copies: flat token `src[i]` -> ring slot `slot[i]`, position `pos[i]` (all [k] int64)."""

    src: torch.Tensor
    slot: torch.Tensor
    pos: torch.Tensor


class QueryRing:
    """Per layer, [slots, q_heads, w, head_dim] rings of the last w queries; one slot per running request.

    Allocated once, for `slots` requests: the runner makes it once vLLM has built the KV pool, with one row per
    request the pool holds at its bounded size (at most `max_num_seqs`; `vase.vllm.ring_size`), after the workers
    took those rows' bytes from the KV memory; never grown. `store=False` (a policy that reads no queries) keeps
    the slot bookkeeping and allocates nothing."""

    def __init__(self, layer_names: list[str], q_heads: int, head_dim: int, window: int, dtype: torch.dtype,
                 device: torch.device, slots: int = 4, store: bool = True):
        self.layer_names = list(layer_names)
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.q_heads, self.head_dim, self.window = q_heads, head_dim, window
        self.dtype, self.device = dtype, device
        self.slots, self.store = slots, store
        self.rings: list[torch.Tensor] = [self._empty(slots if store else 0) for _ in layer_names]
        self.free: list[int] = list(range(slots - 1, -1, -1))
        self.plan: CapturePlan | None = None

    def _empty(self, slots: int) -> torch.Tensor:
        return torch.zeros(slots, self.q_heads, self.window, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes the rings hold (all layers)."""
        return sum(r.numel() * r.element_size() for r in self.rings)

    def acquire(self) -> int:
        """A ring slot for a request starting its (re)prefill; the rings never grow (vase's scheduler runs at most
        `slots` requests, each holding one slot while it runs)."""
        if not self.free:
            raise RuntimeError(f"vase: all {self.slots} query-ring slots are taken (one per running request, as many "
                               f"as the KV pool holds at the bounded size): the worker ran more requests at once")
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def record(self, layer_name: str, query: torch.Tensor) -> None:
        """Copy this step's planned rows of `query` [num_tokens, q_heads, head_dim] into the layer's ring."""
        plan = self.plan
        if plan is None or not self.store or plan.src.numel() == 0:
            return
        ring = self.rings[self.index[layer_name]]
        ring_put(ring, plan.slot, plan.pos, query.index_select(0, plan.src))

    def windows_of(self, layer: int, slots: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The last w queries of k requests (ring rows `slots` [k], `seen` [k] tokens written each), in time
        order: [k, q_heads, w, head_dim], one indexing op (`vase.core.ring.ring_gather`)."""
        return ring_gather(self.rings[layer], slots, seen)

    def window_of(self, layer: int, slot: int, seen: int) -> torch.Tensor:
        """The last w queries of a request that has written `seen` tokens, in time order: [1, q_heads, w, head_dim]."""
        return ring_read(self.rings[layer][slot:slot + 1], seen, self.window)  # the one query ring (`vase.core.ring`)


def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
    """Record the planned query rows (into `vase_ring`, set per instance by the runner), then attend."""
    ring = self.vase_ring
    if ring is not None and attn_metadata is not None:
        ring.record(layer.layer_name, query)
    return super(self._vase_class, self).forward(layer, query, key, value, kv_cache, attn_metadata, output, *args,
                                                 **kwargs)


_CAPTURING: dict[type, type] = {}


def capturing(cls: type) -> type:
    """`cls` (a vLLM attention implementation class) recording its queries first; one class per `cls`.

    A direct subclass adding no storage, so a live instance of `cls` can take it as its class."""
    if getattr(cls, "vase_capturing", False):
        return cls
    if cls not in _CAPTURING:
        sub = type(f"Vase{cls.__name__}", (cls,), {"__module__": __name__, "forward": _forward, "vase_ring": None,
                                                    "vase_capturing": True})
        sub._vase_class = sub
        _CAPTURING[cls] = sub
    return _CAPTURING[cls]


def install(impl: object, ring: QueryRing | None = None) -> None:
    """Make one layer's attention implementation record its queries into `ring` (class swap, state kept)."""
    impl.__class__ = capturing(type(impl))
    if ring is not None:
        impl.vase_ring = ring

