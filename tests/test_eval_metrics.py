"""Metrics on hand-computed records and fidelity on constructed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from vase.eval.metrics import (
    aggregate_fidelity,
    agreement,
    compression_ratio,
    failure_shares,
    fidelity_metrics,
    inflation,
    length_stats,
    pass_at_1,
)


def rec(pid: str, sample: int, correct: bool = False, answer: str | None = None,
        length: int = 0, failure: str = "ok") -> dict:
    return {"problem_id": pid, "sample": sample, "correct": correct, "answer": answer,
            "length": length, "failure": failure}


def test_pass_at_1_hand_computed() -> None:
    # p1: 2/4 = 0.5, p2: 1/1 = 1.0, p3: 0/2 = 0.0 -> mean 0.5 (problems weigh equally).
    records = [rec("p1", i, c) for i, c in enumerate([True, False, True, False])]
    records += [rec("p2", 0, True), rec("p3", 0, False), rec("p3", 1, False)]
    mean, se = pass_at_1(records)
    assert mean == pytest.approx(0.5)
    # std(ddof=1) of [0.5, 1, 0] = 0.5; / sqrt(3)
    assert se == pytest.approx(0.5 / math.sqrt(3))


def test_pass_at_1_single_problem_and_empty() -> None:
    assert pass_at_1([rec("p", 0, True), rec("p", 1, False)]) == (0.5, 0.0)
    with pytest.raises(ValueError):
        pass_at_1([])


def test_agreement() -> None:
    full = [rec("a", 0, answer="1"), rec("a", 1, answer="2"), rec("b", 0, answer=None),
            rec("c", 0, answer="x = 5")]
    method = [rec("a", 0, answer="1"), rec("a", 1, answer="3"), rec("b", 0, answer=None),
              rec("c", 0, answer="x=5"), rec("z", 0, answer="9")]  # z has no partner
    assert agreement(method, full) == pytest.approx(2 / 4)
    assert agreement(method, full, none_matches=True) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="no .* pair"):
        agreement([rec("q", 0, answer="1")], full)
    with pytest.raises(ValueError, match="duplicate"):
        agreement(method, full + [rec("a", 0, answer="1")])


def test_lengths_and_ratios() -> None:
    records = [rec("a", 0, length=10), rec("a", 1, length=20), rec("b", 0, length=60)]
    assert length_stats(records) == (30.0, 20.0)
    assert inflation(1500.0, 1000.0) == pytest.approx(1.5)
    assert compression_ratio(4096.0, 1024) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        compression_ratio(1.0, 0)
    with pytest.raises(ValueError):
        inflation(1.0, 0.0)


def test_failure_shares() -> None:
    records = [rec("a", i, failure=f) for i, f in enumerate(["ok", "ok", "garbage", "truncated"])]
    shares = failure_shares(records)
    assert shares == {"garbage": 0.25, "phrase_loop": 0.0, "truncated": 0.25, "ok": 0.5}
    with pytest.raises(ValueError, match="unknown failure class"):
        failure_shares([rec("a", 0, failure="weird")])


def test_fidelity_identical_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(7, 50, generator=g), dim=-1)
    targets = torch.randint(0, 50, (7,), generator=g)
    m = fidelity_metrics(lp, lp.clone(), targets)
    assert m["kl_mean"] == 0.0
    assert m["top1_agree"] == 1.0
    assert m["top1_disagree_share"] == 0.0
    assert m["dnll_mean"] == 0.0
    assert m["n_tokens"] == 7


def test_fidelity_hand_computed() -> None:
    # Token 0: p = (0.6, 0.4), q = (0.25, 0.75); token 1: identical rows.
    p = torch.tensor([[0.6, 0.4], [0.9, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.75], [0.9, 0.1]], dtype=torch.float64)
    targets = torch.tensor([1, 0])
    m = fidelity_metrics(p.log(), q.log(), targets)
    kl0 = 0.6 * math.log(0.6 / 0.25) + 0.4 * math.log(0.4 / 0.75)
    assert m["kl_mean"] == pytest.approx(kl0 / 2, abs=1e-12)
    # argmax: token 0 full -> 0, comp -> 1: disagree; token 1 agrees.
    assert m["top1_agree"] == 0.5 and m["top1_disagree_share"] == 0.5
    dnll0 = -math.log(0.75) - (-math.log(0.4))
    assert m["dnll_mean"] == pytest.approx(dnll0 / 2, abs=1e-12)


def test_fidelity_zero_probability_entries_and_bf16() -> None:
    lp = torch.tensor([[0.0, -math.inf, -math.inf]])  # p_full is one-hot
    lc = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    m = fidelity_metrics(lp, lc, torch.tensor([0]))
    assert m["kl_mean"] == pytest.approx(math.log(2))
    assert math.isfinite(m["kl_mean"])
    x = torch.log_softmax(torch.randn(4, 16), -1).to(torch.bfloat16)
    assert fidelity_metrics(x, x, torch.zeros(4, dtype=torch.long))["kl_mean"] == 0.0


def test_fidelity_shape_errors() -> None:
    a = torch.zeros(3, 5)
    with pytest.raises(ValueError):
        fidelity_metrics(a, torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError):
        fidelity_metrics(a, a, torch.zeros(4, dtype=torch.long))


def test_aggregate_fidelity_is_token_weighted() -> None:
    g = torch.Generator().manual_seed(1)
    a_full, a_comp = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)
    b_full, b_comp = torch.randn(9, 10, generator=g), torch.randn(9, 10, generator=g)
    ta, tb = torch.randint(0, 10, (3,), generator=g), torch.randint(0, 10, (9,), generator=g)
    agg = aggregate_fidelity([fidelity_metrics(a_full, a_comp, ta), fidelity_metrics(b_full, b_comp, tb)])
    pooled = fidelity_metrics(torch.cat([a_full, b_full]), torch.cat([a_comp, b_comp]), torch.cat([ta, tb]))
    for k in ("kl_mean", "top1_agree", "top1_disagree_share", "dnll_mean"):
        assert agg[k] == pytest.approx(pooled[k], abs=1e-12)
    assert agg["n_tokens"] == 12 and agg["n_problems"] == 2
    with pytest.raises(ValueError):
        aggregate_fidelity([])
