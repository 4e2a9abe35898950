"""The vLLM plugin's evicting step when many requests evict together (issue 39): batched vs one by one.

    OMP_NUM_THREADS=1 python benchmarks/vllm_batch_evict.py --results docs/results/vllm-batch-evict.json

1. Engine: a tiny random Llama (2 layers, 4 query and 2 KV heads, head_dim 32, fp32) on vLLM's CPU build,
   k requests with equal prompts (so all k evict at the same steps), snapkv B = 48, w = 16, greedy. Each
   engine step is timed; a step is an evicting one when the runner's eviction count rose. Per k: the median
   step time of evicting and of non-evicting decode steps, and their ratio (the eviction's share of a step).
   `--mode loop` replays the old path (one `evict_paged` per request and layer) through the same runner, for
   the before/after in one run.
2. Kernel: the eviction alone on a paged cache of one layer (the same shapes), `evict_paged` per request vs
   one `evict_paged_batch`, median of `--repeats` in alternation.
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

B, W, BLOCK, PROMPT = 48, 16, 32, 20


def loop_evict(runner):
    """The path before batching, for the comparison: one `evict_paged` per request and layer."""
    from vase.vllm.paged import evict_paged

    def evict(req_ids, reqs, indices, length, keep, seen):
        cfg = runner.vase_config
        for req_id, req, index, s in zip(req_ids, reqs, indices, seen):
            block_ids, target = runner._vase_eviction_blocks(req_id, index)
            for layer, name in enumerate(runner.vase_layers):
                keys, values = runner._kv_views(name)
                queries = runner.vase_ring.window_of(runner.vase_ring.index[name], req.slot, s)
                evict_paged(keys, values, block_ids, length, queries, runner.vase_policy, keep, cfg.window,
                            req.state, layer, sort_kept=cfg.sort_kept, layout=runner.vase_layout,
                            block_size=runner.vase_block_size, target_block_ids=target)
            req.state.evictions += 1
            runner.vase_evictions += 1
    return evict


def engine_steps(path: str, k: int, n_new: int, mode: str) -> dict:
    from tests.vllm_tiny import core, greedy, runner, start_llm
    from vase.vllm import additional_config

    llm = start_llm(dict(model=path, max_model_len=256, kv_cache_memory_bytes=(2 * k + 8) * BLOCK * 1024,
                         block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=k,
                         max_num_batched_tokens=max(2048, k * PROMPT)), additional_config("snapkv", B, W))
    r = runner(llm)
    if mode == "loop":
        r._vase_evict = loop_evict(r)
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(3, 90, (PROMPT,), generator=g).tolist()
    for i in range(k):
        llm.llm_engine.add_request(f"r{i}", {"prompt_token_ids": ids}, greedy(n_new))
    evicting, plain = [], []
    sched = core(llm).scheduler
    while llm.llm_engine.has_unfinished_requests():
        before, running = r.vase_evictions, len(sched.running)
        t0 = time.perf_counter()
        llm.llm_engine.step()
        dt = time.perf_counter() - t0
        if running == k and all(q.num_output_tokens > 1 for q in sched.running):  # decode steps of all k
            (evicting if r.vase_evictions > before else plain).append(dt)
    del llm
    return {"evicting_steps": len(evicting), "step_ms_evicting": 1e3 * statistics.median(evicting),
            "step_ms_plain": 1e3 * statistics.median(plain),
            "ratio": statistics.median(evicting) / statistics.median(plain)}


def kernel_times(k: int, repeats: int) -> dict:
    from vase.core.policies import get_policy
    from vase.vllm.paged import EvictionJob, RequestPolicyState, evict_paged, evict_paged_batch

    policy, length = get_policy("snapkv"), B + W
    n_blocks = -(-length // BLOCK)
    g = torch.Generator().manual_seed(k)
    kc = torch.randn(k * n_blocks + 1, 2, BLOCK, 32, generator=g)
    vc = torch.randn(kc.shape, generator=g)
    blocks = [torch.arange(j * n_blocks, (j + 1) * n_blocks) for j in range(k)]
    queries = torch.randn(k, 4, W, 32, generator=g)
    states = [RequestPolicyState(generator=torch.Generator().manual_seed(j)) for j in range(k)]
    loop, batch = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for j in range(k):
            evict_paged(kc, vc, blocks[j], length, queries[j:j + 1], policy, B, W, states[j], 0)
        loop.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        evict_paged_batch(kc, vc, [EvictionJob(blocks[j], states[j]) for j in range(k)], length, queries, policy,
                          B, W, 0)
        batch.append(time.perf_counter() - t0)
    return {"kernel_ms_loop": 1e3 * statistics.median(loop), "kernel_ms_batch": 1e3 * statistics.median(batch),
            "kernel_speedup": statistics.median(loop) / statistics.median(batch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", default="1,16,64,256", help="comma-separated numbers of requests evicting together")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per request (evictions at 44, 60, 76, 92)")
    ap.add_argument("--repeats", type=int, default=5, help="kernel timing repeats")
    ap.add_argument("--results", type=Path, required=True, help="results file (JSON, with provenance)")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.requests.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--requests takes comma-separated integers, got {args.requests!r}")
    if not counts or min(counts) < 1 or args.tokens <= B + W - PROMPT or args.repeats < 1:
        ap.error(f"--requests >= 1 each, --tokens > {B + W - PROMPT} (so that requests evict), --repeats >= 1")

    from tests.vllm_tiny import save_tiny_llama
    from vase.files.provenance import finish, provenance, write_results

    record = provenance(budget=B, window=W, block_size=BLOCK, prompt=PROMPT, tokens=args.tokens, method="snapkv")
    path = save_tiny_llama(tempfile.mkdtemp(prefix="vase-tiny-"))
    rows = []
    for k in counts:
        row = {"requests": k}
        for mode in ("batch", "loop"):
            got = engine_steps(path, k, args.tokens, mode)
            row.update({f"{key}_{mode}": v for key, v in got.items()})
        row.update(kernel_times(k, args.repeats))
        print(row, flush=True)
        rows.append(row)
    keys = ["requests", "step_ms_plain_batch", "step_ms_evicting_batch", "ratio_batch", "step_ms_evicting_loop",
            "ratio_loop", "kernel_ms_loop", "kernel_ms_batch", "kernel_speedup"]
    columns = ["requests evicting together", "decode step, none evicting (ms)", "evicting step, batched (ms)",
               "ratio", "evicting step, one by one (ms)", "ratio", "eviction kernel, one by one (ms)",
               "batched (ms)", "speed-up"]
    formats = {k: ".1f" for k in keys[1:]}
    formats.update({"ratio_batch": ".2f", "ratio_loop": ".2f", "kernel_speedup": ".1f"})
    table = {"columns": columns, "keys": keys, "align": "r" * len(keys), "formats": formats}
    print(f"wrote {write_results(args.results, rows, finish(record), table=table)}")


if __name__ == "__main__":
    main()
