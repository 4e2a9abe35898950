"""The eviction schedule as pure functions: when a sequence evicts and how much it stores.

Shared by every integration (the transformers `EvictionCache`, the vLLM plugin), so each one
can compute where it stands from three numbers and a count instead of feeding counts back.
No torch here.

Terms, per sequence (one batch row; padding is not counted):

- `prefill_len` P: prompt tokens written by the prefill.
- `budget` B: tokens kept per layer and KV head after an eviction.
- `window` w: recent tokens never evicted; also the eviction interval.
- `n_generated` n: tokens written to the cache after the prompt, i.e. decode steps fed back
  (the last sampled token, never fed back, is not counted).
- limit: a sequence evicts before a write would take its stored length past the limit.
  The first limit is `max(P, B) + w` (a long prompt is kept whole until then); after an
  eviction, which brings the stored length to B, the limit is `B + w`.

With one token written per step, evictions run before the writes of generated tokens
e1 + 1, e1 + 1 + w, e1 + 1 + 2w, ... where e1 = max(P, B) + w - P; we call e1, e1 + w, ...
the eviction steps (the count of generated tokens stored when the eviction runs).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SequenceStats", "cdiv", "eviction_steps", "first_eviction_step", "first_limit", "is_eviction_step",
    "max_blocks", "must_evict", "num_evictions", "peak_length", "physical_length", "room", "sequence_stats",
    "placeholder_budget", "steady_limit", "stored_length_sum",
]


def _check(prefill_len: int, budget: int, window: int, n_generated: int = 0) -> None:
    if prefill_len < 0 or n_generated < 0:
        raise ValueError(f"prefill_len ({prefill_len}) and n_generated ({n_generated}) must be >= 0")
    if window < 1:
        raise ValueError(f"window must be a positive number of tokens, got {window}")
    if budget < 1:
        raise ValueError(f"budget must be a positive number of tokens, got {budget}")


def first_limit(prefill_len: int, budget: int, window: int) -> int:
    """Stored length a sequence may reach before its first eviction: max(P, B) + w."""
    _check(prefill_len, budget, window)
    return max(prefill_len, budget) + window


def steady_limit(budget: int, window: int) -> int:
    """Stored length a sequence may reach between later evictions: B + w."""
    return budget + window


def first_eviction_step(prefill_len: int, budget: int, window: int) -> int:
    """Generated tokens stored when the first eviction runs: max(P, B) + w - P."""
    return first_limit(prefill_len, budget, window) - prefill_len


def is_eviction_step(prefill_len: int, budget: int, window: int, n_generated: int) -> bool:
    """Whether the cache evicts before writing generated token `n_generated + 1` (one token per step)."""
    _check(prefill_len, budget, window, n_generated)
    first = first_eviction_step(prefill_len, budget, window)
    return n_generated >= first and (n_generated - first) % window == 0


def num_evictions(prefill_len: int, budget: int, window: int, n_generated: int) -> int:
    """Evictions that ran while `n_generated` tokens were written after the prompt."""
    _check(prefill_len, budget, window, n_generated)
    first = first_eviction_step(prefill_len, budget, window)
    return 0 if n_generated <= first else 1 + (n_generated - first - 1) // window


def eviction_steps(prefill_len: int, budget: int, window: int, n_generated: int) -> list[int]:
    """The eviction steps (generated tokens stored when each eviction ran) while writing `n_generated` tokens."""
    first = first_eviction_step(prefill_len, budget, window)
    return [first + k * window for k in range(num_evictions(prefill_len, budget, window, n_generated))]


def physical_length(prefill_len: int, budget: int, window: int, n_generated: int) -> int:
    """Tokens stored (per layer and KV head) after `n_generated` tokens were written after the prompt."""
    _check(prefill_len, budget, window, n_generated)
    first = first_eviction_step(prefill_len, budget, window)
    if n_generated <= first:
        return prefill_len + n_generated
    return budget + (n_generated - first - 1) % window + 1


def peak_length(prefill_len: int, budget: int, window: int, n_generated: int) -> int:
    """Most tokens ever stored up to `n_generated`: the first limit once reached, else what is stored."""
    _check(prefill_len, budget, window, n_generated)
    return min(prefill_len + n_generated, first_limit(prefill_len, budget, window))


def must_evict(stored: int, incoming: int, limit: int, budget: int) -> bool:
    """Whether a sequence storing `stored` tokens evicts before writing `incoming` more.

    It does when the write would pass its `limit` (first_limit, then steady_limit) and it
    holds more than B (a sequence at B has nothing to evict)."""
    return stored + incoming > limit and stored > budget


def room(stored: int, limit: int) -> int:
    """Tokens a sequence can write before it must evict (0: the next write evicts first)."""
    return max(limit - stored, 0)


def stored_length_sum(prefill_len: int, budget: int, window: int, n_generated: int) -> int:
    """Sum of `physical_length(P, B, w, j)` over j = 1..n: stored tokens summed over the decode steps.

    Divide by n for the time-averaged stored length; multiply by bytes per token for the bytes a
    sequence held, summed over its steps. Closed form (no loop over steps)."""
    _check(prefill_len, budget, window, n_generated)
    first = first_eviction_step(prefill_len, budget, window)
    grow = min(n_generated, first)  # steps before the first eviction: P + 1 .. P + grow
    total = grow * prefill_len + grow * (grow + 1) // 2
    after = n_generated - grow  # steps after it: B + 1 .. B + w, repeated
    cycles, rest = divmod(after, window)
    return total + after * budget + cycles * window * (window + 1) // 2 + rest * (rest + 1) // 2


@dataclass(frozen=True)
class SequenceStats:
    """Where one sequence stands after `n_generated` tokens were written after its prompt (per layer and KV head)."""

    evictions: int  # `num_evictions`
    stored: int  # `physical_length`: tokens stored now
    peak: int  # `peak_length`: most tokens ever stored (the prompt included)
    seen: int  # tokens written: P + n
    stored_sum: int  # `stored_length_sum`: stored tokens summed over the decode steps 1..n


def sequence_stats(prefill_len: int, budget: int | None, window: int, n_generated: int) -> SequenceStats:
    """`SequenceStats` of a sequence with prompt P = `prefill_len`; `budget` None: a cache that never evicts
    (`full`: everything written stays stored). The one call the reports make for a sequence's lengths."""
    P, n = prefill_len, n_generated
    if budget is None:
        if P < 0 or n < 0:
            raise ValueError(f"prefill_len ({P}) and n_generated ({n}) must be >= 0")
        return SequenceStats(evictions=0, stored=P + n, peak=P + n, seen=P + n, stored_sum=n * P + n * (n + 1) // 2)
    return SequenceStats(evictions=num_evictions(P, budget, window, n), stored=physical_length(P, budget, window, n),
                         peak=peak_length(P, budget, window, n), seen=P + n,
                         stored_sum=stored_length_sum(P, budget, window, n))


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative integers (blocks needed for `a` tokens of block size `b`)."""
    return -(-a // b)


def max_blocks(budget: int, window: int, block_size: int) -> int:
    """Paged-cache blocks a sequence needs once it has evicted: ceil((B + w) / block_size)."""
    return cdiv(steady_limit(budget, window), block_size)


def placeholder_budget(window: int) -> int:
    """The budget given to a method that keeps every token (`full`) when none is asked for: it never evicts, so B
    only has to pass the budget rule, which `full` passes at any B >= 1. One value for every door (the cache, the
    eval, the bench, the byte model), so no two compute it differently."""
    return window + 1
