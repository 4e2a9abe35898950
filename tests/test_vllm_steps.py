"""The plugin's per-request step (`vase.vllm.steps`): pure schedule arithmetic, no vLLM needed."""

import pytest

from vase import schedule
from vase.vllm.steps import VaseStepError, allocation_length, plan_step

B, W = 64, 16


def _run(origin: int, prefill_len: int, start: int, stop: int) -> list:
    """Plans of the one-token steps that write tokens start+1..stop after a prefill of `prefill_len`."""
    return [plan_step("r", origin, prefill_len, c, 1, B, W) for c in range(start, stop)]


@pytest.mark.parametrize("origin", [1, 20, 64, 100, 300])
def test_uninterrupted_steps_follow_the_schedule(origin):
    plans = _run(origin, origin, origin, origin + 400)
    for n, plan in enumerate(plans):  # n generated tokens stored before the step
        c = origin + n
        assert plan.physical_end == schedule.physical_length(origin, B, W, n + 1)
        assert plan.offset == c + 1 - plan.physical_end
        assert plan.physical_end == allocation_length(origin, origin, c + 1, B, W)
        if schedule.is_eviction_step(origin, B, W, n):
            assert (plan.evict_from, plan.evict_to) == (schedule.physical_length(origin, B, W, n), B)
        else:
            assert plan.evict_from == 0
    assert sum(p.evict_from > 0 for p in plans) == schedule.num_evictions(origin, B, W, 400)
    # Inside a prefill (chunked or not) nothing moves.
    for c, n in ((0, origin), (0, 1), (origin - 1, 1)):
        assert plan_step("r", origin, origin, c, n, B, W) == plan_step("r", origin, origin, c, n, B, W)
        assert plan_step("r", origin, origin, c, n, B, W).offset == 0


@pytest.mark.parametrize("origin, preempt_at", [(20, 150), (20, 100), (100, 190), (20, 61), (300, 320)])
def test_a_recomputed_request_returns_to_the_uninterrupted_length_at_once(origin, preempt_at):
    """Preempted with `preempt_at` tokens computed; the recompute prefills all preempt_at + 1 tokens."""
    p2 = preempt_at + 1
    evicted = schedule.num_evictions(origin, B, W, preempt_at - origin) > 0
    first = plan_step("r", origin, p2, p2, 1, B, W)
    target = schedule.physical_length(origin, B, W, p2 + 1 - origin)
    assert first.physical_end == target  # what it would hold had it never been preempted
    if evicted:
        assert (first.evict_from, first.evict_to) == (p2, target - 1)
        assert target <= B + W
    else:
        assert first.evict_from == 0 or schedule.is_eviction_step(origin, B, W, p2 - origin)
    for c, plan in zip(range(p2 + 1, p2 + 200), _run(origin, p2, p2 + 1, p2 + 200)):
        assert plan == plan_step("r", origin, origin, c, 1, B, W)  # then exactly the uninterrupted steps
        assert plan.physical_end == allocation_length(origin, p2, c + 1, B, W)
    assert allocation_length(origin, p2, p2, B, W) == p2  # the recompute itself holds everything


@pytest.mark.parametrize("computed, n", [(100, 2), (100, 17), (120, 3), (90, 20)])
def test_more_than_one_token_past_the_prefill_is_refused_in_one_line(computed, n):
    with pytest.raises(VaseStepError) as info:
        plan_step("req-7", 20, 100, computed, n, B, W)
    message = str(info.value)
    assert "req-7" in message and f"writes {n} tokens" in message and "\n" not in message
