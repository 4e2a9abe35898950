"""The memory-traffic model of a decode step: the bytes a step must move, hence the fastest it can be.

A decode step at small batch is bound by memory, not arithmetic: it reads every weight once and
the K/V its attention attends. At a measured bandwidth W (bytes/s, `vase.bench.bandwidth`) a step
that moves T bytes takes at least T / W; a bounded cache cannot be faster than the full cache by
more than T_full / T_bounded, whatever the implementation. Formula and terms: docs/bench.md.

    mb = ModelBytes.from_model(model)
    t = decode_traffic(mb, "evicting", prompt=128, new_tokens=2048, batch=1, budget=512, window=64)
    t.total            # mean bytes per decode step over the run's N - 1 forwards

Pure functions of shapes and the schedule (`vase.core.schedule`); nothing is timed or allocated here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hf.hybrid import CHUNKED, LINEAR, SLIDING, kv_bytes_per_layer_token, layer_types, local_window, recurrent_state_bytes
from ..storage.quantized import QuantBytes
from ..core.schedule import first_limit, num_evictions, stored_length_sum, steady_limit

__all__ = ["KINDS", "ModelBytes", "StepTraffic", "decode_traffic", "gain_share"]

#: the cache kinds the model knows: `full` (vase's owned cache, no eviction), `dynamic` (transformers'
#: DynamicCache: torch.cat per step), `evicting` (an EvictionCache that evicts)
KINDS = ("full", "dynamic", "evicting")


@dataclass(frozen=True)
class ModelBytes:
    """The sizes a decode step's traffic is made of, for one model in one dtype.

    weights: bytes of the weights one step reads, whatever the batch (a tied embedding is read
        whole once, as the LM head; an untied input embedding is not counted here, only its rows);
    embed_row: bytes of one input-embedding row (read once per batch row);
    kv_token: bytes of one token's K and V over the layers whose cache grows (full attention), full precision;
    logits_row: bytes of one row's logits (vocab x element bytes);
    expert_weights: bytes of the routed experts of a mixture-of-experts model (all E of every layer),
        included in `weights`; a step reads only the experts its tokens are routed to;
    expert_fraction: experts per token / E (1.0 without experts);
    sliding_token, sliding_held: a hybrid model's sliding (or chunked-local) layers: bytes of one token's K and V over all
        of them, and the most tokens they keep between forwards (window - 1);
    state: bytes of a hybrid model's recurrent (linear-attention) states, one row: read and rewritten
        every step, whatever the cache."""

    weights: int
    embed_row: int
    kv_token: int
    logits_row: int
    expert_weights: int = 0
    expert_fraction: float = 1.0
    sliding_token: int = 0
    sliding_held: int = 0
    state: int = 0

    def weights_read(self, batch: int) -> float:
        """Weight bytes one step of `batch` rows reads: everything but the routed experts, and of those the
        expected share a batch hits under uniform routing, 1 - (1 - k/E)^batch."""
        dense = self.weights - self.expert_weights
        return dense + self.expert_weights * (1.0 - (1.0 - self.expert_fraction) ** batch)

    @classmethod
    def from_model(cls, model) -> "ModelBytes":
        """Count the parameters of `model` (each storage once: tied weights are one read) and its K/V shapes."""
        from ..engines.base import kv_bytes_per_token

        inp = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        tied = out is not None and _storage(out.weight) == _storage(inp)
        seen: set[int] = set()
        weights = 0
        for p in model.parameters():
            if _storage(p) in seen or (p is inp and not tied):
                continue  # an untied input embedding: only the rows of this step's tokens are read
            seen.add(_storage(p))
            weights += p.numel() * p.element_size()
        text = model.config.get_text_config()
        experts, fraction = _routed_experts(model, text)
        element = inp.element_size()
        types = layer_types(text)
        # local layers: sliding-window (Gemma 3, gpt-oss) or chunked-local (Llama 4), each keeping window - 1 tokens
        # (no model mixes the two)
        local = SLIDING if SLIDING in types else CHUNKED
        window = local_window(text, local) or 1
        return cls(weights=weights, embed_row=inp.shape[1] * element, kv_token=kv_bytes_per_token(model),
                   logits_row=int(text.vocab_size) * element, expert_weights=experts, expert_fraction=fraction,
                   sliding_token=types.count(local) * kv_bytes_per_layer_token(text, element),
                   sliding_held=window - 1 if local in types else 0,
                   state=types.count(LINEAR) * recurrent_state_bytes(text, element) if LINEAR in types else 0)


def _storage(p) -> int:
    """What identifies a parameter's memory: its address, or on the meta device (shapes without memory, as
    `benchmarks/hybrid_ceilings.py` counts the shapes too large to build) the tensor itself."""
    return id(p) if p.device.type == "meta" else p.data_ptr()


def _routed_experts(model, text) -> tuple[int, float]:
    """Bytes of the routed experts' parameters (an `experts` module's tensors with one slice per expert) and
    experts per token / E; (0, 1.0) for a dense model. A shared expert is dense: read every step."""
    total = int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
                or getattr(text, "n_routed_experts", None) or 0)
    per_token = int(getattr(text, "num_experts_per_tok", None) or 0)
    if total <= 1 or per_token <= 0:
        return 0, 1.0
    experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if ".experts." in f".{name}" and p.dim() >= 2 and p.shape[0] == total)
    return experts, min(1.0, per_token / total)


@dataclass(frozen=True)
class StepTraffic:
    """Mean bytes per decode step over a run, by term (all rows of the batch)."""

    weights: float  # weights read (plus the embedding rows)
    kv_read: float  # K/V read: attention, and a DynamicCache's copy of what it held
    kv_write: float  # K/V written: the new token, a DynamicCache's new tensor, a quantized store's codes
    evict: float  # eviction events amortised over the steps: stored K/V read, survivors written
    logits: float  # logits written by the LM head and read once by the sampler

    @property
    def total(self) -> float:
        return self.weights + self.kv_read + self.kv_write + self.evict + self.logits

    @property
    def kv(self) -> float:
        return self.kv_read + self.kv_write + self.evict


def decode_traffic(mb: ModelBytes, kind: str, prompt: int, new_tokens: int, batch: int, budget: int | None = None,
                   window: int | None = None, compiled: bool = False, quant: QuantBytes | None = None) -> StepTraffic:
    """Mean bytes per decode step over the N - 1 forwards that decode N = `new_tokens` tokens after a prompt of P.

    At step j (j = 1 .. N - 1) the cache stores L_j tokens after the step's write: P + j without
    eviction, `vase.core.schedule.physical_length(P, B, w, j)` with it; per row, K/V read is

    - full (eager): L_j tokens; compiled (transformers' StaticCache): its whole P + N slots;
    - dynamic: L_j read by attention, plus L_j - 1 read and L_j written by torch.cat;
    - evicting (eager): L_j tokens; compiled (`vase.caches.static`): its whole B + w slots. `quant`
      (a `QuantBytes`): those slots at the packed size, the reserve and window in full precision.

    Each step also writes the new token (and, quantized, its codes once it is flushed); each
    eviction event reads the B + w stored tokens and writes the B survivors. Every row of the
    batch reads the same weights once (of a mixture of experts, the experts it is routed to:
    `ModelBytes.weights_read`). A hybrid model's other layers cost every kind the same: its sliding
    layers read min(window - 1, P + j - 1) held tokens and write the new one, its recurrent states are
    read and rewritten. Returns the mean of each term over the N - 1 steps.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if new_tokens < 2 or prompt < 1 or batch < 1:
        raise ValueError(f"need new_tokens >= 2, prompt >= 1, batch >= 1 (got {new_tokens}, {prompt}, {batch})")
    evicting = kind == "evicting"
    if evicting and (budget is None or window is None):
        raise ValueError("an evicting cache needs its budget and window")
    if quant is not None and not evicting:
        raise ValueError("quantized storage is modelled for evicting caches only (full and dynamic stay dense)")
    steps = new_tokens - 1
    P, b, kv = prompt, batch, mb.kv_token
    mean_len = (stored_length_sum(P, budget, window, steps) if evicting else steps * P + steps * (steps + 1) // 2) / steps
    write = float(kv)
    evict_bytes = 0.0
    if kind == "full":
        read = kv * (P + new_tokens if compiled else mean_len)
    elif kind == "dynamic":
        read = kv * (mean_len + (mean_len - 1))
        write = kv * mean_len
    else:
        B, w = budget, window
        cap = steady_limit(B, w) if compiled else first_limit(P, B, w)
        events = num_evictions(P, B, w, steps)
        if quant is None:
            read = kv * (steady_limit(B, w) if compiled else mean_len)
            evict_bytes = events * kv * (B + w + B) / steps
        else:
            read = (quant.allocated(cap) if compiled else quant.byte_steps(P, steps, cap, B, evicts=True) / steps)
            write = kv + quant.write_bytes(cap)  # the token in full precision, later its stored form
            evict_bytes = events * (quant.held(B + w, 0, cap) + quant.held(B, 0, cap)) / steps
    if mb.sliding_token:  # held before step j's token: min(window - 1, P + j - 1), j = 1 .. N - 1
        held = sum(min(mb.sliding_held, P + j - 1) for j in range(1, new_tokens))
        read += mb.sliding_token * held / steps
        write += mb.sliding_token
    read, write = read + mb.state, write + mb.state
    return StepTraffic(weights=float(mb.weights_read(b) + b * mb.embed_row), kv_read=b * float(read),
                       kv_write=b * float(write), evict=b * float(evict_bytes), logits=2.0 * b * mb.logits_row)


def gain_share(ratio: float | None, ceiling: float | None, min_gain: float = 0.01) -> float | None:
    """The share of the ceiling's gain a measured speed-up reached: (ratio - 1) / (ceiling - 1).

    None when either is missing or the ceiling allows less than `min_gain` (a share of nothing is noise)."""
    if ratio is None or ceiling is None or ratio != ratio or ceiling != ceiling or ceiling - 1 < min_gain:
        return None
    return (ratio - 1) / (ceiling - 1)
