"""The vLLM plugin's overhead and memory, on the embedded model (CPU build of vLLM 0.32).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_plugin.py --rounds 5 --tokens 128 --batch 4

1. Overhead when memory is ample, paired alternation in one process (stock, plugin, evicting,
   stock, plugin, evicting, ...) so machine load hits all alike: (a) the plugin with B so large
   that nothing evicts (pure hook cost: query capture, schedule bookkeeping, physical slot
   mapping), (b) the plugin evicting (`--evict-budget`, `--window`); per round the tok/s ratio
   to the stock run of the same round, then the median and the spread (min..max).
2. Blocks held over time: one request decoding `--long` tokens with vase-attnv B=128, w=32,
   read from vLLM's KV cache manager after each step, against stock vLLM's.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # to read the KV cache manager


def make(path, vase, block_size, pool_bytes, max_len):
    from vllm import LLM

    return LLM(model=path, max_model_len=max_len, kv_cache_memory_bytes=pool_bytes, block_size=block_size,
               enforce_eager=True, dtype="float32", seed=0, additional_config=vase or {})


def prompts(n, length):
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(300, 9000, (length,), generator=g).tolist()} for _ in range(n)]


def tok_s(llm, batch, tokens):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(prompts(batch, 32), params, use_tqdm=False)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in out) / dt


def blocks_over_time(llm, n_tokens, every):
    from vllm import SamplingParams

    llm.llm_engine.add_request("long", prompts(1, 32)[0], SamplingParams(max_tokens=n_tokens, temperature=0.0,
                                                                          ignore_eos=True))
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    series, step = [], 0
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        step += 1
        for rid, blocks in manager.req_to_blocks.items():
            if step % every == 0:
                series.append((step, len(blocks)))
    return series


def hook_seconds(llm) -> list[float]:
    """Wrap this engine's per-step hook and query capture with timers; returns the running total [seconds]."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    runner._vase_step = timed(runner._vase_step)
    runner.vase_ring.record = timed(runner.vase_ring.record)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--evict-budget", type=int, default=128, help="B of the evicting configuration (b)")
    ap.add_argument("--window", type=int, default=32, help="w of the evicting configuration (b)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--long", type=int, default=1000, help="tokens of the blocks-over-time decode (0: skip it)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--results", default=None,
                    help="write the paired rounds with provenance to this JSON file (e.g. docs/results/vllm-overhead.json)")
    args = ap.parse_args()

    from vase.bench.paired import alternating, paired_ratio
    from vase.models import model_dir
    from vase.files.provenance import finish, provenance, write_results
    from vase.vllm import additional_config

    record = provenance(note=f"{args.rounds} paired, alternating rounds (stock, plugin without eviction, plugin "
                             f"evicting) in one process; each ratio within its round")

    path = model_dir()
    pool = 256 << 20
    max_len = max(args.tokens, args.long) + 64
    stock = make(path, None, args.block_size, pool, max_len)
    plugin = make(path, additional_config("snapkv", 4096, 64), args.block_size, pool, max_len)
    tok_s(stock, 1, 8), tok_s(plugin, 1, 8)  # warm-up
    evicting = make(path, additional_config("vase-attnv", args.evict_budget, args.window), args.block_size, pool,
                    max_len)
    tok_s(evicting, 1, 8)
    rates: dict[str, list[float]] = {"stock": [], "plugin": [], "evicting": []}
    engines = {"stock": stock, "plugin": plugin, "evicting": evicting}
    for r, name in alternating(list(engines), args.rounds):  # stock, plugin, evicting, stock, ...
        rates[name].append(tok_s(engines[name], args.batch, args.tokens))
        if name != "evicting":
            continue
        a, b, c = rates["stock"][r], rates["plugin"][r], rates["evicting"][r]
        print(f"round {r}: stock {a:.2f} tok/s, plugin (a) no eviction {b:.2f} ({b / a:.3f}), "
              f"(b) vase-attnv B={args.evict_budget} w={args.window} {c:.2f} ({c / a:.3f})", flush=True)
    if args.results:
        evicting_label = f"(b) vase-attnv B = {args.evict_budget}, w = {args.window}"
        rows = [{"round": str(r), "stock tok/s": f"{a:.2f}", "(a) no eviction": f"{b:.2f}", "ratio": f"{b / a:.3f}",
                 evicting_label: f"{c:.2f}", "ratio (column 6)": f"{c / a:.3f}"}
                for r, (a, b, c) in enumerate(zip(rates["stock"], rates["plugin"], rates["evicting"]))]
        table = {"columns": ["round", "stock tok/s", "(a) no eviction", "ratio", evicting_label, "ratio"],
                 "align": "llllll", "keys": ["round", "stock tok/s", "(a) no eviction", "ratio", evicting_label,
                                             "ratio (column 6)"]}
        print(f"wrote {write_results(args.results, rows, finish(record), table)}")
    for name, mine in (("(a) no eviction", rates["plugin"]), (f"(b) B={args.evict_budget} evicting", rates["evicting"])):
        med, lo, hi = paired_ratio(mine, rates["stock"])  # within each round, then median and spread
        print(f"{name}: median plugin/stock tok/s {med:.3f}, spread {lo:.3f}..{hi:.3f} (batch {args.batch}, "
              f"{args.tokens} new tokens, {args.rounds} rounds)")
    # The ratio above is at the mercy of machine load; time the hooks themselves within one run too.
    spent = hook_seconds(plugin)
    t = time.perf_counter()
    tok_s(plugin, args.batch, args.tokens)
    total = time.perf_counter() - t
    print(f"time inside the plugin's hooks (schedule bookkeeping, slot mapping, query capture): "
          f"{spent[0]:.3f} s of {total:.2f} s generate wall time ({100 * spent[0] / total:.2f} %)")
    if args.long <= 0:
        return
    evicting = make(path, additional_config("vase-attnv", 128, 32), args.block_size, pool, max_len)  # as documented
    every = 50
    theirs = dict(blocks_over_time(stock, args.long, every))
    ours = dict(blocks_over_time(evicting, args.long, every))
    print(f"blocks held (block size {args.block_size}), vase-attnv B=128 w=32 vs stock, one request, "
          f"{args.long} tokens:")
    print("step  stock  vase")
    for step in sorted(ours):
        print(f"{step:4d}  {theirs.get(step, '-'):>5}  {ours[step]:>4}")


if __name__ == "__main__":
    main()
