#!/usr/bin/env python
"""fp8 KV cache with eviction in the vLLM plugin (issue 41), on the embedded SmolLM2-135M (fp32 weights, CPU).

    VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python benchmarks/vllm_fp8.py [--repeats 3] [--requests 4] [--prompt 128] [--new 256]

Four engines, each started once: stock vLLM with kv_cache_dtype auto (fp32) and fp8, vase (vase-attnv, B = 128,
w = 32) with auto and fp8. Each round runs the same greedy batch through all four in turn (paired; the order
rotates each round): tok/s (generated tokens / wall seconds of the batch) and the peak KV bytes one request held
(its peak blocks in the full-attention group x the bytes of one block over all layers, from vLLM's KV cache
spec). Writes docs/results/vllm-fp8.json (vase.files.provenance): per engine the median and range of tok/s over the
rounds, the peak KV bytes per request (the same every round), and whether its tokens equal its own first round.
Needs x86 with AVX-512 or AMX (vLLM's CPU fp8 kernel).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vase.files.provenance import finish, provenance, write_results  # noqa: E402

METHOD, BUDGET, WINDOW, BLOCK = "vase-attnv", 128, 32, 32
ENGINES = [("stock vLLM", "auto", False), ("stock vLLM", "fp8", False), (f"vase {METHOD}", "auto", True),
           (f"vase {METHOD}", "fp8", True)]
TABLE = {"columns": ["engine", "kv_cache_dtype", "KV bytes / request (peak)", "vs stock fp32", "tok/s (median)",
                     "tok/s (min-max)", "rounds", "same tokens every round"],
         "keys": ["engine", "kv_cache_dtype", "kv_bytes_peak", "kv_ratio", "tok_per_s_median", "tok_per_s_range",
                  "rounds", "same_tokens_every_round"],
         "align": "llrrrrrl", "formats": {"tok_per_s_median": ".1f", "kv_ratio": ".3f"}}


def start(path: str, kv: str, vase: bool, max_len: int, requests: int):
    from vase.engines.vllm import engine_args, start_engine
    from vase.vllm.config import vase_section

    section = vase_section(METHOD, BUDGET, WINDOW) if vase else None
    args = engine_args(path, dtype="float32", max_model_len=max_len, seed=0, section=section, in_process=True,
                       block_size=BLOCK, max_num_seqs=requests, kv_cache_dtype=kv,
                       kv_cache_memory_bytes=256 * 1024 * 1024, max_num_batched_tokens=4096)
    return start_engine(args)


def block_bytes(llm) -> int:
    """Bytes of one block over every layer of the (single) KV cache group."""
    cfg = llm.engine_core.engine_core.scheduler.kv_cache_config
    group = cfg.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


def run(llm, prompts: list[list[int]], new: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sched = llm.engine_core.engine_core.scheduler
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    for i, ids in enumerate(prompts):
        llm.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids),
                        SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False))
    outputs, peak = {}, 0
    t0 = time.perf_counter()
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id.rsplit("-", 1)[0]] = list(out.outputs[0].token_ids)
        peak = max([peak] + [len(b) for b in manager.req_to_blocks.values()])
    seconds = time.perf_counter() - t0
    return {"tok_per_s": sum(len(t) for t in outputs.values()) / seconds, "peak_blocks": peak, "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vase.models.resolve import model_dir

    path = model_dir(None)
    cmd = ("VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python "
           f"benchmarks/vllm_fp8.py --repeats {a.repeats} --requests {a.requests} --prompt {a.prompt} --new {a.new}")
    rec = provenance(command=cmd, model="SmolLM2-135M-Instruct (embedded), fp32 weights", method=METHOD,
                     budget=BUDGET, window=WINDOW, block_size=BLOCK, requests=a.requests, prompt=a.prompt,
                     new_tokens=a.new, repeats=a.repeats)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.prompt)] for _ in range(a.requests)]
    engines = [start(path, kv, vase, a.prompt + a.new, a.requests) for _, kv, vase in ENGINES]
    runs: list[list[dict]] = [[] for _ in ENGINES]
    for r in range(a.repeats):
        order = list(range(len(ENGINES)))
        order = order[r % len(order):] + order[: r % len(order)]  # rotate who runs first
        for i in order:
            runs[i].append(run(engines[i], prompts, a.new))
            gc.collect()
        print(f"round {r}", [round(x[-1]["tok_per_s"], 1) for x in runs], flush=True)
    rows = []
    for (name, kv, _), llm, rs in zip(ENGINES, engines, runs):
        tps = [x["tok_per_s"] for x in rs]
        rows.append({"engine": name, "kv_cache_dtype": kv,
                     "kv_bytes_peak": max(x["peak_blocks"] for x in rs) * block_bytes(llm),
                     "tok_per_s_median": statistics.median(tps),
                     "tok_per_s_range": f"{min(tps):.1f}-{max(tps):.1f}", "tok_per_s": tps, "rounds": len(rs),
                     "same_tokens_every_round": all(x["outputs"] == rs[0]["outputs"] for x in rs)})
    for row in rows:
        row["kv_ratio"] = row["kv_bytes_peak"] / rows[0]["kv_bytes_peak"]
    print(rows, flush=True)
    finish(rec)
    write_results(ROOT / "docs" / "results" / "vllm-fp8.json", rows, rec, table=TABLE)


if __name__ == "__main__":
    main()
