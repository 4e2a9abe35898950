"""How much a preemption after eviction changes a request's tokens in the plugin (vLLM CPU, tiny Llama).

    PYTHONPATH=src:. .venv/bin/python tests/vllm_preemption_drift.py [METHOD ...]   # default: every evicting one

For each method, the three requests of test_vllm_exact's preemption test (prompts of 10, 30 and 70
tokens, 150 greedy tokens, B = 48, w = 16) run once uninterrupted and once with each request
preempted twice by vLLM's own `_preempt_request` after it had evicted (the test's helper). Prints,
per method, the first token index where the preempted run differs from the uninterrupted one, per
request (150: identical), and the index of the first forced preemption's next token for scale.
"""

from __future__ import annotations

import sys
import tempfile


def main(methods: list[str]) -> None:
    from tests import test_vllm_exact as exact
    from tests.vllm_tiny import runner, save_tiny_llama
    from vase.bench.vllm_bench import first_difference
    from vase.policies import get_policy
    from vase.vllm import additional_config

    tiny = save_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    llm = exact.make_engine(tiny, additional_config("h2o", exact.B_PRE, exact.W_PRE), enable_chunked_prefill=True,
                            max_num_batched_tokens=64)
    prompts = [exact.prompt_ids(n, n) for n in (10, 30, 70)]
    for method in methods or exact.EVICTING:
        runner(llm).vase_policy = get_policy(method)
        plain = exact._preempt_evicted(llm, prompts, 150, every=10**9)["outputs"]
        forced = exact._preempt_evicted(llm, prompts, 150, every=23)
        firsts = [first_difference(plain[k], forced["outputs"][k]) for k in sorted(plain)]
        print(f"{method:>14}: first differing token per request {firsts} (150 = identical); "
              f"preemptions {sorted(forced['forced'].values())}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
