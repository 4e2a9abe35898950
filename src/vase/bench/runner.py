"""Decode throughput and memory of the eviction methods against the full cache.

    rows = run_bench(model, ["vase-attnv", "vase-dkv"], budgets=[512], output_lengths=[1024, 4096],
                     batch_sizes=[1])

Every configuration decodes `output_length` new tokens (sampled as `vase.generate` samples by default:
temperature 0.6, top-p 0.95, one generator per row; EOS ignored) after a random
prompt of `prompt_length` tokens, through `vase.generation.generate.decode`, with one of

- an evicting method at budget B (an `EvictionCache`),
- `full`: the same owned cache without eviction (preallocated to prompt + output), and
- `dynamic`: transformers' `DynamicCache` on the stock attention kernel (the full cache as
  users run it today; vase's attention function is uninstalled for these runs).

What is measured (per run; a row reports the median over `repeats` runs after `warmup` runs):

- Step clock: `decode`'s `on_token` callback stamps the time when each step's first token
  is known (after a `torch.cuda.synchronize()` on CUDA). The N tokens of a run need N - 1
  decode forwards; the gap between consecutive stamps is one step (forward + sampling +
  loop). Prefill is excluded.
- tok_s = (N - 1) x batch / (last stamp - first stamp); `segments` splits the N - 1 steps into
  equal parts and reports the rate of each (`seg_tok_s`, ';'-joined, first to last);
  `seg_ratio` = last part's rate / first part's. With repeats, `seg_ratio` is taken from the
  median part rates and `seg_ratio_lo` .. `seg_ratio_hi` is the range of the rounds' own ratios.
  A bounded cache's step does not grow once it has evicted: `steady_ratio` is the same ratio over
  the steps after the first eviction only (before it the cache is still filling, holding fewer
  tokens than later, so faster), and an evicting row below 0.95 gets a flag.
- Evictions: `cache.stats()["evictions"]` (events per layer; every layer evicts at the same
  step). `expected_evictions` is what the schedule (`vase.core.schedule`, docs/methods.md) predicts;
  `eviction_fired` is False for an evicting method that never evicted (prompt + output too
  short for its budget): such a row gets a `flag` and NO speed-up ratios.
- Time per eviction event (all layers), two ways:
  `evict_ms`: `EvictionLayer.evict` of every layer wrapped (instance attribute, the class is
  untouched) with perf_counter on CPU, CUDA events on GPU (no extra synchronisation),
  summed over layers, divided by the events; `evict_step_ms`: median over eviction steps of
  (that step's time - median of the non-evicting steps within 8 steps of it): what an eviction
  adds to the step it lands on, Python overhead included.
- evict_share: the eviction events' time amortised over the run, (sum of the timed `evict`
  calls) / decode_s, median over runs; eager only (compiled evictions run inside the step).
- Ceiling (docs/bench.md): `bytes_step` is the traffic model's mean bytes per decode step
  (`vase.bench.traffic`: weights, K/V read by attention, writes, eviction events amortised;
  `bytes_weights`, `bytes_kv` two of its parts); `bandwidth_gbs` the probe's bandwidth
  (`vase.bench.bandwidth`, measured once per `run_bench`); `roofline_tok_s` = bandwidth x
  batch / bytes_step, the fastest rate the memory allows, and `roofline_share` = tok_s / it.
  Beside each ratio, `ceiling_vs_full` / `ceiling_vs_dynamic` = the reference's bytes_step /
  the row's (the largest speed-up the traffic allows) and `gain_vs_full` / `gain_vs_dynamic` =
  (ratio - 1) / (ceiling - 1), the share of that gain reached.
- Repeats: round r runs every configuration once (A, B, A, B, ...); `tok_s_runs` holds each
  round's rate, and `vs_full` / `vs_dynamic` are medians over rounds of the ratio within the round
  (`vase.bench.paired`), with the range in `vs_full_lo` .. `vs_full_hi`.
- kv_bytes: K/V bytes held at the end (`stats()["kv_bytes"]`; for DynamicCache the bytes of
  its tensors); kv_bytes_alloc: bytes allocated for K/V (the owned cache preallocates).
- Peak memory: on CUDA `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`
  (`peak_mem_bytes`, weights included; `peak_mem_delta_bytes` = peak - allocated before the
  run). On CPU the process's resident-set high-water mark: before each run the garbage
  collector runs, glibc's `malloc_trim(0)` returns freed heap pages to the OS, and writing
  "5" to /proc/self/clear_refs resets VmHWM to the current RSS; after the run VmHWM is read
  (`mem_method = "vmhwm"`). Where clear_refs is not writable, a thread samples VmRSS every
  millisecond instead (`mem_method = "rss-sampled"`, may miss short spikes). CPU torch has no
  caching allocator, so freed tensors do not hide in the process between configurations.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ..caches.eager import EvictionCache
from ..core.checks import check_seed
from ..core.spec import Request, RequestSpec
from ..generation.generate import PAPER_SAMPLING, Sampler, decode
from .memory import PeakMemory, dynamic_kv_bytes
from .paired import alternating
from .rows import (BASELINES, add_ratios, add_traffic, evict_step_cost, expected_evictions, row_traffic, segment_rates,
                   summarise)
from .traffic import ModelBytes

__all__ = ["BASELINES", "add_ratios", "expected_evictions", "row_traffic", "run_bench", "run_one"]


#: next-token choice of every run: what `vase.generate` does by default (the paper's sampling, one
#: generator per row), not greedy. Greedy decoding of a random-weight model collapses into a loop of
#: a few tokens, a cache content users never run.
BENCH_SAMPLER = Sampler(**PAPER_SAMPLING)


def _now() -> float:
    """The bench's clock (a module function so a test can put a fake clock in its place)."""
    return time.perf_counter()


def _cpu_now() -> float:
    """CPU seconds of this process: with one torch thread, the time the decode itself ran, without the time a
    loaded machine gave to other processes (`clock="cpu"`)."""
    return time.process_time()


#: run_bench's `clock` choices: wall time, or this process's CPU time (meaningful with one torch thread)
CLOCKS = ("wall", "cpu")


# -- caches ----------------------------------------------------------------------------------------
def _dynamic_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


class _EvictTimer:
    """Wraps `evict` of every layer of an EvictionCache (instance attributes; the class is untouched)."""

    def __init__(self, cache: EvictionCache, device: torch.device, clock: Callable[[], float] | None = None):
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.seconds = 0.0
        self.events: list[tuple] = []
        for layer in cache.evicting_layers:
            layer.evict = self._wrap(layer.evict)

    def _wrap(self, evict: Callable) -> Callable:
        def timed(due):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                evict(due)
                end.record()
                self.events.append((start, end))
            else:
                now = self.clock or _now
                t = now()
                evict(due)
                self.seconds += now() - t

        return timed

    def total_seconds(self) -> float:
        if self.cuda and self.events:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.events) / 1000.0
        return self.seconds


# -- one run -------------------------------------------------------------------------------------
def device_of(model) -> torch.device:
    return next(model.parameters()).device


def _random_prompt(vocab: int, batch: int, length: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


def _set_attention(model, method: str) -> None:
    from ..hf.attention import uninstall

    if method == "dynamic":
        uninstall(model)  # the stock kernel and transformers' own masks, as users run it today


def run_one(model, method: str, budget: int | None, new_tokens: int, batch: int, prompt_length: int = 128,
            window: int = 64, segments: int = 4, seed: int = 0, compile: bool = False, cache_tokens: int | None = None,
            clock: str = "wall", request: Request | None = None, **method_params) -> dict:
    """Decode `new_tokens` tokens once and return the raw measurements of that run.

    request: the validated request of `method` at `budget` (`run_bench` carries the one it validated at its door);
    None: validated here from `method`, `budget`, `window`, `seed` and `method_params` (not read for `dynamic`).

    compile: decode with `vase.generation.compiled.decode_compiled` (`full`: transformers' StaticCache, the step
    compiled; evicting methods: the static cache's compiled steps); `dynamic` stays eager.
    cache_tokens: size the full caches for this many new tokens instead of `new_tokens` (a warm-up
    run compiles the StaticCache step for the shapes of the timed run).
    clock: "wall" (perf_counter), or "cpu": this process's CPU time (`time.process_time`) for the
    step stamps and the eviction timer, on a CPU with one torch thread (a shared machine's other load
    then does not count; memory contention still does)."""
    _check_clock(model, clock)
    now = _cpu_now if clock == "cpu" else None
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    input_ids = _random_prompt(vocab, batch, prompt_length, seed, device)
    attention_mask = torch.ones_like(input_ids)
    cuda = device.type == "cuda"

    _set_attention(model, method)
    memory = PeakMemory(device)
    with memory:
        compiled = compile and method != "dynamic"
        if method != "dynamic":
            request = _run_request(method, budget, window, seed, method_params, request)
        cache, timer, run_decode = _bench_cache(model, method, request, batch, prompt_length, new_tokens,
                                                compiled, cache_tokens, now, device)
        stamps: list[float] = []
        evict_marks: list[int] = []
        calls = 0
        evictions_now = _eviction_counter(cache, timer, compiled)

        def on_token(row: int, token: int) -> None:
            nonlocal calls
            if calls % batch == 0:  # the first row of a step: every row's token of this step is known
                if cuda:
                    torch.cuda.synchronize(device)
                stamps.append((now or _now)())
                evict_marks.append(evictions_now())
            calls += 1

        ids, _, prefill_s = run_decode(model, input_ids, attention_mask, cache, max_new_tokens=new_tokens,
                                       sampler=BENCH_SAMPLER, seeds=[seed + r for r in range(batch)],
                                       ignore_eos=True, on_token=on_token)
        if cuda:
            torch.cuda.synchronize(device)
    if any(len(r) != new_tokens for r in ids):
        raise RuntimeError(f"{method}: expected {new_tokens} tokens per row, got {[len(r) for r in ids]}")

    out = _step_measures(stamps, evict_marks, batch, segments, prefill_s)
    if compiled and method != "full":
        from ..generation.compiled import decode_compiled

        cache = decode_compiled.last_cache or cache  # the static form the steps ran on
    out.update(_cache_measures(cache, timer, compiled, out["decode_s"]))
    out.update(peak_mem_bytes=memory.peak, peak_mem_delta_bytes=memory.delta, mem_method=memory.method)
    del cache
    return out


def _check_clock(model, clock: str) -> None:
    """ValueError for a clock `run_one` cannot read: an unknown one, or "cpu" off a one-thread CPU run."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and (device_of(model).type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("clock='cpu' times one CPU thread: run on the CPU with one torch thread (--threads 1)")


def _run_request(method: str, budget: int | None, window: int, seed: int, method_params: dict,
                 request: Request | None) -> Request:
    """The request one run builds its cache from: `request` (carried; seeded with `seed`), else validated here (the
    method's parameters are not full's: full runs in full precision without them)."""
    if request is None:
        params = method_params if method not in BASELINES else {}
        return RequestSpec.of(method, budget, window, seed=seed, **params).validate()  # budget None: the placeholder
    if not isinstance(request, Request) or request.method != method or request.window != window or (
            budget is not None and request.budget != budget):
        raise ValueError(f"request must be the validated Request of {method!r} at budget {budget}, window {window} "
                         f"(RequestSpec(...).validate()), got {request!r}")
    if request.seed == seed:
        return request
    check_seed(seed)
    return replace(request, seed=seed)


def _bench_cache(model, method: str, request: Request | None, batch: int, prompt_length: int, new_tokens: int,
                 compiled: bool, cache_tokens: int | None, now, device: torch.device):
    """The cache one run decodes into (built from `request`, not read for `dynamic`), its eviction timer (None:
    nothing to time) and the decode loop to run."""
    timer = None
    if method == "dynamic":
        cache = _dynamic_cache(model)
    else:
        cache = EvictionCache.from_request(model, request, max_length=prompt_length + new_tokens)
        timer = _EvictTimer(cache, device, now)  # eager evictions only (the compiled ones run inside the step)
    run_decode = decode
    if compiled:
        from ..generation.compiled import compile_cache, decode_compiled

        cache = compile_cache(model, cache, batch, prompt_length + max(new_tokens, cache_tokens or 0))
        run_decode = decode_compiled
        if method == "full":
            timer = None
    return cache, timer, run_decode


def _eviction_counter(cache, timer, compiled: bool) -> Callable[[], int]:
    """A function reading how many times the first evicting layer has evicted so far (0 without a timer)."""
    first_layer = cache.evicting_layers[0] if timer is not None else None
    if compiled and timer is not None:
        from ..generation.compiled import decode_compiled

        def evictions_now() -> int:  # the static cache counts once the steps are compiled
            return (decode_compiled.last_cache or first_layer.cache).layers[0].evictions
    else:
        def evictions_now() -> int:
            return first_layer.evictions if first_layer is not None else 0
    return evictions_now


def _step_measures(stamps: list[float], evict_marks: list[int], batch: int, segments: int, prefill_s: float) -> dict:
    """Rates and step times from the per-step stamps and eviction counts of one run."""
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    evicted = [b > a for a, b in itertools.pairwise(evict_marks)]
    decode_s = sum(steps)
    return {
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "tok_s": len(steps) * batch / decode_s if decode_s > 0 else math.nan,
        "seg_tok_s": segment_rates(steps, batch, segments),
        # the same parts over the steps after the first eviction: the steady state of a bounded cache
        "steady_tok_s": segment_rates(steps[evicted.index(True) + 1:], batch, segments) if any(evicted) else [],
        "step_ms": 1000 * statistics.median(steps) if steps else math.nan,
        "evict_step_ms": evict_step_cost(steps, evicted),
    }


def _cache_measures(cache, timer, compiled: bool, decode_s: float) -> dict:
    """Evictions, K/V bytes and eviction time of the cache a run ended with."""
    if timer is not None:
        stats = cache.stats()
        # Eager evictions are timed call by call; compiled ones run inside the step graph (not separable).
        evict_s = timer.total_seconds() if not compiled else math.nan
        return dict(evictions=stats["evictions"], kv_bytes=stats["kv_bytes"],
                    kv_bytes_alloc=stats["kv_bytes_capacity"], kv_bytes_full=stats["kv_bytes_full"],
                    stored_length=stats["stored_length"],
                    evict_ms=1000 * evict_s / stats["evictions"] if stats["evictions"] and not compiled else math.nan,
                    evict_share=evict_s / decode_s if stats["evictions"] and decode_s > 0 else math.nan)
    kv = dynamic_kv_bytes(cache)
    return dict(evictions=0, kv_bytes=kv, kv_bytes_alloc=kv, kv_bytes_full=kv,
                stored_length=int(cache.get_seq_length()), evict_ms=math.nan, evict_share=math.nan)


def run_bench(model, methods: Sequence[str], budgets: Sequence[int], output_lengths: Sequence[int],
              batch_sizes: Sequence[int], prompt_length: int = 128, window: int = 64, warmup: int = 1,
              repeats: int = 3, segments: int = 4, include_dynamic: bool = True, seed: int = 0,
              include_full: bool = True, warmup_tokens: int | None = None,
              progress: Callable[[dict], None] | None = None, compile: bool | str = False,
              bandwidth: float | str | None = "probe", clock: str = "wall",
              requests: Mapping[tuple[str, int], Request] | None = None, **method_params) -> list[dict]:
    """Benchmark decode throughput and memory; one row per (batch, method, budget, output length).

    `methods` are eviction methods (run at every budget); `full` (owned cache, no eviction) and,
    with `include_dynamic`, `dynamic` (transformers' DynamicCache) are added once per batch size
    and length as references. Each configuration first gets `warmup` untimed runs of
    `warmup_tokens` new tokens (default: the first output length), once per batch size; then,
    for each output length, the `repeats` timed runs go round-robin over the configurations
    (so a change in machine load during the benchmark hits every method alike); rows report
    medians.
    `progress(row)` is called as each row completes. See the module docstring for what each
    column means. Speed-up ratios (`vs_full`, `vs_dynamic`) compare with the references at the
    same batch and output length; they are left empty for a row whose eviction never fired.
    `compile`: False (eager), True (compiled steps, `run_one`), or "both": every configuration but
    `dynamic` runs eager and compiled (rows `compiled` False / True; ratios compare like with like).

    The ceiling (docs/bench.md): each row carries the bytes per decode step of the traffic model
    (`vase.bench.traffic`); `bandwidth` (bytes/s; "probe": measured once here by
    `vase.bench.bandwidth.probe_bandwidth`; None: not measured) turns them into the fastest rate the
    memory allows (`roofline_tok_s`) and the share of it reached; `add_ratios` puts beside each ratio
    the ratio the traffic model allows (`ceiling_vs_full`, ...) and the share of that gain reached.
    Repeats are paired: round r runs every configuration once (A, B, A, B, ...), and each ratio is
    the median over rounds of that round's ratio, with its range (`vs_full_lo` .. `vs_full_hi`).
    `clock`: "wall", or "cpu" (`run_one`: CPU time of one thread, for a loaded shared machine).
    `requests`: the validated request of each evicting (method, budget) (the CLI's door, `checked_requests`); the
    others are validated here, once each, from `window`, `seed` and `method_params`; every run carries its request.
    """
    configs = _bench_configs(methods, budgets, output_lengths, batch_sizes, prompt_length, warmup, repeats,
                             include_full, include_dynamic, compile)
    carried = _bench_requests(configs, window, seed, method_params, requests or {})
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    bandwidth, sizes = _traffic_inputs(model, device, bandwidth)
    was_training = model.training
    original_attn = model.config._attn_implementation
    model.eval()
    rows: list[dict] = []
    warmed: set[tuple] = set()
    try:
        for batch in batch_sizes:
            for length in output_lengths:
                for method, budget, comp in configs:
                    # A compiled full cache has the output length in its shape: warm up (compile) per length.
                    warm_key = (batch, method, budget, comp, length if comp and method == "full" else None)
                    if warm_key not in warmed:
                        for _ in range(max(warmup, 1 if comp else 0)):  # compiling is never timed
                            run_one(model, method, budget, warmup_tokens or length, batch, prompt_length, window,
                                    segments, seed, compile=comp, cache_tokens=length, clock=clock,
                                    request=carried.get((method, budget)))
                        warmed.add(warm_key)
                runs: dict[tuple, list[dict]] = {cfg: [] for cfg in configs}
                # paired rounds (A, B, A, B, ...), so drifting machine load hits every method alike
                for rep, (method, budget, comp) in alternating(configs, repeats):
                    runs[(method, budget, comp)].append(run_one(model, method, budget, length, batch,
                                                                prompt_length, window, segments, seed,
                                                                compile=comp, clock=clock,
                                                                request=carried.get((method, budget))))
                    if rep == repeats - 1:  # this configuration is done: report it now
                        row = summarise(runs[(method, budget, comp)], model, device, dtype, method, budget,
                                         length, batch, prompt_length, window, repeats, comp)
                        add_traffic(row, model, sizes, bandwidth, method_params)
                        row["clock"] = clock
                        rows.append(row)
                        if progress is not None:
                            progress(dict(row))
    finally:
        if model.config._attn_implementation != original_attn:  # as we found it
            model.set_attn_implementation(original_attn)
        model.train(was_training)
    return add_ratios(rows)


def _bench_configs(methods: Sequence[str], budgets: Sequence[int], output_lengths: Sequence[int],
                   batch_sizes: Sequence[int], prompt_length: int, warmup: int, repeats: int, include_full: bool,
                   include_dynamic: bool, compile: bool | str) -> list[tuple[str, int | None, bool]]:
    """The (method, budget, compiled) configurations `run_bench` times, after checking its settings (ValueError)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not output_lengths or min(output_lengths) < 2:
        raise ValueError("output lengths must be >= 2 tokens (one decode step needs two tokens)")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("batch sizes must be >= 1")
    if prompt_length < 1:
        raise ValueError(f"prompt_length must be >= 1, got {prompt_length}")
    evicting = [m for m in dict.fromkeys(methods) if m not in BASELINES]
    if evicting and not budgets:
        raise ValueError("give at least one budget for the evicting methods")
    configs: list[tuple[str, int | None]] = []
    if include_full or "full" in methods:
        configs.append(("full", None))
    if include_dynamic or "dynamic" in methods:
        configs.append(("dynamic", None))
    configs += [(m, b) for m in evicting for b in budgets]
    modes = [False, True] if compile == "both" else [bool(compile)]
    return [(m, b, c) for m, b in configs for c in modes if not (c and m == "dynamic")]


def _bench_requests(configs: Sequence[tuple[str, int | None, bool]], window: int, seed: int, method_params: dict,
                    given: Mapping[tuple[str, int], Request]) -> dict[tuple[str, int | None], Request]:
    """run_bench's door: the request of every (method, budget) but `dynamic`, the given one (a validated
    `Request`) or validated here once (SpecError, one line); every run of the configuration carries it."""
    out: dict[tuple[str, int | None], Request] = {}
    for method, budget, _ in configs:
        if method == "dynamic" or (method, budget) in out:
            continue
        request = given.get((method, budget))
        out[method, budget] = _run_request(method, budget, window, seed, method_params, request)
    return out


def _traffic_inputs(model, device: torch.device, bandwidth: float | str | None):
    """The memory bandwidth in bytes/s ("probe": measured now) and the traffic model's byte counts (None: a shape
    it cannot count) behind each row's ceiling."""
    if bandwidth == "probe":
        from .bandwidth import probe_bandwidth

        bandwidth = probe_bandwidth(device)
    elif isinstance(bandwidth, str):
        raise ValueError(f"bandwidth must be 'probe', a number of bytes/s or None, got {bandwidth!r}")
    try:
        sizes = ModelBytes.from_model(model)
    except (AttributeError, TypeError, ValueError):  # a shape the traffic model cannot count: rows without ceiling
        sizes = None
    return bandwidth, sizes


def default_out_dir() -> Path:
    return Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
