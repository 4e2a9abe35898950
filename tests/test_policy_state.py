"""The one driver of the policy-state hooks (`vase.core.policy_state`) and the one quantized flush
(`vase.storage.flush`): what each engine relies on."""

from __future__ import annotations

import torch

from vase.core.policies import get_policy
from vase.core.policy_state import draw_layer_state, ensure_slot_state
from vase.storage.flush import split_flush


def test_layer_state_is_drawn_once_per_row_from_its_own_generator():
    policy = get_policy("curdkv")
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    state: dict[str, torch.Tensor] = {}
    ready = [False, False, False]
    draw_layer_state(policy, state, ready, [2], gens, 3, 2, 8, torch.device("cpu"))
    assert ready == [False, False, True]
    assert state["projection"].shape[0] == 3 and not state["projection"][:2].any()
    alone = policy.init_layer_state(1, 2, 8, [torch.Generator().manual_seed(3)], torch.device("cpu"))
    assert torch.equal(state["projection"][2:], alone["projection"])  # row 2's own draw, as if alone
    drawn = state["projection"][2].clone()
    draw_layer_state(policy, state, ready, [0, 2], gens, 3, 2, 8, torch.device("cpu"))
    assert ready == [True, False, True]
    assert torch.equal(state["projection"][2], drawn)  # a ready row is never drawn again
    assert state["projection"][0].any() and not state["projection"][1].any()


def test_slot_state_is_zero_and_kept_once_made():
    policy = get_policy("h2o")
    state = ensure_slot_state(policy, {}, 2, 3, 5, torch.device("cpu"))
    assert set(state) == set(policy.slot_state) and all(t.shape == (2, 3, 5) and not t.any() for t in state.values())
    name = policy.slot_state[0]
    state[name] += 1
    assert ensure_slot_state(policy, state, 2, 3, 5, torch.device("cpu"))[name].eq(1).all()


def test_flush_sizes_agree_between_the_eager_and_the_fixed_shape_store():
    """n_out=None (the eager store: a host read) and n_out=every entry (the compiled step) keep the same full-
    precision store and send the same entries to the codes, the fixed one padded with unchosen entries."""
    g = torch.Generator().manual_seed(0)
    b, h, n_fp, d = 2, 2, 6, 4
    fk, fv = torch.randn(b, h, n_fp, d, generator=g), torch.randn(b, h, n_fp, d, generator=g)
    fslot = torch.tensor([0, 1, 2, 3, 4, -1]).expand(b, h, n_fp).clone()
    frank = torch.rand(b, h, n_fp, generator=g)
    k, v = torch.randn(b, h, 1, d, generator=g), torch.randn(b, h, 1, d, generator=g)
    slots, rank = torch.full((b, h, 1), 5), torch.rand(b, h, 1, generator=g)
    args = (fk, fv, fslot, frank, k, v, slots, rank, 4, 1)
    kept_a, out_a = split_flush(*args, None)
    kept_b, out_b = split_flush(*args, n_fp + 1)
    for a, c in zip(kept_a, kept_b):
        assert torch.equal(a, c)
    assert kept_a.count.eq(3).all()  # slots 4, 5 (the window) and the top-1 old one stay exact
    n = out_a.slots.shape[2]
    assert n == 3 and out_a.chosen.all() and not out_b.chosen[..., n:].any()
    assert torch.equal(out_a.slots, out_b.slots[..., :n]) and torch.equal(out_a.keys, out_b.keys[..., :n, :])
    assert out_b.slots[..., n:].eq(-1).all()
