"""The vLLM plugin at serving scale (issue 39's scale bench, parts 1 and 3), stock vLLM beside vase in one run.

    OMP_NUM_THREADS=1 python benchmarks/vllm_scale.py --part requests --results docs/results/vllm-scale-requests.json
    OMP_NUM_THREADS=1 python benchmarks/vllm_scale.py --part preemption \
        --results docs/results/vllm-scale-preemption.json

Both parts run the tiny random Llama of the vLLM tests (`tests/vllm_tiny.py`: 2 layers, 4 query and 2 KV heads,
head_dim 32, fp32) on vLLM's CPU build, in process, one OpenMP thread, greedy, EOS ignored, blocks of 32 tokens.
Each engine is built once; the repeats alternate stock and vase (stock first in even repeats, vase first in odd
ones) on the same engines. Times: wall clock for tok/s, and the process's CPU time (`time.process_time`: what
other processes on a shared machine take does not count) for tok per CPU-second; the scheduler's
`schedule()` + `update_from_output()` and the worker's eviction (`_vase_evict`) in thread CPU time.

1. `requests`: k requests (distinct random 20-token prompts, `--tokens` new tokens each) submitted at once into a
   pool that holds all of them at full length (neither engine preempts; all k run together); vase is snapkv
   B = 48, w = 16, so all k evict together at the same steps (the worst case: first at 44 tokens generated, then
   every 16). Per k: tok/s, scheduler ms per step, eviction ms per step (the whole run's eviction time over its
   steps) and per evicting step.
2. `preemption`: `--long` requests (distinct random 16-token prompts, `--tokens` new tokens) submitted at once
   into a pool of `--pool` blocks; vase is snapkv B = 48, w = 32 (a bounded request holds at most 3 blocks).
   Once the last-admitted running request (the one vLLM's scheduler preempts first) holds `--preempt-at` tokens
   (200: past its evictions in vase), it is preempted as vLLM preempts (`_preempt_request`), and `--late` short
   requests (16-token prompts, 32 new tokens) arrive behind it; the pool's own preemptions count too. Stock
   vLLM runs the same requests in the same pool: it does not evict, so its requests grow to their full length
   (9 blocks at 16 + 256 tokens), fewer run at a time and it preempts at other steps; what is compared is the
   same workload and the same forced preemption in the same memory. Per engine: the preempted request's
   history and its steps to readmission (1: the next step), all preemptions (and those of requests past their
   first eviction), the median and largest steps from any preemption to readmission, the late requests' wait
   (steps from arrival to admission; 1: the next step), steps, tok/s, and whether each request's tokens equal
   those of the same engine with an ample pool (no preemption).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

BLOCK = 32
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32
REQ_B, REQ_W, REQ_PROMPT = 48, 16, 20  # part 1: a bounded request holds 2 blocks (64 slots)
PRE_B, PRE_W, PRE_PROMPT, LATE_TOKENS = 48, 32, 16, 32  # part 2: 2 blocks after a compaction, 3 before the next


def engine(path: str, vase: dict | None, pool_blocks: int, max_num_seqs: int, max_len: int, batched: int):
    """An in-process tiny-Llama engine whose KV pool has `pool_blocks` usable blocks (vLLM keeps one as its null
    block)."""
    from tests.vllm_tiny import start_llm

    return start_llm(dict(model=path, max_model_len=max_len, kv_cache_memory_bytes=(pool_blocks + 1) * BLOCK *
                          BYTES_PER_TOKEN, block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, enable_chunked_prefill=True),
                     vase)


def prompt(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(7000 + salt)
    return torch.randint(3, 90, (n,), generator=g).tolist()


class Meter:
    """Counts an engine's steps: the scheduler's and the eviction's thread CPU seconds, the requests each step
    scheduled, the preemptions (request id, step, tokens computed). Wraps the instances' methods (this
    benchmark's instrumentation; the plugin itself is unchanged)."""

    def __init__(self, llm):
        from tests.vllm_tiny import core, runner

        self.sched, self.runner = core(llm).scheduler, runner(llm)
        self.reset()
        schedule, update, preempt = self.sched.schedule, self.sched.update_from_output, self.sched._preempt_request

        def timed_schedule(*a, **k):
            t0 = time.thread_time()
            out = schedule(*a, **k)
            self.sched_s += time.thread_time() - t0
            self.scheduled.append({rid.rsplit("-", 1)[0] for rid in out.num_scheduled_tokens})
            return out

        def timed_update(*a, **k):
            t0 = time.thread_time()
            out = update(*a, **k)
            self.sched_s += time.thread_time() - t0
            return out

        def counted_preempt(request, *a, **k):
            # inside schedule() of step len + 1, which it then does not run in
            self.preempted.append((request.request_id.rsplit("-", 1)[0], len(self.scheduled) + 1,
                                   request.num_computed_tokens))
            return preempt(request, *a, **k)

        self.sched.schedule, self.sched.update_from_output = timed_schedule, timed_update
        self.sched._preempt_request = counted_preempt
        evict = getattr(self.runner, "_vase_evict", None)
        if evict is not None:
            def timed_evict(*a, **k):
                t0 = time.thread_time()
                out = evict(*a, **k)
                self.evict_s += time.thread_time() - t0
                self.evict_calls += 1
                return out
            self.runner._vase_evict = timed_evict

    def reset(self) -> None:
        self.sched_s = self.evict_s = 0.0
        self.evict_calls = 0
        self.scheduled: list[set[str]] = []  # per step (1-based: step s is index s - 1)
        self.preempted: list[tuple[str, int, int]] = []  # (request, step it was preempted in, tokens computed)


def drive(llm, meter: Meter, requests: dict[str, tuple[list[int], int]], on_step=None) -> dict:
    """Submit `requests` {id: (prompt, new tokens)} at once and step the engine until all finish; `on_step(step)`
    after each step may add requests. Returns tokens per request, steps, wall and CPU seconds."""
    from tests.vllm_tiny import greedy

    eng = llm.llm_engine
    llm.reset_prefix_cache()
    meter.reset()
    evictions = getattr(meter.runner, "vase_evictions", 0)
    for rid, (ids, n) in requests.items():
        eng.add_request(rid, {"prompt_token_ids": ids}, greedy(n))
    outputs, evicting_steps = {}, 0
    wall, cpu = time.perf_counter(), time.process_time()
    while eng.has_unfinished_requests():
        before = getattr(meter.runner, "vase_evictions", 0)
        for out in eng.step():
            if out.finished:
                outputs[out.request_id.rsplit("-", 1)[0]] = list(out.outputs[0].token_ids)
        evicting_steps += getattr(meter.runner, "vase_evictions", 0) > before
        if on_step is not None:
            on_step(len(meter.scheduled))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(t) for t in outputs.values())
    return {"outputs": outputs, "steps": len(meter.scheduled), "wall": wall, "cpu": cpu, "tokens": tokens,
            "tok_s": tokens / wall, "cpu_tok_s": tokens / cpu, "evicting_steps": evicting_steps,
            "evictions": getattr(meter.runner, "vase_evictions", 0) - evictions}


def spread(values: list[float], fmt: str = ".2f") -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def paired(engines: dict, repeats: int):
    """(repeat, name) alternating: stock then vase in even repeats, vase then stock in odd ones."""
    names = list(engines)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            yield r, name


def part_requests(path: str, counts: list[int], tokens: int, repeats: int) -> tuple[list[dict], dict]:
    from vase.vllm import additional_config

    top = max(counts)
    blocks = top * -(-(REQ_PROMPT + tokens) // BLOCK) + 8
    kw = dict(pool_blocks=blocks, max_num_seqs=top, max_len=REQ_PROMPT + tokens + 8, batched=max(2048, top * REQ_PROMPT))
    engines = {"stock": engine(path, None, **kw), "vase": engine(path, additional_config("snapkv", REQ_B, REQ_W), **kw)}
    meters = {name: Meter(llm) for name, llm in engines.items()}
    for name, llm in engines.items():  # warm-up
        drive(llm, meters[name], {"w": (prompt(REQ_PROMPT, 0), REQ_B + REQ_W)})
    rows = []
    for k in counts:
        got: dict[str, list[dict]] = {"stock": [], "vase": []}
        for r, name in paired(engines, repeats):
            reqs = {f"r{i}": (prompt(REQ_PROMPT, 100 * r + i + 1), tokens) for i in range(k)}
            res = drive(engines[name], meters[name], reqs)
            m = meters[name]
            assert max(len(s) for s in m.scheduled) == k and not m.preempted, (name, k)  # all k ran together
            res.update(sched_ms=1e3 * m.sched_s / res["steps"], evict_ms=1e3 * m.evict_s / res["steps"],
                       evict_ms_evicting=1e3 * m.evict_s / max(res["evicting_steps"], 1))
            got[name].append(res)
        s, v = got["stock"], got["vase"]
        col = lambda runs, key: [x[key] for x in runs]  # noqa: E731
        ratio = lambda key: [a[key] / b[key] for a, b in zip(v, s)]  # noqa: E731
        row = {"requests": k, "repeats": repeats,
               "stock_tok_s": statistics.median(col(s, "tok_s")), "vase_tok_s": statistics.median(col(v, "tok_s")),
               "tok_s_ratio": statistics.median(ratio("tok_s")), "tok_s_ratio_range": spread(ratio("tok_s")),
               "cpu_tok_s_ratio": statistics.median(ratio("cpu_tok_s")),
               "cpu_tok_s_ratio_range": spread(ratio("cpu_tok_s")),
               "stock_sched_ms": statistics.median(col(s, "sched_ms")),
               "vase_sched_ms": statistics.median(col(v, "sched_ms")),
               "sched_ratio": statistics.median(ratio("sched_ms")), "sched_ratio_range": spread(ratio("sched_ms")),
               "vase_evict_ms": statistics.median(col(v, "evict_ms")),
               "vase_evict_ms_range": spread(col(v, "evict_ms")),
               "vase_evict_ms_evicting": statistics.median(col(v, "evict_ms_evicting")),
               "evicting_steps": v[0]["evicting_steps"], "steps": v[0]["steps"]}
        print(row, flush=True)
        rows.append(row)
    keys = ["requests", "stock_tok_s", "vase_tok_s", "tok_s_ratio", "tok_s_ratio_range", "cpu_tok_s_ratio",
            "cpu_tok_s_ratio_range", "stock_sched_ms", "vase_sched_ms", "sched_ratio", "sched_ratio_range",
            "vase_evict_ms", "vase_evict_ms_range", "vase_evict_ms_evicting", "evicting_steps", "steps"]
    columns = ["running requests", "stock tok/s", "vase tok/s", "vase / stock tok/s", "range",
               "vase / stock tok per CPU-s", "range", "stock scheduler ms/step", "vase scheduler ms/step",
               "vase / stock", "range", "vase eviction ms/step", "range", "eviction ms per evicting step",
               "evicting steps", "steps"]
    formats = {k: ".2f" for k in keys if k.endswith(("ratio", "_ms", "_ms_evicting"))}
    formats.update({"stock_tok_s": ".0f", "vase_tok_s": ".0f"})
    return rows, {"columns": columns, "keys": keys, "align": "r" * len(keys), "formats": formats}


def preemption_stats(meter: Meter, arrivals: dict[str, int], first_limit: int) -> dict:
    """Steps from each preemption to the request's next scheduled step; steps from each late arrival (after step a)
    to its first scheduled step."""
    def next_scheduled(rid: str, after: int) -> int:
        return next(s for s in range(after + 1, len(meter.scheduled) + 1) if rid in meter.scheduled[s - 1])

    readmit = [next_scheduled(rid, step) - step for rid, step, _ in meter.preempted]
    late = [next_scheduled(rid, a) - a for rid, a in arrivals.items()]
    history = [n for _, _, n in meter.preempted]
    return {"preemptions": len(meter.preempted), "after_evicting": sum(n > first_limit for n in history),
            "history": history, "readmit": readmit, "late_wait": late}


def part_preemption(path: str, long: int, tokens: int, pool: int, late: int, repeats: int, preempt_at: int) -> tuple[list[dict], dict]:
    from vase.core import schedule
    from vase.vllm import additional_config

    vase_cfg = additional_config("snapkv", PRE_B, PRE_W)
    full = -(-(PRE_PROMPT + tokens) // BLOCK)
    kw = dict(max_num_seqs=long + late, max_len=PRE_PROMPT + tokens + 8, batched=256)
    ample = {"stock": engine(path, None, (long + late) * full + 4, **kw),
             "vase": engine(path, vase_cfg, (long + late) * full + 4, **kw)}
    engines = {"stock": engine(path, None, pool, **kw), "vase": engine(path, vase_cfg, pool, **kw)}
    meters = {name: Meter(llm) for name, llm in engines.items()}
    work = {f"r{i}": (prompt(PRE_PROMPT, 500 + i), tokens) for i in range(long)}
    extra = {f"late{j}": (prompt(PRE_PROMPT, 900 + j), LATE_TOKENS) for j in range(late)}
    reference = {name: drive(llm, Meter(llm), {**work, **extra})["outputs"] for name, llm in ample.items()}
    first_limit = schedule.first_limit(PRE_PROMPT, PRE_B, PRE_W)
    got: dict[str, list[dict]] = {"stock": [], "vase": []}
    for r, name in paired(engines, repeats):
        llm, meter = engines[name], meters[name]
        arrivals: dict[str, int] = {}

        forced: list[int] = []

        def add_late(step: int) -> None:
            """Once the last-admitted running request (vLLM's victim) holds `preempt_at` tokens, preempt it as
            vLLM does, and the late requests arrive behind it."""
            if arrivals or not meter.sched.running or meter.sched.running[-1].num_computed_tokens < preempt_at:
                return
            from tests.vllm_tiny import greedy

            victim = meter.sched.running[-1]
            meter.sched.running.remove(victim)
            forced.append(len(meter.preempted))
            meter.sched._preempt_request(victim, time.monotonic())
            meter.preempted[-1] = (meter.preempted[-1][0], step, meter.preempted[-1][2])  # after step `step`
            for rid, (ids, n) in extra.items():
                llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, greedy(n))
                arrivals[rid] = step

        res = drive(llm, meter, work, on_step=add_late)
        res.update(preemption_stats(meter, arrivals, first_limit))
        assert forced, f"{name}: no running request reached {preempt_at} tokens"
        res["forced_history"], res["forced_readmit"] = res["history"][forced[0]], res["readmit"][forced[0]]
        res["same"] = sum(res["outputs"].get(rid) == toks for rid, toks in reference[name].items())
        res["same_of"] = len(reference[name]) if arrivals else long
        print(name, r, {k: v for k, v in res.items() if k not in ("outputs", "history")}, flush=True)
        got[name].append(res)
    rows = []
    for name, runs in got.items():
        one = runs[0]
        for run in runs[1:]:  # greedy on a deterministic scheduler: the steps repeat exactly
            assert (run["preemptions"], run["readmit"], run["late_wait"]) == \
                (one["preemptions"], one["readmit"], one["late_wait"]), name
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        rows.append({"engine": "stock vLLM" if name == "stock" else f"vase snapkv B={PRE_B} w={PRE_W}",
                     "pool_blocks": pool, "requests": f"{long} + {len(one['late_wait'])} late",
                     "forced_history": one["forced_history"], "forced_readmit": one["forced_readmit"],
                     "preemptions": one["preemptions"], "after_evicting": one["after_evicting"],
                     "history_median": med(one["history"]), "history_max": max(one["history"], default=None),
                     "readmit_median": med(one["readmit"]), "readmit_max": max(one["readmit"], default=None),
                     "late_wait_max": max(one["late_wait"], default=None), "steps": one["steps"],
                     "tok_s": statistics.median([x["tok_s"] for x in runs]),
                     "tok_s_range": spread([x["tok_s"] for x in runs], ".0f"),
                     "cpu_tok_s": statistics.median([x["cpu_tok_s"] for x in runs]),
                     "cpu_tok_s_range": spread([x["cpu_tok_s"] for x in runs], ".0f"),
                     "same_tokens": f"{min(x['same'] for x in runs)} of {one['same_of']}", "repeats": repeats})
        print(rows[-1], flush=True)
    keys = ["engine", "pool_blocks", "requests", "forced_history", "forced_readmit", "preemptions", "after_evicting", "history_median", "history_max",
            "readmit_median", "readmit_max", "late_wait_max", "steps", "tok_s", "tok_s_range", "cpu_tok_s",
            "cpu_tok_s_range", "same_tokens"]
    columns = ["engine", "pool (blocks)", "requests", "preempted request's history (tokens)",
               "its steps to readmission", "preemptions (all)", "of them after evicting",
               "history at preemption (median tokens)", "max", "steps to readmission (median)", "max",
               "late requests' wait (max steps)", "steps", "tok/s", "range", "tok per CPU-s", "range",
               "same tokens as the ample pool (worst repeat)"]
    formats = {"tok_s": ".0f", "cpu_tok_s": ".0f", "history_median": ".0f", "readmit_median": ".1f"}
    return rows, {"columns": columns, "keys": keys, "align": "l" + "r" * (len(keys) - 1), "formats": formats}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["requests", "preemption"], required=True)
    ap.add_argument("--results", type=Path, required=True, help="results file (JSON, with provenance)")
    ap.add_argument("--repeats", type=int, default=3, help="paired, alternating repeats (>= 1)")
    ap.add_argument("--requests", default="16,64,256,1024", help="part 1: comma-separated running requests")
    ap.add_argument("--tokens", type=int, default=None,
                    help="new tokens per request (default: 96 in part 1, 256 in part 2)")
    ap.add_argument("--long", type=int, default=8, help="part 2: long requests")
    ap.add_argument("--pool", type=int, default=20, help="part 2: usable KV blocks of 32 tokens")
    ap.add_argument("--late", type=int, default=2, help="part 2: short requests arriving behind the preemption")
    ap.add_argument("--preempt-at", type=int, default=200,
                    help="part 2: preempt the last-admitted running request once it holds this many tokens")
    args = ap.parse_args(argv)
    try:
        counts = [int(x) for x in args.requests.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--requests takes comma-separated integers, got {args.requests!r}")
    tokens = args.tokens or (96 if args.part == "requests" else 256)
    if args.repeats < 1 or not counts or min(counts) < 1:
        ap.error("--repeats >= 1 and --requests >= 1 each")
    if args.part == "requests" and tokens <= REQ_B + REQ_W - REQ_PROMPT:
        ap.error(f"--tokens > {REQ_B + REQ_W - REQ_PROMPT} in part 1, so that the requests evict")
    if args.part == "preemption" and (args.long < 1 or args.late < 0 or args.pool < 3
                                      or not PRE_PROMPT < args.preempt_at < PRE_PROMPT + tokens):
        ap.error(f"--long >= 1, --late >= 0, --pool >= 3 (a bounded request's 3 blocks) and "
                 f"{PRE_PROMPT} < --preempt-at < {PRE_PROMPT + tokens}")

    from tests.vllm_tiny import save_tiny_llama
    from vase.files.provenance import finish, provenance, write_results

    setting = (dict(method="snapkv", budget=REQ_B, window=REQ_W, prompt=REQ_PROMPT, requests=counts)
               if args.part == "requests" else
               dict(method="snapkv", budget=PRE_B, window=PRE_W, prompt=PRE_PROMPT, long=args.long, late=args.late,
                    late_tokens=LATE_TOKENS, pool_blocks=args.pool, preempt_at=args.preempt_at))
    record = provenance(command="PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/vllm_scale.py " +
                        " ".join(sys.argv[1:] if argv is None else argv),
                        block_size=BLOCK, tokens=tokens, repeats=args.repeats, model="tiny random Llama "
                        "(tests/vllm_tiny.py)", **setting)
    path = save_tiny_llama(os.path.join(tempfile.gettempdir(), "vase-scale-tiny-llama"))
    if args.part == "requests":
        rows, table = part_requests(path, counts, tokens, args.repeats)
    else:
        rows, table = part_preemption(path, args.long, tokens, args.pool, args.late, args.repeats,
                                      args.preempt_at)
    print(f"wrote {write_results(args.results, rows, finish(record), table=table)}")


if __name__ == "__main__":
    main()
