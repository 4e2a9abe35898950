"""The plugin's per-request step (`vase.vllm.steps`): pure schedule arithmetic, no vLLM needed."""

import pytest

from vase.core import schedule
from vase.vllm.steps import StepPlan, VaseStepError, allocation_length, next_boundary, plan_step, step_end

B, W = 64, 16


def _run(origin: int, start: int, stop: int) -> list:
    """Plans of the one-token steps that write tokens start+1..stop."""
    return [plan_step("r", origin, c, 1, B, W) for c in range(start, stop)]


@pytest.mark.parametrize("origin", [1, 20, 64, 100, 300])
def test_uninterrupted_steps_follow_the_schedule(origin):
    plans = _run(origin, origin, origin + 400)
    for n, plan in enumerate(plans):  # n generated tokens stored before the step
        c = origin + n
        assert plan.physical_end == schedule.physical_length(origin, B, W, n + 1)
        assert plan.offset == c + 1 - plan.physical_end
        assert plan.physical_end == allocation_length(origin, c + 1, B, W)
        if schedule.is_eviction_step(origin, B, W, n):
            assert (plan.evict_from, plan.evict_to) == (schedule.physical_length(origin, B, W, n), B)
            assert next_boundary(origin, c - 1, B, W) == c  # eviction steps are the boundaries
        else:
            assert plan.evict_from == 0
    assert sum(p.evict_from > 0 for p in plans) == schedule.num_evictions(origin, B, W, 400)
    # Inside a prefill (chunked or not) nothing moves.
    for c, n in ((0, origin), (0, 1), (origin - 1, 1)):
        assert plan_step("r", origin, c, n, B, W) == StepPlan(0, 0, 0, c + n)


def _replay(origin: int, history: int, chunk: int) -> list:
    """The steps of a recomputing prefill of `history` tokens cut at the boundaries and at `chunk` tokens."""
    steps, c = [], 0
    while c < history:
        n = min(chunk, history - c, next_boundary(origin, c, B, W) - c)
        steps.append((c, n, plan_step("r", origin, c, n, B, W)))
        c += n
    return steps


@pytest.mark.parametrize("origin, history, chunk", [(20, 150, 64), (20, 101, 7), (100, 190, 1000), (20, 61, 3),
                                                     (300, 320, 64), (300, 700, 50), (80, 80 + 16 + 64, 40)])
def test_a_recomputing_prefill_cut_at_the_boundaries_replays_the_uninterrupted_schedule(origin, history, chunk):
    """After each chunk the request stores what decoding stored at that length; it evicts at exactly the positions
    decoding evicted at, from the same lengths, to B; then decoding goes on as if nothing happened."""
    decoded = {c: p for c, p in zip(range(origin, history), _run(origin, origin, history))}
    evicted_at = [c for c, p in decoded.items() if p.evict_from]
    replay = _replay(origin, history, chunk)
    assert [c for c, _, p in replay if p.evict_from] == evicted_at
    for c, n, plan in replay:
        assert plan.physical_end == allocation_length(origin, c + n, B, W)
        if c + n > origin:
            assert plan.physical_end == schedule.physical_length(origin, B, W, c + n - origin)
            assert plan.offset == c + n - plan.physical_end
        if plan.evict_from:
            assert (plan.evict_from, plan.evict_to) == (decoded[c].evict_from, B)
        assert plan.physical_end <= max(schedule.first_limit(origin, B, W), B + W)
    for c in range(history, history + 100):
        assert plan_step("r", origin, c, 1, B, W) == plan_step("r", origin, c, 1, B, W)


@pytest.mark.parametrize("computed, n", [(70, 30), (100, 17), (158, 3), (10, 20)])
def test_a_step_across_a_boundary_is_refused_in_one_line(computed, n):
    """P0 = 20, B = 64, w = 16: boundaries 20, 80, 96, 112, ...; a step may end on one, never cross it."""
    assert next_boundary(20, computed, B, W) < computed + n
    with pytest.raises(VaseStepError) as info:
        plan_step("req-7", 20, computed, n, B, W)
    message = str(info.value)
    assert "req-7" in message and f"writes {n} tokens" in message and "\n" not in message
    end = next_boundary(20, computed, B, W)
    assert plan_step("req-7", 20, computed, end - computed, B, W).physical_end == allocation_length(20, end, B, W)


def test_drafts_after_the_prompt_stop_at_the_first_eviction_only():
    """vLLM pads a waiting request's one-token step (its prompt's last token, the rest a prefix-cache hit) with
    placeholder drafts: they may pass the prompt end (nothing is evicted there), never an eviction boundary; known
    tokens still stop at the prompt end. P0 = 20, B = 64, w = 16: first eviction at 80."""
    assert step_end(20, 19, 1, B, W) == 80 and step_end(20, 10, 30, B, W) == 20 and step_end(20, 79, 1, B, W) == 80
    assert plan_step("r", 20, 19, 4, B, W, drafts=3) == StepPlan(0, 0, 0, 23)
    with pytest.raises(VaseStepError):
        plan_step("r", 20, 19, 4, B, W, drafts=2)  # two known tokens: 19 and 20, past the prompt end
    assert plan_step("r", 20, 77, 3, B, W, drafts=2).physical_end == 80  # a verify step ending on the boundary
    with pytest.raises(VaseStepError):
        plan_step("r", 20, 78, 4, B, W, drafts=3)  # its drafts would pass the boundary
