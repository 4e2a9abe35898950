"""`vase analyze sweep`: budgets from compression, the retrieval task, the report on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from vase.analysis.sweep import (
    equal_sparsity_budget,
    evicting_attended_sum,
    markdown_table,
    retrieval_problems,
    run_sweep,
    selection_attended_sum,
    sweep_budget,
    task_prompts,
)

from .conftest import tiny_model, tiny_tokenizer


def test_budget_from_compression_and_run_length():
    assert sweep_budget(800, 4, 16) == (200, False)
    assert sweep_budget(800, 16, 16) == (50, False)
    assert sweep_budget(300, 16, 16) == (24, True)  # round(18.75) = 19 < w + 8: clamped and marked
    with pytest.raises(ValueError, match="compression"):
        sweep_budget(100, 1, 16)


def test_attended_tokens_per_step_by_hand():
    """P = 10, B = 24, w = 16: the first eviction comes after target 30, so rows 31..46 attend 25..40
    tokens (mean 32.5 = B + (w + 1) / 2), and Quest runs at K = 33."""
    assert evicting_attended_sum(10, 47, 24, 16, 31) == sum(range(25, 41)) == 520
    assert evicting_attended_sum(10, 48, 24, 16, 31) == 520 + 25  # row 47: evicted again, back to B + 1
    assert equal_sparsity_budget(10, 47, 24, 16, 31) == 33
    assert equal_sparsity_budget(10, 33, 24, 16, 31) == 26  # rows 31, 32 attend 25, 26: mean 25.5
    # Quest at K = 33 with 1 of 2 layers dense: rows see n = 41..56 tokens, (n + 33) / 2 per row.
    assert selection_attended_sum(10, 47, 33, 31, n_layers=2, dense_layers=1) == (sum(range(41, 57)) + 16 * 33) / 2
    assert selection_attended_sum(10, 47, 33, 31, n_layers=2) == 16 * 33
    with pytest.raises(ValueError, match="first_row"):
        evicting_attended_sum(10, 47, 24, 16, 0)


@torch.no_grad()
def test_quest_attends_what_the_sweep_reports(monkeypatch):
    """Count the tokens Quest's masks really let each scored row attend in a forced run."""
    import vase.core.policies.quest as quest

    from vase.eval.metrics import first_evicted_target
    from vase.generation.generate import forced_log_probs

    seen: dict[int, list[int]] = {}  # n visible -> tokens attended, one entry per layer and head
    real = quest.quest_mask

    def counting(keys, queries, q_start, *args):
        mask = real(keys, queries, q_start, *args)
        for i in range(mask.shape[2]):
            seen.setdefault(q_start + i + 1, []).extend(mask[0, :, i].sum(-1).tolist())
        return mask

    monkeypatch.setattr(quest, "quest_mask", counting)
    model = tiny_model("qwen3", "sdpa")
    # T = 52: the scored rows 29..51 end inside an eviction cycle, so the evicting cache attends 31.13 tokens
    # per row on average, not B + w / 2 = 32 (which a whole number of cycles, e.g. T = 70, gives within 0.5:
    # there the old `B + w // 2` sizing passed this test too).
    P, T, B, w = 12, 52, 24, 16
    torch.manual_seed(0)
    prompt, targets = torch.randint(0, 90, (P,)), torch.randint(0, 90, (T,))
    t0 = first_evicted_target(P, budget=B, window=w, evicts=True)
    K = equal_sparsity_budget(P, T, B, w, t0)
    assert (t0, K) == (29, 31) and K != B + w // 2
    forced_log_probs(model, prompt, targets, method="quest", budget=K, window=w, page_size=8)
    per_row = [sum(seen[P + t]) / len(seen[P + t]) if P + t in seen else P + t for t in range(t0, T)]
    n_layers = model.config.num_hidden_layers
    assert all(len(seen[P + t]) == n_layers * model.config.num_key_value_heads for t in range(t0, T))
    assert sum(per_row) == selection_attended_sum(P, T, K, t0, n_layers=n_layers)
    assert abs(sum(per_row) / (T - t0) - evicting_attended_sum(P, T, B, w, t0) / (T - t0)) <= 0.5


def test_retrieval_problems_state_the_asked_codes_far_back():
    a, b = retrieval_problems(3, seed=1), retrieval_problems(3, seed=1)
    assert a == b and a != retrieval_problems(3, seed=2)
    for p in a:
        assert len(p.asked) == 4 and len(p.prompt) > 3000
        question = p.prompt.rsplit("\n\n", 1)[1]
        for name, code in p.answer.items():
            where = p.prompt.index(f"The code of project {name} is {code}.")
            assert where < len(p.prompt) // 10  # stated in the first tenth of the prompt
            assert name in question and code not in question
    assert task_prompts("retrieval", limit=2, seed=1) == [p.prompt for p in a[:2]]
    assert "boxed" in task_prompts("arith", limit=1)[0]


def test_run_sweep_on_a_tiny_model(tmp_path):
    model, tok = tiny_model("qwen3", "sdpa"), tiny_tokenizer()
    tasks = {"short": ["Tell me a story about a cat", "Count to ten please"]}
    report = run_sweep(model, tok, tmp_path, tasks=tasks, methods=["full", "snapkv", "quest", "quest:dense_layers=1"], compressions=[2, 3],
                       window=16, max_new_tokens=80, chat_template=False)
    rows = {(r["method"], r["compression"]): r for r in report["rows"]}
    assert set(rows) == {(m, c) for m in ("full", "snapkv", "quest", "quest:dense_layers=1") for c in (2, 3)}
    assert rows[("quest:dense_layers=1", 2)]["kl"] != rows[("quest", 2)]["kl"]  # the parameter reached the cache
    for c in (2, 3):
        assert rows[("full", c)]["kl"] == 0.0 and rows[("full", c)]["top1"] == 1.0  # the reference against itself
        assert rows[("snapkv", c)]["kl"] > 0 and rows[("quest", c)]["kl"] > 0
        assert rows[("quest", c)]["selection"] and not rows[("snapkv", c)]["selection"]
    # a higher compression is a smaller budget
    assert rows[("snapkv", 3)]["budget_mean"] < rows[("snapkv", 2)]["budget_mean"]
    for c in (2, 3):  # equal sparsity: Quest attends as many tokens per scored step as the evicting cache
        assert abs(rows[("quest", c)]["attended_mean"] - rows[("snapkv", c)]["attended_mean"]) <= 0.5
        assert rows[("full", c)]["attended_mean"] > rows[("snapkv", c)]["attended_mean"]
    for name in ("sweep.json", "sweep.csv", "sweep.md", "sweep.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "sweep.json").read_text())["config"]["window"] == 16
    assert "| quest |" in markdown_table(report) and "tokens attended per step" in markdown_table(report)


def _cli(args, capsys):
    from vase.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_cli_sweep_writes_its_report(model_dir, tmp_path, capsys):
    code, out, err = _cli(["analyze", "sweep", "--model", model_dir, "--tasks", "arith", "--limit", "1",
                           "--methods", "snapkv,quest", "--compressions", "2", "--max-new-tokens", "60",
                           "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "| quest |" in out and (tmp_path / "sweep.md").exists()


@pytest.mark.parametrize("args, message", [
    (["analyze", "sweep", "--methods", "snapk"], "Did you mean snapkv"),
    (["analyze", "sweep", "--compressions", "1"], "compression must be > 1"),
    (["analyze", "randomness", "--seeds", "0"], "--seeds must be in 1..256"),
])
def test_cli_errors_are_one_line(model_dir, args, message, capsys):
    code, out, err = _cli([*args, "--model", model_dir], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and message in lines[-1] and "Traceback" not in err


def test_run_sweep_gives_quest_the_equal_sparsity_budget_at_its_call_site(tmp_path, monkeypatch):
    """The budget run_sweep hands Quest is `equal_sparsity_budget` of that problem's own P, T, B and t0 (not, e.g.,
    `B + w // 2`, which the attended-tokens check above lets through within its 0.5 tolerance)."""
    import vase.generation.generate as generation
    from vase.eval.metrics import first_evicted_target

    calls, real = [], generation.forced_log_probs

    def spy(model, prompt_ids, targets, **kw):
        r = kw["request"]  # every run carries its validated request
        calls.append((r.method, r.budget, len(prompt_ids), len(targets), r.window))
        return real(model, prompt_ids, targets, **kw)

    monkeypatch.setattr(generation, "forced_log_probs", spy)
    model, tok = tiny_model("qwen3", "sdpa"), tiny_tokenizer()
    run_sweep(model, tok, tmp_path, tasks={"short": ["Tell me a story about a cat", "Count to ten please"]},
              methods=["snapkv", "quest"], compressions=[2, 3], window=16, max_new_tokens=61, chat_template=False)
    scored = [c for c in calls if c[0] != "full"]
    assert [c[0] for c in scored] == ["snapkv", "quest"] * (len(scored) // 2) and scored
    for (_, B, P, T, w), (_, K, P2, T2, _) in zip(scored[::2], scored[1::2]):
        assert (P, T) == (P2, T2)
        t0 = first_evicted_target(P, budget=B, window=w, evicts=True)
        assert K == equal_sparsity_budget(P, T, B, w, t0), (P, T, B, K)
