"""The compiled decode loop: `torch.compile`d steps over fixed-shape caches.

    ids, finished, prefill_s = decode_compiled(model, input_ids, attention_mask, cache, ...)

An evicting method: prefill (and, for a row whose prompt is longer than B, decode until its
first eviction) runs eagerly with the `EvictionCache`; then the cache becomes a
`vase.caches.static.StaticEvictionCache` and every further step runs one of two compiled graphs,
plain or evicting (with quantized storage, each also in a flush variant), picked by the host
from the schedule (no recompilation, no graph break at an eviction). `full`: transformers'
`StaticCache` of prompt + new tokens on the stock kernel, the decode step compiled (the fair
full-cache peer).

Finished rows stay in the batch (their tokens are ignored), so shapes never change.
The model call stays transformers' own; only the step function around it is compiled.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
from transformers import StaticCache

from ..hf.attention import base_kernel, uninstall
from ..caches.eager import EvictionCache
from ..caches.compiled import compile_mode
from ..storage.registry import kind_of
from ..hf.compat import cache_kwargs
from .decoding import prefill, sampler_generators
from ..caches.static import (CompileUnsupportedError, StaticEvictionCache, activate, check_compilable, check_no_kept_layers,
                     ready)


def _model_step(model, cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One decode forward: tokens/positions [b, 1] -> last logits [b, vocab]."""
    out = model(input_ids=tokens, position_ids=positions, **cache_kwargs(cache), use_cache=True)
    return out.logits[:, -1]


# One function (one code object) per variant, so each keeps its own compiled graph: the graph is specialised on
# the cache's host flags `evicting` and `flushing` (quantized storage), set by the host from the schedule.
def _plain_step(model, cache, tokens, positions):
    return _model_step(model, cache, tokens, positions)


def _evicting_step(model, cache, tokens, positions):
    return _model_step(model, cache, tokens, positions)


def _flush_step(model, cache, tokens, positions):
    return _model_step(model, cache, tokens, positions)


def _evicting_flush_step(model, cache, tokens, positions):
    return _model_step(model, cache, tokens, positions)


def _full_step(model, cache, tokens, positions, mask):
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    return out.logits[:, -1]


def _fresh(fn: Callable, tag: str) -> Callable:
    """A copy of `fn` with its own code object: dynamo keeps compiled graphs per code object, so each
    configuration gets its own cache entries and never counts as a recompilation of another's."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledSteps:
    """The compiled step functions of one configuration (`mode`, `backend` as `torch.compile`'s)."""

    def __init__(self, mode: str | None = None, backend: str | Callable = "inductor", tag: str = "0"):
        self.mode = mode
        opts = dict(fullgraph=True, dynamic=False, backend=backend, **compile_mode(mode, backend))
        self.plain = torch.compile(_fresh(_plain_step, tag), **opts)
        self.evicting = torch.compile(_fresh(_evicting_step, tag), **opts)
        self.flush = torch.compile(_fresh(_flush_step, tag), **opts)  # quantized storage only
        self.evicting_flush = torch.compile(_fresh(_evicting_flush_step, tag), **opts)
        self.full = torch.compile(_fresh(_full_step, tag), **opts)


_STEPS: dict[tuple, CompiledSteps] = {}


def compiled_steps(key: tuple = (), mode: str | None = None, backend: str = "inductor") -> CompiledSteps:
    """The compiled steps for configuration `key` (built once, reused by later calls with the same key)."""
    full_key = (key, mode, backend)
    if full_key not in _STEPS:
        _STEPS[full_key] = CompiledSteps(mode, backend, tag=str(len(_STEPS)))
    return _STEPS[full_key]


def config_key(model, cache, batch: int) -> tuple:
    """What a compiled step specialises on: the model, the method and its parameters, B, w and the batch."""
    policy = getattr(cache, "policy", None)
    cfg = getattr(cache, "cfg", None)
    return (id(model), type(cache).__name__, repr(policy), getattr(cfg, "budget", None), getattr(cfg, "window", None),
            getattr(cfg, "sort_kept", None), batch)


class StaticStepper:
    """Runs the steady-state steps of an evicting cache: host schedule + the compiled variants (plain,
    evicting; with quantized storage also a flush variant of each, picked when the flush is due)."""

    def __init__(self, model, cache: StaticEvictionCache, steps: CompiledSteps):
        self.model, self.cache, self.steps = model, cache, steps

    def variant(self, evicting: bool, flushing: bool) -> Callable:
        """The compiled graph for a step that evicts and/or flushes (quantized storage)."""
        s = self.steps
        return ((s.evicting_flush if flushing else s.evicting) if evicting else
                (s.flush if flushing else s.plain))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        due = self.cache.begin_step()
        try:
            logits = self.variant(bool(due), self.cache.flushing)(self.model, self.cache, tokens, positions)
        finally:
            self.cache.evicting = self.cache.flushing = False
        self.cache.advance(due)
        return logits


def compile_cache(model, cache: EvictionCache, batch: int, total: int):
    """The cache `decode_compiled` runs for `cache`'s method: transformers' StaticCache of `total`
    slots for `full`, else `cache` itself once it is checked compilable (one-line refusal otherwise)."""
    check_no_kept_layers(cache)  # a hybrid model, even for 'full'
    if not cache.policy.evicts and not cache.policy.selects:
        if cache.storage_config is not None:
            drop = "kv_bits" if hasattr(cache.storage_config, "bits") else f"the {kind_of(cache.storage_config).name} storage"
            raise CompileUnsupportedError("compile=True runs 'full' on transformers' StaticCache, which stores "
                                          f"K/V densely: drop {drop} for 'full' (or use compile=False)")
        return StaticCache(config=model.config, max_cache_len=total)
    check_compilable(cache, base_kernel(model))
    return cache


@torch.inference_mode()
def decode_compiled(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, *, max_new_tokens: int,
                    sampler: Callable, seeds: Sequence[int], eos_token_ids: Sequence[int] = (),
                    ignore_eos: bool = False, on_token: Callable[[int, int], None] | None = None,
                    row_stats: list[dict] | None = None, steps: CompiledSteps | None = None,
                    on_cache: Callable | None = None) -> tuple[list[list[int]], list[bool], float]:
    """`vase.generation.generate.decode` with compiled decode steps (see the module docstring); same returns.

    `cache`: an EvictionCache (an evicting method, dense or quantized storage) or a transformers StaticCache
    (the full cache; the model must run its stock kernel). `on_cache(static_cache)` is called
    once the evicting cache went static (tests use it to look inside)."""
    steps = steps or compiled_steps(config_key(model, cache, input_ids.shape[0]))
    decode_compiled.last_cache = None
    b = input_ids.shape[0]
    device = input_ids.device
    generators = sampler_generators(seeds, device)
    eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], device=device)
    full = isinstance(cache, StaticCache)
    if not full:
        check_compilable(cache, base_kernel(model))
    step_mask = None
    original_attn = model.config._attn_implementation
    if full:
        uninstall(model)
        total = cache.layers[0].max_cache_len
        if bool((attention_mask == 0).any()):  # left padding: a fixed-size 2-D mask, padding off, the rest on
            step_mask = torch.ones(b, total, dtype=attention_mask.dtype, device=device)
            step_mask[:, :input_ids.shape[1]] = attention_mask

    positions, logits, prefill_seconds = prefill(model, input_ids, attention_mask, cache)
    generated: list[list[int]] = [[] for _ in range(b)]
    finished = [False] * b
    done_rows = [False] * b
    next_pos = positions[:, -1:] + 1
    stepper: StaticStepper | None = None
    try:
        for _ in range(max_new_tokens):
            tokens = sampler(logits, generators)
            done = torch.isin(tokens, eos).tolist() if not ignore_eos else [False] * b
            for r, token in enumerate(tokens.tolist()):  # one device sync per step
                if done_rows[r]:
                    continue
                if done[r]:
                    finished[r] = done_rows[r] = True
                else:
                    generated[r].append(token)
                    if on_token is not None:
                        on_token(r, token)
            live = [r for r in range(b) if not done_rows[r]]
            if not live or len(generated[live[0]]) >= max_new_tokens:
                break
            feed = tokens[:, None]
            if full:
                logits = steps.full(model, cache, feed, next_pos, step_mask)
            elif stepper is not None:
                logits = stepper(feed, next_pos)
            elif ready(cache):
                static = StaticEvictionCache.from_eager(cache, model.config.get_text_config().num_attention_heads,
                                                        static_addresses=steps.mode == "reduce-overhead")
                activate(model, static)
                stepper = StaticStepper(model, static, steps)
                decode_compiled.last_cache = static
                if on_cache is not None:
                    on_cache(static)
                logits = stepper(feed, next_pos)
            else:  # a long prompt: eager until every row's first eviction
                logits = model(input_ids=feed, position_ids=next_pos, **cache_kwargs(cache), use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
    finally:
        if stepper is not None:
            activate(model, None)
        if full and model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)
    if row_stats is not None:
        source = stepper.cache if stepper is not None else (cache if isinstance(cache, EvictionCache) else None)
        if source is not None:
            for r, stats in enumerate(source.row_stats()):
                row_stats[r] = stats
    if stepper is not None:
        decode_compiled.last_cache = stepper.cache  # the static cache of the last call (stats)
    return generated, finished, prefill_seconds


decode_compiled.last_cache = None


@torch.inference_mode()
def teacher_forced(model, method: str, input_ids: torch.Tensor, attention_mask: torch.Tensor, feed: torch.Tensor,
                   budget: int, window: int, *, steps: CompiledSteps | None = None, seeds: Sequence[int] | None = None,
                   on_step: Callable | None = None, **params) -> tuple[torch.Tensor, list, int]:
    """Prefill left-padded `input_ids` [b, P], then feed the tokens `feed` [b, T] one step at a time.

    Eager (`steps` None) or with the compiled steps `steps` (eager until `ready`, as `decode_compiled`).
    Returns (logits [T, b, vocab] in the model dtype, kept positions per layer [layer][row][kv_head] -> sorted sequence
    indices, eviction events of layer 0). For comparing the two paths (tests, benchmarks/gpu_check.py).
    `on_step(t, stepper_or_None)` runs after step t."""
    b = input_ids.shape[0]
    cache = EvictionCache(model, method, budget, window, seed=list(seeds or range(7, 7 + b)), **params)
    positions, _, _ = prefill(model, input_ids, attention_mask, cache)
    nxt = positions[:, -1:] + 1
    logits, stepper = [], None
    try:
        for t in range(feed.shape[1]):
            tok = feed[:, t:t + 1]
            if steps is not None and stepper is None and ready(cache):
                static = StaticEvictionCache.from_eager(cache, model.config.get_text_config().num_attention_heads)
                activate(model, static)
                stepper = StaticStepper(model, static, steps)
            if stepper is not None:
                out = stepper(tok, nxt)
            else:
                out = model(input_ids=tok, position_ids=nxt, **cache_kwargs(cache), use_cache=True).logits[:, -1]
            logits.append(out.clone())  # own dtype: a float32 cast would turn 1e-15 differences into 1-ulp flips
            nxt = nxt + 1
            if on_step is not None:
                on_step(t, stepper)
    finally:
        if stepper is not None:
            activate(model, None)
    if stepper is not None:
        kept = [stepper.cache.kept_positions(i) for i in range(len(cache.layers))]
        evictions = stepper.cache.stats()["evictions"]
    else:
        kept = []
        for l in cache.layers:
            pos = l.positions.cpu()
            kept.append([[sorted(pos[r, k, l.pad[r]:l.length].tolist()) for k in range(pos.shape[1])]
                         for r in range(pos.shape[0])])
        evictions = cache.stats()["evictions"]
    return torch.stack(logits), kept, evictions
