"""What the speculative-decoding tests of the vLLM plugin share (tests/test_vllm_spec.py: n-gram,
test_vllm_spec_draft.py: a draft model, test_vllm_spec_eagle.py: EAGLE heads): the engine settings, the
comparison with plain decoding, the preemption replay, and the fixture that lets later engines start."""

from __future__ import annotations

import sys
import time

import pytest

from tests.vllm_tiny import core, greedy, runner, start_llm, vllm_batch
from vase.core import schedule
from vase.core.policies import get_policy, method_names
from vase.vllm import additional_config

BLOCK, B, W, N_NEW = 32, 48, 16, 200
EVICTING = [m for m in method_names() if get_policy(m).evicts]
#: repetitive prompts (the n-gram proposer drafts from them) and one without repeats; 24 to 30 tokens, so that
#: 200 new tokens cross the first eviction (at 64) and 9 more (every 16)
PROMPTS = [[5, 6, 7, 8, 9, 10] * 5, [11, 12, 13, 14] * 6, list(range(30, 56))]


def spec_engine(path: str, bytes_per_token: int, **kwargs):
    """A tiny in-process engine with h2o at B, W: a KV pool of 32 blocks of `bytes_per_token`-byte tokens, chunked
    prefill of 64 tokens (a resumed request replays its history in chunks: the preemption tests)."""
    options = dict(model=path, max_model_len=512, kv_cache_memory_bytes=32 * BLOCK * bytes_per_token,
                   block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8,
                   enable_chunked_prefill=True, max_num_batched_tokens=64, **kwargs)
    return start_llm(options, additional_config("h2o", B, W))


@pytest.fixture(scope="module", autouse=True)
def later_engines_can_start():
    """After this module, let later vLLM engines start in this process: the n-gram proposer imports numba, whose
    `llvmlite.binding.ffi.lib` answers `vars()` with a non-dict, and vLLM 0.32's kernel-override scan over
    `sys.modules` (`triton_utils/dispatcher.py` `_rebind_kernels`) then fails every later engine start with
    "'_lib_fn_wrapper' object has no attribute 'get'" (seen in `make test`: 17 errors in the vLLM files a worker ran
    after this one). The module stays imported by `llvmlite.binding`; only the scan's view of it is dropped."""
    yield
    sys.modules.pop("llvmlite.binding.ffi", None)


def same(ours: list[dict], ref: list[dict], min_evictions: int = 8) -> None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a["tokens"] == b["tokens"], (i, next(t for t, (x, y) in enumerate(zip(a["tokens"], b["tokens"]))
                                                   if x != y))
        assert sorted(a["kept"]) == sorted(b["kept"]) and len(b["kept"]) >= min_evictions, (i, sorted(a["kept"]))
        for seen in b["kept"]:
            assert a["kept"][seen] == b["kept"][seen], (i, seen)


def plain_batch(plain, method: str) -> list[dict]:
    """`vllm_batch(plain, method, PROMPTS, N_NEW)` on the engine without speculation, run once per method for that
    engine: greedy decoding and the per-request eviction draws repeat exactly, and a module compares several
    speculative engines (and the preemption replays) with the same plain runs."""
    runs = plain.__dict__.setdefault("vase_plain_runs", {})
    if method not in runs:
        runs[method] = vllm_batch(plain, method, PROMPTS, N_NEW)
    return runs[method]


def preempted_once(llm, method: str, prompts: list[list[int]], n_new: int) -> list[dict]:
    """The prompts as one greedy batch; each request is preempted once, at the first step after its second eviction
    (vLLM recomputes its history as a chunked prefill, the worker replays its evictions). Per prompt: tokens and
    the kept sets of every eviction (the replay's overwrite the first run's at the same length)."""
    r, sched = runner(llm), core(llm).scheduler
    r.vase_policy = get_policy(method)
    r.vase_record = {}
    for i, ids in enumerate(prompts):
        llm.llm_engine.add_request(f"s{i}", {"prompt_token_ids": ids}, greedy(n_new))
    outs, forced = {}, set()
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
        for req in list(sched.running):
            p, c = req.num_prompt_tokens, req.num_computed_tokens
            if req.request_id not in forced and c >= p and schedule.num_evictions(p, B, W, c - p) >= 2 \
                    and c == req.num_tokens - 1:
                sched.running.remove(req)
                sched._preempt_request(req, time.monotonic())
                forced.add(req.request_id)
    record = {rid.rsplit("-", 1)[0]: entry for rid, entry in r.vase_record.items()}
    r.vase_record = None
    assert len(forced) == len(prompts)
    return [{"tokens": outs[f"s{i}"], "kept": {e["seen"]: e["positions"] for e in record[f"s{i}"]["kept"]},
             "evictions": record[f"s{i}"]["evictions"]} for i in range(len(prompts))]


def assert_preempted_exact(llm, plain, method: str) -> None:
    """Each request preempted once after its second eviction (`preempted_once`): the same tokens and kept sets as
    `plain` without speculation or preemption; the replay evicted again (more eviction events than lengths)."""
    before = runner(llm).vase_recomputes
    ours = preempted_once(llm, method, PROMPTS, N_NEW)
    same(ours, plain_batch(plain, method), min_evictions=9)
    assert runner(llm).vase_recomputes - before == len(PROMPTS)
    assert all(o["evictions"] > len(o["kept"]) for o in ours)
