"""Every method's first eviction on a long prompt stays O(n * d) or O(w * n) (issue 39), and R-KV's redundancy,
now computed without the [n, n] similarity matrix, still equals the old formula.

The memory check is an invariant, not a timing: a dispatch mode records the largest tensor any torch op makes
while a method selects (and while `evict_paged` runs the vLLM path), and it must stay under
n * max(kv_heads * head_dim, q_heads * w) elements: the candidates' keys, or the window's attention logits.
An [n, n] intermediate is n / (that width) times larger. docs/vllm.md's first-eviction table has the bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vase.core.policies import POLICIES, get_policy, key_redundancy, window_attention
from vase.vllm.paged import RequestPolicyState, evict_paged


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any new tensor a torch op returns inside the block (an in-place
    op returning its input, e.g. the write into the paged cache, makes nothing new)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.numel() > self.largest \
                    and leaf.untyped_storage().data_ptr() not in inputs:
                self.largest, self.op = leaf.numel(), func
        return out


def old_redundancy(keys: torch.Tensor) -> torch.Tensor:
    """The formula before issue 39, in float64: softmax_i of the row mean (over all n) of cos(k_i, k_j), diagonal 0."""
    k = torch.nn.functional.normalize(keys.double(), dim=-1)
    cos = k @ k.transpose(-1, -2)
    cos.diagonal(dim1=-2, dim2=-1).zero_()
    return cos.mean(-1).softmax(-1)


def long_keys(n: int, seed: int = 0, b: int = 2, h: int = 2, d: int = 16) -> torch.Tensor:
    """Random keys with runs of near-duplicates (what redundancy scores) and one all-zero key."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, n, d, generator=g)
    run = n // 8
    keys[:, :, 10:10 + run] = keys[:, :, 10:11] + 0.02 * torch.randn(b, h, run, d, generator=g)
    keys[:, :, n // 2:n // 2 + run] = 3.0 * keys[:, :, 7:8]  # same direction, another norm
    keys[:, 1, 5] = 0.0
    return keys


@pytest.mark.parametrize("n", [40, 1500])
def test_key_redundancy_equals_the_old_formula(n):
    keys = long_keys(n)
    ref = old_redundancy(keys)
    got = key_redundancy(keys)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_rkv_keeps_what_the_old_formula_kept(lam):
    n, w, k = 1500, 16, 300
    keys = long_keys(n, seed=1)
    g = torch.Generator().manual_seed(2)
    values = torch.randn(keys.shape, generator=g)
    queries = torch.randn(2, 4, w, 16, generator=g)
    kept = get_policy("rkv", rkv_lambda=lam).select(keys, values, queries, k)
    old = lam * window_attention(keys, queries).double() - (1 - lam) * old_redundancy(keys)
    want = old.topk(k, dim=-1).indices
    assert torch.equal(kept.sort(-1).values, want.sort(-1).values)


def test_key_redundancy_leaves_float64_keys_alone():
    keys = long_keys(64).double()
    before = keys.clone()
    key_redundancy(keys)
    assert torch.equal(keys, before)


def test_key_redundancy_never_builds_n_by_n():
    n, d = 4096, 16
    keys = long_keys(n, d=d)
    with LargestTensor() as mode:
        key_redundancy(keys)
    assert mode.largest <= keys.numel(), f"{mode.op} made {mode.largest} elements for {keys.numel()} keys"


# Every registered method but Quest (it selects per step and never evicts; see the next test).
EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]
SHAPE = dict(b=1, h_kv=2, h_q=4, d=32, w=16)


def _bound(n: int) -> int:
    s = SHAPE
    return s["b"] * n * max(s["h_kv"] * s["d"], s["h_q"] * s["w"])


@pytest.mark.parametrize("name", EVICTING + ["vase-attnv+guard", "tova+sample"])
def test_first_eviction_is_linear_in_the_prompt(name):
    s, n, budget = SHAPE, 6000, 512
    base, _, extra = name.partition("+")
    params = {"guard": {"value_guard": 0.25}, "sample": {"sample": True}}.get(extra, {})
    policy = get_policy(base, **params)
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(s["b"], s["h_kv"], n, s["d"], generator=g)
    values = torch.randn(keys.shape, generator=g)
    queries = torch.randn(s["b"], s["h_q"], s["w"], s["d"], generator=g)
    state = {name: torch.zeros(s["b"], s["h_kv"], n) for name in policy.slot_state}
    state.update(policy.init_layer_state(s["b"], s["h_kv"], s["d"], [g], keys.device))
    gens = [torch.Generator().manual_seed(4)]
    with LargestTensor() as mode:
        policy.select(keys, values, queries if policy.needs_queries else None, budget - s["w"],
                      generator=gens if policy.stochastic else None, budget=budget, **state)
    assert mode.largest <= _bound(n), f"{name}: {mode.op} made {mode.largest} elements (bound {_bound(n)})"


@pytest.mark.parametrize("name", ["rkv", "snapkv", "h2o", "curdkv"])
def test_paged_first_eviction_is_linear_in_the_prompt(name):
    """The vLLM path (`evict_paged`: gather the request's slots from its blocks, choose, scatter the survivors)."""
    s, bs, budget = SHAPE, 16, 512
    n = 6000 + s["w"]
    policy = get_policy(name)
    g = torch.Generator().manual_seed(5)
    n_blocks = -(-n // bs)
    key_cache = torch.randn(n_blocks + 3, s["h_kv"], bs, s["d"], generator=g)
    value_cache = torch.randn(key_cache.shape, generator=g)
    block_ids = torch.randperm(n_blocks + 3, generator=g)[:n_blocks]
    queries = torch.randn(1, s["h_q"], s["w"], s["d"], generator=g)
    state = RequestPolicyState(generator=torch.Generator().manual_seed(6))
    with LargestTensor() as mode:
        evict_paged(key_cache, value_cache, block_ids, n, queries if policy.needs_queries else None, policy,
                    budget, s["w"], state, layer=0, layout=None)
    assert mode.largest <= _bound(n), f"{name}: {mode.op} made {mode.largest} elements (bound {_bound(n)})"


def test_quest_decode_mask_is_linear_in_the_context():
    s, n = SHAPE, 6000
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(s["b"], s["h_kv"], n, s["d"], generator=g)
    query = torch.randn(s["b"], s["h_q"], 1, s["d"], generator=g)
    with LargestTensor() as mode:
        get_policy("quest").attend_mask(keys, query, n - 1, 512, s["w"])
    assert mode.largest <= _bound(n), f"quest: {mode.op} made {mode.largest} elements"
