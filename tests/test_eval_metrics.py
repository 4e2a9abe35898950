"""Metrics on hand-computed records and fidelity on constructed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from vase.eval.metrics import (
    aggregate_fidelity,
    agreement,
    failure_shares,
    fidelity_metrics,
    inflation,
    length_stats,
    pass_at_1,
    accuracy_split,
    agreement_split,
    answered_share,
    cap_share,
    decode_steps,
    first_evicted_target,
    kl_per_token,
    kv_byte_steps,
    kv_schedule,
)
from vase.eval.paired import (
    bootstrap_ci,
    discordant,
    first_divergence,
    mcnemar_exact,
    pair_records,
    paired_problem_diffs,
    sign_flip_test,
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


# ----------------------------------------------------------------------------- answered, cap, agreement


def full_rec(pid, sample, correct=False, answer=None, finished=True, **kw):
    return {"problem_id": pid, "sample": sample, "correct": correct, "answer": answer, "finished": finished, **kw}


def test_answered_cap_and_accuracy_split() -> None:
    records = [full_rec("a", 0, True, "1"), full_rec("a", 1, False, None, finished=False),
               full_rec("b", 0, True, "4", finished=False), full_rec("b", 1, False, "5")]
    assert answered_share(records) == 0.75
    assert cap_share(records) == 0.5
    assert accuracy_split(records) == {"acc_finished": 0.5, "acc_truncated": 0.5, "n_finished": 2, "n_truncated": 2}
    only_done = accuracy_split(records[:1])
    assert only_done["acc_truncated"] is None and only_done["acc_finished"] == 1.0


def test_agreement_split_uses_math_verify_and_keeps_unanswered_apart() -> None:
    full = [full_rec("a", 0, answer="0.5"), full_rec("a", 1, answer="3"), full_rec("b", 0, answer=None),
            full_rec("b", 1, answer="7"), full_rec("c", 0, answer=None)]
    method = [full_rec("a", 0, answer="\\frac12"), full_rec("a", 1, answer="4"), full_rec("b", 0, answer=None),
              full_rec("b", 1, answer=None), full_rec("c", 0, answer="2"), full_rec("z", 0, answer="1")]
    out = agreement_split(method, full)
    # Both answered: a0 (1/2 == 0.5) and a1 (4 != 3) -> 1 of 2; b0 neither; b1 only full; c0 only method.
    assert out == {"agree": 0.5, "both_none": 0.2, "only_method": 0.2, "only_full": 0.2, "n_pairs": 5, "n_both": 2}
    none_only = agreement_split([full_rec("a", 0)], [full_rec("a", 0)])
    assert none_only["agree"] is None and none_only["both_none"] == 1.0  # nothing to agree on: no 100 %
    with pytest.raises(ValueError, match="no .* pair"):
        agreement_split([full_rec("x", 0)], [full_rec("y", 0)])


# ----------------------------------------------------------------------------- paired statistics


def test_paired_problem_diffs_average_within_problem() -> None:
    full = [full_rec("a", 0, True), full_rec("a", 1, True), full_rec("b", 0, False), full_rec("b", 1, True)]
    method = [full_rec("a", 0, False), full_rec("a", 1, True), full_rec("b", 0, True), full_rec("b", 1, True),
              full_rec("c", 0, True)]  # c has no partner: left out
    assert paired_problem_diffs(method, full) == {"a": -0.5, "b": 0.5}
    lengths = paired_problem_diffs([dict(r, length=10 * i) for i, r in enumerate(method[:2])],
                                   [dict(r, length=5) for r in full[:2]], key="length")
    assert lengths == {"a": ((0 - 5) + (10 - 5)) / 2}
    assert discordant(method, full) == (1, 1)
    with pytest.raises(ValueError, match="duplicate"):
        pair_records(full + full[:1], full)


def test_bootstrap_ci_brackets_the_mean_and_is_reproducible() -> None:
    vals = [0.0, 1.0] * 10
    mean, lo, hi = bootstrap_ci(vals)
    assert mean == 0.5 and lo < 0.5 < hi
    # The percentile interval of a mean of 20 fair coins: about mean +- 1.96 * 0.5 / sqrt(20) = +- 0.22,
    # on the grid of 1/20 steps such means take.
    assert 0.15 <= 0.5 - lo <= 0.25 and 0.15 <= hi - 0.5 <= 0.25
    assert bootstrap_ci(vals) == (mean, lo, hi)
    assert bootstrap_ci([0.0] * 7) == (0.0, 0.0, 0.0)  # no spread: a point
    assert bootstrap_ci([3.0]) == (3.0, 3.0, 3.0) and bootstrap_ci([]) is None


def test_mcnemar_exact_hand_computed() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 32)  # 2 * 0.5**5
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact(3, 3) == 1.0
    # b=1, c=7: 2 * (C(8,0) + C(8,1)) / 256 = 18 / 256
    assert mcnemar_exact(1, 7) == pytest.approx(18 / 256)
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def _clustered_case() -> tuple[list[dict], list[dict]]:
    """10 problems x 4 samples; full right everywhere, the method wrong on every sample of p0-p2."""
    full = [full_rec(f"p{i}", s, True) for i in range(10) for s in range(4)]
    method = [full_rec(f"p{i}", s, i >= 3) for i in range(10) for s in range(4)]
    return method, full


def test_sign_flip_is_a_problem_level_test() -> None:
    method, full = _clustered_case()
    # Sample-level McNemar counts 12 discordant samples as independent: 2 / 2**12, far too small.
    assert discordant(method, full) == (0, 12) and mcnemar_exact(0, 12) == pytest.approx(2 / 4096)
    diffs = list(paired_problem_diffs(method, full).values())
    assert sorted(diffs) == [-1.0] * 3 + [0.0] * 7
    # Three problems differ: the 8 sign vectors give sums -3, -1 (x3), +1 (x3), +3; |sum| >= 3 in 2 of 8.
    assert sign_flip_test(diffs) == (0.25, True)
    assert sign_flip_test([0.0, 0.0]) == (1.0, True) and sign_flip_test([]) == (1.0, True)
    # Fractional differences: +0.5, -0.25, +0.75 -> sum 1.0; |sum| >= 1 for (+,+,+) 1.0, (+,-,+) 1.5, and
    # their negations: 4 of 8.
    assert sign_flip_test([0.5, -0.25, 0.75]) == (0.5, True)


@pytest.mark.parametrize("b,c", [(0, 0), (5, 0), (0, 6), (3, 3), (1, 7), (4, 9), (2, 18), (10, 10)])
def test_sign_flip_with_one_sample_per_problem_is_exact_mcnemar(b, c) -> None:
    # One 0/1 outcome per problem: the differences are +1 (only the method right), -1, or 0.
    diffs = [1.0] * b + [-1.0] * c + [0.0] * 5
    p, exact = sign_flip_test(diffs)
    assert exact and p == pytest.approx(mcnemar_exact(b, c), abs=1e-12)


def test_sign_flip_monte_carlo_above_the_exact_limit() -> None:
    diffs = [1.0] * 5 + [-1.0] * 16  # 21 problems differ: above 20, random sign vectors
    p, exact = sign_flip_test(diffs)
    assert not exact and sign_flip_test(diffs) == (p, False)  # fixed seed: reproducible
    assert p == pytest.approx(mcnemar_exact(5, 16), abs=0.01)  # 0.0266 exactly; MC error about 0.001
    # Enumerated (2**21 sums, 16 MB) it is McNemar's exact value.
    assert sign_flip_test(diffs, exact_max=21) == (pytest.approx(mcnemar_exact(5, 16), abs=1e-12), True)


def test_kv_byte_steps_count_every_decode_step() -> None:
    assert decode_steps(10, True) == 10 and decode_steps(10, False) == 9 and decode_steps(0, False) == 0
    assert kv_byte_steps({"kv_bytes_time_mean": 50.0, "length": 101, "finished": False}) == 5000.0
    assert kv_byte_steps({"kv_bytes_time_mean": None, "length": 3}) is None


def test_kl_per_token_matches_fidelity_metrics() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 11, generator=g), torch.randn(6, 11, generator=g)
    per = kl_per_token(a, b)
    assert per.shape == (6,) and per.dtype == torch.float64 and bool((per > 0).all())
    assert per.mean().item() == pytest.approx(fidelity_metrics(a, b, torch.zeros(6, dtype=torch.long))["kl_mean"])
    assert kl_per_token(a, a).abs().max().item() < 1e-12


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([5], [6]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped (EOS) where the other went on
    assert first_divergence([], []) is None


# ----------------------------------------------------------------------------- the cache schedule


def test_kv_schedule_hand_computed() -> None:
    # P=10, B=8, w=4: stores 11..14 (limit max(10, 8) + 4 = 14), evicts to 8 and stores 9..12, evicts, 9..
    s = kv_schedule(10, 20, budget=8, window=4, evicts=True)
    lengths = [11, 12, 13, 14, 9, 10, 11, 12, 9, 10]
    assert s == {"evictions": 2, "peak": 14, "time_mean": pytest.approx(sum(lengths) / 10)}
    full = kv_schedule(10, 13, budget=8, window=4, evicts=False)
    assert full == {"evictions": 0, "peak": 13, "time_mean": pytest.approx((11 + 12 + 13) / 3)}
    assert kv_schedule(10, 10, budget=8, window=4, evicts=True)["time_mean"] == 10.0
    with pytest.raises(ValueError):
        kv_schedule(10, 9, budget=8, window=4, evicts=True)


@pytest.mark.parametrize("method,extra,tokens,equal", [
    ("full", {}, "repeated", True),
    ("snapkv", {"budget": 48}, "repeated", True),
    ("vase-attnv", {"budget": 48, "value_guard": 0.0}, "repeated", True),  # no value guard: no tie to break
    ("vase-attnv", {"budget": 48}, "distinct", True),  # the guard, but no two copies of one token
    # the guard ranks copies of one token: exact ties rank by slot on both paths, a near-tie (one copy computed in a
    # chunk, the other alone) may still differ: either outcome, the rows before the first eviction compared only
    ("vase-attnv", {"budget": 48}, "repeated", None),
])
def test_float32_forcing_equals_decoding_but_for_value_guard_ties(method, extra, tokens, equal) -> None:
    """What docs/eval.md promises in float32 (the fidelity columns' models): teacher forcing gives token-by-token
    decoding's log-probs to float32 rounding (<= 1e-5 nats), except where the value guard ranks two copies of one
    token. Layer 0's values depend on the token only, so the copies' magnitudes tie up to rounding, which a chunk of
    tokens and a single token round differently; the guard can then keep the other copy, and the rows after that
    eviction differ (0.07 nats here; up to 0.19 seen on a row of the tiny model). Before the first eviction the
    two always agree. (float64 models agree everywhere: tests/test_quant.py.)"""
    from vase.generation.generate import forced_log_probs

    from .conftest import tiny_model

    model = tiny_model()  # float32
    torch.manual_seed(7)
    if tokens == "repeated":  # 200 tokens of a 90-token vocabulary: many copies
        prompt, target = torch.randint(0, 90, (30,)), torch.randint(0, 90, (170,))
    else:  # every token once
        perm = torch.randperm(model.config.vocab_size)
        prompt, target = perm[:20], perm[20:90]
    kw = dict(method=method, window=16, seed=1, **extra)
    forced = forced_log_probs(model, prompt, target, **kw)
    decoded = forced_log_probs(model, prompt, target, max_chunk=1, **kw)  # one token per forward: decoding
    gap = (forced - decoded).abs().max(-1).values
    t0 = first_evicted_target(len(prompt), budget=extra.get("budget", 10**6), window=16, evicts=method != "full")
    if t0 is not None:
        assert float(gap[:t0].max()) <= 1e-5  # before the first eviction: rounding only, whatever the tokens
    if equal:
        assert float(gap.max()) <= 1e-5


def test_first_evicted_target_matches_the_cache(tiny_model_tok) -> None:
    """Rows before the index equal full's (no eviction yet); the row at the index does not."""
    import vase

    model, _ = tiny_model_tok
    prompt = list(range(3, 23))  # P = 20
    targets = list(range(30, 90))
    full = vase.forced_log_probs(model, prompt, targets, method="full")
    comp = vase.forced_log_probs(model, prompt, targets, method="streamingllm", budget=13, window=8)
    t = first_evicted_target(20, budget=13, window=8, evicts=True)
    assert t == 9
    assert torch.allclose(full[:t], comp[:t], atol=1e-5)
    assert not torch.allclose(full[t], comp[t], atol=1e-3)
    assert first_evicted_target(20, budget=13, window=8, evicts=False) is None


@pytest.fixture(scope="module")
def tiny_model_tok():
    from tests.helpers_tiny import tiny_model_and_tokenizer

    return tiny_model_and_tokenizer()
