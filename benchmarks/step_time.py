#!/usr/bin/env python
"""Steady-state time of one decode step, eager vs compiled, in one run (no generation loop around it).

    python benchmarks/step_time.py                          # SmolLM2-135M shapes (random weights), batch 1
    python benchmarks/step_time.py --batch 4 --kv-bits 4    # a batch, quantized storage

Prefills a random prompt, decodes `--warm` untimed steps (compiled: the graphs of the steps that ran
compile there: plain, and evicting once the cache reached B + w, and with kv_bits the flush variants),
then times `--steps` more steps of each path: eager
(`EvictionCache`, vase's attention function) and compiled (`StaticEvictionCache`, eviction inside the
`torch.compile`d step), eager again to bracket the compiled run (the machine's load drifts). The
compiled/eager ratio uses the mean of the two eager runs. Prints ms per step; no sampling, no host
work other than the schedule.

    python benchmarks/step_time.py --repeats 5 --out docs/results/step-time-b1.json

alternates eager, compiled, eager, compiled, ..., eager (5 compiled runs between 6 eager ones): each
compiled run is paired with the mean of the eager runs on either side, and the result is the median
ratio with its range, written with its provenance (`vase.files.provenance`) when `--out` is given.
With the defaults (prompt 128, B + w = 576) no eviction falls in the 340 steps; `--prompt 500 --warm 150`
evicts at steps 76 and 140 and times steps 150 .. 189 with 522 .. 561 tokens stored (the steady band
B .. B + w), no eviction among them.
"""

from __future__ import annotations

import argparse
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="a vase.bench.shapes name (random weights)")
    p.add_argument("--method", default="vase-attnv")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--kv-bits", type=int, default=16)
    p.add_argument("--warm", type=int, default=300, help="untimed steps before each timed run")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter; cpu: this process's CPU time (time.process_time; with one thread it "
                        "leaves out the time a loaded machine gave to other processes)")
    p.add_argument("--repeats", type=int, default=1, help="compiled runs, each between two eager runs (paired)")
    p.add_argument("--out", help="write the rows and their provenance to this results file (JSON)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead of timing: profile N steady steps of each path (torch.profiler, after the same "
                        "warm-up) and print the ops with the most self CPU time (ms per step, share of the step)")
    p.add_argument("--top", type=int, default=15, help="ops listed per path with --profile")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from vase.bench.shapes import build_random_model
    from vase.caches.eager import EvictionCache
    from vase.hf.compat import cache_kwargs
    from vase.generation.compiled import StaticStepper, compiled_steps
    from vase.generation.decoding import prefill
    from vase.caches.static import StaticEvictionCache, activate

    model = build_random_model(args.shape, dtype=torch.float32, device="cpu", attn_implementation="sdpa")
    ids = torch.randint(0, 1000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    storage = {"kv_bits": args.kv_bits} if args.kv_bits != 16 else {}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def new_cache() -> tuple[EvictionCache, torch.Tensor]:
        cache = EvictionCache(model, args.method, args.budget, args.window, seed=list(range(args.batch)), **storage)
        positions, _, _ = prefill(model, ids, mask, cache)
        return cache, positions[:, -1:] + 1

    def timed(step, nxt: torch.Tensor) -> float | list[dict]:
        token = ids[:, -1:]
        for _ in range(args.warm):
            step(token, nxt)
            nxt = nxt + 1
        if args.profile:
            return profiled(step, token, nxt)
        start = clock()
        for _ in range(args.steps):
            step(token, nxt)
            nxt = nxt + 1
        return (clock() - start) / args.steps * 1000

    def profiled(step, token: torch.Tensor, nxt: torch.Tensor) -> list[dict]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile):
                step(token, nxt)
                nxt = nxt + 1
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events)
        events.sort(key=lambda e: -e.self_cpu_time_total)
        return [{"op": e.key[:70], "calls per step": round(e.count / args.profile, 1),
                 "ms per step": round(e.self_cpu_time_total / 1000 / args.profile, 3),
                 "share": round(e.self_cpu_time_total / total, 3)} for e in events[:args.top]] + \
            [{"op": "(all ops)", "calls per step": round(sum(e.count for e in events) / args.profile, 1),
              "ms per step": round(total / 1000 / args.profile, 3), "share": 1.0}]

    @torch.inference_mode()
    def eager() -> float:
        cache, nxt = new_cache()
        return timed(lambda t, p: model(input_ids=t, position_ids=p, **cache_kwargs(cache), use_cache=True), nxt)

    @torch.inference_mode()
    def compiled() -> float:
        cache, nxt = new_cache()
        static = StaticEvictionCache.from_eager(cache, model.config.num_attention_heads)
        activate(model, static)
        try:
            return timed(StaticStepper(model, static, compiled_steps(("step_time",))), nxt)
        finally:
            activate(model, None)

    if args.repeats < 1:
        raise SystemExit("step_time.py: --repeats must be at least 1")
    from vase.files.provenance import finish, provenance, write_results

    record = provenance()
    if args.profile:
        rows = [{"path": path, **row} for path, fn in (("eager", eager), ("compiled", compiled)) for row in fn()]
        for row in rows:
            print(f"{row['path']:9s} {row['ms per step']:9.3f} ms {row['share']:6.1%} {row['calls per step']:7.1f} "
                  f"calls  {row['op']}")
        if args.out:
            settings = {k: getattr(args, k) for k in ("shape", "method", "batch", "budget", "window", "prompt",
                                                       "kv_bits", "warm", "profile", "threads")}
            write_results(args.out, rows, finish({**record, "settings": settings}),
                          table={"align": "llrrr", "formats": {"ms per step": ".3f", "share": ".1%"}})
            print(f"wrote {args.out}")
        return 0
    eagers, comps = [eager()], []
    for _ in range(args.repeats):  # E, C, E, C, ..., E: every compiled run sits between two eager runs
        comps.append(compiled())
        eagers.append(eager())
    rows = []
    for i, comp in enumerate(comps):
        first, last = eagers[i], eagers[i + 1]
        ratio = (first + last) / 2 / comp
        rows.append({"repeat": i, "eager ms before": round(first, 2), "compiled ms": round(comp, 2),
                     "eager ms after": round(last, 2), "compiled / eager": round(ratio, 3)})
        print(f"{args.shape}, {args.method}, batch {args.batch}, B = {args.budget}, w = {args.window}, "
              f"kv_bits {args.kv_bits}, {args.threads} thread(s), {args.clock} clock: ms per step eager {first:.1f} / "
              f"compiled "
              f"{comp:.1f} / eager {last:.1f}; compiled / eager speed {ratio:.2f}x", flush=True)
    ratios = sorted(r["compiled / eager"] for r in rows)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    if len(rows) > 1:
        print(f"median compiled / eager {median:.3f}x over {len(rows)} paired repeats (range {ratios[0]:.3f}.."
              f"{ratios[-1]:.3f})")
    if args.out:
        settings = {k: getattr(args, k) for k in ("shape", "method", "batch", "budget", "window", "prompt",
                                                   "kv_bits", "warm", "steps", "threads", "repeats", "clock")}
        write_results(args.out, rows, finish({**record, "settings": settings}),
                      table={"align": "rrrrr", "formats": {k: ".3f" if k == "compiled / eager" else ".2f"
                                                           for k in rows[0] if k != "repeat"}})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
