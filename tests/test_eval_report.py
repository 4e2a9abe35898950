"""Run summaries: the files, their columns, and a rebuild from the JSONL files alone."""

from __future__ import annotations

import csv
import shutil

import pytest

from tests.helpers_tiny import tiny_model_and_tokenizer
from vase.eval.config import EvalConfig
from vase.eval.prompts import build_user_message
from vase.eval.report import COLUMNS, PLOT_FILES, conclusion, summarize, summary_rows
from vase.eval.runner import run_eval
from vase.eval.tasks import load_task
from vase.generation import GenerationOutput

GOLD = {build_user_message(p): p.answer for p in load_task("arith", limit=8)}


def fake_generate(model, tokenizer, prompts, *, method, budget, seed, max_new_tokens, **kw):
    """Instant, deterministic stand-in: the full cache answers right more often than small budgets."""
    texts, ids, finished = [], [], []
    for prompt, s in zip(prompts, seed):
        good = (s % 10) < (8 if method == "full" else min(8, budget // 10))
        text = f"so the answer is \\boxed{{{GOLD[prompt]}}}" if good else "abcdefghij" * 8
        texts.append(text)
        ids.append(list(range(3, 3 + (12 if good else max_new_tokens))))
        finished.append(good)
    return GenerationOutput(texts=texts, token_ids=ids, prompt_lengths=[20] * len(prompts), finished=finished,
                            seconds=0.02 * len(prompts), prefill_seconds=0.001, stats={})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model, tok = tiny_model_and_tokenizer()
    out = tmp_path_factory.mktemp("report")
    cfg = EvalConfig(task="arith", limit=8, methods=["snapkv", "rkv"], budgets=[24, 48], window=8, samples=3,
                     max_new_tokens=40, batch_size=6, model="tiny", output_dir=str(out))
    return run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)


def test_summary_files_and_columns(run_dir, capsys):
    for name in ("summary.csv", "summary.md", PLOT_FILES["accuracy"], PLOT_FILES["failures"], PLOT_FILES["length"],
                 PLOT_FILES["divergence"]):
        assert (run_dir / name).stat().st_size > 0, name
    assert (run_dir / PLOT_FILES["accuracy"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run_dir / PLOT_FILES["fidelity"]).exists()  # no fidelity measured
    with open(run_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == COLUMNS
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("full", ""), ("rkv", "24"), ("rkv", "48"), ("snapkv", "24"), ("snapkv", "48")]
    full = rows[0]
    assert full["agree_pct"] == "" and full["d_acc_pct"] == "" and full["window"] == "8"
    assert float(full["kv_peak_ratio"]) == 1.0 and int(full["n_samples"]) == 24 and int(full["n_problems"]) == 8
    for c in ("garbage", "phrase_loop", "truncated", "ok"):
        r = rows[1]
        assert float(r[f"{c}_lo_pct"]) <= float(r[f"{c}_pct"]) <= float(r[f"{c}_hi_pct"])
    assert sum(float(rows[1][f"{c}_pct"]) for c in ("garbage", "phrase_loop", "truncated", "ok")) == pytest.approx(100)
    md = (run_dir / "summary.md").read_text()
    assert md.count("\n| ") == 1 + len(rows) and "Δ pass@1 pts [95% CI]" in md and "24 / 8" in md
    assert "batch tok/s" in md and "vase bench" in md


def test_summarize_rebuilds_identical_csv_from_jsonl_alone(run_dir, tmp_path, capsys):
    only = tmp_path / run_dir.name
    only.mkdir()
    for p in run_dir.glob("*.jsonl"):
        if p.name.startswith(("samples.", "fidelity.")):
            shutil.copy(p, only / p.name)
    shutil.copy(run_dir / "config.json", only / "config.json")
    rows = summarize(only, print_table=True)
    out = capsys.readouterr().out
    assert "pass@1" in out and ("distinguishable" in out or "less accurate" in out)
    assert (only / "summary.csv").read_text() == (run_dir / "summary.csv").read_text()
    assert (only / "summary.md").read_text() == (run_dir / "summary.md").read_text()
    assert len(rows) == 5
    with pytest.raises(FileNotFoundError):
        summarize(tmp_path / "nothing")


def rec(method, budget, pid, sample, correct, length, answer=None, **kw):
    return {"method": method, "budget": budget, "problem_id": pid, "sample": sample, "correct": correct,
            "answer": answer, "length": length, "failure": kw.pop("failure", "ok"), "seconds": 1.0,
            "prefill_seconds": 0.0, "batch_rows": 2, "kv_bytes_peak": kw.pop("peak", 100),
            "kv_bytes_time_mean": kw.pop("avg", 80.0), "kv_bytes_full": 200, "evictions": 1,
            "finished": kw.pop("finished", True), **kw}


def test_summary_rows_values():
    samples = [
        rec("full", None, "a", 0, True, 100, "1", peak=200, avg=160.0, token_ids=[1, 2, 3]),
        rec("full", None, "a", 1, True, 100, "1", peak=200, avg=160.0, token_ids=[1, 2, 3]),
        rec("full", None, "b", 0, False, 200, "2", peak=400, avg=100.0, token_ids=[4, 5]),
        rec("full", None, "b", 1, True, 200, "3", peak=400, avg=100.0, token_ids=[4, 5, 6, 7]),
        rec("m", 50, "a", 0, True, 300, "1", token_ids=[1, 2, 3]),
        rec("m", 50, "a", 1, False, 300, "9", failure="phrase_loop", token_ids=[1, 9]),
        rec("m", 50, "b", 0, False, 300, "2", token_ids=[4, 5, 6]),
        rec("m", 50, "b", 1, False, 300, None, failure="truncated", finished=False, token_ids=[8]),
    ]
    fidelity = [
        {"method": "full", "budget": None, "problem_id": "a", "n_tokens": 10, "kl_mean": 0.0, "noise_kl_mean": 1e-9},
        {"method": "full", "budget": None, "problem_id": "b", "n_tokens": 30, "kl_mean": 0.0, "noise_kl_mean": 3e-9},
        {"method": "m", "budget": 50, "problem_id": "a", "n_tokens": 10, "kl_mean": 0.1, "n_tokens_evicted": 5,
         "kl_mean_evicted": 0.2, "top1_agree_evicted": 1.0, "dnll_mean_evicted": 0.3},
        {"method": "m", "budget": 50, "problem_id": "b", "n_tokens": 30, "kl_mean": 0.5, "n_tokens_evicted": 20,
         "kl_mean_evicted": 0.6, "top1_agree_evicted": 0.5, "dnll_mean_evicted": 0.5},
    ]
    full, m = summary_rows(list(reversed(samples)), fidelity, window=16)
    assert full["pass_at_1_pct"] == pytest.approx(75.0) and full["pass_at_1_stderr_pct"] == pytest.approx(25.0)
    assert full["noise_kl"] == pytest.approx(2e-9) and full["d_acc_pct"] is None
    assert m["pass_at_1_pct"] == pytest.approx(25.0) and m["answered_pct"] == 75.0 and m["cap_pct"] == 25.0
    assert m["acc_finished_pct"] == pytest.approx(100 / 3) and m["acc_truncated_pct"] == 0.0
    # Paired: a: (0 + -1) / 2 = -0.5, b: (0 + -1) / 2 = -0.5 -> -50 pts with no spread; 0 vs 2 discordant.
    assert (m["d_acc_pct"], m["d_acc_lo_pct"], m["d_acc_hi_pct"]) == (-50.0, -50.0, -50.0)
    assert (m["only_method_right"], m["only_full_right"]) == (0, 2) and m["mcnemar_p"] == pytest.approx(0.5)
    assert m["d_length"] == pytest.approx(150.0)  # a: +200, b: +100
    # Both answered in a0 (1=1), a1 (9!=1), b0 (2=2); b1 only full answered.
    assert m["agree_pct"] == pytest.approx(200 / 3) and m["agree_n_both"] == 3
    assert m["only_full_answered_pct"] == 25.0 and m["both_none_pct"] == 0.0
    # First divergence: a0 identical, a1 at 1, b0 at 2 (full stopped), b1 at 0.
    assert m["identical_pct"] == 25.0 and m["first_div_median"] == 1.0
    # Peak 100 over 200 (a) and 400 (b); time-averaged 80 over 160 and 100.
    assert m["kv_peak_ratio"] == pytest.approx((0.5 + 0.5 + 0.25 + 0.25) / 4)
    assert m["kv_time_ratio"] == pytest.approx((0.5 + 0.5 + 0.8 + 0.8) / 4)
    assert m["phrase_loop_pct"] == 25.0 and m["truncated_pct"] == 25.0 and m["ok_pct"] == 50.0
    assert m["batch_tokens_per_s"] == pytest.approx(1200 / 2.0)  # 4 rows of 1 s batches shared by 2 rows each
    # Fidelity after the first eviction: per problem, then over problems; all tokens token-weighted.
    assert m["kl_evicted"] == pytest.approx(0.4) and m["kl_evicted_lo"] <= 0.4 <= m["kl_evicted_hi"]
    assert m["top1_agree_evicted_pct"] == pytest.approx(75.0) and m["dnll_evicted"] == pytest.approx(0.4)
    assert m["kl_all"] == pytest.approx((0.1 * 10 + 0.5 * 30) / 40) and m["fidelity_tokens_evicted"] == 25
    assert full["kl_evicted"] is None and m["problems_match"] is True
    line = conclusion([full, m])
    assert "less accurate than full" in line and "m B=50 (-50 pts)" in line


def test_partial_problem_sets_are_flagged():
    samples = [rec("full", None, "a", 0, True, 10, "1"), rec("full", None, "b", 0, True, 10, "1"),
               rec("m", 50, "a", 0, True, 10, "1")]
    full, m = summary_rows(samples)
    assert full["problems_match"] is True and m["problems_match"] is False
    assert m["d_acc_pct"] == 0.0 and m["d_acc_lo_pct"] == 0.0
    assert "different problem set" in conclusion([full, m]) and "not distinguishable" in conclusion([full, m])


def test_against_another_method(run_dir, capsys):
    from vase.eval.report import parse_reference

    assert parse_reference("snapkv:24") == ("snapkv", 24) and parse_reference("full") == ("full", None)
    with pytest.raises(ValueError, match="integer"):
        parse_reference("snapkv:x")
    rows = {(r["method"], r["budget"]): r for r in summarize(run_dir, print_table=False, reference=("snapkv", 24))}
    assert rows[("snapkv", 24)]["d_acc_pct"] is None and rows[("snapkv", 24)]["reference"] == "snapkv B=24"
    # Paired the other way round: full minus snapkv B=24 is the negative of snapkv B=24 minus full.
    vs_full = {(r["method"], r["budget"]): r for r in summarize(run_dir, print_table=False)}
    assert rows[("full", None)]["d_acc_pct"] == pytest.approx(-vs_full[("snapkv", 24)]["d_acc_pct"])
    assert (run_dir / "summary-vs-snapkv-24.md").exists()
    with pytest.raises(ValueError, match="no rows of the reference"):
        summarize(run_dir, print_table=False, reference=("snapkv", 999))
