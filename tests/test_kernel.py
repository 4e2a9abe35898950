"""The one eviction kernel (`vase.core.kernel`) and the one query ring (`vase.core.ring`), through the three engines.

The same K/V/queries go through the eager `EvictionLayer`, the static (compiled-form) `StaticLayer`
and the vLLM plugin's paged eviction (`evict_paged`, scattered blocks in a scrambled layout): at every
eviction the three keep the same tokens in the same order and hold the same compacted K/V. Pure
tensor code: no model, no vLLM engine.
"""

import pytest
import torch

from tests.test_vllm_paged import _dense_run, _paged_run
from vase.core import schedule
from vase.caches.eager import EvictionCache
from vase.core.kernel import compact_slots, gather_slots, keep_index
from vase.core.policies import get_policy, method_names
from vase.core.ring import new_ring, ring_read, ring_write
from vase.caches.static import StaticEvictionCache, ready

STATIC = [m for m in method_names() if get_policy(m).evicts and not get_policy(m).selects]


def _static_run(method, K, V, Q, P, B, w, seed):
    """The eager cache until every row is in the steady schedule, then the static cache's step, token by token
    (host side as the compiled loop: `begin_step`, the layer's update and query record, `advance`). Returns
    (evictions the eager cache made before the conversion, snapshots of each static eviction)."""
    cache = EvictionCache(None, method, B, w, num_layers=1, seed=seed)
    layer = cache.layers[0]
    n = K.shape[2]
    t = 0
    for start, end in [(0, P)] + [(i, i + 1) for i in range(P, n)]:
        layer.update(K[:, :, start:end], V[:, :, start:end])
        layer.observe_padding(None)
        layer.record_queries(Q[:, :, start:end])
        layer.awaiting_attention = False
        t = end
        if ready(cache):
            break
    before = layer.evictions
    static = StaticEvictionCache.from_eager(cache, q_heads=Q.shape[1])
    slayer = static.layers[0]
    snaps = []
    for i in range(t, n):
        due = static.begin_step()
        slayer.update(K[:, :, i:i + 1], V[:, :, i:i + 1])
        slayer.step_mask(Q[:, :, i:i + 1], "bool")
        static.evicting = False
        static.advance(due)
        if due:  # evicted, then wrote token i at slot B
            snaps.append((slayer.keys[:, :, :B].clone(), slayer.values[:, :, :B].clone(),
                          slayer.positions[:, :, :B].clone()))
    return before, snaps


@pytest.mark.parametrize("method", STATIC)
@pytest.mark.parametrize("P", [10, 37])  # a prompt shorter than B (static from the prefill), one longer (after one)
def test_three_engines_keep_the_same_tokens_and_compact_the_same_kv(method, P):
    torch.manual_seed(5)
    B, w, h, hq, d = 24, 8, 2, 4, 16
    n = schedule.first_limit(P, B, w) + 3 * w + 2  # four evictions
    K, V, Q = torch.randn(1, h, n, d), torch.randn(1, h, n, d), torch.randn(1, hq, n, d)
    V[0, :, 5] *= 9.0  # a large value, so the value guard has something to keep
    eager = _dense_run(method, K, V, Q, P, B, w, seed=11)
    paged = _paged_run(method, K, V, Q, P, B, w, seed=11)
    skipped, static = _static_run(method, K, V, Q, P, B, w, seed=11)
    assert len(eager) == len(paged) == 4 and len(static) == 4 - skipped >= 3
    for i, (ek, ev, ep) in enumerate(eager):
        others = [paged[i]] + ([static[i - skipped]] if i >= skipped else [])
        for ok, ov, op in others:
            assert torch.equal(ep, op), (i, ep, op)  # the same tokens, in the same order, per KV head
            assert torch.equal(ek, ok) and torch.equal(ev, ov)


def test_keep_index_is_the_kept_candidates_then_the_window():
    kept = torch.tensor([[[4, 0, 2]]])
    assert keep_index(kept, 10, 3).tolist() == [[[4, 0, 2, 7, 8, 9]]]
    assert keep_index(kept, 10, 3, sort_kept=True, offset=1).tolist() == [[[1, 3, 5, 7, 8, 9]]]


@pytest.mark.parametrize("contiguous", [True, False])
def test_compaction_moves_the_indexed_slots_to_the_front(contiguous):
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, 3, 7, 5, generator=g)
    if not contiguous:  # a strided view (the paged cache's rows)
        buf = torch.randn(3, 2, 7, 5, generator=g).transpose(0, 1)
    index = torch.stack([torch.randperm(7, generator=g)[:4] for _ in range(6)]).view(2, 3, 4)
    want = torch.stack([torch.stack([buf[r, k, index[r, k]] for k in range(3)]) for r in range(2)])
    assert torch.equal(gather_slots(buf, index), want)
    pos = torch.arange(42.0).view(2, 3, 7)
    ref = pos.clone()
    compact_slots(pos, index)
    assert torch.equal(pos[:, :, :4], ref.gather(2, index)) and torch.equal(pos[:, :, 4:], ref[:, :, 4:])
    compact_slots(buf, index)
    assert torch.equal(buf[:, :, :4], want)


@pytest.mark.parametrize("chunks", [[1] * 11, [5, 1, 1, 3, 1], [13], [2, 9, 1]])
def test_the_ring_holds_the_last_w_queries_in_time_order(chunks):
    """Written in chunks (a prompt, single decode tokens, a teacher-forced run), as an int (eager) or a tensor
    (the compiled step's) count: the ring reads back exactly the last min(seen, w) queries, oldest first."""
    w, total = 4, sum(chunks)
    q = torch.randn(2, 3, total, 5)
    ring, seen = new_ring(2, 3, w, 5, q), 0
    for c in chunks:
        ring_write(ring, seen, q[:, :, seen:seen + c])
        seen += c
        assert torch.equal(ring_read(ring, seen), q[:, :, max(0, seen - w):seen])
    t_ring, t_seen = new_ring(2, 3, w, 5, q), torch.tensor(0)
    for i in range(total):  # one token per step with the count on the device
        ring_write(t_ring, t_seen, q[:, :, i:i + 1])
        t_seen += 1
    assert torch.equal(ring_read(t_ring, t_seen, w), q[:, :, total - w:])
