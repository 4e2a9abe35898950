"""Batched eviction in the paged cache (issue 39): `evict_paged_batch` over k requests of one length is k calls of
`evict_paged`, one per request: the same kept slots, the same cache afterwards (bit for bit), the same policy
state, for every evicting method, in place and copy-on-write, plain and packed block layouts. No vLLM import."""

from __future__ import annotations

import pytest
import torch

from vase.core.policies import POLICIES, get_policy
from vase.vllm.paged import EvictionJob, Layout, RequestPolicyState, evict_paged, evict_paged_batch

H_KV, H_Q, D, BS, W, B = 2, 4, 16, 8, 8, 24
EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]


def _setup(k: int, length: int, seed: int, cow: bool):
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-length // BS)
    total = k * n_blocks * 2 + 3
    key_cache = torch.randn(total, H_KV, BS, D, generator=g)
    value_cache = torch.randn(total, H_KV, BS, D, generator=g)
    perm = torch.randperm(total, generator=g)
    blocks = [perm[j * n_blocks:(j + 1) * n_blocks] for j in range(k)]
    spare = perm[k * n_blocks:]
    targets = [spare[j * n_blocks:(j + 1) * n_blocks] if cow and j % 2 == 0 else None for j in range(k)]
    queries = torch.randn(k, H_Q, W, D, generator=g)
    return key_cache, value_cache, blocks, targets, queries


def _states(k: int, name: str, length: int, prior: bool):
    """Per-request states; `prior`: as after an earlier eviction (H2O's accumulator, CurDKV's projection set)."""
    policy = get_policy(name)
    states = [RequestPolicyState(generator=torch.Generator().manual_seed(100 + j)) for j in range(k)]
    if prior:
        for j, st in enumerate(states):
            for s in policy.slot_state:
                st.slot_state[0] = {s: torch.rand(1, H_KV, length, generator=torch.Generator().manual_seed(j))}
            st.layer_state[0] = policy.init_layer_state(1, H_KV, D, [torch.Generator().manual_seed(50 + j)],
                                                        torch.device("cpu"))
    return states


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize("cow,packed,prior", [(False, False, False), (True, False, True), (False, True, True)])
def test_batched_eviction_is_one_eviction_per_request(name, cow, packed, prior):
    k, length = 5, 45
    policy = get_policy(name)
    layout = Layout.plain(BS, D) if packed else None
    kc, vc, blocks, targets, queries = _setup(k, length, seed=len(name), cow=cow)
    q = queries if policy.needs_queries else None
    one_k, one_v, one_states = kc.clone(), vc.clone(), _states(k, name, length, prior)
    want = [evict_paged(one_k, one_v, blocks[j], length, None if q is None else q[j:j + 1], policy, B, W,
                        one_states[j], layer=0, layout=layout, block_size=BS, target_block_ids=targets[j])
            for j in range(k)]
    states = _states(k, name, length, prior)
    jobs = [EvictionJob(blocks[j], states[j], targets[j]) for j in range(k)]
    got = evict_paged_batch(kc, vc, jobs, length, q, policy, B, W, layer=0, layout=layout, block_size=BS)
    assert torch.equal(got, torch.cat(want))
    assert torch.equal(kc, one_k) and torch.equal(vc, one_v)
    for a, b in zip(states, one_states):
        for s in policy.slot_state:
            assert torch.equal(a.slot_state[0][s], b.slot_state[0][s])
        assert a.layer_state[0].keys() == b.layer_state[0].keys()
        for s in a.layer_state[0]:
            assert torch.equal(a.layer_state[0][s], b.layer_state[0][s])
        assert torch.equal(a.generator.get_state(), b.generator.get_state())  # the same draws, in the same order


def test_ring_gather_reads_each_row_as_ring_read():
    from vase.core.ring import ring_gather, ring_read

    g = torch.Generator().manual_seed(3)
    ring = torch.randn(6, H_Q, W, D, generator=g)
    rows, seen = torch.tensor([4, 0, 2, 5]), torch.tensor([W, 37, 100, W + 3])
    got = ring_gather(ring, rows, seen)
    for j in range(4):
        assert torch.equal(got[j:j + 1], ring_read(ring[int(rows[j]):int(rows[j]) + 1], int(seen[j]), W))
