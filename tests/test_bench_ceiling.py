"""The bench's ceiling: the traffic model counted by hand, the bandwidth probe, the eviction share and the
paired repeats (both under a fake clock), and the results file of `vase bench`."""

from __future__ import annotations

import math

import pytest
import torch

from vase.bench import build_random_model, run_bench
from vase.bench import runner as runner_mod
from vase.bench.bandwidth import probe_bandwidth
from vase.bench.paired import alternating, paired_ratio
from vase.bench.traffic import ModelBytes, decode_traffic, gain_share
from vase.caches.eager import EvictionLayer
from vase.core.policies import get_policy
from vase.storage.quantized import QuantBytes

# The tiny shape (tests, `vase.bench.shapes`): vocab 256, hidden 64, MLP 128, 2 layers, 4 query heads, 2 KV heads,
# head_dim 16, tied embedding, Qwen3 (q_norm and k_norm of head_dim), float32.
EMBED = 256 * 64
PER_LAYER = (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v, o
             + 3 * 64 * 128  # gate, up, down
             + 64 + 64 + 16 + 16)  # two RMSNorms, q_norm, k_norm
WEIGHTS = 4 * (EMBED + 2 * PER_LAYER + 64)  # + the final norm; the tied LM head is the embedding, read once
KV_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x layers x KV heads x head_dim x 4 bytes = 512
EMBED_ROW, LOGITS_ROW = 64 * 4, 256 * 4


@pytest.fixture(scope="module")
def tiny():
    return build_random_model("tiny")


@pytest.fixture(scope="module")
def sizes(tiny):
    return ModelBytes.from_model(tiny)


def test_model_bytes_counted_by_hand(sizes):
    assert WEIGHTS == 361_984
    assert sizes == ModelBytes(weights=WEIGHTS, embed_row=EMBED_ROW, kv_token=KV_TOKEN, logits_row=LOGITS_ROW)


def test_untied_embedding_is_read_by_rows_only():
    from transformers import Qwen3Config

    from vase.bench.shapes import SHAPES

    cfg = Qwen3Config(**{**SHAPES["tiny"][1], "tie_word_embeddings": False})
    m = ModelBytes.from_model(build_random_model(cfg))
    assert m.weights == WEIGHTS  # the LM head (256 x 64) is read whole; the input table is not counted
    assert m.embed_row == EMBED_ROW


def test_full_and_dynamic_traffic_by_hand(sizes):
    # P = 8, N = 5: steps j = 1..4 store L = 9, 10, 11, 12 (mean 10.5).
    full = decode_traffic(sizes, "full", prompt=8, new_tokens=5, batch=1)
    assert (full.weights, full.kv_read, full.kv_write, full.evict, full.logits) == (
        WEIGHTS + EMBED_ROW, 512 * 10.5, 512, 0, 2 * LOGITS_ROW)
    assert full.total == 361_984 + 256 + 5376 + 512 + 2048 == 370_176
    # DynamicCache: torch.cat reads the L - 1 it held and writes L, attention reads L.
    dyn = decode_traffic(sizes, "dynamic", prompt=8, new_tokens=5, batch=1)
    assert (dyn.kv_read, dyn.kv_write) == (512 * (10.5 + 9.5), 512 * 10.5)
    # Compiled full (transformers' StaticCache): every step reads all P + N = 13 slots.
    assert decode_traffic(sizes, "full", 8, 5, 1, compiled=True).kv_read == 512 * 13
    # Batch 2: the weights once, everything per row twice.
    two = decode_traffic(sizes, "full", 8, 5, 2)
    assert two.weights == WEIGHTS + 2 * EMBED_ROW and two.kv_read == 2 * 5376 and two.logits == 4 * LOGITS_ROW


def test_evicting_traffic_by_hand(sizes):
    # P = 8, B = 4, w = 2, N = 9 (8 steps). First limit max(8, 4) + 2 = 10: steps 1, 2 store 9, 10; the
    # eviction before step 3 leaves 4, then 5, 6, evict, 5, 6, ...: L = 9 10 5 6 5 6 5 6, sum 52.
    # Three evictions (before steps 3, 5, 7), each reads B + w = 6 tokens and writes B = 4.
    t = decode_traffic(sizes, "evicting", prompt=8, new_tokens=9, batch=1, budget=4, window=2)
    assert t.kv_read == 512 * 52 / 8
    assert t.kv_write == 512
    assert t.evict == 3 * 512 * (6 + 4) / 8
    assert t.total == WEIGHTS + EMBED_ROW + 3328 + 512 + 1920 + 2048
    # Compiled (vase.caches.static): all B + w = 6 slots every step.
    assert decode_traffic(sizes, "evicting", 8, 9, 1, budget=4, window=2, compiled=True).kv_read == 512 * 6


def test_quantized_traffic_by_hand(tiny, sizes):
    # 8 bits, group 16 (= head_dim): K codes 16 B + scale and zero 2 x 2 B = 20 B, V the same, a 2-byte slot tag
    # (int16, the narrowest tag): 42 B per (token, KV head). Full precision: (16 + 16) x 4 + tag 2 + rank 4 = 134 B.
    # flush_every 1, guard 1, w 2: 3 entries in full precision once L >= 3, so per row and step
    # held(L) = 2 layers x 2 heads x (3 x 134 + (L - 3) x 42) = 1104 + 168 L.
    quant = QuantBytes.for_model(tiny, get_policy("snapkv"), 4, 2, {"kv_bits": 8, "quant_guard": 1, "flush_every": 1})
    t = decode_traffic(sizes, "evicting", prompt=8, new_tokens=9, batch=1, budget=4, window=2, quant=quant)
    assert t.kv_read == (8 * 1104 + 168 * 52) / 8
    assert t.kv_write == 512 + 2 * 2 * 42  # the new token in full precision, its codes when flushed
    assert t.evict == 3 * ((1104 + 168 * 6) + (1104 + 168 * 4)) / 8
    with pytest.raises(ValueError, match="evicting caches only"):
        decode_traffic(sizes, "full", 8, 9, 1, quant=quant)


def test_issue_figures_for_smollm2_shapes():
    # SmolLM2-135M in float32, counted by hand: 49152 x 576 tied embedding, 30 layers of q, o 576 x 576, k, v 576 x 192,
    # MLP 3 x 576 x 1536, two norms; the final norm. K/V per token: 2 x 30 layers x 3 heads x 64 x 4 = 46,080 B.
    params = 49152 * 576 + 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
    m = ModelBytes(weights=4 * params, embed_row=576 * 4, kv_token=46_080, logits_row=49152 * 4)
    assert 4 * params == 538_060_032  # "about 540 MB"
    full = decode_traffic(m, "full", prompt=128, new_tokens=4096, batch=4)
    bounded = decode_traffic(m, "evicting", prompt=128, new_tokens=4096, batch=4, budget=512, window=64)
    assert full.kv_read / 1e9 == pytest.approx(0.40, abs=0.005)  # 4 x 46,080 x (128 + 4096 / 2) on average
    assert bounded.kv_read / 1e9 == pytest.approx(0.100, abs=0.005)  # about B + w / 2 tokens per row
    assert full.total / bounded.total == pytest.approx(1.47, abs=0.01)


def test_model_bytes_of_a_real_shape_match_the_hand_count():
    m = ModelBytes.from_model(build_random_model("smollm2-135m", num_layers=2))
    params = 49152 * 576 + 2 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
    assert (m.weights, m.kv_token) == (4 * params, 2 * 2 * 3 * 64 * 4)


def test_gain_share():
    assert gain_share(1.5, 2.0) == 0.5
    assert gain_share(1.0, 1.2) == 0.0
    assert gain_share(1.04, 1.005) is None  # a ceiling that allows nothing has no share
    assert gain_share(None, 2.0) is None and gain_share(1.2, None) is None


def test_bandwidth_probe_under_a_fake_clock():
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # three runs: 0.5 s, 0.25 s, 1 s; the fastest counts
    bw = probe_bandwidth("cpu", mib=4, repeats=3, clock=lambda: next(ticks))
    assert bw == 4 * (1 << 20) / 0.25
    real = probe_bandwidth("cpu", mib=64, repeats=2)
    assert 1e8 < real < 1e13  # a real machine: between 0.1 GB/s and 10 TB/s


def test_alternating_and_paired_ratio():
    assert list(alternating("AB", 3)) == [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B")]
    assert paired_ratio([2.0, 2.0, 8.0], [1.0, 2.0, 4.0]) == (2.0, 1.0, 2.0)
    assert paired_ratio([1.0, math.nan], [2.0, 1.0]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="one value per round"):
        paired_ratio([1.0], [1.0, 2.0])


class FakeClock:
    """Time that moves only when the model runs a forward (by `step` seconds) or a layer evicts (by `evict`)."""

    def __init__(self):
        self.now = 0.0
        self.step = 0.0
        self.evict = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(tiny, monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(runner_mod, "_now", fake)
    handle = tiny.register_forward_pre_hook(lambda *_: setattr(fake, "now", fake.now + fake.step))
    yield fake
    handle.remove()


def test_eviction_share_from_the_timings(tiny, clock, monkeypatch):
    original = EvictionLayer.evict

    def slow_evict(self, due):
        clock.now += clock.evict
        return original(self, due)

    monkeypatch.setattr(EvictionLayer, "evict", slow_evict)
    clock.step, clock.evict = 0.01, 0.25
    rows = run_bench(tiny, ["vase-attnv"], [24], [40], [1], prompt_length=8, window=8, warmup=0, repeats=1,
                     include_dynamic=False, bandwidth=None)
    row = next(r for r in rows if r["method"] == "vase-attnv")
    # Two evictions (steps 24 and 32 of 39), each of 2 layers at 0.25 s: 1 s of 39 x 0.01 + 1 s of decoding.
    assert row["evictions"] == 2
    assert row["evict_ms"] == pytest.approx(1000 * 2 * 0.25)
    assert row["decode_s"] == pytest.approx(39 * 0.01 + 1.0)
    assert row["evict_share"] == pytest.approx(1.0 / 1.39)
    full = next(r for r in rows if r["method"] == "full")
    assert full["evict_share"] is None or math.isnan(full["evict_share"])
    assert full["tok_s"] == pytest.approx(1 / 0.01)


def test_paired_repeats_alternate_and_take_the_median_of_the_round_ratios(tiny, clock, monkeypatch):
    # Seconds per step of each configuration in each round: the median of the round ratios (2, 1, 2 -> 2) is not
    # the ratio of the median rates (1/2 over 1/2 -> 1), so the test tells the two apart.
    per_round = {"full": [0.001, 0.002, 0.004], "dynamic": [0.001, 0.001, 0.001], "vase-attnv": [0.0005, 0.002, 0.002]}
    order: list[str] = []
    real_run_one = runner_mod.run_one

    def run_one(model, method, *args, **kwargs):
        clock.step = per_round[method][sum(m == method for m in order)]
        order.append(method)
        return real_run_one(model, method, *args, **kwargs)

    monkeypatch.setattr(runner_mod, "run_one", run_one)
    rows = run_bench(tiny, ["vase-attnv"], [24], [40], [1], prompt_length=8, window=8, warmup=0, repeats=3,
                     bandwidth=2e9)
    assert order == ["full", "dynamic", "vase-attnv"] * 3  # A, B, C, A, B, C, A, B, C
    row = next(r for r in rows if r["method"] == "vase-attnv")
    assert [float(v) for v in row["tok_s_runs"].split(";")] == pytest.approx([2000, 500, 500])
    assert (row["vs_full"], row["vs_full_lo"], row["vs_full_hi"]) == pytest.approx((2.0, 1.0, 2.0))
    assert (row["vs_dynamic"], row["vs_dynamic_lo"], row["vs_dynamic_hi"]) == pytest.approx((0.5, 0.5, 2.0))
    # The ceiling beside each ratio, from the traffic model, and the share of its gain.
    full = next(r for r in rows if r["method"] == "full")
    dyn = next(r for r in rows if r["method"] == "dynamic")
    assert row["ceiling_vs_full"] == pytest.approx(full["bytes_step"] / row["bytes_step"])
    assert row["ceiling_vs_dynamic"] == pytest.approx(dyn["bytes_step"] / row["bytes_step"])
    expected = decode_traffic(ModelBytes.from_model(tiny), "evicting", 8, 40, 1, budget=24, window=8).total
    assert row["bytes_step"] == expected
    # The tiny model's K/V is small beside its weights: the traffic allows 0.2 %, too little to share.
    assert 1 < row["ceiling_vs_full"] < 1.01 and row["gain_vs_full"] is None
    # Roofline at 2 GB/s: the fastest rate the bytes allow, and the share of it reached (tok_s is the median, 500).
    assert row["bandwidth_gbs"] == 2.0
    assert row["roofline_tok_s"] == pytest.approx(2e9 / expected)
    assert row["roofline_share"] == pytest.approx(500 / (2e9 / expected))


def test_cli_writes_results_with_provenance_and_flat_rows(tmp_path, capsys):
    from vase.cli import main
    from vase.files.provenance import read_results

    results = tmp_path / "results" / "bench.json"
    with pytest.raises(SystemExit) as done:
        main(["bench", "--random-init", "tiny", "--methods", "vase-attnv", "--budgets", "24", "--window", "8",
              "--lengths", "40", "--prompt-length", "8", "--warmup", "0", "--repeats", "2", "--no-dynamic",
              "--bandwidth", "2", "--out", str(tmp_path / "out"), "--results", str(results)])
        raise SystemExit(0)
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    record, rows = read_results(results)
    # the vase command as given, not the process's argv (pytest's here)
    assert record["command"].startswith("vase bench --random-init tiny") and record["threads"] >= 1 and "loadavg_1m_after" in record["machine"]
    assert (tmp_path / "out" / "bench.csv").is_file()  # the CSV stays
    assert {r["method"] for r in rows} == {"full", "vase-attnv"}
    for row in rows:  # one flat dict per table row: a renderer reads cells, never nested structures
        assert all(v is None or isinstance(v, (str, int, float, bool)) for v in row.values()), row
        assert row["bandwidth_gbs"] == 2.0 and row["bytes_step"] > 0 and len(row["tok_s_runs"].split(";")) == 2
    row = next(r for r in rows if r["method"] == "vase-attnv")
    assert row["vs_full_lo"] <= row["vs_full"] <= row["vs_full_hi"] and row["ceiling_vs_full"] > 1
    assert 0 < row["evict_share"] < 1
    assert "ceiling" in out and "bandwidth 2.0 GB/s" in out


def test_cli_layers_cuts_the_random_shape(tmp_path, capsys):
    from vase.cli import main
    from vase.files.provenance import read_results

    kv = {}
    for layers in (None, 1):
        results = tmp_path / f"bench-{layers}.json"
        with pytest.raises(SystemExit) as done:
            main(["bench", "--random-init", "tiny", "--methods", "vase-attnv", "--budgets", "24", "--window", "8",
                  "--lengths", "40", "--prompt-length", "8", "--warmup", "0", "--no-dynamic", "--bandwidth", "0",
                  "--out", str(tmp_path / "out"), "--results", str(results)] + (["--layers", "1"] if layers else []))
            raise SystemExit(0)
        assert done.value.code == 0, capsys.readouterr().out
        _, rows = read_results(results)
        kv[layers] = next(r for r in rows if r["method"] == "full")["kv_bytes_full"]
    assert kv[1] * 2 == kv[None] > 0  # the tiny shape has 2 layers: one layer holds half the K/V


def test_cpu_clock_times_steps_and_evictions_and_needs_one_thread(tiny, monkeypatch):
    fake = FakeClock()

    def wall():
        raise AssertionError("the wall clock was read under clock='cpu'")

    monkeypatch.setattr(runner_mod, "_now", wall)
    monkeypatch.setattr(runner_mod, "_cpu_now", fake)
    handle = tiny.register_forward_pre_hook(lambda *_: setattr(fake, "now", fake.now + 0.02))
    # The thread count the check reads, set through torch's getter: once a vLLM CPU engine has run in this process
    # (the suite's workers share processes between files), torch.set_num_threads is a no-op.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    try:
        rows = run_bench(tiny, ["vase-attnv"], [24], [40], [1], prompt_length=8, window=8, warmup=0, repeats=1,
                         include_dynamic=False, bandwidth=None, clock="cpu")
        assert {r["clock"] for r in rows} == {"cpu"}
        assert all(r["tok_s"] == pytest.approx(1 / 0.02) for r in rows)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        with pytest.raises(ValueError, match="one torch thread"):
            run_bench(tiny, ["vase-attnv"], [24], [40], [1], prompt_length=8, window=8, warmup=0, repeats=1,
                      include_dynamic=False, bandwidth=None, clock="cpu")
    finally:
        handle.remove()


def test_add_ratios_puts_the_ceiling_and_gain_share_beside_the_paired_ratio():
    from vase.bench import add_ratios

    def row(method, bytes_step, runs):
        return {"method": method, "batch": 1, "new_tokens": 64, "compiled": False, "eviction_fired": True if method
                == "snapkv" else None, "tok_s": sorted(runs)[len(runs) // 2], "tok_s_runs": ";".join(map(str, runs)),
                "bytes_step": bytes_step, "kv_bytes": 10}

    full, dyn = row("full", 200.0, [1.0, 2.0, 1.0]), row("dynamic", 300.0, [1.0, 1.0, 1.0])
    mine = row("snapkv", 100.0, [1.5, 2.4, 1.2])  # rounds over full: 1.5, 1.2, 1.2
    add_ratios([full, dyn, mine])
    assert (mine["vs_full"], mine["vs_full_lo"], mine["vs_full_hi"]) == pytest.approx((1.2, 1.2, 1.5))
    assert mine["ceiling_vs_full"] == 2.0 and mine["gain_vs_full"] == pytest.approx(0.2)
    assert mine["ceiling_vs_dynamic"] == 3.0 and mine["gain_vs_dynamic"] == pytest.approx((1.5 - 1) / 2)
    # One round each (or unequal counts): the ratio of the rates, as before pairing.
    one = row("snapkv", 100.0, [3.0])
    add_ratios([row("full", 200.0, [2.0]), one])
    assert one["vs_full"] == 1.5 and one["gain_vs_full"] == pytest.approx(0.5)


@pytest.mark.parametrize("extra, says", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--results", "/"], "--results must name a file"),
    (["--clock", "foo"], "--clock must be wall or cpu, got 'foo'"),
    (["--engine", "vllm", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--engine", "vllm", "--clock", "cpu"], "--clock is for the transformers engine's bench only"),
    (["--engine", "vllm", "--bandwidth", "5"], "--bandwidth is for the transformers engine's bench only"),
    (["--engine", "vllm", "--results", "/"], "--results must name a file"),
])
def test_bench_flags_refused_in_one_line_before_a_model_loads(extra, says, capsys, monkeypatch, tmp_path):
    """A bad value, or a flag the chosen engine would drop, is one line naming the flag (no model, no engine)."""
    from tests.conftest import run_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("vase.bench.runner.run_bench", lambda *a, **k: pytest.fail("the bench started"))
    monkeypatch.setattr("vase.bench.vllm_bench.cli_bench", lambda *a, **k: pytest.fail("the vLLM bench started"))
    # --random-init is the transformers engine's too (refused beside --engine vllm in its own line)
    model = [] if "vllm" in extra else ["--random-init", "tiny"]
    code, _, err = run_main(["bench", *model, "--methods", "snapkv", "--budgets", "24", "--window", "8", "--lengths",
                             "16", *extra], capsys)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("vase: warning")]
    assert code != 0 and len(lines) == 1 and says in lines[0], err


def test_vllm_bench_takes_repeats_and_a_results_file(capsys, monkeypatch, tmp_path):
    """--repeats and --results reach the vLLM bench (paired rounds, its own results file), not dropped."""
    from tests.conftest import run_main

    got = {}

    def cli_bench(*args, **kwargs):
        got.update(kwargs)
        return {}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("vase.bench.vllm_bench.cli_bench", cli_bench)
    code, _, err = run_main(["bench", "--engine", "vllm", "--methods", "vase-attnv", "--budgets", "24", "--window",
                             "8", "--lengths", "16", "--repeats", "3", "--results", "r.json"], capsys)
    assert code == 0, err
    assert got["repeats"] == 3 and str(got["results"]) == "r.json" and "--repeats 3" in " ".join(got["command"])


# -- hybrid and mixture-of-experts models (tests/hybrid_models.py: float64, hidden 64, 2 KV heads of 16) -----------

def test_moe_reads_only_the_experts_a_step_is_routed_to():
    from dataclasses import replace

    from .hybrid_models import hybrid_model

    m = ModelBytes.from_model(hybrid_model("gpt-oss"))  # 4 layers, 4 experts, 2 per token, MLP 32
    per_layer = (4 * 64 * 2 * 32 + 4 * 2 * 32  # gate_up [E, hidden, 2 x MLP] and its bias
                 + 4 * 32 * 64 + 4 * 64)  # down [E, MLP, hidden] and its bias; the router is dense
    assert m.expert_weights == 4 * per_layer * 8 and m.expert_fraction == 0.5
    assert m.weights_read(1) == m.weights - m.expert_weights / 2  # 2 of 4 experts
    assert m.weights_read(2) == m.weights - m.expert_weights / 4  # 1 - (1 - 1/2)^2 = 3/4 of them
    assert decode_traffic(m, "full", 8, 5, 2).weights == m.weights_read(2) + 2 * m.embed_row
    # Qwen3-Next: gate_up [E, 2 x 32, hidden] and down [E, hidden, 32] per layer; the shared expert and the router
    # (gate) are read every step
    nxt = ModelBytes.from_model(hybrid_model("qwen3-next"))
    assert (nxt.expert_weights, nxt.expert_fraction) == (4 * 4 * (64 * 64 + 64 * 32) * 8, 0.5)
    dense = ModelBytes.from_model(hybrid_model("qwen3.5"))
    assert (dense.expert_weights, dense.weights_read(3)) == (0, dense.weights)
    # the same model counted as dense reads every expert: a lower ceiling than the routed count
    full, bounded = (decode_traffic(m, k, 8, 40, 1, budget=8, window=4) for k in ("full", "evicting"))
    as_dense = replace(m, expert_weights=0)
    full_d, bounded_d = (decode_traffic(as_dense, k, 8, 40, 1, budget=8, window=4) for k in ("full", "evicting"))
    assert full.total / bounded.total > full_d.total / bounded_d.total


def test_sliding_layers_and_recurrent_states_cost_every_cache_the_same():
    from dataclasses import replace

    from .hybrid_models import hybrid_model

    # Gemma 3: 3 sliding layers (window 8: 7 tokens held) and 1 full-attention layer; K/V of one token in one
    # layer 2 x 2 heads x 16 x 8 bytes = 512.
    g = ModelBytes.from_model(hybrid_model("gemma3"))
    assert (g.kv_token, g.sliding_token, g.sliding_held, g.state) == (512, 3 * 512, 7, 0)
    # P = 4, N = 6: before steps j = 1..5 the sliding layers hold min(7, 4 + j - 1) = 4, 5, 6, 7, 7 tokens
    full = decode_traffic(g, "full", prompt=4, new_tokens=6, batch=2)
    assert full.kv_read == 2 * (512 * (5 + 6 + 7 + 8 + 9) / 5 + 1536 * (4 + 5 + 6 + 7 + 7) / 5)
    assert full.kv_write == 2 * (512 + 1536)
    plain = replace(g, sliding_token=0, sliding_held=0)
    for kind in ("dynamic", "evicting"):
        with_layers = decode_traffic(g, kind, 4, 6, 2, budget=2, window=1)
        without = decode_traffic(plain, kind, 4, 6, 2, budget=2, window=1)
        assert with_layers.kv_read - without.kv_read == pytest.approx(2 * 1536 * 29 / 5)
        assert with_layers.kv_write - without.kv_write == 2 * 1536
    # Qwen3.5: 3 linear-attention layers; each state: conv (2 x 2 x 8 + 4 x 8) x kernel 4 in float64, and the
    # recurrent [4 value heads, 8, 8] in float32.
    q = ModelBytes.from_model(hybrid_model("qwen3.5"))
    assert (q.sliding_token, q.state) == (0, 3 * (64 * 4 * 8 + 4 * 8 * 8 * 4))
    t = decode_traffic(q, "full", prompt=4, new_tokens=6, batch=1)
    t0 = decode_traffic(replace(q, state=0), "full", prompt=4, new_tokens=6, batch=1)
    assert (t.kv_read - t0.kv_read, t.kv_write - t0.kv_write) == (q.state, q.state)


def test_meta_device_shapes_count_as_built_ones():
    """benchmarks/hybrid_ceilings.py counts shapes too large to build on the meta device: same bytes as built."""
    from .hybrid_models import hybrid_config

    for cfg in ("tiny", hybrid_config("gpt-oss"), hybrid_config("gemma3"), hybrid_config("qwen3.5")):
        kwargs = {"attn_implementation": "eager"}
        built = ModelBytes.from_model(build_random_model(cfg, **kwargs))
        assert ModelBytes.from_model(build_random_model(cfg, device="meta", **kwargs)) == built


def test_gpt_oss_20b_reads_its_published_active_parameters():
    # OpenAI's model card: gpt-oss-20b has 21B parameters, 3.6B active per token (4 of 32 experts).
    model = build_random_model("gpt-oss-20b", dtype=torch.bfloat16, device="meta", attn_implementation="eager")
    total = sum(p.numel() for p in model.parameters())
    active = ModelBytes.from_model(model).weights_read(1) / 2  # bfloat16: 2 bytes a parameter
    assert 20.5e9 < total < 21.5e9
    # 3.61B: the routed 4 of 32 experts, attention, router and LM head; the untied input table is read by rows,
    # as the card's active count leaves the embedding out
    assert 3.5e9 < active < 3.7e9, active
