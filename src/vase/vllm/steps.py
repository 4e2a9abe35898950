"""One request's step in the plugin, as a pure function of the schedule: what to evict and where to write.

The schedule of a request is keyed by its prompt length P0 (`vase.core.schedule`) for its whole life,
and it evicts only at its eviction boundaries: the logical positions max(P0, B) + w + k w, before
the token there is written. vLLM's recompute preemption throws a request's blocks away and later
prefills its whole logical history again. The plugin makes that recompute exact: the scheduler
cuts the recomputing prefill into chunks that end at P0 and at each eviction boundary
(`next_boundary`, applied in `VaseScheduler`), and the worker evicts before a chunk that starts
on a boundary, with the request's policy state started afresh and its generator re-seeded, so
the replay rebuilds the cache decoding had built, holding (and allocated) exactly what the
uninterrupted schedule holds. A step may therefore write several tokens past the prompt, as long
as it crosses no boundary.

Both sides use this: the worker (`VaseCPUModelRunner`, `VaseGPUModelRunner`) to evict and map
slots, the scheduler (`EvictingKVCacheManager`) to cut chunks and allocate blocks.
No vLLM or torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import schedule


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


def next_boundary(origin: int, computed: int, budget: int, window: int) -> int:
    """The first logical position after `computed` where a request with prompt `origin` (P0) stops a multi-token
    step: its prompt end P0, then max(P0, B) + w + k w (the positions evicted before)."""
    if computed < origin:
        return origin
    first = schedule.first_limit(origin, budget, window)
    if computed < first:
        return first
    return first + ((computed - first) // window + 1) * window


def step_end(origin: int, computed: int, real: int, budget: int, window: int) -> int:
    """The furthest position a step starting at `computed` may end, its first `real` tokens known ones (prompt or
    sampled) and the rest draft tokens (speculative decoding; vLLM also pads a waiting request's one-token step with
    placeholder drafts): `next_boundary`, except that drafts following the prompt's last token stop only at the
    first eviction boundary. No step crosses an eviction boundary, so an eviction runs on verified tokens only: vLLM
    rolls a rejected draft back (`num_computed_tokens -= num_rejected`) before the step that would evict."""
    if computed < origin and computed + real <= origin:  # only drafts pass the prompt end
        return next_boundary(origin, origin, budget, window)
    return next_boundary(origin, computed, budget, window)


def draft_limit(origin: int, computed: int, budget: int, window: int) -> int:
    """The first eviction boundary after `computed` for a request with prompt `origin` (P0): a draft model writes
    its own K/V for positions ahead of the verified ones, and only those below this limit have a physical slot (the
    same `logical - offset` as the step's tokens; at the limit the target evicts before it writes)."""
    first = schedule.first_limit(origin, budget, window)
    if computed < first:
        return first
    return first + ((computed - first) // window + 1) * window


def stored_before(origin: int, computed: int, budget: int, window: int) -> int:
    """Tokens a request stores once `computed` tokens (logical) are written, prompt `origin` (P0)."""
    if computed <= origin:
        return computed
    return schedule.physical_length(origin, budget, window, computed - origin)


def plan_step(req_id: str, origin: int, computed: int, scheduled: int, budget: int, window: int,
              drafts: int = 0) -> StepPlan:
    """The step of request `req_id` that writes `scheduled` tokens after `computed` (both logical), prompt `origin`,
    the last `drafts` of them draft tokens (speculative decoding).

    A prefill chunk (new or recomputing), a decode step or a verify step: evicts first when it starts
    on an eviction boundary. Raises VaseStepError for a step that crosses a boundary or, with known
    tokens, the prompt end (`step_end`: the scheduler cuts steps there; a streaming-input chunk would)."""
    c, n = computed, scheduled
    if c + n <= origin:  # (part of) the prompt: nothing evicted yet, physical = logical
        return StepPlan(0, 0, 0, c + n)
    end = step_end(origin, c, n - drafts, budget, window)
    if c + n > end:
        raise VaseStepError(f"vase: request {req_id} writes {n} tokens at position {c}, past its eviction boundary "
                            f"{end} (prompt {origin}); the plugin's scheduler cuts steps there (no streaming input "
                            f"or other schedulers): drop additional_config['vase'] for such requests")
    before = stored_before(origin, c, budget, window)
    after = stored_before(origin, c + n, budget, window)
    if before + n > after:  # the step starts on an eviction boundary: evict to B first
        return StepPlan(before, after - n, c + n - after, after)
    return StepPlan(0, 0, c + n - after, after)


def allocation_length(origin: int, n_tokens: int, budget: int, window: int) -> int:
    """Tokens a request must have room for once `n_tokens` (logical) are written (the scheduler's view): the
    uninterrupted schedule's length, also while a recomputing prefill replays it."""
    return stored_before(origin, n_tokens, budget, window)


def evicts_at(origin: int, computed: int, budget: int, window: int) -> bool:
    """Whether a step of a request with prompt `origin` (P0) that starts at logical position `computed` evicts
    before it writes (it starts on an eviction boundary: max(P0, B) + w + k w)."""
    first = schedule.first_limit(origin, budget, window)
    return computed >= first and (computed - first) % window == 0


def max_prefix_hit(origin: int, budget: int, block_size: int) -> int:
    """The most tokens a request with prompt `origin` (P0) may take from the prefix cache: whole blocks within
    max(P0, B), so that the tokens from there to its first eviction boundary max(P0, B) + w, whose queries its
    first eviction reads, are computed (a new request's hit is within its prompt anyway)."""
    return max(origin, budget) // block_size * block_size
