"""`vase bench --engine vllm`: the pool arithmetic and report (no vLLM), and one tiny run where the pool is tight.

The run: 4 requests x 96 new tokens after 32-token prompts, 32-token blocks, a pool that holds 2 requests at
full length (8 blocks). Stock vLLM must preempt; vase-attnv at B=48, w=8 holds at most 2 blocks per request,
so all 4 fit at once and nothing is preempted. Numbers come from the engine (stat logger, worker counter).
"""

from __future__ import annotations

import csv
import importlib.util
import math

import pytest

from vase.bench.vllm_bench import (Step, VllmBenchRow, _time_mean, compare_to_ample, first_difference, pool_bytes,
                                   write_vllm_report)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here (pip install -e '.[vllm]')")

N, NEW, PROMPT, BS, B, W = 4, 96, 32, 32, 48, 8


def test_pool_bytes_holds_whole_requests_plus_the_null_block():
    bpt = 46080
    # 2 requests x ceil(128 / 32) = 8 blocks, + 1 null block, of 32 tokens each
    assert pool_bytes(2, 32, 96, 32, bpt) == 9 * 32 * bpt
    assert pool_bytes(0.25 * 16, 128, 2048, 128, bpt) == (4 * 17 + 1) * 128 * bpt


def test_pool_smaller_than_one_request_is_refused():
    with pytest.raises(ValueError, match="at least one request"):
        pool_bytes(0.5, 32, 96, 32, 46080)


def test_time_mean_weights_each_value_by_how_long_it_held():
    assert _time_mean([0.0, 1.0, 3.0], [4, 2, 0], 4.0) == pytest.approx((4 * 1 + 2 * 2 + 0 * 1) / 4)
    assert _time_mean([], [], 1.0) == 0.0


def test_first_difference_is_the_first_unequal_index():
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_outputs_are_compared_with_the_same_configuration_run_in_the_ample_pool():
    ample_full = _row("full", None, 1.0, [4], regime="ample", outputs=[[1, 2, 3], [4, 5, 6]])
    ample_vase = _row("vase-attnv", 48, 1.0, [4], regime="ample", outputs=[[1, 2, 3], [7, 8, 9]])
    tight_full = _row("full", None, 1.0, [4], outputs=[[1, 2, 3], [4, 0, 6]])
    squeeze_vase = _row("vase-attnv", 48, 1.0, [4], regime="squeeze", outputs=[[1, 2, 0], [0, 8, 9]])
    other_budget = _row("vase-attnv", 64, 1.0, [4], regime="squeeze", outputs=[[1, 2, 3], [7, 8, 9]])
    compare_to_ample([ample_full, ample_vase, tight_full, squeeze_vase, other_budget])
    assert (tight_full.same_as_ample, tight_full.first_diff_median) == (1, 2.0)  # identical (3) and 1
    assert (squeeze_vase.same_as_ample, squeeze_vase.first_diff_median) == (0, 1.0)  # 2 and 0
    assert ample_full.same_as_ample is None and other_budget.same_as_ample is None  # nothing to compare with


def _row(method, budget, seconds, running, regime="tight", outputs=()) -> VllmBenchRow:
    steps = [Step(t=0.5 * i, running=r, waiting=0, blocks=2 * r, preempted=0, tokens=r) for i, r in enumerate(running)]
    return VllmBenchRow(regime=regime, method=method, budget=budget, window=8, n_requests=4, prompt_len=32,
                        new_tokens=96, pool_bytes=1, pool_blocks=8, block_size=32, seconds=seconds, output_tokens=384,
                        tokens_per_s=384 / seconds, running_peak=max(running), running_mean=1.0, preemptions=0,
                        blocks_peak=2 * max(running), blocks_mean=1.0, evictions=None, engine_start_s=1.0,
                        timeline=steps, outputs=[list(o) for o in outputs])


def test_paired_rounds_alternate_and_take_each_ratio_within_its_round_and_regime():
    """Round r runs every configuration once (A, B, A, B, ...); a row's ratios are to stock vLLM of its own round and
    regime, and the summary is the median of those ratios with their range, not the ratio of the medians."""
    from vase.bench.vllm_bench import paired_rounds, paired_summary

    # per (regime, method): tok/s and seconds in rounds 0, 1, 2
    tok = {("tight", "full"): [10.0, 20.0, 30.0], ("tight", "vase-attnv"): [15.0, 22.0, 60.0],
           ("ample", "full"): [40.0, 40.0, 40.0], ("ample", "vase-attnv"): [36.0, 44.0, 40.0]}
    secs = {("tight", "full"): [10.0, 5.0, 4.0], ("tight", "vase-attnv"): [5.0, 4.0, 2.0],
            ("ample", "full"): [3.0, 3.0, 3.0], ("ample", "vase-attnv"): [3.0, 3.0, 3.0]}
    calls = []

    def run(regime, method, budget):
        k = sum(1 for c in calls if c[:2] == (regime, method))  # this configuration's round
        calls.append((regime, method, budget))
        r = _row(method, budget, secs[regime, method][k], [4], regime=regime, outputs=[[1, 2], [3, k]])
        r.tokens_per_s = tok[regime, method][k]
        return r

    configs = [("ample", "full", None), ("ample", "vase-attnv", 48), ("tight", "full", None), ("tight", "vase-attnv", 48)]
    rows = paired_rounds(configs, 3, run)
    assert calls == configs * 3  # alternating: every configuration once per round
    assert [r.round for r in rows] == [0] * 4 + [1] * 4 + [2] * 4
    tight_vase = [r for r in rows if r.regime == "tight" and r.method == "vase-attnv"]
    assert [r.vs_full_tok_s for r in tight_vase] == pytest.approx([1.5, 1.1, 2.0])  # within each round
    assert [r.vs_full_time for r in tight_vase] == pytest.approx([2.0, 1.25, 2.0])
    # each round's tight run compared with the same round's ample run (request 1's last token is the round)
    assert [r.same_as_ample for r in tight_vase] == [2, 2, 2]
    summary = {(s["regime"], s["method"]): s for s in paired_summary(rows)}
    s = summary["tight", "vase-attnv"]
    assert (s["vs_full_tok_s"], s["vs_full_tok_s_lo"], s["vs_full_tok_s_hi"]) == pytest.approx((1.5, 1.1, 2.0))
    assert (s["vs_full_time"], s["vs_full_time_lo"], s["vs_full_time_hi"]) == pytest.approx((2.0, 1.25, 2.0))
    assert s["tokens_per_s"] == 22.0 and s["repeats"] == 3 and s["seconds"] == 4.0
    a = summary["ample", "vase-attnv"]
    assert (a["vs_full_tok_s"], a["vs_full_tok_s_lo"], a["vs_full_tok_s_hi"]) == pytest.approx((1.0, 0.9, 1.1))
    assert summary["tight", "full"]["vs_full_tok_s"] is None  # the reference has no ratio to itself


def test_paired_summary_takes_the_worst_round_for_tokens_equal_to_the_ample_run():
    from vase.bench.vllm_bench import paired_rounds, paired_summary

    outs = {("ample", 0): [[1, 2], [3, 4]], ("tight", 0): [[1, 2], [3, 4]],
            ("ample", 1): [[1, 2], [3, 4]], ("tight", 1): [[1, 0], [3, 4]]}  # round 1: request 0 differs at 1
    seen: dict = {}

    def run(regime, method, budget):
        k = seen[regime] = seen.get(regime, -1) + 1
        return _row(method, budget, 1.0, [4], regime=regime, outputs=outs[regime, k])

    rows = paired_rounds([("ample", "vase-attnv", 48), ("tight", "vase-attnv", 48)], 2, run)
    tight = next(s for s in paired_summary(rows) if s["regime"] == "tight")
    assert (tight["same_as_ample"], tight["first_diff_median"]) == (1, 1.5)  # round 1's: 1 of 2, first diffs 1, 2


def test_report_writes_table_timeline_and_plot(tmp_path):
    rows = [_row("full", None, 10.0, [4, 2, 2]), _row("vase-attnv", 48, 5.0, [4, 4])]
    paths = write_vllm_report(rows, tmp_path)
    table = list(csv.DictReader(paths["csv"].open()))
    assert [r["method"] for r in table] == ["full", "vase-attnv"]
    timeline = list(csv.DictReader(paths["timeline"].open()))
    assert len(timeline) == 5 and {r["method"] for r in timeline} == {"full", "vase-attnv"}
    md = paths["md"].read_text()
    assert "| tight | vase-attnv | 48 |" in md and "76.80" in md  # 384 tokens / 5 s
    assert paths["png"].stat().st_size > 1000


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The run on the tiny random Llama (what is checked does not depend on the weights; SmolLM took 40 s here)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here")
    from tests.vllm_tiny import save_tiny_llama
    from vase.bench.vllm_bench import run_vllm_bench

    model = save_tiny_llama(str(tmp_path_factory.mktemp("bench-tiny")))
    got = run_vllm_bench(model, ["vase-attnv"], [B], n_requests=N, new_tokens=NEW, prompt_len=PROMPT, window=W,
                         pool_requests=2, block_size=BS, log=lambda *a: None)
    return {r.method: r for r in got}


@needs_vllm
def test_gpu_script_runs_tiny_on_cpu(tmp_path, rows):
    """benchmarks/gpu_vllm_bench.py at toy size: random weights from a config-only folder (vLLM's dummy loader)."""
    import importlib.util as iu
    from pathlib import Path

    spec = iu.spec_from_file_location("gpu_vllm_bench", Path(__file__).parents[1] / "benchmarks" / "gpu_vllm_bench.py")
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    rc = script.main(["--shape", "smollm2-135m", "--num-layers", "2", "--requests", "4", "--new-tokens", "48",
                      "--prompt", "16", "--budgets", "40", "--window", "8", "--block-size", "32", "--regimes", "tight",
                      "--out", str(tmp_path)])
    assert rc == 0
    table = list(csv.DictReader((tmp_path / "vllm_bench.csv").open()))
    assert [r["method"] for r in table] == ["full", "vase-attnv"]
    assert all(int(r["output_tokens"]) == 4 * 48 for r in table)
    assert (tmp_path / "vllm_bench.png").is_file() and (tmp_path / "meta.json").is_file()


@needs_vllm
def test_pool_is_the_requested_size(rows):
    for r in rows.values():
        assert r.block_size == BS and r.pool_blocks == 2 * math.ceil((PROMPT + NEW) / BS)
        assert r.output_tokens == N * NEW and r.tokens_per_s > 0
        assert [len(o) for o in r.outputs] == [NEW] * N  # every request's tokens, by its own id
        assert r.blocks_peak <= r.pool_blocks
        ts = [s.t for s in r.timeline]
        assert ts == sorted(ts) and ts[-1] <= r.seconds
        assert sum(s.tokens for s in r.timeline) == N * NEW  # the stat logger saw every output token


@needs_vllm
def test_stock_vllm_preempts_in_the_tight_pool(rows):
    full = rows["full"]
    assert full.preemptions > 0 and full.evictions is None
    assert full.recomputed_tokens is None  # stock vLLM does not count them


@needs_vllm
def test_bounded_requests_all_run_at_once_without_preemption(rows):
    from vase.core import schedule

    v = rows["vase-attnv"]
    assert v.preemptions == 0 and v.recomputed_tokens == 0
    assert v.running_peak == N
    assert v.blocks_peak <= N * math.ceil((B + W) / BS)
    # the plugin's worker counted one eviction event per request at every step the schedule says
    assert v.evictions == N * schedule.num_evictions(PROMPT, B, W, NEW - 1)
