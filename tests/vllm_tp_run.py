"""One vLLM engine (CPU build) with the vase plugin at a given tensor-parallel degree, run as a script by
tests/test_vllm_tp.py (TP needs vLLM's multiprocess executor: one worker process per rank).

    python tests/vllm_tp_run.py MODEL_DIR TP OUT.json
    python tests/vllm_tp_run.py MODEL_DIR TP --stock    # stock vLLM at that degree, no vase section: does TP run?
    python tests/vllm_tp_run.py --compare TP1.json TPN.json   # the test's comparison, printed (exit 1 if it fails)

For each method it swaps the policy on every worker (`collective_rpc`), decodes the same batch of prompts
greedily, and writes per method and request: the tokens, vLLM's top-5 log-probs per step, and the kept
logical positions at every eviction of every rank (per layer: the rank's KV heads, global head order).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.vllm_parallel import request_entry, worker_env  # noqa: E402

BLOCK = 32
BUDGET, WINDOW, N_NEW = 48, 16, 150
METHODS = ["snapkv", "h2o", "vase-attnv"]  # deterministic, per-slot state, seeded stochastic
PROMPT_LENGTHS = (7, 60, 33)
TOL = 2e-3  # log-prob tolerance, and the top-2 margin below which a token may flip by rounding
#: The engine both runs use (vase's and the stock probe): eager, fp32, a pool of POOL_BLOCKS blocks.
ENGINE = dict(max_model_len=512, block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8)
POOL_BLOCKS = 64


def engine_settings(model: str) -> dict:
    """ENGINE plus a KV pool of POOL_BLOCKS blocks of this model (fp32)."""
    from transformers import AutoConfig

    from vase.engines.base import kv_bytes_per_token

    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model), "float32")
    return {**ENGINE, "kv_cache_memory_bytes": POOL_BLOCKS * BLOCK * per_token}


def horizon(logprobs: list[dict]) -> int:
    """Index of the first step whose top-2 margin is below TOL (tokens after it may flip by rounding)."""
    for t, step in enumerate(logprobs):
        top = sorted(step.values(), reverse=True)
        if len(top) > 1 and top[0] - top[1] < TOL:
            return t
    return len(logprobs)


def compare(one: dict, other: dict, method: str) -> dict:
    """Check run `other` (TP = N) against `one` (TP = 1) for `method`, raising AssertionError at the first
    difference: tokens and kept positions (every eviction, layer, KV head) equal and log-probs within TOL, up to
    TP = 1's first near-tie per request. Returns what was compared: steps, evictions, largest log-prob gap."""
    assert one["prompts"] == other["prompts"]
    steps = evictions = 0
    gap = 0.0
    for ref, ours, prompt in zip(one["methods"][method], other["methods"][method], one["prompts"]):
        n = min(horizon(ref["logprobs"]) + 1, len(ref["tokens"]))
        assert ours["tokens"][:n] == ref["tokens"][:n], (method, "tokens differ")
        for t in range(n):
            common = ours["logprobs"][t].keys() & ref["logprobs"][t].keys()  # the top-5 tails may differ by a tie
            assert str(ref["tokens"][t]) in common
            for token in common:
                d = abs(ours["logprobs"][t][token] - ref["logprobs"][t][token])
                assert d < TOL, (method, t, token, d)
                gap = max(gap, d)
        # An eviction at `seen` tokens ran before generated token seen - P + 1 was written.
        seen = [s for s in ref["kept"] if int(s) - len(prompt) < n]
        assert seen == [s for s in ours["kept"] if int(s) - len(prompt) < n]
        for s in seen:
            assert ours["kept"][s] == ref["kept"][s], (method, s, "kept positions differ (layer -> head -> positions)")
        steps += n
        evictions += len(seen)
    return {"method": method, "steps": steps, "evictions": evictions, "max_logprob_gap": gap}


def prompt_ids(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(3000 + salt)
    return torch.randint(3, 90, (n,), generator=g).tolist()


def _swap_policy(worker, method: str) -> None:
    """On a worker: run `method` from now on (as the rank sees it) and start recording kept positions."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from vase.core.policies import get_policy
    from vase.vllm.heads import RankHeads, rank_policy

    runner = worker.model_runner
    heads = RankHeads.of_rank(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                              runner.vllm_config.model_config.get_total_num_kv_heads())
    runner.vase_policy = rank_policy(get_policy(method), heads)
    runner.vase_record = {}


def _take_record(worker) -> dict:
    """On a worker: (TP rank, what it recorded since the swap)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    record, worker.model_runner.vase_record = worker.model_runner.vase_record, None
    return {"rank": get_tensor_model_parallel_rank(), "record": record}


def main(model: str, tp: int, out: str) -> None:
    """Write the run described in the module docstring to `out`; with out == "--stock", only generate a few
    tokens with stock vLLM (the plugin inactive) at this degree."""
    worker_env(tp)
    from vllm import LLM, SamplingParams

    from vase.vllm import additional_config

    engine = engine_settings(model)
    if out == "--stock":
        llm = LLM(model=model, tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
                  **engine)
        llm.generate([{"prompt_token_ids": prompt_ids(20, 0)}], SamplingParams(max_tokens=8, temperature=0.0),
                     use_tqdm=False)
        return
    llm = LLM(model=model, tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
              additional_config=additional_config(METHODS[0], BUDGET, WINDOW), **engine)
    prompts = [prompt_ids(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    result: dict = {"tp": tp, "prompts": prompts, "methods": {}}
    for method in METHODS:
        llm.collective_rpc(_swap_policy, args=(method,))
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        ranks = sorted(llm.collective_rpc(_take_record), key=lambda r: r["rank"])
        # The engine core suffixes request ids ("0" -> "0-1a2b..."): key the records by the front end's id.
        records = [{rid.rsplit("-", 1)[0]: entry for rid, entry in r["record"].items()} for r in ranks]
        per_request = []
        for i, o in enumerate(outs):
            rid = o.request_id
            kept = [{e["seen"]: e["positions"] for e in rec[rid]["kept"]} for rec in records]
            # kept[seen] -> per layer, the KV heads of all ranks in global order
            per_request.append(request_entry(o, {str(seen): [sum((k[seen][layer] for k in kept), [])
                                                             for layer in range(len(kept[0][seen]))]
                                                 for seen in kept[0]}))
        result["methods"][method] = per_request
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        runs = [json.load(open(path)) for path in sys.argv[2:4]]
        for m in METHODS:
            print(json.dumps({"tp": runs[1]["tp"], "vs_tp": runs[0]["tp"], **compare(runs[0], runs[1], m)}))
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
