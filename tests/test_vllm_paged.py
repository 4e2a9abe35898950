"""Paged compaction (the plugin's worker side) equals the dense EvictionLayer on the same K/V/queries.

Pure tensor code: no vLLM needed. The dense reference is `EvictionCache` with one layer, driven
token by token exactly as a model would drive it.
"""

import pytest
import torch

from vase.core import schedule
from vase.caches.eager import EvictionCache
from vase.core.policies import get_policy, method_names
from vase.vllm.paged import Layout, RequestPolicyState, evict_paged, gather, scatter, slot_index

EVICTING = [m for m in method_names() if get_policy(m).evicts]


def _dense_run(method, K, V, Q, P, B, w, seed):
    """Feed prompt P then one token at a time; return (keys, values, positions) after each eviction."""
    cache = EvictionCache(None, method, B, w, num_layers=1, seed=seed)
    layer = cache.layers[0]
    snaps = []
    n = K.shape[2]
    for start, end in [(0, P)] + [(t, t + 1) for t in range(P, n)]:
        before = layer.evictions
        layer.update(K[:, :, start:end], V[:, :, start:end])
        layer.observe_padding(None)
        layer.record_queries(Q[:, :, start:end])
        layer.awaiting_attention = False
        if layer.evictions > before:  # the update evicted, then wrote token `start` at slot B
            snaps.append((layer.keys[:, :, :B].clone(), layer.values[:, :, :B].clone(),
                          layer.positions[:, :, :B].clone()))
    return snaps


def _paged_run(method, K, V, Q, P, B, w, seed, block_size=4, num_blocks=40, codec=None):
    """The same tokens through a paged cache with scattered blocks, a scrambled in-block layout (as a kernel
    packing its blocks would), and the plugin's eviction: per eviction (stored keys, values, positions) of the kept
    slots. codec: None, or an fp8 codec (`vase.vllm.fp8.Fp8Codec`): K and V are then uint8 codes, which the
    eviction decodes for the policy and moves unchanged."""
    policy = get_policy(method)
    _, h, n, d = K.shape
    g = torch.Generator().manual_seed(0)
    if codec is None:  # garbage outside the request's slots
        key_cache = torch.randn(num_blocks, h, block_size, d, generator=g)
        value_cache = torch.randn(num_blocks, h, block_size, d, generator=g)
    else:
        key_cache = torch.randint(0, 255, (num_blocks, h, block_size, d), generator=g, dtype=torch.uint8)
        value_cache = torch.randint(0, 255, (num_blocks, h, block_size, d), generator=g, dtype=torch.uint8)
    limit = schedule.first_limit(P, B, w)
    block_ids = torch.randperm(num_blocks, generator=g)[: -(-limit // block_size)]
    layout = Layout(*(torch.randperm(block_size * d, generator=g).view(block_size, d) for _ in range(2)))
    positions = torch.full((h, limit), -1, dtype=torch.long)
    state = RequestPolicyState(generator=torch.Generator().manual_seed(seed))
    length, snaps = 0, []
    for t in range(n):
        if t >= P and schedule.is_eviction_step(P, B, w, t - P):
            queries = Q[:, :, t - w:t]  # the last w queries, in time order
            index = evict_paged(key_cache, value_cache, block_ids, length, queries, policy, B, w, state, layer=0,
                                layout=layout, codec=codec)
            positions[:, :B] = positions[torch.arange(h)[:, None], index[0]]
            length = B
            blocks, offsets = slot_index(block_ids, B, block_size)
            snaps.append((gather(key_cache, layout.key, blocks, offsets), gather(value_cache, layout.value, blocks,
                                                                                  offsets),
                          positions[None, :, :B].clone()))
        blocks, offsets = slot_index(block_ids, length + 1, block_size)
        scatter(key_cache, layout.key, blocks[-1:], offsets[-1:], K[0, :, t:t + 1])
        scatter(value_cache, layout.value, blocks[-1:], offsets[-1:], V[0, :, t:t + 1])
        positions[:, length] = t
        length += 1
        assert length == schedule.physical_length(P, B, w, t + 1 - P) if t >= P else True
    return snaps


@pytest.mark.parametrize("method", EVICTING)
@pytest.mark.parametrize("P", [10, 37])  # a prompt shorter than B, and one longer than B
def test_paged_compaction_equals_dense_eviction(method, P):
    torch.manual_seed(3)
    B, w, h, hq, d = 24, 8, 2, 4, 16
    n = schedule.first_limit(P, B, w) + 2 * w + 2  # three evictions
    K, V, Q = torch.randn(1, h, n, d), torch.randn(1, h, n, d), torch.randn(1, hq, n, d)
    V[0, :, 5] *= 9.0  # a large value, so the value guard has something to keep
    dense = _dense_run(method, K, V, Q, P, B, w, seed=11)
    paged = _paged_run(method, K, V, Q, P, B, w, seed=11)
    assert len(dense) == len(paged) == 3
    for (dk, dv, dp), (pk, pv, pp) in zip(dense, paged):
        assert torch.equal(dp, pp)  # the same tokens kept, in the same order, per KV head
        assert torch.equal(dk, pk) and torch.equal(dv, pv)


def test_stochastic_methods_depend_on_the_generator():
    """The exact match above is not vacuous: another seed keeps other tokens."""
    torch.manual_seed(3)
    B, w, P = 24, 8, 10
    n = schedule.first_limit(P, B, w) + 1
    K, V, Q = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 4, n, 16)
    a = _paged_run("vase-attnv", K, V, Q, P, B, w, seed=1)[0][2]
    b = _paged_run("vase-attnv", K, V, Q, P, B, w, seed=2)[0][2]
    assert not torch.equal(a, b)
