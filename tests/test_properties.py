"""Property-based tests (hypothesis): the cache's invariants and the store's exactly-once guarantee.

The cache is driven without a model, exactly as vase's attention function drives it (``update`` then
``attention_mask_for``), over random shapes, budgets, windows, left paddings, prompt lengths, policies
and finished rows leaving the batch. Keys and values of padding slots are NaN, so a policy that ever
saw padding would be caught. The store is driven by random interleavings of appends, kills in the
middle of a write and resumes.

Profiles: ``vase-ci`` (default, seconds) and ``vase-deep`` (set ``VASE_HYPOTHESIS_PROFILE=vase-deep``).
"""

from __future__ import annotations

import json
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vase.core import schedule
from vase.caches.eager import EvictionCache
from vase.eval.store import SAMPLE_KEY, JsonlStore, read_jsonl
from vase.hf.masks import mask_kind
from vase.core.policies import POLICIES, get_policy

settings.register_profile("vase-ci", max_examples=40, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("vase-deep", max_examples=1000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings(settings.get_profile(os.environ.get("VASE_HYPOTHESIS_PROFILE", "vase-ci")))

EVICTING = sorted(n for n, cls in POLICIES.items() if cls.evicts and not getattr(cls, "selects", False))
SINKS = 4


def spy(name: str, **params):
    """The policy `name`, subclassed to record whether any select() call saw a NaN (padding) key or value."""
    base = type(get_policy(name))
    calls: list[dict] = []

    class Spy(base):  # type: ignore[valid-type, misc]
        def select(self, keys, values, queries, n_keep, generator=None, budget=None, **extra):
            calls.append({"nan": bool(keys.isnan().any() or values.isnan().any()), "n": keys.shape[2],
                          "n_keep": n_keep})
            return super().select(keys, values, queries, n_keep, generator=generator, budget=budget, **extra)

    return Spy(**get_policy(name, **params).params()), calls


@st.composite
def cache_runs(draw):
    window = draw(st.integers(1, 8))
    protect = draw(st.booleans())
    budget = window + (SINKS if protect else 0) + draw(st.integers(1, 16))
    batch = draw(st.integers(1, 3))
    return {
        "method": draw(st.sampled_from(EVICTING)),
        "protect_sinks": protect,
        "sort_kept": draw(st.booleans()),
        "window": window,
        "budget": budget,
        "kv_heads": draw(st.integers(1, 2)),
        "group": draw(st.integers(1, 2)),
        "prompts": draw(st.lists(st.integers(1, 3 * budget), min_size=batch, max_size=batch)),
        "steps": draw(st.integers(0, 3 * (budget + window))),
        # (step, row) pairs: at that decode step, that row (if still there) finishes and leaves the batch
        "drops": draw(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 2)), max_size=2)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check_layer(layer, run: dict, rows: list[int], generated: int) -> None:
    """Every invariant of one layer after `generated` decode steps; rows[i] = original row of batch row i."""
    B, w = run["budget"], run["window"]
    pos = layer.positions
    for i, r in enumerate(rows):
        P = run["prompts"][r]
        pad = layer.pad[i]
        real = pos[i, :, pad:layer.length]  # [h, n]
        n = layer.length - pad
        # Stored length and eviction count are exactly the schedule's (docs/methods.md, "The setting").
        assert n == schedule.physical_length(P, B, w, generated), (r, n, P, generated)
        assert layer.row_evictions[i] == schedule.num_evictions(P, B, w, generated)
        assert n <= max(P, B) + w and (layer.row_evictions[i] == 0 or n <= B + w)
        # Padding slots hold position -1, real slots hold real positions.
        assert bool((pos[i, :, :pad] == -1).all())
        first = layer.row_pad0[i]
        assert bool((real >= first).all()) and bool((real < first + P + generated).all())
        for head in real.tolist():
            assert len(set(head)) == len(head)  # unique
            recent = head[-min(w, n):]
            assert recent == list(range(first + P + generated - len(recent), first + P + generated))
            if run["sort_kept"]:
                assert head == sorted(head)
            if run["protect_sinks"] and layer.row_evictions[i]:
                assert set(range(first, first + min(SINKS, P))) <= set(head)  # the sinks survived


@PROFILE
@given(cache_runs())
def test_cache_invariants(run):
    policy, calls = spy(run["method"], protect_sinks=run["protect_sinks"])
    kv, hq, d = run["kv_heads"], run["kv_heads"] * run["group"], 4
    cache = EvictionCache(None, policy, run["budget"], run["window"], seed=run["seed"], sort_kept=run["sort_kept"],
                          num_layers=1)
    layer = cache.layers[0]
    kind = mask_kind("sdpa")
    gen = torch.Generator().manual_seed(run["seed"])
    prompts = run["prompts"]
    b, width = len(prompts), max(prompts)
    mask = torch.tensor([[0] * (width - p) + [1] * p for p in prompts])
    keys = torch.randn(b, kv, width, d, generator=gen)
    values = torch.randn(b, kv, width, d, generator=gen)
    pad = (mask == 0)[:, None, :, None]
    keys, values = keys.masked_fill(pad, float("nan")), values.masked_fill(pad, float("nan"))
    layer.update(keys, values)
    layer.attention_mask_for(torch.randn(b, hq, width, d, generator=gen), mask, kind)
    rows = list(range(b))
    _check_layer(layer, run, rows, 0)
    for step in range(run["steps"]):
        for at, r in run["drops"]:
            if at == step and r in rows and len(rows) > 1:
                keep = [i for i, x in enumerate(rows) if x != r]
                cache.batch_select_indices(torch.tensor(keep))
                rows = [rows[i] for i in keep]
        n = len(rows)
        layer.update(torch.randn(n, kv, 1, d, generator=gen), torch.randn(n, kv, 1, d, generator=gen))
        layer.attention_mask_for(torch.randn(n, hq, 1, d, generator=gen), None, kind)
        _check_layer(layer, run, rows, step + 1)
    assert not any(c["nan"] for c in calls)  # no padding ever reached the policy
    assert all(c["n_keep"] == run["budget"] - run["window"] for c in calls)
    stats = cache.stats()
    assert stats["evictions"] == layer.evictions and stats["stored_length"] == layer.length


# ----------------------------------------------------------------------------- the store

OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 12)),  # finish sample k (skipped if stored: the runner's rule)
    st.tuples(st.just("kill"), st.integers(0, 12), st.integers(1, 60)),  # die writing sample k after n bytes
    st.tuples(st.just("resume")),
), max_size=40)


def _record(k: int) -> dict:
    return {"method": "snapkv", "budget": 24, "problem_id": f"p{k // 2}", "sample": k % 2, "text": "é" * k}


@PROFILE
@given(OPS)
def test_store_keeps_each_record_exactly_once(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("store") / "samples.rank0.jsonl"
    store = JsonlStore(path).open()
    finished: set[tuple] = set()
    for op in ops:
        if store is None or op[0] == "resume":  # a killed run is always restarted before doing more
            if store is not None:
                store.close()
            store = JsonlStore(path).open()
            assert store.keys == finished  # resuming finds exactly what finished, torn lines dropped
        if op[0] == "append":
            rec = _record(op[1])
            key = tuple(rec[k] for k in SAMPLE_KEY)
            if key not in store:
                assert store.append(rec)
                finished.add(key)
        elif op[0] == "kill":
            line = (json.dumps(_record(op[1]), ensure_ascii=False) + "\n").encode()
            with open(path, "ab") as f:  # the write never finished: no newline
                f.write(line[: min(op[2], len(line) - 1)])
            os.close(store._fd)  # the process dies: the lock goes with its descriptor, no clean close
            store._fd = None
            store = None
    if store is not None:
        store.close()
    store = JsonlStore(path).open()
    store.close()
    keys = [tuple(r[k] for k in SAMPLE_KEY) for r in read_jsonl(path)]
    assert len(keys) == len(set(keys)) and set(keys) == finished
    assert path.read_bytes().endswith(b"\n") or path.stat().st_size == 0  # torn tails were cut on open
