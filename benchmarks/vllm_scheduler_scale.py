#!/usr/bin/env python
"""Scheduler time per step, vase's `VaseScheduler` beside stock vLLM's `Scheduler`, at 16 to 1,024 running requests.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/vllm_scheduler_scale.py   # docs/results/vllm-scheduler-scale.json

Synthetic and model-free: each scheduler is built from a hand-made `VllmConfig` (the tiny Llama's config, no
weights) and a one-group KV cache config; N requests (96-token prompts, groups of 4 sharing a 64-token prefix,
prefix caching on, as vLLM's default) are prefilled in one step, then every step of the next `steps` decode steps
is timed (thread CPU time, so that other processes on a shared machine do not count): `schedule()` plus
`update_from_output()` with one sampled token per request (no forward). vase runs
snapkv B = 64, w = 32, so the measured steps hold the requests before their first compaction (its copy reserve
counts them), the compaction with its copy-on-write and trims, and the steady state after. The pool holds every
request's logical length, so neither scheduler preempts. `scan` is vase with the copy reserve scanned at every
allocation (the code before issue 39), up to 256 requests. Paired repeats: stock and vase built afresh in turn.

`scheduler_ms_per_step(n, kind)` is the function a wider scale bench can call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BLOCK, BUDGET, WINDOW, PROMPT, SHARED = 32, 64, 32, 96, 64


def _tiny_config_dir() -> str:
    """A directory with the tiny Llama's config.json (no weights: the scheduler never loads a model)."""
    from transformers import LlamaConfig

    path = os.path.join(tempfile.gettempdir(), "vase-scheduler-scale-config")
    if not os.path.exists(os.path.join(path, "config.json")):
        LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=2048).save_pretrained(path)
    return path


def make_scheduler(kind: str, n_requests: int, steps: int):
    """A stock ('stock') or vase ('vase', 'scan') scheduler whose pool holds `n_requests` at their logical length
    after `steps` decode steps."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=_tiny_config_dir(), max_model_len=2048, dtype="float32", skip_tokenizer_init=True, seed=0)
    sched = SchedulerConfig(max_num_seqs=n_requests, max_num_batched_tokens=n_requests * (PROMPT + 1),
                            max_model_len=2048, enable_chunked_prefill=True, is_encoder_decoder=False)
    vase = None if kind == "stock" else {"vase": {"method": "snapkv", "budget": BUDGET, "window": WINDOW}}
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=CacheConfig(block_size=BLOCK),
                        additional_config=vase or {})
    per_request = -(-(PROMPT + steps + 2) // BLOCK)
    kv = KVCacheConfig(num_blocks=n_requests * (per_request + 3) + 8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=2,
                                                                              head_size=32, dtype=torch.float32))])
    config.cache_config.num_gpu_blocks = kv.num_blocks
    if kind == "stock":
        return Scheduler(config, kv, StructuredOutputManager(config), BLOCK)
    from vase.vllm.scheduler import VaseScheduler

    scheduler = VaseScheduler(config, kv, StructuredOutputManager(config), BLOCK)
    if kind == "scan":  # the copy reserve scanned at every allocation, as before issue 39
        manager = scheduler.kv_cache_manager
        manager.begin_schedule = lambda: None  # the count kept through a schedule() off: every call scans
        manager.pending_copies = manager.scan_copies
    return scheduler


def _requests(n: int, steps: int):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.utils.hashing import sha256
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    out = []
    for i in range(n):
        group = i // 4
        prompt = [(group * 7 + j) % 120 + 3 for j in range(SHARED)] + [(i * 13 + j) % 120 + 3
                                                                       for j in range(PROMPT - SHARED)]
        out.append(Request(f"r{i}", prompt, params, None, block_hasher=hasher))
    return out


def _step(scheduler) -> float:
    """One scheduler step with one sampled token per scheduled request; its seconds (schedule + update)."""
    from vllm.v1.outputs import ModelRunnerOutput

    t0 = time.thread_time()
    output = scheduler.schedule()
    t1 = time.thread_time()
    ids = list(output.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                               pooler_output=[])
    t2 = time.thread_time()
    scheduler.update_from_output(output, runner)
    t3 = time.thread_time()
    return (t1 - t0) + (t3 - t2)


def scheduler_ms_per_step(n_requests: int, kind: str, steps: int = 64) -> dict:
    """Mean scheduler milliseconds per decode step over `steps` steps at `n_requests` running (kind: 'stock',
    'vase' or 'scan'); also the requests running at the end and vase's preemptions (both must show no pressure)."""
    scheduler = make_scheduler(kind, n_requests, steps)
    for request in _requests(n_requests, steps):
        scheduler.add_request(request)
    _step(scheduler)  # the prefill of every request
    times = [_step(scheduler) for _ in range(steps)]
    first = max(PROMPT, BUDGET) + WINDOW - PROMPT  # decode steps before the first compaction
    before, after = times[:first - 1], times[first + 1:]
    return {"ms": 1000 * sum(times) / len(times), "running": len(scheduler.running),
            "ms_before": 1000 * sum(before) / len(before), "ms_after": 1000 * sum(after) / max(len(after), 1),
            "preemptions": getattr(scheduler, "vase_preemptions", 0),
            "blocks_freed": getattr(scheduler, "vase_blocks_freed", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--scan-up-to", type=int, default=256, help="measure the scan variant up to this many")
    parser.add_argument("--results", default="docs/results/vllm-scheduler-scale.json")
    args = parser.parse_args()
    from vase.files.provenance import finish, provenance, write_results

    record = provenance(command="PYTHONPATH=src OMP_NUM_THREADS=1 python " + " ".join(sys.argv),
                        setup=f"snapkv B={BUDGET} w={WINDOW}, block {BLOCK}, {PROMPT}-token prompts (groups of 4 "
                              f"share {SHARED}), prefix caching on, {args.steps} decode steps timed, no model")
    rows = []
    for n in args.running:
        kinds = ["stock", "vase"] + (["scan"] if n <= args.scan_up_to else [])
        ms = {k: [] for k in kinds}
        phase = {(k, p): [] for k in ("stock", "vase") for p in ("ms_before", "ms_after")}
        for _ in range(args.repeats):
            for kind in kinds:
                res = scheduler_ms_per_step(n, kind, args.steps)
                assert res["running"] == n and res["preemptions"] == 0, (kind, res)
                assert kind == "stock" or res["blocks_freed"] > 0, (kind, res)  # vase compacted and trimmed
                ms[kind].append(res["ms"])
                for p in ("ms_before", "ms_after"):
                    if kind in ("stock", "vase"):
                        phase[(kind, p)].append(res[p])
        ratio = [v / s for v, s in zip(ms["vase"], ms["stock"])]
        before = [v / s for v, s in zip(phase[("vase", "ms_before")], phase[("stock", "ms_before")])]
        after = [v / s for v, s in zip(phase[("vase", "ms_after")], phase[("stock", "ms_after")])]
        row = {"running": n, "stock_ms": statistics.median(ms["stock"]),
               "stock_range": f"{min(ms['stock']):.2f}-{max(ms['stock']):.2f}",
               "vase_ms": statistics.median(ms["vase"]), "vase_range": f"{min(ms['vase']):.2f}-{max(ms['vase']):.2f}",
               "ratio": statistics.median(ratio), "ratio_range": f"{min(ratio):.2f}-{max(ratio):.2f}",
               "ratio_before": statistics.median(before), "ratio_before_range": f"{min(before):.2f}-{max(before):.2f}",
               "ratio_after": statistics.median(after), "ratio_after_range": f"{min(after):.2f}-{max(after):.2f}",
               "scan_ms": statistics.median(ms["scan"]) if "scan" in ms else None, "repeats": args.repeats}
        rows.append(row)
        print(row, flush=True)
    table = {"columns": ["running", "stock_ms", "stock_range", "vase_ms", "vase_range", "ratio", "ratio_range",
                         "ratio_before", "ratio_before_range", "ratio_after", "ratio_after_range", "scan_ms"],
             "align": "rrrrrrrrrrrr", "formats": {"stock_ms": ".2f", "vase_ms": ".2f", "ratio": ".2f",
                                                  "ratio_before": ".2f", "ratio_after": ".2f", "scan_ms": ".1f"}}
    print(f"wrote {write_results(args.results, rows, finish(record), table)}")


if __name__ == "__main__":
    main()
