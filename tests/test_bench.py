"""`vase bench`: the runner's rows, the no-eviction flag, constant KV memory, the report files,
the random-shape models and the standalone GPU script (run tiny, on the CPU)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vase.bench import (
    CSV_COLUMNS,
    build_random_model,
    expected_evictions,
    print_table,
    read_csv,
    resolve_shape,
    run_bench,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
P, B, W = 8, 24, 8  # prompt, budget, window: the first eviction comes 25 tokens in, then one every 8


@pytest.fixture(scope="module")
def tiny():
    return build_random_model("tiny")


@pytest.fixture(scope="module")
def rows(tiny):
    # 8 new tokens: never evicts at B=24; 40 and 80 are past the first eviction, 40 tokens (5 windows) apart.
    return run_bench(tiny, ["vase-attnv"], [B], [8, 40, 80], [1], prompt_length=P, window=W, warmup=0, repeats=1,
                     segments=4)


def pick(rows, method, n):
    (row,) = [r for r in rows if r["method"] == method and r["new_tokens"] == n]
    return row


def test_rows_have_every_csv_column(rows):
    assert {(r["method"], r["new_tokens"]) for r in rows} == {
        (m, n) for m in ("full", "dynamic", "vase-attnv") for n in (8, 40, 80)}
    for row in rows:
        assert set(CSV_COLUMNS) <= set(row), set(CSV_COLUMNS) - set(row)
        assert row["tok_s"] > 0 and row["decode_s"] > 0 and row["step_ms"] > 0
        assert len(row["seg_tok_s"].split(";")) == 4
        assert row["peak_mem_bytes"] > 0 and row["mem_method"]
        assert row["model"] == "random:tiny" and row["batch"] == 1 and row["attn"] == "sdpa"
    full = pick(rows, "full", 80)
    assert full["vs_full"] == pytest.approx(1.0) and full["vs_dynamic"] > 0 and full["eviction_fired"] is None
    attnv = pick(rows, "vase-attnv", 80)
    assert attnv["evictions"] == attnv["expected_evictions"] == expected_evictions(P, 80, B, W) == 7
    # No schedule flag; a "rate fell" note is a timing reading (noisy on a shared machine), not checked here.
    assert attnv["eviction_fired"] is True
    assert all(note.startswith("rate fell after the first eviction") for note in attnv["flag"].split("; ") if note)
    assert attnv["vs_full"] == pytest.approx(attnv["tok_s"] / full["tok_s"])
    assert attnv["vs_dynamic"] == pytest.approx(attnv["tok_s"] / pick(rows, "dynamic", 80)["tok_s"])
    assert attnv["evict_ms"] > 0 and attnv["evict_step_ms"] == attnv["evict_step_ms"]  # measured, not NaN


def test_eviction_that_never_fired_is_flagged_not_a_speedup(rows):
    row = pick(rows, "vase-attnv", 8)
    assert row["evictions"] == 0 and row["expected_evictions"] == 0
    assert row["eviction_fired"] is False
    assert "never fired" in row["flag"]
    assert row["vs_full"] is None and row["vs_dynamic"] is None  # never reported as a speed-up
    from rich.console import Console

    console = Console(record=True, width=200)
    print_table([row], console)
    line = next(l for l in console.export_text().splitlines() if "vase-attnv" in l)
    assert "NO EVICTION" in line and "n/a" in line


def test_kv_bytes_flat_for_an_evicting_method_while_full_grows(rows):
    a40, a80 = pick(rows, "vase-attnv", 40), pick(rows, "vase-attnv", 80)
    assert a40["kv_bytes"] == a80["kv_bytes"] > 0
    assert a40["kv_bytes_alloc"] == a80["kv_bytes_alloc"]
    assert a40["stored_length"] == a80["stored_length"] <= B + W
    for ref in ("full", "dynamic"):
        r40, r80 = pick(rows, ref, 40), pick(rows, ref, 80)
        assert r80["kv_bytes"] > r40["kv_bytes"]
        assert r80["stored_length"] == P + 80 - 1  # the last new token is never fed back
    assert pick(rows, "full", 80)["kv_bytes"] == pick(rows, "dynamic", 80)["kv_bytes"]
    assert a80["kv_vs_full"] == pytest.approx(a80["kv_bytes"] / pick(rows, "full", 80)["kv_bytes"])


@pytest.mark.parametrize("last,flagged", [(9.4, True), (9.6, False)])
def test_a_bounded_row_whose_rate_falls_below_0_95_is_flagged(tiny, monkeypatch, last, flagged):
    """The flat-rate check: an evicting row whose last part runs below 0.95 x its first part after the first
    eviction is flagged, one at 0.96 is not, a faster fill phase before that eviction (the whole run's first part
    at 12) does not count, and the growing caches (full, dynamic) are never flagged for slowing down."""
    import vase.bench.runner as runner

    real = runner.run_one

    def run_one(*args, **kwargs):  # the real run, its part rates replaced: 10, 10, 10, `last` after the eviction
        out = real(*args, **kwargs)
        return {**out, "seg_tok_s": [12.0, 10.0, 10.0, last], "steady_tok_s": [10.0, 10.0, 10.0, last]}

    monkeypatch.setattr(runner, "run_one", run_one)
    got = run_bench(tiny, ["snapkv"], [B], [40], [1], prompt_length=P, window=W, warmup=0, repeats=1, segments=4)
    row = pick(got, "snapkv", 40)
    assert row["seg_ratio"] == pytest.approx(last / 12) and row["eviction_fired"]
    assert row["steady_ratio"] == pytest.approx(last / 10)
    assert ("rate fell after the first eviction (last/first part %.2f)" % (last / 10) in row["flag"]) is flagged
    assert "rate fell" not in pick(got, "full", 40)["flag"] + pick(got, "dynamic", 40)["flag"]


def test_steady_parts_start_after_the_first_eviction(tiny, monkeypatch):
    """run_one's steady_tok_s covers the steps after the first eviction only: with a clock under which every forward
    takes 10 ms until the cache has evicted and 20 ms after, the steady parts run at 50 tok/s, the whole run's first
    part faster; a cache that never evicts has no steady parts."""
    import vase.bench.runner as runner
    from vase.caches.eager import EvictionLayer

    clock = {"now": 0.0, "evicted": False}
    evict = EvictionLayer.evict

    def evict_and_note(self, *args, **kwargs):
        clock["evicted"] = True
        return evict(self, *args, **kwargs)

    def tick(module, args):
        clock["now"] += 0.02 if clock["evicted"] else 0.01

    monkeypatch.setattr(EvictionLayer, "evict", evict_and_note)
    monkeypatch.setattr(runner, "_now", lambda: clock["now"])
    handle = tiny.register_forward_pre_hook(tick)
    try:
        evicting = runner.run_one(tiny, "snapkv", B, 40, 1, P, W, segments=2)
        clock["evicted"] = False
        full = runner.run_one(tiny, "full", None, 40, 1, P, W, segments=2)
    finally:
        handle.remove()
    assert evicting["steady_tok_s"] == pytest.approx([50.0, 50.0])
    assert evicting["seg_tok_s"][0] > 55  # the fill steps (10 ms) are in the whole run's first part
    assert full["steady_tok_s"] == []


def test_flat_rate_range_is_the_spread_of_the_rounds_own_last_first_ratios(tiny, monkeypatch):
    """With repeats, seg_ratio is read from the median part rates and seg_ratio_lo..hi is the range of each round's
    own last/first ratio (a flat rate is told from noise by that range)."""
    import vase.bench.runner as runner

    real = runner.run_one
    lasts = iter([8.0, 8.0, 9.0, 9.0, 9.0, 12.0, 7.0, 7.0, 10.0])  # rounds of (full, dynamic, snapkv)

    def run_one(*args, **kwargs):
        out = real(*args, **kwargs)
        return {**out, "seg_tok_s": [10.0, 10.0, 10.0, next(lasts)]}

    monkeypatch.setattr(runner, "run_one", run_one)
    got = run_bench(tiny, ["snapkv"], [B], [40], [1], prompt_length=P, window=W, warmup=0, repeats=3, segments=4)
    row = pick(got, "snapkv", 40)
    assert (row["seg_ratio"], row["seg_ratio_lo"], row["seg_ratio_hi"]) == pytest.approx((1.0, 0.9, 1.2))
    full = pick(got, "full", 40)
    assert (full["seg_ratio"], full["seg_ratio_lo"], full["seg_ratio_hi"]) == pytest.approx((0.8, 0.7, 0.9))


def test_report_writes_csv_markdown_and_plots(rows, tmp_path):
    paths = write_report(rows, tmp_path, show=False)
    with paths["csv"].open() as f:
        header = next(csv.reader(f))
    assert header == CSV_COLUMNS
    back = read_csv(paths["csv"])
    assert len(back) == len(rows)
    assert back[0]["method"] == rows[0]["method"] and back[0]["tok_s"] == pytest.approx(rows[0]["tok_s"])
    assert any(r["eviction_fired"] is False for r in back)
    assert "NO EVICTION" in paths["md"].read_text()
    for name in ("throughput", "memory", "segments"):
        data = paths[name].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_run_bench_rejects_bad_arguments(tiny):
    with pytest.raises(ValueError):
        run_bench(tiny, ["vase-attnv"], [B], [1], [1])
    with pytest.raises(ValueError):
        run_bench(tiny, ["vase-attnv"], [], [16], [1])
    with pytest.raises(ValueError):
        run_bench(tiny, ["vase-attnv"], [B], [16], [1], repeats=0)


def test_run_bench_batch_and_budget_grid_leaves_model_as_found(tiny):
    impl = tiny.config._attn_implementation
    rows = run_bench(tiny, ["vase-dkv"], [16, 24], [48], [2], prompt_length=P, window=W, warmup=1, repeats=2,
                     include_dynamic=False, warmup_tokens=20, rank=8)  # a method parameter (not passed to full)
    assert [(r["method"], r["budget"]) for r in rows] == [("full", None), ("vase-dkv", 16), ("vase-dkv", 24)]
    assert all(r["batch"] == 2 and r["repeats"] == 2 for r in rows)
    assert rows[1]["evictions"] == expected_evictions(P, 48, 16, W) > rows[2]["evictions"] > 0
    assert rows[1]["kv_bytes"] < rows[2]["kv_bytes"] < rows[0]["kv_bytes"]
    assert tiny.config._attn_implementation == impl


def test_expected_evictions_schedule():
    assert expected_evictions(8, 25, 24, 8) == 0  # 24 fed tokens: the cache reaches B + w = 32 exactly
    assert expected_evictions(8, 26, 24, 8) == 1
    assert expected_evictions(8, 33, 24, 8) == 1
    assert expected_evictions(8, 34, 24, 8) == 2
    assert expected_evictions(100, 10, 24, 8) == 1  # a long prompt is cut down after w tokens
    assert expected_evictions(128, 4096, 512, 64) == 1 + (4095 - 448 - 1) // 64


def test_shapes_match_the_real_models():
    q4 = resolve_shape("qwen3-4b")
    assert (q4.hidden_size, q4.intermediate_size, q4.num_hidden_layers, q4.num_attention_heads,
            q4.num_key_value_heads, q4.head_dim, q4.vocab_size) == (2560, 9728, 36, 32, 8, 128, 151936)
    assert q4.rope_parameters["rope_theta"] == 1e6 and q4.max_position_embeddings == 40960
    q14 = resolve_shape("qwen3-14b", num_layers=2)
    assert (q14.hidden_size, q14.intermediate_size, q14.num_hidden_layers, q14.num_attention_heads) == (5120, 17408,
                                                                                                        2, 40)
    smol = resolve_shape("smollm2-135m")
    assert (smol.hidden_size, smol.num_hidden_layers, smol.num_attention_heads, smol.num_key_value_heads,
            smol.vocab_size, smol.tie_word_embeddings) == (576, 30, 9, 3, 49152, True)
    # Parameter counts of the published models (meta device: nothing is allocated).
    assert sum(p.numel() for p in build_random_model("qwen3-0.6b", device="meta").parameters()) == 596_049_920
    assert sum(p.numel() for p in build_random_model("smollm2-135m", device="meta").parameters()) == 134_515_008
    with pytest.raises(ValueError, match="unknown model shape"):
        resolve_shape("qwen9-1t")


def test_build_random_model_from_config_json(tmp_path):
    config = resolve_shape("tiny")
    config.to_json_file(tmp_path / "config.json")
    model = build_random_model(tmp_path / "config.json", num_layers=1, dtype="bfloat16")
    assert model.config.num_hidden_layers == 1 and next(model.parameters()).dtype == torch.bfloat16
    weights = [p for p in model.parameters() if p.dim() > 1]
    assert all(torch.isfinite(p).all() for p in weights)
    assert 0.01 < float(weights[1].detach().float().std()) < 0.03
    again = build_random_model(tmp_path, num_layers=1, dtype="bfloat16")  # the directory works too
    assert torch.equal(next(again.parameters()), next(model.parameters()))  # seeded


def test_gpu_bench_script_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--tiny", "--device", "cpu", "--new-tokens", "64",
         "--budget", "24", "--window", "8", "--batch", "2", "--prompt", "16", "--threads", "1"],
        check=False, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_csv(out / "bench.csv")
    assert [r["method"] for r in rows] == ["full", "dynamic", "rkv", "vase-attnv", "vase-dkv"]
    for r in rows:
        assert r["tok_s"] > 0 and r["new_tokens"] == 64 and r["batch"] == 2
        if r["method"] not in ("full", "dynamic"):
            assert r["budget"] == 24 and r["evictions"] == expected_evictions(16, 64, 24, 8) > 0
            assert r["eviction_fired"] is True and r["vs_full"] > 0 and r["vs_dynamic"] > 0
    md = (out / "bench.md").read_text()
    assert "vase-attnv B=24" in md and "Paper" in md
    env_info = json.loads((out / "env.json").read_text())
    assert env_info["shape"] == "tiny" and env_info["device"] == "cpu"
    assert (out / "throughput.png").is_file() and (out / "memory.png").is_file()
