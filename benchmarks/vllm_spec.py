#!/usr/bin/env python
"""Speculative decoding with eviction in the vLLM plugin (issue 41), on the embedded SmolLM2-135M (fp32, CPU).

    VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python benchmarks/vllm_spec.py [--repeats 2] [--new 96] [--proposer ngram|draft_model]

`--proposer draft_model`: the embedded model drafts for itself (K = 3; the only model here with its vocabulary), so
the table shows what eviction costs a drafter's acceptance (its layers keep sink + recent, `vase.vllm.drafter`),
not a speed-up; writes docs/results/vllm-spec-draft.json.

Four engines, each started once: stock vLLM without and with n-gram speculation (K = 3 drafts, lookup of 2 to 4
tokens), vase (vase-attnv, B = 32, w = 16) without and with it. Two workloads of 4 greedy requests each: a
repetitive one (counting, listing: the n-gram proposer finds its drafts in the context) and a non-repetitive one
(short essays). Each engine runs both once untimed first (warm-up). Each round runs every (workload, engine)
pair in turn, the engine order rotating per round. Per
row: tok/s (generated tokens / wall seconds of the batch; median and range over the rounds), drafts accepted per
verify step and generated tokens per request-step (1.0 without speculation), and whether the tokens equal the
same engine's without speculation (greedy fp32: they should). Writes docs/results/vllm-spec.json
(vase.files.provenance).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vase.files.provenance import finish, provenance, write_results  # noqa: E402

METHOD, BUDGET, WINDOW, BLOCK = "vase-attnv", 32, 16, 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
#: (name, vase, speculation); each engine lives in its own process (`serve`): in one process, a second engine fails
#: to start after one with a proposer (vLLM 0.32's CPU kernel overrides do not register twice)
ENGINES = [("stock vLLM", False, False), (f"vase {METHOD}", True, False), ("stock vLLM", False, True),
           (f"vase {METHOD}", True, True)]
WORKLOADS = {
    "repetitive": ["Count from 1 to 200, separated by commas: 1, 2, 3, 4, 5,",
                   "Count from 300 to 500, separated by commas: 300, 301, 302, 303,",
                   "List the numbers from 50 to 250, one per line:\n50\n51\n52\n",
                   "Write the multiplication table of 7, one line each: 7 x 1 = 7\n7 x 2 = 14\n7 x 3 = 21\n"],
    "non-repetitive": ["Write a short essay about the history of the printing press and its effect on Europe.",
                       "Explain how a refrigerator works to a curious ten-year-old, step by step.",
                       "Describe a walk through a busy market in a coastal town at dawn.",
                       "Give advice to someone starting their first job as a software engineer."],
}
TABLE = {"columns": ["workload", "engine", "n-gram speculation", "tok/s (median)", "tok/s (min-max)",
                     "drafts accepted / verify step", "tokens / request-step", "same tokens as without", "rounds"],
         "keys": ["workload", "engine", "speculation", "tok_per_s_median", "tok_per_s_range",
                  "accepted_per_verify", "tokens_per_request_step", "same_tokens_as_plain", "rounds"],
         "align": "lllrrrrll", "formats": {"tok_per_s_median": ".1f", "accepted_per_verify": ".2f",
                                          "tokens_per_request_step": ".2f"}}


def speculative_config(proposer: str, path: str) -> dict:
    """n-gram lookup, or the model at `path` as its own draft model; K = 3 either way."""
    if proposer == "ngram":
        return dict(NGRAM)
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3}


def start(path: str, vase: bool, spec: bool, max_len: int, proposer: str = "ngram"):
    from vase.engines.vllm import engine_args, start_engine
    from vase.vllm.config import vase_section

    extra = {"speculative_config": speculative_config(proposer, path)} if spec else {}
    args = engine_args(path, dtype="float32", max_model_len=max_len, seed=0,
                       section=vase_section(METHOD, BUDGET, WINDOW) if vase else None, in_process=True,
                       block_size=BLOCK, max_num_seqs=4, kv_cache_memory_bytes=256 * 1024 * 1024,
                       max_num_batched_tokens=4096, **extra)
    llm = start_engine(args)
    llm.spec_counts = count_drafts(llm.engine_core.engine_core.scheduler)
    return llm


def count_drafts(sched) -> dict:
    """Wrap `sched.update_from_output` to count drafts scheduled, drafts accepted, verify steps and request-steps."""
    counts = {"drafts": 0, "accepted": 0, "verify_steps": 0, "request_steps": 0}
    update = sched.update_from_output

    def counting(scheduler_output, model_runner_output):
        counts["request_steps"] += len(scheduler_output.num_scheduled_tokens)
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            counts["drafts"] += len(drafts)
            counts["verify_steps"] += 1
            sampled = model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[rid]]
            counts["accepted"] += len(sampled) - 1
        return update(scheduler_output, model_runner_output)

    sched.update_from_output = counting
    return counts


def run(llm, prompts: list[list[int]], new: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = dict(llm.spec_counts)
    for i, ids in enumerate(prompts):
        llm.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids),
                        SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False))
    outputs = {}
    t0 = time.perf_counter()
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id.rsplit("-", 1)[0]] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    counts = {k: llm.spec_counts[k] - before[k] for k in before}
    generated = sum(len(t) for t in outputs.values())
    return {"tok_per_s": generated / seconds, "outputs": outputs, "counts": counts, "generated": generated}


def serve(conn, path: str, vase: bool, spec: bool, max_len: int, prompts: dict, new: int,
          proposer: str = "ngram") -> None:
    """One engine in a child process: runs the workload named by each message, sends its `run` back (None: stop)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = start(path, vase, spec, max_len, proposer)
    for workload in prompts:  # warm-up, untimed: the n-gram proposer's numba kernels compile on their first call
        run(llm, prompts[workload], 16)
    conn.send("ready")
    while (workload := conn.recv()) is not None:
        result = run(llm, prompts[workload], new)
        gc.collect()
        conn.send(result)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--proposer", choices=["ngram", "draft_model"], default="ngram")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from vase.models.resolve import model_dir

    path = model_dir(None)
    cmd = ("VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python "
           f"benchmarks/vllm_spec.py --repeats {a.repeats} --new {a.new}"
           + (f" --proposer {a.proposer}" if a.proposer != "ngram" else ""))
    draft = a.proposer == "draft_model"
    spec_cfg = speculative_config(a.proposer, "<the embedded model>")
    label = "draft K=3 (itself)" if draft else "ngram K=3"
    rec = provenance(command=cmd, model="SmolLM2-135M-Instruct (embedded), fp32 weights", method=METHOD,
                     budget=BUDGET, window=WINDOW, block_size=BLOCK, speculative_config=spec_cfg, new_tokens=a.new,
                     repeats=a.repeats, workloads=WORKLOADS)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = {w: [tok(p)["input_ids"] for p in texts] for w, texts in WORKLOADS.items()}
    max_len = max(len(ids) for ps in prompts.values() for ids in ps) + a.new
    ctx = multiprocessing.get_context("spawn")
    engines = []
    for _, vase, spec in ENGINES:  # started one after the other (each takes the machine while it starts)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(child, path, vase, spec, max_len, prompts, a.new, a.proposer),
                           daemon=True)
        proc.start()
        assert parent.recv() == "ready"
        engines.append((proc, parent))
    runs = {(w, i): [] for w in WORKLOADS for i in range(len(ENGINES))}
    for r in range(a.repeats):
        order = list(range(len(ENGINES)))
        order = order[r % len(order):] + order[: r % len(order)]  # rotate who runs first
        for w in WORKLOADS:
            for i in order:  # one engine at a time: the others wait on their pipes
                engines[i][1].send(w)
                runs[w, i].append(engines[i][1].recv())
        print(f"round {r}", {f"{w}/{i}": round(x[-1]["tok_per_s"], 1) for (w, i), x in runs.items()}, flush=True)
    rows = []
    for w in WORKLOADS:
        for i, (name, vase, spec) in enumerate(ENGINES):
            rs = runs[w, i]
            plain = runs[w, ENGINES.index((name, vase, False))]
            tps = [x["tok_per_s"] for x in rs]
            drafts = sum(x["counts"]["drafts"] for x in rs)
            verify = sum(x["counts"]["verify_steps"] for x in rs)
            accepted = sum(x["counts"]["accepted"] for x in rs)
            rows.append({"workload": w, "engine": name, "speculation": label if spec else "off",
                         "tok_per_s_median": statistics.median(tps), "tok_per_s_range": f"{min(tps):.1f}-{max(tps):.1f}",
                         "tok_per_s": tps, "drafts": drafts, "accepted": accepted, "verify_steps": verify,
                         "accepted_per_verify": accepted / verify if verify else 0.0,
                         "tokens_per_request_step": sum(x["generated"] for x in rs)
                         / sum(x["counts"]["request_steps"] for x in rs),
                         "same_tokens_as_plain": all(x["outputs"] == plain[0]["outputs"] for x in rs),
                         "rounds": len(rs)})
    for proc, conn in engines:
        conn.send(None)
        proc.join(timeout=60)
    print(rows, flush=True)
    finish(rec)
    table = dict(TABLE, columns=[("draft-model speculation" if draft else c) if c == "n-gram speculation" else c
                                 for c in TABLE["columns"]])
    write_results(ROOT / "docs" / "results" / ("vllm-spec-draft.json" if draft else "vllm-spec.json"), rows, rec,
                  table=table)


if __name__ == "__main__":
    main()
