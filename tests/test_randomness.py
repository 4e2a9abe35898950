"""`vase analyze randomness`: the mechanics on hand-made inputs, the tracer against forced_log_probs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vase.analysis.randomness import (
    Arm, Mixture, consecutive_overlap, coverage, ensemble_kl, jaccard, relative_error, run_randomness, token_kl,
    traced_forced,
)
from vase.eval.metrics import first_evicted_target
from vase.generation.generate import forced_log_probs

from .conftest import tiny_model, tiny_tokenizer


def _set(n, *items):
    s = torch.zeros(n, dtype=torch.bool)
    s[list(items)] = True
    return s


def test_jaccard_coverage_and_overlap_on_hand_made_sets():
    n = 10
    k1, k2, k3 = _set(n, 0, 1, 2), _set(n, 0, 1, 5), _set(n, 0, 1, 5)
    assert float(jaccard(k1, k2)) == pytest.approx(2 / 4)
    assert float(jaccard(_set(n), _set(n))) == 1.0
    assert consecutive_overlap([k1, k2, k3]).tolist() == pytest.approx([0.5, 1.0])
    # offered 0-3, then 0-2 and 4-6, then 0,1,5 and 7-8: positions 0-8 were offered, 0,1,2,5 ever kept
    c1, c2, c3 = _set(n, 0, 1, 2, 3), _set(n, 0, 1, 2, 4, 5, 6), _set(n, 0, 1, 5, 7, 8)
    assert float(coverage([k1, k2, k3], [c1, c2, c3])) == pytest.approx(4 / 9)
    # batched over a leading axis (layers x heads): each set on its own
    kept = [torch.stack([k1, k2]), torch.stack([k2, k2])]
    assert consecutive_overlap(kept)[0].tolist() == pytest.approx([0.5, 1.0])


def test_ensemble_kl_identity_when_all_seeds_agree_and_convexity_otherwise():
    torch.manual_seed(0)
    full = torch.randn(7, 11).log_softmax(-1)
    one = torch.randn(7, 11).log_softmax(-1)
    mix, single = ensemble_kl(full, [one, one, one])
    torch.testing.assert_close(mix, single, atol=1e-12, rtol=0)
    torch.testing.assert_close(single, token_kl(full, one))
    seeds = [torch.randn(7, 11).log_softmax(-1) for _ in range(4)]
    mix, single = ensemble_kl(full, seeds)
    # Against the definitions, written out here (mix <= single holds by Jensen for any mixture, so it tests nothing);
    # ensemble_kl renormalises its float32 inputs in float64, as here.
    full, seeds = full.double().log_softmax(-1), [x.double().log_softmax(-1) for x in seeds]
    p = full.exp()
    q = torch.stack([x.exp() for x in seeds]).mean(0)
    torch.testing.assert_close(mix, (p * (full - q.log())).sum(-1), atol=1e-12, rtol=0)
    kls = torch.stack([(p * (full - x)).sum(-1) for x in seeds])
    torch.testing.assert_close(single, kls.mean(0), atol=1e-12, rtol=0)
    m = Mixture()
    for lp in seeds[:2]:
        m.add(lp)
    torch.testing.assert_close(m.log_probs().exp(), (seeds[0].exp() + seeds[1].exp()).double() / 2)
    assert float(token_kl(full, full).abs().max()) < 1e-12


def test_relative_error():
    ref = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    assert relative_error(ref + torch.tensor([[0.0, 5.0], [0.0, 0.0]]), ref).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("method,params", [("snapkv", {}), ("vase-attnv", {}), ("vase-attnv", {"sample": False})])
def test_tracer_evicts_and_scores_exactly_as_forced_log_probs(method, params):
    model = tiny_model("qwen3", "sdpa")
    torch.manual_seed(1)
    prompt, target = torch.randint(0, 90, (12,)).tolist(), torch.randint(0, 90, (70,)).tolist()
    budget, window = 24, 8
    ref = traced_forced(model, prompt, target, method="full", budget=budget, window=window, keep_outputs=True)
    tr = traced_forced(model, prompt, target, method=method, budget=budget, window=window, seed=3,
                       reference=ref.attn_out, **params)
    want = forced_log_probs(model, prompt, target, method=method, budget=budget, window=window, seed=3, **params)
    assert torch.equal(tr.log_probs, want)
    assert torch.equal(ref.log_probs, forced_log_probs(model, prompt, target, method="full"))
    t0 = first_evicted_target(len(prompt), budget=budget, window=window, evicts=True)
    assert tr.evict_targets[0] == t0
    assert len(tr.kept) == len(tr.evict_targets) == math.ceil((len(prompt) + len(target) - 1 - budget - window) / window)
    for kept, offered in zip(tr.kept, tr.candidates):
        assert not (kept & ~offered).any()
        assert (kept.sum(-1) == budget - window).all()  # every layer and KV head keeps B - w candidates
        assert (offered.sum(-1) == budget).all()  # offered: everything stored but the window
    # attention outputs: the same tokens before the first eviction (up to chunking), different after
    assert float(tr.attn_err[:, : t0 - 1].max()) < 1e-4
    assert float(tr.attn_err[:, t0 - 1:].mean()) > 1e-3


def _recomputed_mixtures(model, tok, prompts, budget, window, runs, first_row):
    """Per problem, (mean mixture KL, mean single KL) of the forced runs `runs` [(method, budget, seed, params)],
    from `first_row(prompt_len)` on, recomputed here from the definitions: the study's own trajectories (full,
    sampled with seed 0), KL(full || mean of the runs' distributions) and the mean of KL(full || run)."""
    from vase.generation.generate import encode_prompts, generate

    gen = generate(model, tok, list(prompts), method="full", budget=budget, window=window, max_new_tokens=48, seed=0,
                   temperature=0.6, top_p=0.95, chat_template=False)
    out = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompts(tok, [prompt], False, torch.device("cpu"))[0][0].tolist()
        targets = gen.token_ids[i]
        if len(ids) + len(targets) - 1 <= max(len(ids), budget) + window:
            continue  # the study skips it too: no eviction
        t0 = first_row(len(ids))
        # float32 log-probs, renormalised in float64 (as token_kl and Mixture do)
        p = forced_log_probs(model, ids, targets, method="full").double().log_softmax(-1)[t0:].exp()
        qs = [forced_log_probs(model, ids, targets, method=m, budget=b, window=window, seed=sd, **kw).double()
              .log_softmax(-1)[t0:] for m, b, sd, kw in runs]
        q = torch.stack([x.exp() for x in qs]).mean(0)
        mix = (p * (p.log() - q.log())).sum(-1).mean()
        single = torch.stack([(p * (p.log() - x)).sum(-1) for x in qs]).mean(0).mean()
        out.append((float(mix), float(single)))
    return out


def test_run_randomness_writes_report_and_plots(tmp_path):
    model, tok = tiny_model("qwen3", "sdpa"), tiny_tokenizer()
    arms = (Arm("snapkv", "snapkv"), Arm("snapkv-sample", "snapkv-sample"))
    report = run_randomness(model, tok, ["Tell me a story", "Count to ten", "abc"], tmp_path, arms=arms, budget=24,
                            window=8, seeds=2, max_new_tokens=48, loop_tokens=20, chat_template=False)
    assert report["problems"]  # at least one trajectory was long enough to evict
    rows = {r["method"]: r for r in report["methods"]}
    assert rows["snapkv"]["ensemble_kl_mixture"] is None  # deterministic: one seed, no mixture
    s = rows["snapkv-sample"]
    # The 2-seed mixture, recomputed from the forced runs of each seed (Jensen alone would hold for any mixture).
    want = _recomputed_mixtures(model, tok, ["Tell me a story", "Count to ten", "abc"], 24, 8,
                                [("snapkv-sample", 24, sd, {}) for sd in (0, 1)],
                                lambda P: first_evicted_target(P, budget=24, window=8, evicts=True))
    assert len(want) == len(report["problems"])
    assert s["ensemble_kl_mixture"] == pytest.approx(sum(m for m, _ in want) / len(want), rel=1e-9)
    assert s["ensemble_kl_single_mean"] == pytest.approx(sum(x for _, x in want) / len(want), rel=1e-9)
    assert s["ensemble_ratio"] == pytest.approx(s["ensemble_kl_mixture"] / s["ensemble_kl_single_mean"])
    for r in rows.values():
        assert 0 < r["coverage"] <= 1 and 0 <= r["overlap"] <= 1 and r["kl_after_eviction"] > 0
        assert len(r["attn_err_per_layer"]) == 2
    assert set(report["free_generation"]) == {"full", "snapkv", "snapkv-sample"}
    for name in ("randomness.json", "randomness.csv", "attn_error.png", "mechanisms.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "randomness.json").read_text())["config"]["budget"] == 24


def test_bootstrap_ratio_on_hand_made_problems():
    from vase.analysis.randomness import bootstrap_ratio, bootstrap_ratio_difference

    assert bootstrap_ratio([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == (0.5, 0.5, 0.5)  # every resample: 0.5
    # Two problems, ratios 1 and 0: resamples give 1 (both the first), 0.5 or 0 (both the second).
    ratio, lo, hi = bootstrap_ratio([1.0, 0.0], [1.0, 1.0])
    assert (ratio, lo, hi) == (0.5, 0.0, 1.0)
    ratio, lo, hi = bootstrap_ratio([0.7, 0.8, 0.75, 0.9], [1.0, 1.0, 1.0, 1.0], level=0.5)
    assert lo < ratio < hi and 0.7 <= lo and hi <= 0.9
    # Paired: the same draws for both, so identical inputs differ by exactly 0 in every resample.
    assert bootstrap_ratio_difference([1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]) == (0.0, 0.0, 0.0)
    diff, lo, hi = bootstrap_ratio_difference([0.5, 0.6], [1.0, 1.0], [0.9, 1.0], [1.0, 1.0])
    assert diff == pytest.approx(-0.4) and lo == pytest.approx(-0.4) and hi == pytest.approx(-0.4)
    with pytest.raises(ValueError, match="one value per problem"):
        bootstrap_ratio_difference([1.0], [1.0, 2.0], [1.0], [1.0])


def test_neighbouring_budget_control_mixes_deterministic_runs(tmp_path):
    """The control: top-k at 4 budgets, mixed like seeds. Jensen alone puts its ratio below 1."""
    from vase.analysis.randomness import Control

    model, tok = tiny_model("qwen3", "sdpa"), tiny_tokenizer()
    arms = (Arm("snapkv-sample", "snapkv-sample"),)
    controls = (Control("snapkv@B±", "snapkv", "snapkv-sample", offsets=(-2, 0, 2, 4)),)
    report = run_randomness(model, tok, ["Tell me a story", "Count to ten", "abc"], tmp_path, arms=arms,
                            controls=controls, budget=24, window=8, seeds=2, max_new_tokens=48, loop_tokens=0,
                            chat_template=False)
    (ctl,) = report["controls"]
    assert ctl["budgets"] == [22, 24, 26, 28] and ctl["problems"] == len(report["problems"])
    # The mixture of the 4 budgets' runs, recomputed from the definitions over the rows after the latest first
    # eviction (a ratio below 1 would hold by Jensen for any 4 different runs, so it tests nothing).
    want = _recomputed_mixtures(model, tok, ["Tell me a story", "Count to ten", "abc"], 24, 8,
                                [("snapkv", b, 0, {}) for b in (22, 24, 26, 28)],
                                lambda P: max(first_evicted_target(P, budget=b, window=8, evicts=True)
                                              for b in (22, 24, 26, 28)))
    assert len(want) == ctl["problems"]
    assert ctl["ensemble_kl_mixture"] == pytest.approx(sum(m for m, _ in want) / len(want), rel=1e-9)
    assert ctl["ensemble_kl_single_mean"] == pytest.approx(sum(x for _, x in want) / len(want), rel=1e-9)
    assert ctl["ensemble_ratio_lo"] <= ctl["ensemble_ratio"] <= ctl["ensemble_ratio_hi"]
    (cmp,) = report["comparisons"]
    assert cmp["arm"] == "snapkv-sample" and cmp["difference"] == pytest.approx(cmp["arm_ratio"] - cmp["control_ratio"])
    assert cmp["difference_lo"] <= cmp["difference"] <= cmp["difference_hi"]
    assert "snapkv@B±" in (tmp_path / "randomness.csv").read_text()
    with pytest.raises(ValueError, match="not a stochastic arm"):
        run_randomness(model, tok, ["abc"], tmp_path, arms=(Arm("snapkv", "snapkv"),), controls=controls, budget=24,
                       window=8, seeds=2, max_new_tokens=48, loop_tokens=0, chat_template=False)
