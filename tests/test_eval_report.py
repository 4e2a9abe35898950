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
from vase.generation.generate import GenerationOutput

GOLD = {build_user_message(p): p.answer for p in load_task("arith", limit=8)}


def fake_generate(model, tokenizer, prompts, *, request, seed, max_new_tokens, **kw):
    """Instant, deterministic stand-in: the full cache answers right more often than small budgets (the runner
    hands down the config's validated request)."""
    texts, ids, finished = [], [], []
    for prompt, s in zip(prompts, seed):
        good = (s % 10) < (8 if request.method == "full" else min(8, request.budget // 10))
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
    assert (m["only_method_right"], m["only_full_right"]) == (0, 2) and m["paired_p"] == pytest.approx(0.5)
    assert m["d_length"] == pytest.approx(150.0)  # a: +200, b: +100
    # Both answered in a0 (1=1), a1 (9!=1), b0 (2=2); b1 only full answered.
    assert m["agree_pct"] == pytest.approx(200 / 3) and m["agree_n_both"] == 3
    assert m["only_full_answered_pct"] == 25.0 and m["both_none_pct"] == 0.0
    # First divergence: a0 identical, a1 at 1, b0 at 2 (full stopped), b1 at 0.
    assert m["identical_pct"] == 25.0 and m["first_div_median"] == 1.0
    # Peak 100 over 200 (a) and 400 (b). Held bytes summed over the decode steps: 80 x 300 steps (299 for b1,
    # cut at the cap) per method sequence, over full's 160 x 100 (a) and 100 x 200 (b).
    assert m["kv_peak_ratio"] == pytest.approx((0.5 + 0.5 + 0.25 + 0.25) / 4)
    assert m["kv_sum_ratio"] == pytest.approx(80 * (300 * 3 + 299) / (2 * 160 * 100 + 2 * 100 * 200))
    assert m["phrase_loop_pct"] == 25.0 and m["truncated_pct"] == 25.0 and m["ok_pct"] == 50.0
    assert m["batch_tokens_per_s"] == pytest.approx(1200 / 2.0)  # 4 rows of 1 s batches shared by 2 rows each
    # Fidelity after the first eviction: per problem, then over problems; all tokens token-weighted.
    assert m["kl_evicted"] == pytest.approx(0.4) and m["kl_evicted_lo"] <= 0.4 <= m["kl_evicted_hi"]
    assert m["top1_agree_evicted_pct"] == pytest.approx(75.0) and m["dnll_evicted"] == pytest.approx(0.4)
    assert m["kl_all"] == pytest.approx((0.1 * 10 + 0.5 * 30) / 40) and m["fidelity_tokens_evicted"] == 25
    assert full["kl_evicted"] is None and m["keys_match"] is True
    # Both problems worse: the bootstrap interval is [-50, -50], but with 2 problems the exact paired p is 0.5.
    line = conclusion([full, m])
    assert "less accurate" not in line and "not distinguishable from full" in line and "n = 2 problems" in line
    assert "m B=50 ([-50.0, -50.0] pts, p = 0.500)" in line


def test_partial_problem_sets_are_flagged():
    samples = [rec("full", None, "a", 0, True, 10, "1"), rec("full", None, "b", 0, True, 10, "1"),
               rec("m", 50, "a", 0, True, 10, "1")]
    full, m = summary_rows(samples)
    assert full["keys_match"] is True and m["keys_match"] is False
    assert m["d_acc_pct"] == 0.0 and m["d_acc_lo_pct"] == 0.0
    assert "other (problem, sample) pairs" in conclusion([full, m]) and "not distinguishable" in conclusion([full, m])


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


# ----------------------------------------------------------------------------- issue 20: numbers that mislead


def test_paired_p_tests_problems_not_samples():
    # 10 problems x 4 samples, the method wrong on every sample of 3 problems: 12 discordant samples but
    # 3 discordant problems. Sample-level McNemar would say 2 / 2**12 = 0.00049; on problems it is 2 / 8.
    samples = [rec("full", None, f"p{i}", s, True, 10, "1") for i in range(10) for s in range(4)]
    samples += [rec("m", 50, f"p{i}", s, i >= 3, 10, "1") for i in range(10) for s in range(4)]
    full, m = summary_rows(samples)
    assert (m["only_method_right"], m["only_full_right"]) == (0, 12)
    assert m["paired_p"] == pytest.approx(0.25) and m["paired_p_exact"] is True
    # The interval reaches 0, as p says: (-30 pts) with a percentile bootstrap of [-60, 0] (P(no wrong problem
    # drawn in 10) = 0.7**10 = 2.8 % > 2.5 %, so the upper end is exactly 0).
    assert (m["d_acc_pct"], m["d_acc_lo_pct"], m["d_acc_hi_pct"]) == (-30.0, -60.0, 0.0)
    assert full["paired_p"] is None
    assert "not distinguishable" in conclusion([full, m]) and "less accurate" not in conclusion([full, m])


def test_verdict_needs_both_the_interval_and_the_exact_test():
    # 16 problems, one sample each: the method wrong on 4 where full is right, never the other way. The bootstrap
    # interval lies below 0, but the exact paired test (McNemar: 2 / 2**4) gives p = 0.125: not a difference.
    samples = [rec("full", None, f"p{i}", 0, True, 10, "1") for i in range(16)]
    samples += [rec("m", 50, f"p{i}", 0, i >= 4, 10, "1") for i in range(16)]
    full, m = summary_rows(samples)
    assert m["d_acc_hi_pct"] < 0 and m["paired_p"] == pytest.approx(0.125) and m["paired_p_exact"] is True
    line = conclusion([full, m])
    assert "less accurate" not in line
    assert line.startswith("not distinguishable from full on accuracy at n = 16 problems")
    assert "m B=50 ([-50.0, -6.2] pts, p = 0.125)" in line
    # 8 of 16 worse: interval below 0 and p = 2 / 2**8 < 0.05: now it is below full.
    samples = [rec("full", None, f"p{i}", 0, True, 10, "1") for i in range(16)]
    samples += [rec("m", 50, f"p{i}", 0, i >= 8, 10, "1") for i in range(16)]
    full, m = summary_rows(samples)
    assert m["paired_p"] == pytest.approx(2 / 2**8)
    line = conclusion([full, m])
    assert line.startswith("less accurate than full") and "m B=50 (-50 pts, p = 0.008)" in line
    assert "not distinguishable" not in line
    # And the other side: better on 8 of 16.
    samples = [rec("full", None, f"p{i}", 0, i >= 8, 10, "1") for i in range(16)]
    samples += [rec("m", 50, f"p{i}", 0, True, 10, "1") for i in range(16)]
    full, m = summary_rows(samples)
    assert conclusion([full, m]).startswith("more accurate than full")


def test_kv_avg_sums_bytes_over_decode_steps():
    # Problem b: the method loops to the cap (100 steps at 60 bytes) where full stops after 10 steps at 100.
    # Per-sequence ratios (0.5 and 0.6) would average to 0.55; summed byte-steps are 3.25 x full's.
    samples = [rec("full", None, "a", 0, True, 10, "1", avg=100.0), rec("full", None, "b", 0, True, 10, "1", avg=100.0),
               rec("m", 50, "a", 0, True, 10, "1", avg=50.0),
               rec("m", 50, "b", 0, False, 101, None, avg=60.0, finished=False)]
    full, m = summary_rows(samples)
    assert m["kv_sum_ratio"] == pytest.approx((50 * 10 + 60 * 100) / (100 * 10 + 100 * 10))
    assert full["kv_sum_ratio"] == 1.0


def test_kl_shows_its_problems_and_noise_over_the_same_targets():
    samples = [rec("full", None, p, 0, True, 10, "1") for p in "abc"]
    samples += [rec("m", b, p, 0, True, 10, "1") for b in (50, 90) for p in "abc"]
    # Full's noise per target: a's later targets are noisier; over all targets it is lower.
    noise = {"a": [1e-9] * 5 + [5e-9] * 5, "b": [2e-9] * 10, "c": [3e-9] * 4}
    fidelity = [{"method": "full", "budget": None, "problem_id": p, "n_tokens": len(v), "kl_mean": 0.0,
                 "noise_kl_mean": sum(v) / len(v), "noise_kl_tokens": v} for p, v in noise.items()]
    # B=50 evicts from target 5 on in a and b (c's full sample is too short); B=90 from target 8 in a only.
    fidelity += [{"method": "m", "budget": 50, "problem_id": p, "n_tokens": len(noise[p]), "kl_mean": 0.1,
                  "first_evicted": 5, "n_tokens_evicted": max(0, len(noise[p]) - 5), "kl_mean_evicted": 0.2,
                  "top1_agree_evicted": 1.0, "dnll_mean_evicted": 0.1} for p in "abc"]
    fidelity = [dict(r, kl_mean_evicted=None) if r["problem_id"] == "c" else r for r in fidelity]
    fidelity += [{"method": "m", "budget": 90, "problem_id": "a", "n_tokens": 10, "kl_mean": 0.1, "first_evicted": 8,
                  "n_tokens_evicted": 2, "kl_mean_evicted": 0.3, "top1_agree_evicted": 1.0, "dnll_mean_evicted": 0.1}]
    full, m50, m90 = summary_rows(samples, fidelity)
    assert (m50["fidelity_problems"], m90["fidelity_problems"]) == (2, 1)
    assert m50["noise_kl_evicted"] == pytest.approx((5e-9 + 2e-9) / 2)  # a's targets 5.. and b's 5..
    assert m90["noise_kl_evicted"] == pytest.approx(5e-9)
    assert full["noise_kl"] == pytest.approx((3e-9 + 2e-9 + 3e-9) / 3)  # all targets, as before
    md = _md(summary_rows(samples, fidelity))
    assert "KL after 1st evict. [95% CI] (n)" in md and "0.200 [0.200, 0.200] (2)" in md
    assert "0.300 [0.300, 0.300] (1)" in md and "at most 5.00e-09" in md
    # Without the per-target noise (an older run) the floor is over all targets, and says so.
    old = [{k: v for k, v in r.items() if k != "noise_kl_tokens"} for r in fidelity]
    rows = summary_rows(samples, old)
    assert rows[1]["noise_kl_evicted"] is None and "over all targets" in _md(rows)


def _md(rows) -> str:
    import tempfile
    from pathlib import Path

    from vase.eval.report import write_markdown

    with tempfile.TemporaryDirectory() as d:
        return write_markdown(rows, Path(d) / "s.md").read_text()


def test_a_missing_sample_is_flagged_and_pass_at_1_uses_the_pairs():
    # Same problem ids, but the method lacks sample 1 of a and has a sample full lacks (b1).
    samples = [rec("full", None, "a", 0, True, 10, "1"), rec("full", None, "a", 1, False, 10, "2"),
               rec("full", None, "b", 0, True, 10, "1"),
               rec("m", 50, "a", 0, True, 10, "1"), rec("m", 50, "b", 0, True, 10, "1"),
               rec("m", 50, "b", 1, False, 10, "3")]
    full, m = summary_rows(samples)
    assert full["keys_match"] is True and m["keys_match"] is False
    assert m["n_samples"] == 3 and m["n_paired"] == 2
    assert m["pass_at_1_pct"] == 100.0  # a0 and b0, the pairs; b1 (wrong, unpaired) is left out
    assert "m B=50" in conclusion([full, m]).split("Rows marked *")[1]


def _table_text(rows, width: int, **kw) -> str:
    import io

    from rich.console import Console

    from vase.eval.report import print_table

    con = Console(width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    print_table(rows, title="t", console=con, **kw)
    return con.file.getvalue()


def _demo_rows():
    samples = [rec("full", None, f"p{i}", 0, i % 3 > 0, 10, "1") for i in range(6)]
    samples += [rec(m, b, f"p{i}", 0, i % 2 > 0, 10, "1") for m in ("streamingllm", "vase-attnv")
                for b in (12, 32) for i in range(6)]
    fidelity = [{"method": m, "budget": b, "problem_id": f"p{i}", "n_tokens": 10, "kl_mean": 0.1, "first_evicted": 3,
                 "n_tokens_evicted": 7, "kl_mean_evicted": 1.5 + i / 10, "top1_agree_evicted": 0.5,
                 "dnll_mean_evicted": 0.1} for m in ("streamingllm", "vase-attnv") for b in (12, 32) for i in range(6)]
    return summary_rows(samples, fidelity, window=4)


@pytest.mark.parametrize("width", [80, 120])
def test_console_table_fits_the_terminal(width):
    rows = _demo_rows()
    out = _table_text(rows, width)
    lines = out.split("\n")
    table = lines[:next(i for i, line in enumerate(lines) if line.startswith("└")) + 1]
    assert max(len(line) for line in table) <= width
    # Every cell on one line: each interval appears whole, each row is one line of the table.
    for r in rows[1:]:
        cell = f"{r['d_acc_pct']:+.1f} [{r['d_acc_lo_pct']:+.1f}, {r['d_acc_hi_pct']:+.1f}]"
        assert sum(cell in line and f"{r['method']} " in line and f" {r['budget']} / 4 " in line
                   for line in table) == 1, (cell, out)
    assert "pass@1" in out and "batch tok/s" not in out and "--wide" in out
    if width >= 120:
        assert "KL after 1st" in out and "1.750 [" in out
    wide = _table_text(rows, 400, wide=True)
    assert "batch tok/s" in wide and "top-1 % after" in wide and "--wide" not in wide


def test_headers_name_the_reference(run_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # the console's width, whatever an earlier test in this process left
    summarize(run_dir, print_table=True, plots=False, reference=("snapkv", 24))
    out = capsys.readouterr().out
    md = (run_dir / "summary-vs-snapkv-24.md").read_text()
    assert "KV peak / snapkv:24" in md and "KV avg / snapkv:24" in md
    assert "KV avg / snapkv:24" in out and "/ full" not in out  # the console's default columns
    assert "KV peak / full" not in md
    assert "KV peak / full" in (run_dir / "summary.md").read_text()


def test_header_names_the_embedded_default_model(tmp_path):
    import json

    from vase.eval.report import run_header
    from vase.models import DEFAULT_GGUF_SHA256, DEFAULT_MODEL

    (tmp_path / "config.json").write_text(json.dumps({
        "config": {"task": "recall-3", "model": None, "limit": 16, "greedy": True, "temperature": 0.6},
        "identity": {"model": "default", "model_sha256": DEFAULT_GGUF_SHA256}}))
    line = run_header(tmp_path)
    assert f"model {DEFAULT_MODEL} (sha256 {DEFAULT_GGUF_SHA256[:12]})" in line and "None" not in line
    assert line.startswith("task recall-3") and "temperature" not in line  # greedy: no temperature


def test_cli_wide_flag(run_dir):
    from typer.testing import CliRunner

    from vase.cli import app

    # At 400 columns no header wraps, so a header missing from the output is a hidden column (at 100 columns
    # "batch tok/s" would be missing from the text even when shown, wrapped over two lines).
    default = CliRunner().invoke(app, ["summarize", str(run_dir)], env={"COLUMNS": "400"})
    wide = CliRunner().invoke(app, ["summarize", str(run_dir), "--wide"], env={"COLUMNS": "400"})
    narrow = CliRunner().invoke(app, ["summarize", str(run_dir)], env={"COLUMNS": "100"})
    assert default.exit_code == 0 and wide.exit_code == 0 and narrow.exit_code == 0, (default.output, wide.output)
    assert "batch tok/s" not in default.output and "9 more columns with --wide" in default.output
    assert "batch tok/s" in wide.output and "top-1 % after evict." in wide.output and "more columns" not in wide.output
    assert "pass@1" in narrow.output and "more columns with --wide" in narrow.output


def test_runner_keeps_the_noise_per_target(tmp_path):
    import vase
    from vase.eval.store import read_all

    model, tok = tiny_model_and_tokenizer()
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[24], window=8, samples=1, max_new_tokens=24,
                     fidelity=True, model="tiny", output_dir=str(tmp_path))
    run_dir = run_eval(cfg, model, tok, progress=False, forced_fn=vase.forced_log_probs)
    full = [r for r in read_all(run_dir, "fidelity") if r["method"] == "full"]
    for r in full:
        assert len(r["noise_kl_tokens"]) == r["n_tokens"] > 0
        mean = sum(r["noise_kl_tokens"]) / r["n_tokens"]
        assert mean == pytest.approx(r["noise_kl_mean"], rel=1e-3, abs=1e-15)
    rows = {(r["method"], r["budget"]): r for r in summarize(run_dir, print_table=False, plots=False)}
    assert rows[("snapkv", 24)]["kl_evicted"] > 0 and rows[("snapkv", 24)]["noise_kl_evicted"] is not None


def test_small_p_values_are_shown_not_rounded_to_zero_and_equal_rows_are_named_together():
    from vase.eval.cells import format_p
    from vase.eval.table import verdict_lines

    assert [format_p(p) for p in (1.2207e-4, 0.0156, 0.001, 0.25)] == ["1.2e-4", "0.016", "0.001", "0.250"]
    # 16 problems, two methods wrong on the same 14 where full is right: p = 2 / 2**14 = 1.2e-4 each.
    samples = [rec("full", None, f"p{i}", 0, True, 10, "1") for i in range(16)]
    samples += [rec(m, 50, f"p{i}", 0, i >= 14, 10, "1") for m in ("a", "b") for i in range(16)]
    rows = summary_rows(samples)
    lines = verdict_lines(rows)
    assert lines == ["less accurate than full (95% interval and exact paired test, p < 0.05): "
                     "a B=50, b B=50 (-88 pts, p = 1.2e-4)"]
    assert "0.000" not in conclusion(rows) and conclusion(rows) == lines[0] + "."


def test_piped_output_fits_columns_when_set_and_every_line_fits(monkeypatch, capsys):
    # `vase eval ... | tee log` with COLUMNS=120: not a terminal, but the width to fit is given; the verdict lines
    # are wrapped too (a 400-character line is no better than a wide table), and --wide is named for the rest.
    from vase.eval.report import print_table

    monkeypatch.setenv("COLUMNS", "120")
    print_table(_demo_rows(), title="t")
    out = capsys.readouterr().out
    assert max(len(line) for line in out.split("\n")) <= 120, out
    assert "more columns with --wide" in out and "\n- " in out
    monkeypatch.delenv("COLUMNS")
    print_table(_demo_rows(), title="t", wide=True)  # a log without COLUMNS: every column, not squeezed to 80
    assert max(len(line) for line in capsys.readouterr().out.split("\n")) > 120
