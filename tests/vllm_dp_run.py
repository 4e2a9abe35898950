"""One vLLM engine (CPU build) with the vase plugin at a given data-parallel degree, run as a script by
tests/test_vllm_dp.py. vLLM's offline `LLM` refuses `data_parallel_size > 1`, so this drives `AsyncLLM`, which
starts one engine core process (scheduler + worker) per DP rank behind one front end.

    python tests/vllm_dp_run.py MODEL_DIR DP OUT.json

For each method it swaps the policy on every worker of every rank, sends the batch of `tests.vllm_tp_run`
(request i pinned to rank i % DP, so each rank holds a batch of its own), decodes greedily, and writes per
method and request the tokens, vLLM's top-5 log-probs and the kept logical positions at every eviction, in
`vllm_tp_run`'s format (so `vllm_tp_run.compare` checks it against DP = 1), plus which rank evicted each request.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.vllm_parallel import request_entry, worker_env  # noqa: E402
from tests.vllm_tp_run import BUDGET, METHODS, N_NEW, PROMPT_LENGTHS, WINDOW, engine_settings, prompt_ids  # noqa: E402


def _swap_policy(worker, method: str) -> None:
    """On a worker: run `method` from now on and start recording kept positions."""
    from vase.core.policies import get_policy

    worker.model_runner.vase_policy = get_policy(method)
    worker.model_runner.vase_record = {}


def _take_record(worker) -> dict:
    """On a worker: (its engine's DP index, what it recorded since the swap)."""
    record, worker.model_runner.vase_record = worker.model_runner.vase_record, None
    return {"dp": worker.vllm_config.parallel_config.data_parallel_index, "record": record}


async def _all_engines(llm, fn, *args) -> list:
    """`fn` on every worker of every DP rank (AsyncLLM.collective_rpc answers with the first rank's only)."""
    per_engine = await llm.engine_core.call_utility_all_async("collective_rpc", fn, None, args, None)
    return [w for workers in per_engine for w in workers]


async def _generate(llm, ids: list[int], params, rank: int | None):
    final = None
    async for out in llm.generate({"prompt_token_ids": ids}, params, request_id=str(uuid.uuid4()),
                                  data_parallel_rank=rank):
        final = out
    return final


async def main(model: str, dp: int, out: str) -> None:
    worker_env(None)  # one engine core process per rank, its threads left to vLLM
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vase.vllm import additional_config

    args = AsyncEngineArgs(model=model, data_parallel_size=dp, additional_config=additional_config(METHODS[0], BUDGET,
                           WINDOW), **engine_settings(model))
    llm = AsyncLLM.from_engine_args(args)
    try:
        prompts = [prompt_ids(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
        params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
        result: dict = {"tp": 1, "dp": dp, "prompts": prompts, "methods": {}, "ranks": {}}
        for method in METHODS:
            await _all_engines(llm, _swap_policy, method)
            outs = await asyncio.gather(*[_generate(llm, ids, params, i % dp if dp > 1 else None)
                                          for i, ids in enumerate(prompts)])
            workers = await _all_engines(llm, _take_record)
            per_request, ranks = [], []
            for o in outs:
                # the engine core suffixes request ids: match the front end's id by prefix
                held = [(w["dp"], entry) for w in workers for rid, entry in w["record"].items()
                        if rid.rsplit("-", 1)[0] == o.request_id]
                assert len(held) == 1, (o.request_id, [h[0] for h in held])  # one rank evicted it
                ranks.append(held[0][0])
                per_request.append(request_entry(o, {str(e["seen"]): e["positions"] for e in held[0][1]["kept"]}))
            result["methods"][method] = per_request
            result["ranks"][method] = ranks
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
