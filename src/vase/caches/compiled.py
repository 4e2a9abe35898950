"""transformers' own `model.generate` with the compiled decode step of `vase.caches.static`.

    cache = vase.CompiledEvictionCache(model, method="vase-attnv", budget=512, window=64, seed=0)
    out = model.generate(**inputs, **vase.generate_kwargs(cache), max_new_tokens=2048)

transformers compiles `model.__call__` for its decode loop (`generation_config.compile_config`)
when the cache it is given says it is compileable; the prefill runs uncompiled. The cache here,
`CompiledEvictionCache`, prefills as an `EvictionCache` (eagerly, as vase always does). The host
work between two forwards runs in a logits processor (transformers' public hook, called on the
host after every forward, the prefill's included): right after the prefill it converts the cache
to its fixed-shape form (`StaticEvictionCache`) and points the model's attention at it; before
each decode step it reads the schedule (which rows evict at this step), makes the random draws of
stochastic methods with each row's generator, and sets the flag the compiled graph is specialised
on (two graphs: plain and evicting); after the step it advances the host mirror of the lengths.
So the compiled forward never recompiles as the sequence grows and an eviction is no graph break,
exactly as in `vase.generate(..., compile=True)`.

Limits (each refused with one line): prompts longer than B (their first eviction must run
eagerly, and transformers compiles every decode step: use `vase.generate(..., compile=True)`),
the methods and settings `vase.caches.static.check_compilable` refuses, beam search. Rows that finish
early keep decoding padding, as transformers does with any static cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import CompileConfig

from ..hf.attention import base_kernel
from .eager import EvictionCache
from .static import CompileUnsupportedError, StaticEvictionCache, activate, check_compilable, ready

__all__ = ["CompiledEvictionCache", "StaticStepHook"]


def compile_mode(mode: str | None, backend) -> dict:
    """`torch.compile`'s `mode` / `options` for a vase step: with inductor, `mode`'s settings plus
    `emulate_precision_casts` (a cast to float16, the quantized store's scales in `vase.storage.packing`, then
    rounds as in eager mode; by default inductor keeps such intermediates in float32, and the compiled
    step quantized to other codes than the eager one). torch.compile takes a mode or options, not both."""
    if backend != "inductor":
        return {} if mode is None else {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**(list_mode_options(mode) if mode else {}), "emulate_precision_casts": True}}


class CompiledEvictionCache(Cache):
    """An evicting cache for `model.generate` whose decode steps compile (see the module docstring).

        cache = vase.CompiledEvictionCache(model, method="vase-attnv", budget=512, window=64, seed=0)
        model.generate(**inputs, **vase.generate_kwargs(cache), max_new_tokens=2048)
        cache.stats()

    `vase.generate_kwargs(cache)` holds the cache, the step hook (`logits_processor`) and transformers'
    `compile_config`. Arguments as `EvictionCache`'s (dense or `kv_bits` storage), and mode / backend as
    `torch.compile`'s ("reduce-overhead": CUDA graphs, with static buffer addresses). The model
    must run sdpa or eager attention. One-shot: build a new one for each generate call. The model
    stays on the static attention function afterwards; building any vase cache puts it back.

    Until the first decode step it is the `EvictionCache` it wraps (`eager`); from then on its
    layers are the `StaticEvictionCache`'s (`static`)."""

    is_compileable = True

    def __init__(self, model, method: str = "vase-attnv", budget: int = 512, window: int = 64, *,
                 seed: int | Sequence[int] = 0, mode: str | None = None, backend: str = "inductor",
                 **method_params):
        self.eager = EvictionCache(model, method, budget, window, seed=seed, **method_params)
        check_compilable(self.eager, base_kernel(model))
        self.q_heads = model.config.get_text_config().num_attention_heads
        self.static_addresses = mode == "reduce-overhead"
        self.static: StaticEvictionCache | None = None
        self.compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend,
                                            **{"mode": None, "options": None, **compile_mode(mode, backend)})
        self.compile_config._compile_all_devices = True  # transformers compiles on CUDA-like devices only unless told
        self.hook = StaticStepHook(model, self)
        super().__init__(layers=list(self.eager.layers))

    def generate_options(self) -> dict:
        """What `model.generate` needs besides the cache (merged in by `vase.generate_kwargs`)."""
        return {"logits_processor": LogitsProcessorList([self.hook]), "compile_config": self.compile_config}

    # transformers marks the cache the caller passed at the start of `generate`; the eager cache refuses
    # to be reused once filled, and so does this one.
    @property
    def _is_user_defined(self) -> bool:
        return self.eager._is_user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if value and self.static is not None:
            raise RuntimeError("this cache already holds a generation: build a new one for each generate call")
        self.eager._is_user_defined = value

    def go_static(self) -> StaticEvictionCache:
        """Switch to the fixed-shape form (once every row is in the steady schedule)."""
        if not ready(self.eager):
            raise CompileUnsupportedError(
                f"model.generate with a compiled step needs every prompt to fit the budget (B = "
                f"{self.eager.cfg.budget}; the longest prompt here is {self.eager.layers[0].seen} tokens): raise the "
                f"budget, or use vase.generate(..., compile=True), which decodes eagerly until the first eviction")
        self.static = StaticEvictionCache.from_eager(self.eager, self.q_heads, static_addresses=self.static_addresses)
        self.layers = self.static.layers
        return self.static

    def stats(self) -> dict:
        return (self.static or self.eager).stats()

    def row_stats(self) -> list[dict]:
        return (self.static or self.eager).row_stats()

    def kept_positions(self, layer: int = 0) -> list[list[list[int]]]:
        """Per row and KV head: the sorted sequence indices stored in `layer` (static form only)."""
        if self.static is None:
            raise RuntimeError("no decode step has run yet")
        return self.static.kept_positions(layer)

    def batch_select_indices(self, indices) -> None:
        raise RuntimeError("the compiled decode keeps every row in the batch")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise CompileUnsupportedError("beam search is not supported with an evicting cache (each beam would need its "
                                      "own evicted history): use sampling or greedy decoding (num_beams=1)")


class StaticStepHook(LogitsProcessor):
    """The host side of each compiled step, run by `generate` after every forward (scores pass through).

    After the prefill: convert the cache, point the model at it. Before each decode step: the
    schedule, the random draws, the evicting flag. After it (at the next call): advance the host
    mirror of the lengths."""

    def __init__(self, model, cache: CompiledEvictionCache):
        self.model, self.cache = model, cache
        self.due: list[int] | None = None  # rows evicting in the step now running; None: before the first

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        static = self.cache.static
        if static is None:  # the prefill has run
            static = self.cache.go_static()
            activate(self.model, static)
        elif self.due is not None:  # the step that just ran
            static.evicting = False
            static.advance(self.due)
        self.due = static.begin_step()
        return scores
