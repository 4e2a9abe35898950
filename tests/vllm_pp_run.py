"""One vLLM engine (CPU build) with the vase plugin at a given pipeline-parallel degree, run as a script by
tests/test_vllm_pp.py (PP needs vLLM's multiprocess executor: one worker process per stage).

    python tests/vllm_pp_run.py MODEL_DIR PP OUT.json

The batch, methods and output format of `tests.vllm_tp_run` (so `vllm_tp_run.compare` checks PP = 2 against
PP = 1): each stage records the kept positions of its own layers, and the stages' layer lists are joined in stage
order.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.vllm_parallel import request_entry, worker_env  # noqa: E402
from tests.vllm_tp_run import BUDGET, METHODS as TP_METHODS, N_NEW, PROMPT_LENGTHS, WINDOW, engine_settings, prompt_ids  # noqa: E402,E501

#: `vllm_tp_run`'s methods and vase-dkv, whose per-layer state is drawn (hook 2): both kinds of draws a stage replays
METHODS = [*TP_METHODS, "vase-dkv"]


def _swap_policy(worker, method: str) -> None:
    """On a worker: run `method` from now on and start recording kept positions."""
    from vase.core.policies import get_policy

    worker.model_runner.vase_policy = get_policy(method)
    worker.model_runner.vase_record = {}


def _take_record(worker) -> dict:
    """On a worker: (its pipeline stage, the layers it evicts, what it recorded since the swap)."""
    from vllm.distributed import get_pp_group

    runner = worker.model_runner
    record, runner.vase_record = runner.vase_record, None
    return {"stage": get_pp_group().rank_in_group, "layers": list(runner.vase_layers), "record": record}


def main(model: str, pp: int, out: str) -> None:
    worker_env(pp)
    from vllm import LLM, SamplingParams

    from vase.vllm import additional_config

    llm = LLM(model=model, pipeline_parallel_size=pp, distributed_executor_backend="mp" if pp > 1 else None,
              additional_config=additional_config(METHODS[0], BUDGET, WINDOW), **engine_settings(model))
    prompts = [prompt_ids(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    result: dict = {"tp": 1, "pp": pp, "prompts": prompts, "methods": {}}
    for method in METHODS:
        llm.collective_rpc(_swap_policy, args=(method,))
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        stages = sorted(llm.collective_rpc(_take_record), key=lambda r: r["stage"])
        result["layers"] = [s["layers"] for s in stages]
        records = [{rid.rsplit("-", 1)[0]: entry for rid, entry in s["record"].items()} for s in stages]
        per_request = []
        for o in outs:
            kept = [{e["seen"]: e["positions"] for e in rec[o.request_id]["kept"]} for rec in records]
            assert all(k.keys() == kept[0].keys() for k in kept), "the stages evicted at different steps"
            # kept[seen] -> per layer (stage 0's layers, then stage 1's ...), per KV head, the positions
            per_request.append(request_entry(o, {str(seen): sum((k[seen] for k in kept), []) for seen in kept[0]}))
        result["methods"][method] = per_request
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
