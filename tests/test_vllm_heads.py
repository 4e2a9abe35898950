"""Tensor parallelism: a rank's kept set is the one TP = 1 keeps for the same heads (vase.vllm.heads)."""

import pytest
import torch

from vase.core.policies import get_policy, method_names
from vase.vllm.heads import RankHeads, RankPolicy, rank_policy

EVICTING = [m for m in method_names() if get_policy(m).evicts]
H, GROUP, N, D, W, KEEP = 6, 2, 90, 32, 8, 30


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g)
    queries = torch.randn(1, H * GROUP, W, D, generator=g)
    return keys, values, queries


def _select(policy, keys, values, queries, seed: int, heads: slice):
    """One eviction as evict_paged drives it: generator from the seed, layer state, slot state (of `heads`)."""
    gen = torch.Generator().manual_seed(seed)
    state = policy.init_layer_state(1, keys.shape[1], D, [gen], keys.device)
    slot = {name: torch.rand(1, H, N, generator=torch.Generator().manual_seed(9))[:, heads].clone()
            for name in policy.slot_state}
    kept = policy.select(keys, values, queries if policy.needs_queries else None, KEEP,
                         generator=[gen] if policy.stochastic else None, budget=KEEP + W, **state, **slot)
    return kept, slot


@pytest.mark.parametrize("world", [2, 3, 6])
@pytest.mark.parametrize("method", EVICTING)
def test_each_rank_keeps_what_tp1_keeps(method, world):
    policy = get_policy(method)
    keys, values, queries = _inputs(1)
    full, full_slot = _select(policy, keys, values, queries, 5, slice(0, H))
    for rank in range(world):
        heads = RankHeads.of_rank(rank, world, H)
        lo, hi = heads.start, heads.start + heads.count
        ours = rank_policy(policy, heads)
        assert isinstance(ours, RankPolicy)
        kept, slot = _select(ours, keys[:, lo:hi], values[:, lo:hi], queries[:, lo * GROUP:hi * GROUP], 5,
                             slice(lo, hi))
        assert torch.equal(kept, full[:, lo:hi]), (method, world, rank)
        for name in slot:  # per-slot state (H2O) updated in place for the rank's heads, as at TP = 1
            want = full_slot[name][:, lo:hi]
            assert torch.allclose(slot[name][:, :, :want.shape[-1]], want), name


def test_rank_heads_follow_vllms_split():
    assert [RankHeads.of_rank(r, 3, 6) for r in range(3)] == [RankHeads(0, 2, 6), RankHeads(2, 2, 6),
                                                              RankHeads(4, 2, 6)]
    assert [RankHeads.of_rank(r, 4, 2).start for r in range(4)] == [0, 0, 1, 1]  # replicated KV heads
    assert rank_policy(get_policy("snapkv"), RankHeads(0, 6, 6)).__class__.__name__ == "SnapKV"
    with pytest.raises(ValueError, match="do not split"):
        RankHeads.of_rank(0, 4, 6)


def test_without_the_global_draw_a_stochastic_rank_would_keep_other_slots():
    """The property the wrapper exists for: drawing only the rank's heads changes its random choice."""
    policy = get_policy("snapkv-sample")
    keys, values, queries = _inputs(2)
    full, _ = _select(policy, keys, values, queries, 5, slice(0, H))
    local, _ = _select(policy, keys[:, 2:4], values[:, 2:4], queries[:, 4:8], 5, slice(2, 4))
    assert not torch.equal(local, full[:, 2:4])
