"""The evaluation runner: how much does method X at budget B cost on task T?

    from vase.eval.config import EvalConfig
    from vase.eval.runner import run_eval
    run_dir = run_eval(EvalConfig(task="arith", limit=6, methods=["vase-attnv"], budgets=[96]))

Work is cut into units (one problem x one method/budget, its ``samples`` completions generated
as one batch; several problems share a batch when ``batch_size`` allows). ``full`` runs once per
problem as the reference. Sample ``s`` of problem ``i`` uses the seed :func:`sample_seed`
``(config.seed, i, s)`` under every method, so each completion pairs with the full cache's
completion of the same seed (the agreement metric).

Every finished completion is appended to ``samples.rank{R}.jsonl`` at once (flushed, fsync'ed),
so a killed run loses at most the batch in flight; running the same command again skips what
is stored. Under torchrun/accelerate (``RANK``/``WORLD_SIZE`` set) rank R takes the problems
``i % WORLD_SIZE == R``; a gloo barrier at the end lets rank 0 write the summary.

Run directory (``<output_dir>/<run_name>``)::

    config.json               the run identity and every method's full parameters (never overwritten)
    starts.jsonl              one line per process start (rank, world, device, batch size, ...)
    provenance.jsonl          commit (dirty flag), machine, versions and load at each process's start and end
    samples.rank{R}.jsonl     one record per finished completion (see SAMPLE_FIELDS)
    fidelity.rank{R}.jsonl    one record per (problem, method, budget) when fidelity is on
    summary.csv / summary.md  per (method, budget) table, rebuilt from the JSONL by report.summarize
    accuracy_vs_budget.png, failures.png, fidelity_kl_vs_budget.png
"""

from __future__ import annotations

import logging
import re
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vase.core import schedule
from vase.engines.base import kv_bytes_per_token  # noqa: F401 - re-exported (tests, callers)
from vase.core.capabilities import ENGINES, engine_class
from vase.eval.config import FULL, ConfigError, EvalConfig, MethodSpec
from vase.eval.identity import identity, identity_hash, run_name, runtime_identity
from vase.eval.distributed import Dist, dist_env
from vase.eval.failures import classify_failure
from vase.eval.fidelity_pass import FidelityPass
from vase.eval.grading import extract_answer, is_correct
from vase.eval.metrics import kv_schedule
from vase.eval.prompts import build_user_message
from vase.eval.run_files import RunConflictError, append_line, write_run_config
from vase.eval.run_provenance import record_end, record_start
from vase.eval.sample_rows import finite, problem_label, row_cache_stats, sample_seed
from vase.eval.store import (
    FIDELITY,
    FIDELITY_KEY,
    SAMPLE_KEY,
    SAMPLES,
    JsonlStore,
    fsync_dir,
    rank_path,
    read_all,
    record_key,
)
from vase.eval.tasks import Problem, load_task

__all__ = [
    "run_eval",
    "RunConflictError",
    "sample_seed",
    "dist_env",
    "row_cache_stats",
    "kv_bytes_per_token",
    "write_run_config",
    "SAMPLE_FIELDS",
    "FIDELITY_FIELDS",
    "VOLATILE_FIELDS",
]

log = logging.getLogger(__name__)

#: Fields of a sample record.
SAMPLE_FIELDS: tuple[str, ...] = (
    "problem_id", "problem_index", "sample", "method", "budget", "seed", "gold", "answer", "correct",
    "length", "prompt_length", "finished", "failure", "text", "kv_bytes", "kv_bytes_peak", "kv_bytes_full",
    "evictions", "kv_bytes_time_mean", "kv_bytes_allocated", "token_ids", "seconds", "prefill_seconds",
    "tokens_per_s", "batch_rows", "rank",
)
#: ``*_evicted``: the same means over the targets after the first eviction only (``first_evicted`` on);
#: ``noise_*`` (full's record): full teacher-forced in chunks of ``w`` against full in one chunk.
FIDELITY_FIELDS: tuple[str, ...] = (
    "problem_id", "problem_index", "method", "budget", "seed", "n_tokens", "kl_mean", "top1_agree",
    "top1_disagree_share", "dnll_mean", "first_evicted", "n_tokens_evicted", "kl_mean_evicted",
    "top1_agree_evicted", "dnll_mean_evicted", "noise_kl_mean", "noise_top1_agree", "noise_kl_tokens", "seconds",
    "rank",
)
#: Fields that depend on timing or on how the work was split, not on the results.
VOLATILE_FIELDS: tuple[str, ...] = ("seconds", "prefill_seconds", "tokens_per_s", "batch_rows", "rank")


# ----------------------------------------------------------------------------- the run


@dataclass
class _Unit:
    label: str
    budget: int | None


class _Runner(FidelityPass):
    def __init__(self, config: EvalConfig, model, tokenizer, generate_fn, forced_fn, progress: bool, engine=None):
        self.config = config
        # The engine everything is generated and teacher-forced with: a vase.engines.VllmEngine (--engine vllm),
        # else a TransformersEngine over the model (and generate_fn / forced_fn), built when the model is needed.
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.generate_fn = generate_fn
        self.forced_fn = forced_fn
        self.show_progress = progress
        self.rank, self.world, self.local_rank = dist_env()
        self.specs: dict[str, MethodSpec] = config.method_specs()
        self.units = [_Unit(FULL, None)] + [
            _Unit(label, b) for label, s in self.specs.items() if label != FULL for b in config.budgets]
        self._bpt: int | None = None

    # -- setup -----------------------------------------------------------------------------------
    def prepare(self) -> Path:
        c = self.config
        self.problems: list[Problem] = load_task(
            c.task_name, data_dir=c.data_dir, task_file=c.task_file, question_field=c.question_field,
            answer_field=c.answer_field, limit=c.limit, seed=c.seed)
        # The settings name the run; the runtime fields (model content hash, resolved dtype, device, kernel,
        # versions) are checked on resume, so a changed model is refused instead of mixed in.
        ident = {**identity(c, self.problems), **runtime_identity(c, self.model)}
        name = run_name(c, self.problems)
        self.run_dir = Path(c.output_dir).expanduser() / name
        if self.run_dir.exists() and not self.run_dir.is_dir():  # mkdir would say only "[Errno 17] File exists"
            raise ConfigError(f"the run folder {self.run_dir} is a file: give the run another name (the config's `name` "
                              f"setting), or another --output-dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.run_dir.parent)  # the new run folder survives a crash
        from vase import __version__

        meta = {
            "name": name,
            "hash": identity_hash(ident),
            "identity": ident,
            "methods": {label: s.describe() for label, s in self.specs.items()},
            "config": c.to_dict(),
            "seeds": "sample_seed(seed, problem_index, sample): sha256-based, the same for every method",
            "vase_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_run_config(self.run_dir, meta)
        return self.run_dir

    def _ensure_model(self) -> None:
        if self.engine is not None:  # vLLM loads the model itself; the runner needs the tokenizer and K/V size
            self.engine.start()
            self.tokenizer, self._bpt = self.engine.tokenizer, self.engine.bytes_per_token
            return
        from vase.engines.transformers import TransformersEngine

        fns = {"generate_fn": self.generate_fn, "forced_fn": self.forced_fn}
        if self.model is not None and self.tokenizer is not None:
            self.engine = TransformersEngine(self.model, self.tokenizer, **fns)
            return
        if self.model is not None or self.tokenizer is not None:
            raise ValueError("pass both model and tokenizer, or neither (then config.model is loaded)")
        device = self.config.device
        if self.world > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
            device = f"cuda:{self.local_rank % torch.cuda.device_count()}"
        self.engine = TransformersEngine.load(self.config.model, dtype=self.config.dtype, device=device,
                                              attn_implementation=self.config.attn_implementation, **fns)
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer

    @property
    def bytes_per_token(self) -> int:
        if self._bpt is None:
            self._bpt = self.engine.bytes_per_token
        return self._bpt

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> None:
        c = self.config
        mine = [i for i in range(len(self.problems)) if i % self.world == self.rank]
        samples_path = rank_path(self.run_dir, SAMPLES, self.rank)
        fidelity_path = rank_path(self.run_dir, FIDELITY, self.rank)
        with ExitStack() as stack:
            samples = stack.enter_context(JsonlStore(samples_path, SAMPLE_KEY))
            # Work finished by any rank (the world size may have changed since) counts as done.
            all_samples = read_all(self.run_dir, SAMPLES)
            done = {record_key(r, SAMPLE_KEY) for r in all_samples} | samples.keys
            self.references = {r["problem_id"]: r for r in all_samples
                               if r.get("method") == FULL and r.get("sample") == 0}
            del all_samples  # whole completions: keep only keys and the reference trajectories
            fid_store = fid_done = None
            if c.fidelity:
                fid_store = stack.enter_context(JsonlStore(fidelity_path, FIDELITY_KEY))
                fid_done = {record_key(r, FIDELITY_KEY) for r in read_all(self.run_dir, FIDELITY)} | fid_store.keys

            def pending_of(i: int, u: _Unit) -> list[int]:
                pid = self.problems[i].id
                return [s for s in range(c.samples) if (u.label, u.budget, pid, s) not in done]

            total = len(mine) * len(self.units) * c.samples
            todo = sum(len(pending_of(i, u)) for i in mine for u in self.units)
            fid_total = len(mine) * len(self.units) if c.fidelity else 0
            fid_todo = 0
            if c.fidelity:
                fid_todo = sum((u.label, u.budget, self.problems[i].id) not in fid_done
                               for i in mine for u in self.units)
            self._append_start(total - todo, total)
            if todo == 0 and fid_todo == 0:
                return
            self._ensure_model()

            bar = self._progress(stack)
            task = fid_task = None
            if bar is not None:
                task = bar.add_task(f"rank {self.rank}: samples", total=total, completed=total - todo)
                if c.fidelity:
                    fid_task = bar.add_task(f"rank {self.rank}: fidelity", total=fid_total,
                                            completed=fid_total - fid_todo)

            per_batch, rows = max(1, c.batch_size // c.samples), c.batch_size
            if ENGINES[self.engine.name].internal_batching:  # vLLM: every pending sample of a method in one call
                per_batch, rows = max(1, len(mine)), max(1, len(mine) * c.samples)
            for g in range(0, len(mine), per_batch):
                group = mine[g:g + per_batch]
                for u in self.units:
                    work = [(i, s) for i in group for s in pending_of(i, u)]
                    for b in range(0, len(work), rows):
                        batch = work[b:b + rows]
                        if bar is not None:
                            bar.update(task, description=f"rank {self.rank}: {u.label}"
                                       + (f" B={u.budget}" if u.budget is not None else ""))
                        for rec in self._generate(u, batch):
                            samples.append(rec)
                            done.add(record_key(rec, SAMPLE_KEY))
                            if rec["method"] == FULL and rec["sample"] == 0:
                                self.references[rec["problem_id"]] = rec
                        if bar is not None:
                            bar.advance(task, len(batch))
                if c.fidelity:
                    for i in group:
                        n = self._fidelity(i, fid_store, fid_done)
                        if bar is not None and n:
                            bar.advance(fid_task, n)

    def _progress(self, stack: ExitStack):
        if not self.show_progress or self.rank != 0:
            return None
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        return stack.enter_context(Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()))

    def _append_start(self, done: int, total: int) -> None:
        c = self.config
        append_line(self.run_dir / "starts.jsonl", {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "pid": os.getpid(),
            "rank": self.rank, "world_size": self.world, "samples_done": done, "samples_total": total,
            "batch_size": c.batch_size, "fidelity": c.fidelity, "device": c.device, "dtype": c.dtype,
            "model_given": self.model is not None,
        })

    # -- one batch -------------------------------------------------------------------------------
    def _generate(self, u: _Unit, batch: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        c = self.config
        spec = self.specs[u.label]
        prompts = [build_user_message(self.problems[i]) for i, _ in batch]
        seeds = [sample_seed(c.seed, i, s) for i, s in batch]
        # The config's validated request, carried down as it is; the full cache has no budget (u.budget None): the
        # request spec gave it the placeholder.
        try:
            out = self.engine.generate(
                prompts, request=c.request(u.label, u.budget), max_new_tokens=c.max_new_tokens,
                temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, greedy=c.greedy, seed=seeds,
                chat_template=c.chat_template)
        except ValueError as e:  # "prompt 1 is too long" counts this call's prompts: name the problem and its row
            m = re.match(r"prompt (\d+)\b", str(e))
            if m is None or int(m.group(1)) >= len(batch):
                raise
            raise ValueError(problem_label(self.problems[batch[int(m.group(1))][0]]) + str(e)[m.end():]) from None
        if len(out.texts) != len(batch):
            raise RuntimeError(f"generate returned {len(out.texts)} completions for {len(batch)} prompts")
        seconds = finite(out.seconds)
        prefill = finite(getattr(out, "prefill_seconds", None))
        tps = finite(getattr(out, "tokens_per_second", None))
        stats = dict(getattr(out, "stats", None) or {})
        per_row = stats.get("rows") if isinstance(stats.get("rows"), list) else None
        records = []
        for r, (i, s) in enumerate(batch):
            p = self.problems[i]
            text = out.texts[r]
            ids = list(out.token_ids[r])
            finished = bool(out.finished[r])
            row = per_row[r] if per_row and r < len(per_row) else None
            cache = self._row_stats(spec, u.budget, int(out.prompt_lengths[r]), len(ids), finished, row,
                                    stats.get("capacity"))
            rec: dict[str, Any] = {
                "problem_id": p.id,
                "problem_index": i,
                "sample": s,
                "method": u.label,
                "budget": u.budget,
                "seed": seeds[r],
                "gold": p.answer,
                "answer": extract_answer(text, numeric_fallback=c.numeric_fallback),
                "correct": bool(is_correct(text, p.answer, numeric_fallback=c.numeric_fallback)),
                "length": len(ids),
                "prompt_length": int(out.prompt_lengths[r]),
                "finished": finished,
                "failure": classify_failure(text, hit_length_cap=not finished, end_marker=c.end_marker),
                "text": text,
                **cache,
                "seconds": seconds,
                "prefill_seconds": prefill,
                "tokens_per_s": tps,
                "batch_rows": len(batch),
                "rank": self.rank,
            }
            rec.update(self._kv_over_time(spec, u.budget, rec, stats, row))
            # Every completion keeps its ids: full's sample 0 is the fidelity trajectory, and the
            # first divergence from full's same-seed completion is counted in tokens.
            rec["token_ids"] = [int(t) for t in ids]
            records.append(rec)
        return records

    def _kv_over_time(self, spec: MethodSpec, budget: int | None, rec: dict[str, Any],
                      stats: dict[str, Any], row: dict | None = None) -> dict[str, int | float | None]:
        """Time-averaged K/V bytes of the sequence (from the eviction schedule, kept only when the schedule's
        eviction count equals the cache's own; a quantized cache's own sum, ``kv_byte_steps`` of its per-row
        stats, when given) and the bytes its cache allocated (capacity slots).

        A quantized evicting cache without its own sum gets None once it evicted: which full-precision
        entries survive an eviction is the policy's choice, which the schedule does not know."""
        P, n = rec["prompt_length"], rec["length"]
        seen = P + n - (0 if rec["finished"] or n == 0 else 1)  # the token sampled at the cap is never fed
        sched = kv_schedule(P, seen, budget=budget, window=self.config.window, evicts=spec.evicts)
        agree = rec.get("evictions") is None or int(rec["evictions"]) == sched["evictions"]
        cap = stats.get("capacity")
        cap = int(cap) if isinstance(cap, int) and cap > 0 else None
        quant = self._quant_bytes(spec, budget)
        bounded = self._bounded_mean(P, seen)  # a hybrid model's sliding and linear-attention layers
        if quant is not None:  # kv_bits: the quantized cache's own bytes (codes, exact entries, tags) per step
            c = cap or (schedule.first_limit(P, budget, self.config.window) if spec.evicts else seen)
            steps = seen - P
            if not steps:
                mean = quant.held(P, 0, c)
            elif row is not None and "kv_byte_steps" in row:  # the cache's own bytes, summed over its steps
                mean = int(row["kv_byte_steps"]) / steps
            elif spec.evicts and sched["evictions"]:
                mean = None  # unknown: see the docstring
            else:  # nothing evicted: the schedule's count of exact and quantized entries is the cache's
                mean = quant.byte_steps(P, steps, c, budget, spec.evicts) / steps
            return {"kv_bytes_time_mean": mean + bounded if agree and mean is not None else None,
                    "kv_bytes_allocated": quant.allocated(cap) + bounded if cap else None}
        return {"kv_bytes_time_mean": sched["time_mean"] * self.bytes_per_token + bounded if agree else None,
                "kv_bytes_allocated": cap * self.bytes_per_token + bounded if cap else None}

    def _bounded_mean(self, prompt_length: int, seen: int) -> float:
        """Time-averaged bytes of the layers vase does not evict (`vase.hf.hybrid.bounded_bytes_mean`); 0 without
        a transformers model or for a model with full attention throughout."""
        from vase.hf.hybrid import bounded_bytes_mean, is_hybrid

        if self.model is None or not is_hybrid(self.model.config):
            return 0.0
        size = next(self.model.parameters()).element_size()
        return bounded_bytes_mean(self.model.config, size, prompt_length, seen)

    def _quant_bytes(self, spec: MethodSpec, budget: int | None):
        """The byte model of the method's storage (`vase.storage.registry.byte_model`, e.g. `QuantBytes` for kv_bits);
        None when it holds dense bytes per token."""
        if spec.storage is None:
            return None
        from vase.storage.registry import byte_model

        return byte_model(self.model, spec.policy, budget, self.config.window, spec.storage)

    def _row_stats(self, spec: MethodSpec, budget: int | None, prompt_length: int, n_generated: int,
                   finished: bool, row: dict | None, capacity: Any = None) -> dict[str, int | None]:
        """The sequence's cache stats as `generate` reported them, else derived from the eviction schedule
        (for a custom generate_fn without per-row stats; `capacity`: the batch's cache slots, which size a
        quantized cache's slot tags, else the schedule's first limit).

        Derived for a quantized cache: the peak is exact (reached at the first eviction, before any exact
        entry was evicted); the bytes held after an eviction are None (which exact entries survived is the
        policy's choice, which the schedule does not know)."""
        keys = ("kv_bytes", "kv_bytes_peak", "kv_bytes_full", "evictions")
        if row is not None and all(k in row for k in keys):
            return {k: int(row[k]) for k in keys}
        est = row_cache_stats(prompt_length, n_generated, finished, budget=budget, window=self.config.window,
                              evicts=spec.evicts, bytes_per_token=self.bytes_per_token)
        bounded = round(self._bounded_mean(est["seen_length"], est["seen_length"]))  # at the final length
        for k in ("kv_bytes", "kv_bytes_peak", "kv_bytes_full"):
            est[k] += bounded
        quant = self._quant_bytes(spec, budget)
        if quant is not None:  # the held and peak bytes of the quantized cache (the full reference stays dense)
            steps = est["seen_length"] - prompt_length
            cap = capacity if isinstance(capacity, int) and capacity > 0 else \
                schedule.first_limit(prompt_length, budget, self.config.window) if spec.evicts else est["seen_length"]
            peak_step = est["peak_length"] - prompt_length  # the peak is reached before the first eviction
            est["kv_bytes"] = None if spec.evicts and est["evictions"] else \
                quant.held(est["stored_length"], steps, cap) + bounded
            est["kv_bytes_peak"] = quant.held(est["peak_length"], peak_step, cap) + bounded
        return {k: est[k] for k in keys}

def run_eval(config: EvalConfig, model=None, tokenizer=None, generate_fn: Callable | None = None,
             progress: bool = True, *, forced_fn: Callable | None = None, summarize: bool = True,
             wide: bool = False) -> Path:
    """Run (or resume) an evaluation; returns the run directory.

    Args:
        config: what to run (see :class:`EvalConfig`).
        model, tokenizer: an already-loaded model; otherwise ``config.model`` is loaded with
            :func:`vase.models.load_model`, only if something is left to do. When passing a model,
            set ``config.model`` to a label that identifies it: it is part of the run's identity.
        generate_fn: ``vase.generate`` or anything with its signature and output.
        forced_fn: ``vase.forced_log_probs`` or a stand-in (fidelity only).
        progress: show a progress bar with ETA (rank 0) and print the summary table.
        summarize: write summary.csv/md and plots when done (rank 0, after every rank finished).
        wide: print every column of the table, not the default ones that fit the terminal.

    Raises:
        ConfigError / RunConflictError: bad settings, or the run dir holds a different run.
        TaskError: the task cannot be loaded.
    """
    engine = None
    if ENGINES[config.engine].loads_model and generate_fn is None:  # the others wrap the model and generate_fn below
        engine = engine_class(config.engine)(config.model, dtype=config.dtype, device=config.device, seed=config.seed)
    if generate_fn is None:
        from vase.generation.generate import generate as generate_fn
    if forced_fn is None:
        from vase.generation.generate import forced_log_probs as forced_fn
    if model is not None and config.model is None:
        warnings.warn("a model object was passed but config.model is None: the run is labelled as the default "
                      "model; set config.model to a label that identifies the model", stacklevel=2)
    runner = _Runner(config, model, tokenizer, generate_fn, forced_fn, progress, engine=engine)
    dist = Dist(runner.world, runner.rank)
    try:
        run_dir = runner.prepare()
        started = record_start(run_dir, runner.rank)  # the run's own commit, machine and load (scripts/eval_results.py)
        runner.run()
        record_end(run_dir, started)
        dist.barrier()
        if summarize and runner.rank == 0:
            from vase.eval.report import summarize as _summarize

            try:
                _summarize(run_dir, print_table=progress, wide=wide)
            except Exception as e:
                # Results are safe on disk, but an old summary must not pass for this one.
                for stale in ("summary.csv", "summary.md"):
                    (run_dir / stale).unlink(missing_ok=True)
                raise RuntimeError(f"writing the summary of {run_dir} failed ({type(e).__name__}: {e}); the "
                                   f"results are safe: fix the cause and run `vase summarize {run_dir}`") from e
    finally:
        dist.close()
        if engine is not None:
            engine.close()
    return run_dir
