"""One request's step in the plugin, as a pure function of the schedule: what to evict and where to write.

The schedule of a request is keyed by its original prompt length P0 (`vase.schedule`), for its
whole life. vLLM's recompute preemption throws a request's blocks away and later prefills its
whole logical history again (P' tokens, P' >= P0): during that prefill physical = logical, and
at the first decode step after it the request is brought back at once to the length the
uninterrupted schedule holds there (at most B + w - 1), so the memory bound, the block
accounting and `request_stats` are the same as if it had never been preempted. Only the kept
set differs (it was chosen from the recomputed history).

Both sides use this: the worker (`VaseCPUModelRunner`) to evict and map slots, the scheduler
(`EvictingKVCacheManager`) to allocate blocks; nothing is fed back between them.
No vLLM or torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import schedule


class VaseStepError(RuntimeError):
    """A step the plugin cannot run without writing over kept slots (one line naming the request and the cause)."""


@dataclass(frozen=True)
class StepPlan:
    """What one request does in one step.

    evict_from: tokens stored before the step's writes when it evicts first (0: no eviction).
    evict_to:   tokens kept by that eviction (the last w of them are the most recent tokens).
    offset:     logical minus physical position of this step's tokens (0 inside a prefill).
    physical_end: tokens stored after the step's writes.
    """

    evict_from: int
    evict_to: int
    offset: int
    physical_end: int


def stored_before(origin: int, prefill_len: int, computed: int, budget: int, window: int) -> int:
    """Tokens a request stores once `computed` tokens (logical) are written, P0 = `origin`, last prefill `prefill_len`.

    Inside or right at the end of a (re)prefill everything is stored; after that, the schedule's length."""
    if computed <= prefill_len:
        return computed
    return schedule.physical_length(origin, budget, window, computed - origin)


def plan_step(req_id: str, origin: int, prefill_len: int, computed: int, scheduled: int, budget: int,
              window: int) -> StepPlan:
    """The step of request `req_id` that writes `scheduled` tokens after `computed` (both logical).

    origin: its prompt length P0 (the schedule's key); prefill_len: the length of its last
    (re)prefill P'. Raises VaseStepError for a step that writes more than one token past the
    prefill (a streaming-input chunk): the schedule evicts one token at a time.
    """
    c, n = computed, scheduled
    if c + n <= prefill_len:  # (part of) a prefill: nothing evicted yet, physical = logical
        return StepPlan(0, 0, 0, c + n)
    if c < prefill_len or n != 1:
        raise VaseStepError(f"vase: request {req_id} writes {n} tokens at position {c} after its {prefill_len}-token "
                            f"prefill; the plugin writes one token per step past the prefill (no streaming input "
                            f"or multi-token steps): drop additional_config['vase'] for such requests")
    before = stored_before(origin, prefill_len, c, budget, window)
    after = schedule.physical_length(origin, budget, window, c + 1 - origin)
    if before + 1 > after:  # a scheduled eviction, or the catch-up after a recomputing prefill
        return StepPlan(before, after - 1, c + 1 - after, after)
    return StepPlan(0, 0, c + 1 - after, after)


def allocation_length(origin: int, prefill_len: int, n_tokens: int, budget: int, window: int) -> int:
    """Tokens a request must have room for once `n_tokens` (logical) are written (the scheduler's view).

    Inside a (re)prefill the logical length; past it the schedule's physical length."""
    if n_tokens <= prefill_len:
        return n_tokens
    return schedule.physical_length(origin, budget, window, n_tokens - origin)
