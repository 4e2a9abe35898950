"""Run summaries: the files, their columns, and a rebuild from the JSONL files alone."""

from __future__ import annotations

import csv
import shutil

import pytest

from tests.helpers_tiny import tiny_model_and_tokenizer
from vase.eval.config import EvalConfig
from vase.eval.prompts import build_user_message
from vase.eval.report import COLUMNS, PLOT_FILES, summarize, summary_rows
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


def test_summary_files_and_columns(run_dir):
    for name in ("summary.csv", "summary.md", PLOT_FILES["accuracy"], PLOT_FILES["failures"]):
        assert (run_dir / name).stat().st_size > 0, name
    assert (run_dir / PLOT_FILES["accuracy"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run_dir / PLOT_FILES["fidelity"]).exists()  # no fidelity measured
    with open(run_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == COLUMNS
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("full", ""), ("rkv", "24"), ("rkv", "48"), ("snapkv", "24"), ("snapkv", "48")]
    full = rows[0]
    assert float(full["agreement_pct"]) == 100.0 and full["compression_ratio"] == ""
    assert float(full["inflation"]) == 1.0 and int(full["n_samples"]) == 24 and int(full["n_problems"]) == 8
    shares = sum(float(rows[1][f"{c}_pct"]) for c in ("garbage", "phrase_loop", "truncated", "ok"))
    assert shares == pytest.approx(100.0)
    md = (run_dir / "summary.md").read_text()
    assert md.count("\n| ") == 1 + len(rows) and "pass@1 %" in md


def test_summarize_rebuilds_identical_csv_from_jsonl_alone(run_dir, tmp_path, capsys):
    only = tmp_path / run_dir.name
    only.mkdir()
    for p in run_dir.glob("*.jsonl"):
        if p.name.startswith(("samples.", "fidelity.")):
            shutil.copy(p, only / p.name)
    rows = summarize(only, print_table=True)
    assert "pass@1" in capsys.readouterr().out
    assert (only / "summary.csv").read_text() == (run_dir / "summary.csv").read_text()
    assert (only / "summary.md").read_text() == (run_dir / "summary.md").read_text()
    assert len(rows) == 5
    with pytest.raises(FileNotFoundError):
        summarize(tmp_path / "nothing")


def rec(method, budget, pid, sample, correct, length, answer=None, **kw):
    return {"method": method, "budget": budget, "problem_id": pid, "sample": sample, "correct": correct,
            "answer": answer, "length": length, "failure": kw.pop("failure", "ok"), "seconds": 1.0,
            "prefill_seconds": 0.0, "batch_rows": 2, "kv_bytes": kw.pop("kv", 100), "kv_bytes_full": 200,
            "evictions": 1, **kw}


def test_summary_rows_values():
    samples = [
        rec("full", None, "a", 0, True, 100, "1"), rec("full", None, "a", 1, True, 100, "1"),
        rec("full", None, "b", 0, False, 200, "2"), rec("full", None, "b", 1, True, 200, "3"),
        rec("m", 50, "a", 0, True, 300, "1"), rec("m", 50, "a", 1, False, 300, "9", failure="phrase_loop"),
        rec("m", 50, "b", 0, False, 300, "2"), rec("m", 50, "b", 1, False, 300, None, failure="truncated"),
    ]
    fidelity = [
        {"method": "m", "budget": 50, "problem_id": "a", "n_tokens": 10, "kl_mean": 0.1, "top1_agree": 1.0,
         "top1_disagree_share": 0.0, "dnll_mean": 0.2},
        {"method": "m", "budget": 50, "problem_id": "b", "n_tokens": 30, "kl_mean": 0.5, "top1_agree": 0.5,
         "top1_disagree_share": 0.5, "dnll_mean": 0.4},
    ]
    full, m = summary_rows(list(reversed(samples)), fidelity)
    assert full["pass_at_1_pct"] == pytest.approx(75.0) and full["pass_at_1_stderr_pct"] == pytest.approx(25.0)
    assert m["pass_at_1_pct"] == pytest.approx(25.0)
    assert m["agreement_pct"] == pytest.approx(50.0)  # a0 and b0 agree; a1 and b1 differ
    assert m["mean_length"] == 300 and m["inflation"] == pytest.approx(2.0)
    assert m["compression_ratio"] == pytest.approx(150 / 50)
    assert m["phrase_loop_pct"] == 25.0 and m["truncated_pct"] == 25.0 and m["ok_pct"] == 50.0
    assert m["tokens_per_s"] == pytest.approx(1200 / 2.0)  # 4 rows of 1 s batches shared by 2 rows each
    assert m["kv_ratio"] == pytest.approx(0.5)
    assert m["kl_mean"] == pytest.approx((0.1 * 10 + 0.5 * 30) / 40)  # token-weighted
    assert m["top1_agree_pct"] == pytest.approx(100 * (10 + 15) / 40) and m["fidelity_tokens"] == 40
    assert full["kl_mean"] is None
