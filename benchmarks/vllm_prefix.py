#!/usr/bin/env python
"""Prefix caching with eviction in the vLLM plugin (issue 31), on the embedded SmolLM2-135M (fp32, CPU).

    VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python benchmarks/vllm_prefix.py [--scale small|medium|issue] [--only ttft|samples]

1. `ttft`: R requests sharing an S-token system prompt (+ a 32-token question each), submitted at once,
   eviction on (vase-attnv, B = 128, w = 32), prefix caching on vs off: time to first token (per request,
   from submission; mean and max), prompt tokens computed (vLLM's `num_cached_tokens` per request), wall time.
2. `samples`: N problems x n samples (`SamplingParams.n`, seeded), a tight pool: tok/s, peak blocks in use,
   preemptions; vase-attnv with prefix caching on (the children share the prompt's blocks) and off, and stock
   vLLM with prefix caching on.

Writes docs/results/vllm-prefix-ttft.json and docs/results/vllm-prefix-samples.json (vase.files.provenance) and a CSV
beside each (a scale other than small adds `-<scale>` to the names). `--scale small` (the default) is the issue's
setting scaled down to a few minutes on one core.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vase.files.provenance import finish, provenance, write_results  # noqa: E402

SCALES = {  # the setting, and the one run on the shared 2-core CPU
    "issue": dict(requests=16, system=1024, question=32, ttft_new=64, problems=8, n=8, prompt=256, new=1024,
                  pool_blocks=160),
    "small": dict(requests=16, system=1024, question=32, ttft_new=16, problems=4, n=4, prompt=256, new=256,
                  pool_blocks=48),
    # the 8 x 8 samples, at 256 new tokens in a pool twice the small one's (4 times the samples)
    "medium": dict(requests=16, system=1024, question=32, ttft_new=16, problems=8, n=8, prompt=256, new=256,
                   pool_blocks=96),
}
METHOD, BUDGET, WINDOW, BLOCK = "vase-attnv", 128, 32, 32


def engine(path: str, *, vase: bool, caching: bool, max_len: int, pool_blocks: int, max_seqs: int, sink: list):
    from vase.bench.vllm_bench import _recorder_factory
    from vase.engines.base import kv_bytes_per_token
    from vase.engines.vllm import engine_args, start_engine
    from vase.vllm.config import vase_section
    from transformers import AutoConfig

    bpt = kv_bytes_per_token(AutoConfig.from_pretrained(path).get_text_config(), "float32")
    section = vase_section(METHOD, BUDGET, WINDOW) if vase else None
    args = engine_args(path, dtype="float32", max_model_len=max_len, seed=0, section=section, in_process=True,
                       kv_cache_memory_bytes=(pool_blocks + 1) * BLOCK * bpt, block_size=BLOCK,
                       max_num_seqs=max_seqs, enable_prefix_caching=caching, disable_log_stats=False,
                       max_num_batched_tokens=8192)
    return start_engine(args, stat_loggers=[_recorder_factory(sink)])


def close(llm) -> None:
    try:
        llm.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        pass
    gc.collect()


def ttft_run(path: str, sc: dict, caching: bool) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(sc["system"])]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(sc["question"])] for _ in range(sc["requests"])]
    max_len = len(prompts[0]) + sc["ttft_new"]
    need = sc["requests"] * -(-max_len // BLOCK)
    sink: list = []
    llm = engine(path, vase=True, caching=caching, max_len=max_len, pool_blocks=need, max_seqs=sc["requests"],
                 sink=sink)
    try:
        first, cached, finished = {}, {}, {}
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            llm.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids),
                            SamplingParams(max_tokens=sc["ttft_new"], temperature=0.0, ignore_eos=True,
                                           detokenize=False))
        while llm.has_unfinished_requests():
            outs = llm.step()
            now = time.perf_counter() - t0
            for out in outs:
                rid = out.request_id.rsplit("-", 1)[0]
                if out.outputs and out.outputs[0].token_ids and rid not in first:
                    first[rid] = now
                if out.finished:
                    finished[rid] = list(out.outputs[0].token_ids)
                    cached[rid] = out.num_cached_tokens or 0
        seconds = time.perf_counter() - t0
    finally:
        close(llm)
    t = sorted(first.values())
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prefix_caching": "on" if caching else "off", "requests": len(prompts), "system_prompt": sc["system"],
            "prompt_tokens": prompt_tokens, "prompt_tokens_computed": prompt_tokens - sum(cached.values()),
            "ttft_mean_s": sum(t) / len(t), "ttft_max_s": t[-1], "seconds": seconds,
            "new_tokens": sc["ttft_new"], "outputs": finished}


def samples_run(path: str, sc: dict, vase: bool, caching: bool) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(sc["prompt"])] for _ in range(sc["problems"])]
    max_len = sc["prompt"] + sc["new"]
    sink: list = []
    llm = engine(path, vase=vase, caching=caching, max_len=max_len, pool_blocks=sc["pool_blocks"],
                 max_seqs=sc["problems"] * sc["n"], sink=sink)
    try:
        usable = int(llm.vllm_config.cache_config.num_gpu_blocks) - 1
        sink.clear()
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            llm.add_request(f"p{i}", TokensPrompt(prompt_token_ids=ids),
                            SamplingParams(n=sc["n"], max_tokens=sc["new"], temperature=0.6, top_p=0.95, seed=100 * i,
                                           ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY))
        outputs = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    outputs[out.request_id.rsplit("-", 1)[0]] = [list(o.token_ids) for o in out.outputs]
        seconds = time.perf_counter() - t0
    finally:
        close(llm)
    produced = sum(len(t) for outs in outputs.values() for t in outs)
    return {"engine": ("vase-attnv B=128 w=32" if vase else "stock vLLM"),
            "prefix_caching": "on" if caching else "off", "problems": sc["problems"], "n": sc["n"],
            "prompt": sc["prompt"], "new_tokens": sc["new"], "pool_blocks": usable,
            "tok_per_s": produced / seconds, "seconds": seconds,
            "blocks_peak": max((round(s[3] * usable) for s in sink), default=0),
            "preemptions": sum(s[4] for s in sink), "running_peak": max((s[1] for s in sink), default=0),
            "outputs": outputs}


TTFT_TABLE = {"columns": ["prefix caching", "requests", "system prompt", "prompt tokens computed", "TTFT mean (s)",
                          "TTFT max (s)", "wall (s)", "same tokens as caching off"],
              "keys": ["prefix_caching", "requests", "system_prompt", "prompt_tokens_computed", "ttft_mean_s",
                       "ttft_max_s", "seconds", "same_tokens_as_caching_off"],
              "align": "lrrrrrrl", "formats": {"ttft_mean_s": ".1f", "ttft_max_s": ".1f", "seconds": ".1f"}}
SAMPLES_TABLE = {"columns": ["engine", "prefix caching", "problems", "n", "new tokens", "pool (blocks)", "tok/s",
                             "wall (s)", "blocks peak", "preemptions", "running peak", "same tokens as caching off"],
                 "keys": ["engine", "prefix_caching", "problems", "n", "new_tokens", "pool_blocks", "tok_per_s",
                          "seconds", "blocks_peak", "preemptions", "running_peak", "same_tokens_as_vase_caching_off"],
                 "align": "llrrrrrrrrrl", "formats": {"tok_per_s": ".1f", "seconds": ".1f"}}


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = [k for k in rows[0] if k != "outputs"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in keys})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=sorted(SCALES), default="small")
    ap.add_argument("--only", choices=("ttft", "samples"), default=None)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vase.models.resolve import model_dir

    path = model_dir(None)
    sc = SCALES[a.scale]
    cmd = ("VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 "
           f"python benchmarks/vllm_prefix.py --scale {a.scale}" + (f" --only {a.only}" if a.only else ""))
    results = ROOT / "docs" / "results"
    suffix = "" if a.scale == "small" else f"-{a.scale}"  # the small scale's files keep their names
    if a.only in (None, "ttft"):
        rec = provenance(command=cmd, scale=a.scale, model="SmolLM2-135M-Instruct fp32", method=METHOD,
                         budget=BUDGET, window=WINDOW, block_size=BLOCK)
        rows = [ttft_run(path, sc, caching) for caching in (False, True)]
        same = rows[0]["outputs"] == rows[1]["outputs"]
        for r in rows:
            r["same_tokens_as_caching_off"] = same
        print([{k: v for k, v in r.items() if k != "outputs"} for r in rows], flush=True)
        finish(rec)
        write_results(results / f"vllm-prefix-ttft{suffix}.json", [{k: v for k, v in r.items() if k != "outputs"}
                                                         for r in rows], rec, table=TTFT_TABLE)
        write_csv(results / f"vllm-prefix-ttft{suffix}.csv", rows)
    if a.only in (None, "samples"):
        rec = provenance(command=cmd, scale=a.scale, model="SmolLM2-135M-Instruct fp32", method=METHOD,
                         budget=BUDGET, window=WINDOW, block_size=BLOCK)
        rows = [samples_run(path, sc, vase, caching) for vase, caching in ((True, True), (True, False),
                                                                            (False, True))]
        for r in rows:
            r["same_tokens_as_vase_caching_off"] = (r["outputs"] == rows[1]["outputs"]) if r is not rows[2] else None
        print([{k: v for k, v in r.items() if k != "outputs"} for r in rows], flush=True)
        finish(rec)
        write_results(results / f"vllm-prefix-samples{suffix}.json", [{k: v for k, v in r.items() if k != "outputs"}
                                                            for r in rows], rec, table=SAMPLES_TABLE)
        write_csv(results / f"vllm-prefix-samples{suffix}.csv", rows)


if __name__ == "__main__":
    main()
