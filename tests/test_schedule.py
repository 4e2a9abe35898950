"""The eviction schedule (vase.core.schedule): hand-computed cases, a step-by-step simulation, and the cache's behaviour."""

from __future__ import annotations

import pytest
import torch

from vase.caches.eager import EvictionCache
from vase.hf.compat import cache_kwargs
from vase.core.schedule import (eviction_steps, first_eviction_step, first_limit, is_eviction_step, must_evict,
                           num_evictions, peak_length, physical_length, room, steady_limit)

from .conftest import tiny_model


def test_hand_computed_short_prompt():
    P, B, w = 10, 20, 6
    assert first_limit(P, B, w) == 26 and steady_limit(B, w) == 26
    assert first_eviction_step(P, B, w) == 16
    assert [physical_length(P, B, w, n) for n in (0, 1, 16, 17, 22, 23, 28, 29)] == [10, 11, 26, 21, 26, 21, 26, 21]
    assert eviction_steps(P, B, w, 45) == [16, 22, 28, 34, 40]
    assert eviction_steps(P, B, w, 16) == [] and eviction_steps(P, B, w, 17) == [16]
    assert [n for n in range(45) if is_eviction_step(P, B, w, n)] == [16, 22, 28, 34, 40]
    assert num_evictions(P, B, w, 45) == 5 and num_evictions(P, B, w, 40) == 4
    assert peak_length(P, B, w, 5) == 15 and peak_length(P, B, w, 100) == 26


def test_hand_computed_long_prompt():
    # The prompt (30) is longer than B (16): it is kept whole up to P + w, then cut to B.
    P, B, w = 30, 16, 4
    assert first_limit(P, B, w) == 34 and steady_limit(B, w) == 20
    assert [physical_length(P, B, w, n) for n in range(1, 7)] == [31, 32, 33, 34, 17, 18]
    assert eviction_steps(P, B, w, 13) == [4, 8, 12]
    assert peak_length(P, B, w, 13) == 34


def test_must_evict_and_room():
    assert must_evict(26, 1, 26, 20) and not must_evict(25, 1, 26, 20)
    assert must_evict(24, 3, 26, 20) and not must_evict(24, 2, 26, 20)
    assert not must_evict(20, 30, 26, 20)  # a sequence at B has nothing to evict
    assert room(20, 26) == 6 and room(26, 26) == 0


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="window must be a positive"):
        first_limit(10, 20, 0)
    with pytest.raises(ValueError, match="budget must be a positive"):
        physical_length(10, 0, 4, 3)
    with pytest.raises(ValueError, match=r"n_generated \(-1\)"):
        num_evictions(10, 20, 4, -1)


def _simulate(P: int, B: int, w: int, n: int) -> tuple[list[int], list[int]]:
    """One token per step with must_evict and the two limits: stored length after each write, eviction steps."""
    stored, limit, lengths, steps = P, first_limit(P, B, w), [], []
    for k in range(n):
        if must_evict(stored, 1, limit, B):
            steps.append(k)
            stored, limit = B, steady_limit(B, w)
        stored += 1
        lengths.append(stored)
    return lengths, steps


@pytest.mark.parametrize("P", [1, 5, 19, 20, 21, 40])
@pytest.mark.parametrize("B,w", [(20, 1), (20, 6), (9, 8)])
def test_closed_forms_match_step_by_step_simulation(P, B, w):
    n = 70
    lengths, steps = _simulate(P, B, w, n)
    for k in range(1, n + 1):
        assert physical_length(P, B, w, k) == lengths[k - 1]
        assert eviction_steps(P, B, w, k) == [s for s in steps if s < k]
        assert num_evictions(P, B, w, k) == len([s for s in steps if s < k])
        assert peak_length(P, B, w, k) == max([P] + lengths[:k])
    assert [k for k in range(n) if is_eviction_step(P, B, w, k)] == steps


@pytest.mark.parametrize("method", ["snapkv", "vase-dkv"])
def test_cache_follows_the_schedule_per_row(method):
    """A left-padded batch decoding token by token: each row's stored length and evictions follow the schedule."""
    model = tiny_model()
    B, w = 16, 5
    torch.manual_seed(4)
    prompts = torch.randint(0, 90, (3, 22))
    mask = torch.ones_like(prompts)
    mask[0, :19] = 0  # P = 3
    mask[1, :6] = 0  # P = 16 = B
    prefill = mask.sum(-1).tolist()  # row 2: P = 22 > B
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = EvictionCache(model, method, B, w, seed=0)
    with torch.no_grad():
        out = model(input_ids=prompts, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        pos = positions[:, -1:]
        for n in range(1, 60):
            before = [layer.row_evictions[:] for layer in cache.layers]
            pos = pos + 1
            out = model(input_ids=out.logits[:, -1:].argmax(-1), position_ids=pos, **cache_kwargs(cache))
            for layer, was in zip(cache.layers, before):
                assert layer.real_lengths() == [physical_length(p, B, w, n) for p in prefill]
                assert layer.row_evictions == [num_evictions(p, B, w, n) for p in prefill]
                evicted_now = [a != b for a, b in zip(layer.row_evictions, was)]
                assert evicted_now == [is_eviction_step(p, B, w, n - 1) for p in prefill]
    assert min(cache.layers[0].row_evictions) >= 5


@pytest.mark.parametrize("P,B,w", [(10, 20, 6), (30, 16, 4), (0, 8, 1), (5, 5, 3), (64, 32, 16)])
def test_stored_length_sum_is_the_sum_of_physical_lengths(P, B, w):
    from vase.core.schedule import stored_length_sum

    for n in range(0, 70):
        assert stored_length_sum(P, B, w, n) == sum(physical_length(P, B, w, j) for j in range(1, n + 1)), n


def test_blocks():
    from vase.core.schedule import cdiv, max_blocks

    assert [cdiv(a, 16) for a in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert max_blocks(128, 32, 16) == 10 and max_blocks(120, 10, 16) == 9


def _brute_force(P: int, B: int | None, w: int, n: int) -> dict[str, int]:
    """A cache written token by token, evicting by the documented rule and nothing else (no schedule function):
    before a write that would take it past its limit (max(P, B) + w, then B + w), a cache holding more than B
    drops to B. B None never evicts."""
    stored, limit = P, (max(P, B) + w if B is not None else None)
    evictions, peak, total = 0, P, 0
    for _ in range(n):
        if limit is not None and stored + 1 > limit and stored > B:
            stored, limit, evictions = B, B + w, evictions + 1
        stored += 1
        peak = max(peak, stored)
        total += stored
    return {"evictions": evictions, "stored": stored, "peak": peak, "seen": P + n, "stored_sum": total}


@pytest.mark.parametrize("B", [None, 1, 4, 9, 16])
@pytest.mark.parametrize("w", [1, 3, 8])
def test_sequence_stats_and_their_users_equal_a_brute_force_cache(B, w):
    """The one owner of the schedule (`sequence_stats` and the functions under it) against a brute-force
    simulation over a grid of P, B, w, n; the eval's helpers (metrics, runner) return what the owner says."""
    from dataclasses import asdict

    from vase.eval.metrics import first_evicted_target, kv_schedule
    from vase.eval.runner import row_cache_stats
    from vase.core.schedule import cdiv, max_blocks, sequence_stats

    for P in (0, 1, 2, 5, 9, 16, 17, 30):
        for n in range(0, 60):
            s = sequence_stats(P, B, w, n)
            assert asdict(s) == _brute_force(P, B, w, n), (P, B, w, n)
            evicts = B is not None
            sched = kv_schedule(P, P + n, budget=B, window=w, evicts=evicts)
            assert sched == {"evictions": s.evictions, "peak": s.peak,
                             "time_mean": s.stored_sum / n if n else float(P)}
            for finished in (True, False):  # the token sampled at the length cap is never written
                row = row_cache_stats(P, n + (0 if finished or n == 0 else 1), finished, budget=B, window=w,
                                      evicts=evicts, bytes_per_token=3)
                assert row == {"evictions": s.evictions, "stored_length": s.stored, "seen_length": s.seen,
                               "peak_length": s.peak, "kv_bytes": 3 * s.stored, "kv_bytes_peak": 3 * s.peak,
                               "kv_bytes_full": 3 * s.seen}
        if B is not None:  # target t is predicted from P + t tokens: the first one past the first limit
            first = first_evicted_target(P, budget=B, window=w, evicts=True)
            assert first == min(t for t in range(1, 200) if _brute_force(P, B, w, t)["evictions"]), (P, B, w)
    for block in (1, 4, 16):
        assert [cdiv(a, block) for a in range(40)] == [len(range(0, a, block)) for a in range(40)]
        if B is not None:
            assert max_blocks(B, w, block) == cdiv(B + w, block)
