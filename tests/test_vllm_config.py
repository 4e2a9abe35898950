"""The plugin's config and per-request stats: pure code, no vLLM needed."""

import pytest
import torch

from vase.core import schedule
from vase.vllm import VaseConfigError, VaseVllmConfig, additional_config, max_blocks, request_stats


def test_additional_config_round_trips_and_keeps_method_params():
    extra = additional_config("vase-attnv", 128, 32, n_large=16, seed=3)
    cfg = VaseVllmConfig.from_additional_config(extra)
    assert (cfg.method, cfg.budget, cfg.window, cfg.seed, cfg.params) == ("vase-attnv", 128, 32, 3, {"n_large": 16})
    assert cfg.policy.n_large == 16 and cfg.policy.sample
    assert VaseVllmConfig.from_additional_config({}) is None
    assert VaseVllmConfig.from_additional_config({"other": 1}) is None


@pytest.mark.parametrize("section, fragment", [
    ({"method": "snapkvv", "budget": 128}, "unknown method 'snapkvv'"),
    ({"method": "snapkv", "budget": 128, "bogus": 1}, "no parameter 'bogus'"),
    ({"method": "vase-attnv", "budget": 36, "window": 32}, "budget (36) must be larger than window + protected sinks"),
    ({"method": "snapkv", "budget": "128"}, "vase config: budget must be an integer, got '128' (str)"),
    ({"method": "snapkv", "budget": 128, "window": 0}, "window must be a positive"),
    ({"method": "full", "budget": 128}, "does not evict"),
    ({"budget": 128}, 'needs "method" and "budget"'),
    ("snapkv", "must be a mapping"),
])
def test_bad_config_is_one_line_naming_the_value(section, fragment):
    with pytest.raises(VaseConfigError) as info:
        VaseVllmConfig.from_additional_config({"vase": section})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_request_stats_follow_the_schedule():
    cfg = VaseVllmConfig("snapkv", budget=128, window=32)
    bs = 32
    # Before the first eviction: everything is stored, blocks as stock vLLM.
    s = request_stats(cfg, prompt_len=50, n_generated=100, block_size=bs, kv_bytes_per_token=10)
    assert (s.evictions, s.stored_tokens, s.seen_tokens, s.blocks, s.blocks_full) == (0, 149, 149, 5, 5)
    assert s.kv_bytes == s.kv_bytes_full == 1490
    for n in range(2, 1200, 7):  # after it: at most ceil((B + w) / bs) blocks, stored = schedule's physical length
        s = request_stats(cfg, 50, n, bs)
        assert s.stored_tokens == schedule.physical_length(50, 128, 32, n - 1)
        assert s.evictions == schedule.num_evictions(50, 128, 32, n - 1)
        assert s.tokens_evicted == s.seen_tokens - s.stored_tokens
        assert s.blocks <= (max_blocks(cfg, bs) if s.evictions else s.blocks_full)
    assert max_blocks(cfg, bs) == 5
    # A prompt longer than B is kept whole until the first eviction.
    assert request_stats(cfg, 300, 20, bs).stored_tokens == 319
    assert request_stats(cfg, 300, 34, bs).stored_tokens == 129


def test_other_vllm_versions_are_refused():
    from vase.vllm.plugin import check_vllm_version

    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3")
    for version in ("0.33.0", "0.31.2", "0.320.0", "1.0.0"):
        with pytest.raises(VaseConfigError, match=f"supports vLLM 0.32.x, found {version}"):
            check_vllm_version(version)


# -- refusals on the built VllmConfig and per attention layer (stand-ins; the engine tests build real ones) ----
def _built(**over):
    from types import SimpleNamespace as NS

    hf = NS(model_type="llama")
    cfg = NS(model_config=NS(model="m", hf_config=hf, hf_text_config=hf), cache_config=NS(cache_dtype="auto"),
             kv_transfer_config=None, use_v2_model_runner=False, watermark_config=None,
             attention_config=NS(hisparse_config=None),
             parallel_config=NS(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1))
    for path, value in over.items():
        target = cfg
        *head, last = path.split(".")
        for part in head:
            target = getattr(target, part)
        setattr(target, last, value)
    return cfg


def test_a_plain_built_config_passes():
    from vase.vllm.refusals import check_built_config

    check_built_config(_built(), env={})


@pytest.mark.parametrize("over, env, fragment", [
    ({"model_config.hf_config": __import__("types").SimpleNamespace(model_type="bloom")}, {}, "ALiBi"),
    ({"model_config.hf_text_config": __import__("types").SimpleNamespace(model_type="mpt",
                                                                          attn_config={"alibi": True})}, {}, "ALiBi"),
    ({"model_config.hf_text_config": __import__("types").SimpleNamespace(model_type="falcon", alibi=True)}, {},
     "ALiBi"),
    ({"cache_config.cache_dtype": "int8_per_token_head"}, {}, "KV cache dtype resolved to int8_per_token_head"),
    ({"kv_transfer_config": object()}, {}, "drop kv_transfer_config"),
    ({"use_v2_model_runner": True}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "because VLLM_USE_V2_MODEL_RUNNER=1: set "
                                                                       "VLLM_USE_V2_MODEL_RUNNER=0"),
    ({"use_v2_model_runner": True}, {}, "because vLLM picks it by default on this platform"),
    ({"use_v2_model_runner": True, "watermark_config": object()}, {"VLLM_USE_V2_MODEL_RUNNER": "0"},
     "because watermark_config is set"),
    ({"parallel_config.data_parallel_size": 2, "model_config.is_moe": True}, {},
     "data_parallel_size > 1 for dense models only: m is an MoE model"),
])
def test_settings_that_give_wrong_tokens_are_refused_in_one_line(over, env, fragment):
    from vase.vllm.refusals import check_built_config

    with pytest.raises(VaseConfigError) as info:
        check_built_config(_built(**over), env=env)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_tensor_parallelism_is_accepted_on_the_built_config():
    """TP > 1 runs (tests/test_vllm_tp.py: TP = 2 keeps and generates what TP = 1 does)."""
    from vase.vllm.refusals import check_built_config

    check_built_config(_built(**{"parallel_config.tensor_parallel_size": 2}), env={})


def test_pipeline_parallelism_is_accepted_on_the_built_config():
    """PP > 1 runs on the CPU worker (tests/test_vllm_pp.py: PP = 2 keeps and generates what PP = 1 does); the GPU
    worker refuses it (tests/test_vllm_gpu_worker.py)."""
    from vase.vllm.refusals import check_built_config

    check_built_config(_built(**{"parallel_config.pipeline_parallel_size": 2}), env={})


def test_data_parallelism_of_a_dense_model_is_accepted_on_the_built_config():
    """DP > 1 of a dense model runs: vLLM makes each rank an independent engine core (tests/test_vllm_dp.py: DP = 2
    keeps and generates what DP = 1 does); an MoE model's lockstep ranks stay refused (above)."""
    from vase.vllm.refusals import check_built_config

    check_built_config(_built(**{"parallel_config.data_parallel_size": 2, "model_config.is_moe": False}), env={})


@pytest.mark.parametrize("attrs, fragment", [
    ({"alibi_slopes": [0.5, 0.25]}, "has ALiBi slopes"),
    ({"kv_cache_dtype": "int8_per_token_head"}, "stores its KV cache as int8_per_token_head"),
    ({"sliding_window": 128}, "uses a sliding window"),
])
def test_attention_layers_that_would_read_evicted_slots_wrongly_are_refused(attrs, fragment):
    from types import SimpleNamespace as NS

    from vase.vllm.refusals import check_attention_layer, check_kv_tensor

    plain = dict(alibi_slopes=None, kv_cache_dtype="auto", sliding_window=-1)
    check_attention_layer("model.layers.0.self_attn.attn", NS(**plain), "float32")
    with pytest.raises(VaseConfigError) as info:
        check_attention_layer("model.layers.0.self_attn.attn", NS(**{**plain, **attrs}), "float32")
    assert fragment in str(info.value) and "model.layers.0" in str(info.value) and "\n" not in str(info.value)
    check_kv_tensor("l0", "float32", "float32")
    with pytest.raises(VaseConfigError, match="got a uint8 KV cache for a float32 model"):
        check_kv_tensor("l0", "uint8", "float32")


def test_fp8_e5m2_is_refused_in_one_line_until_compared_end_to_end():
    """e5m2 is decoded (its kernel bytes are tested in tests/test_vllm_fp8.py) but its eviction was never compared
    with the transformers engine (the CPU kernel stores fp8 only on AVX-512/AMX): refused where the engine args
    are read and on the built config, naming the format to use."""
    from vase.vllm.plugin import check_cache_dtype
    from vase.vllm.refusals import check_built_config

    for check in (lambda: check_cache_dtype("fp8_e5m2"),
                  lambda: check_built_config(_built(**{"cache_config.cache_dtype": "fp8_e5m2"}), env={})):
        with pytest.raises(VaseConfigError, match="kv_cache_dtype='fp8_e5m2' .* use kv_cache_dtype='fp8'") as info:
            check()
        assert "\n" not in str(info.value)
    check_cache_dtype("fp8")
    from types import SimpleNamespace as NS

    from vase.vllm.refusals import check_attention_layer

    with pytest.raises(VaseConfigError, match="stores its KV cache as fp8_e5m2.*one of fp8, fp8_e4m3 "):
        check_attention_layer("l0", NS(alibi_slopes=None, kv_cache_dtype="fp8_e5m2", sliding_window=-1), "float32")


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e4m3"])
def test_an_fp8_kv_cache_is_accepted_and_an_unquantised_tensor_under_it_refused(fmt):
    """vLLM's fp8 formats (uint8 codes, tests/test_vllm_fp8.py) pass the built config and the layer checks; a layer
    whose tensor is not uint8 under them is refused."""
    from types import SimpleNamespace as NS

    from vase.vllm.refusals import check_attention_layer, check_built_config, check_kv_tensor

    check_built_config(_built(**{"cache_config.cache_dtype": fmt}), env={})
    check_attention_layer("l0", NS(alibi_slopes=None, kv_cache_dtype=fmt, sliding_window=-1), "float32")
    check_kv_tensor("l0", torch.uint8, torch.float32, fmt)
    with pytest.raises(VaseConfigError, match=f"got a torch.float32 KV cache .* kv_cache_dtype {fmt}"):
        check_kv_tensor("l0", torch.float32, torch.float32, fmt)


# -- beam search, pooling models, TP wider than the KV heads, K/V head sizes that differ (issue 27) ----------------
def _shaped(runner_type="generate", tp=1, kv_heads=2):
    from types import SimpleNamespace as NS

    return NS(model_config=NS(model="m", runner_type=runner_type, get_total_num_kv_heads=lambda: kv_heads),
              parallel_config=NS(tensor_parallel_size=tp))


@pytest.mark.parametrize("over, fragment", [
    ({"runner_type": "pooling"}, "runs as a pooling model"),
    ({"tp": 2, "kv_heads": 1}, "has 1 KV head(s), fewer than tensor_parallel_size=2"),
    ({"tp": 8, "kv_heads": 4}, "use tensor_parallel_size <= 4"),
])
def test_pooling_and_tp_wider_than_the_kv_heads_are_refused(over, fragment):
    from vase.vllm.refusals import check_runner_shape

    check_runner_shape(_shaped())
    check_runner_shape(_shaped(tp=2, kv_heads=2))
    with pytest.raises(VaseConfigError) as info:
        check_runner_shape(_shaped(**over))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_tp_2_over_one_kv_head_is_refused_when_the_real_config_is_built(tmp_path):
    """A tiny Llama with 1 KV head at tensor_parallel_size=2: refused by the plugin when vLLM builds the config
    (nothing started), while the same engine without vase builds."""
    from vllm.engine.arg_utils import EngineArgs

    from tests.vllm_tiny import save_tiny_llama
    from vase.vllm.plugin import register

    register()
    model = save_tiny_llama(str(tmp_path / "kv1"), kv_heads=1, heads=4)
    options = dict(model=model, tensor_parallel_size=2, max_model_len=256, distributed_executor_backend="mp")
    EngineArgs(**options).create_engine_config()
    with pytest.raises(VaseConfigError) as info:
        EngineArgs(**options, additional_config={"vase": {"method": "snapkv", "budget": 48, "window": 16}}
                   ).create_engine_config()
    assert "1 KV head(s), fewer than tensor_parallel_size=2" in str(info.value)


def test_key_and_value_head_sizes_that_differ_are_refused_at_load():
    from types import SimpleNamespace as NS

    from vase.vllm.requests import VaseRunnerMixin

    def runner(head_size_v):
        layer = NS(impl=object(), head_size=128, head_size_v=head_size_v)
        return NS(compilation_config=NS(static_forward_context={"model.layers.0.self_attn.attn": layer}))

    assert [n for n, _ in VaseRunnerMixin._vase_attention_impls(runner(128))] == ["model.layers.0.self_attn.attn"]
    with pytest.raises(VaseConfigError) as info:
        list(VaseRunnerMixin._vase_attention_impls(runner(64)))
    assert "keys of 128 and values of 64 channels" in str(info.value) and "\n" not in str(info.value)


def test_beam_search_is_refused_offline_and_online():
    import asyncio
    from types import SimpleNamespace as NS

    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    from vase.vllm.plugin import register

    register()
    vase = {"vase": {"method": "snapkv", "budget": 48, "window": 16}}
    with pytest.raises(VaseConfigError, match="beam search"):
        BeamSearchOfflineMixin.beam_search(NS(llm_engine=NS(vllm_config=NS(additional_config=vase))), [], None)

    async def first(gen):
        async for item in gen:
            return item

    serving = NS(engine_client=NS(vllm_config=NS(additional_config=vase)))
    with pytest.raises(VaseConfigError, match="beam search") as info:
        asyncio.run(first(BeamSearchOnlineMixin.beam_search(serving, {}, "r0", None)))
    assert "\n" not in str(info.value)
    # without vase the call goes through to vLLM's own code (which then fails on these stand-ins, not on vase)
    with pytest.raises(Exception) as other:
        BeamSearchOfflineMixin.beam_search(NS(llm_engine=NS(vllm_config=NS(additional_config={}))), [], None)
    assert not isinstance(other.value, VaseConfigError)


# -- pipeline parallelism: where a stage's layers sit, and which policies make it replay the others' draws -------
def test_stage_span_counts_the_layers_of_the_other_stages():
    from vase.vllm.stages import stage_span

    assert stage_span([0], 2, 0, 2) == (0, 1)
    assert stage_span([1], 2, 1, 2) == (1, 0)
    assert stage_span([4, 5, 6, 7], 12, 1, 3) == (4, 4)


def test_a_stage_with_layers_outside_the_evicted_group_is_refused_in_one_line():
    from vase.vllm.stages import stage_span

    with pytest.raises(VaseConfigError) as info:  # layer 3 sits in a sliding-window group: not counted in the replay
        stage_span([2], 4, 1, 2)
    assert "stage 1 of 2 holds layers 2..3 but evicts [2]" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("method, replays", [("snapkv", False), ("h2o", False), ("tova", False),
                                             ("vase-attnv", True), ("vase-dkv", True)])
def test_a_stage_replays_the_other_layers_of_policies_that_draw(method, replays):
    from vase.core.policies import get_policy
    from vase.vllm.heads import RankHeads, rank_policy
    from vase.vllm.stages import draws

    policy = get_policy(method)
    assert draws(policy) is replays
    assert draws(rank_policy(policy, RankHeads.of_rank(0, 2, 2))) is replays  # as a TP rank runs it
