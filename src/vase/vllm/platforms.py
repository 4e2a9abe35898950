"""Which vase worker runs on which vLLM platform, and the engine settings the GPU worker needs.

The plugin (`vase.vllm.plugin`) asks `worker_cls_for(current_platform)` for its worker
(the CPU build: `VaseCPUWorker`; CUDA: `VaseGPUWorker`; anything else is refused in one line),
`prepare_gpu_engine_args` before the engine config is built, and `check_gpu_config` once it is.
On a CUDA platform:

- CUDA graphs: attention must run eagerly so the capturing `forward` runs every step, so the
  default becomes PIECEWISE (attention is a splitting op) and a FULL mode is refused;
  `enforce_eager` also works.
- async scheduling: the worker's schedule reads each request's computed tokens when the step
  is prepared, which async scheduling advances before the previous step's output is known; the
  default becomes off and `async_scheduling=True` is refused.
- attention backend: FlashAttention, FlashInfer or Triton attention (the cache layouts in
  `vase.vllm.layouts`); any other one named in `attention_config.backend` is refused here, and
  one picked automatically is refused when the model loads (`layouts.backend_of`).
- decode context parallelism: refused (its per-rank lengths would need their own offsets).

On every platform, `select_v1_runner` picks vLLM's V1 model runner (the one vase hooks) when
the user has not chosen: vLLM 0.32 runs V2 on CUDA by default whenever Triton is present
(`VllmConfig.use_v2_model_runner`, read from `VLLM_USE_V2_MODEL_RUNNER` in every process).

Duck-typed, no vLLM import at module level: the tests hand in stand-ins for the platform and configs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .config import VaseConfigError
from .fp8 import is_fp8
from .layouts import GPU_BACKENDS

CPU_WORKER_CLS = "vase.vllm.worker.VaseCPUWorker"
GPU_WORKER_CLS = "vase.vllm.gpu_worker.VaseGPUWorker"
_DROP = "or drop additional_config['vase']"
#: The environment variable vLLM 0.32 reads (`vllm.envs`) to choose its model runner in every process.
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
logger = logging.getLogger("vase.vllm")


def select_v1_runner(env: Any = None) -> bool:
    """Before the engine config resolves: set VLLM_USE_V2_MODEL_RUNNER=0 unless the user set it; True when set here.

    vLLM reads that variable lazily (`VllmConfig.use_v2_model_runner`) in this process and in the engine
    and worker processes it starts later, which inherit it. It is process-wide: later engines in this
    process run V1 too (set the variable yourself to choose). A user's explicit `1` is left alone and
    refused, with the reason, once the config is built (`refusals.check_built_config`)."""
    env = os.environ if env is None else env
    if env.get(RUNNER_ENV) is not None:
        return False
    env[RUNNER_ENV] = "0"
    if env is os.environ:
        import vllm.envs as envs

        if envs._is_envs_cache_enabled():  # an engine started earlier froze the variables: read them again
            envs.__getattr__.cache_clear()
    logger.warning("vase: selecting vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, process-wide): the plugin "
                   "hooks V1; set VLLM_USE_V2_MODEL_RUNNER yourself to choose")
    return True


def worker_cls_for(platform: Any) -> str:
    """The vase worker class (qualified name) for a vLLM platform; refuses platforms without one in one line."""
    if platform.is_cpu():
        return CPU_WORKER_CLS
    if platform.is_cuda():
        return GPU_WORKER_CLS
    raise VaseConfigError(f"vase's vLLM plugin has a CPU worker and a CUDA worker, not one for "
                          f"{getattr(platform, 'device_name', platform)}: run on a CPU or NVIDIA GPU {_DROP}")


def _mode_name(mode: Any) -> str | None:
    if mode is None:
        return None
    return str(getattr(mode, "name", mode)).upper()


def prepare_gpu_engine_args(args: Any) -> None:
    """Before the config is built on CUDA: PIECEWISE CUDA graphs and no async scheduling, unless the user set them."""
    if getattr(args, "async_scheduling", None):
        raise VaseConfigError(f"vase's GPU worker does not run under async scheduling (the schedule reads each "
                              f"request's computed tokens when a step is prepared): set async_scheduling=False {_DROP}")
    args.async_scheduling = False
    backend = getattr(args, "attention_backend", None)
    if backend is not None and _mode_name(backend) not in GPU_BACKENDS:
        raise VaseConfigError(f"vase's GPU worker runs on {', '.join(GPU_BACKENDS)}, not attention_backend="
                              f"{_mode_name(backend)}: pick one of those {_DROP}")
    if getattr(args, "enforce_eager", False):
        return
    compilation = args.compilation_config
    mode = _mode_name(getattr(compilation, "cudagraph_mode", None))
    if mode is None:
        from vllm.config.compilation import CUDAGraphMode

        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif "FULL" in mode:
        raise VaseConfigError(f"vase records each attention layer's queries in Python, which a FULL CUDA graph "
                              f"replays without: set compilation_config={{'cudagraph_mode': 'PIECEWISE'}} (attention "
                              f"eager) or enforce_eager=True instead of {mode} {_DROP}")


def check_gpu_config(vllm_config: Any) -> None:
    """On the built config (CUDA): refuse what `prepare_gpu_engine_args` could not set (vLLM may have changed it)."""
    if vllm_config.scheduler_config.async_scheduling:
        raise VaseConfigError(f"vase's GPU worker does not run under async scheduling: set async_scheduling=False "
                              f"{_DROP}")
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        raise VaseConfigError(f"vase records attention queries in Python, which a FULL CUDA graph replays without, "
                              f"and this engine resolved cudagraph_mode to {_mode_name(mode)}: set "
                              f"compilation_config={{'cudagraph_mode': 'PIECEWISE'}} or enforce_eager=True {_DROP}")
    backend = getattr(vllm_config.attention_config, "backend", None)
    if backend is not None and _mode_name(backend) not in GPU_BACKENDS:
        raise VaseConfigError(f"vase's GPU worker runs on {', '.join(GPU_BACKENDS)}, not attention backend "
                              f"{_mode_name(backend)}: pick one of those {_DROP}")
    if is_fp8(vllm_config.cache_config.cache_dtype):
        raise VaseConfigError(f"vase evicts an fp8 KV cache on vLLM's CPU worker only (the GPU kernels' fp8 rounding "
                              f"and layout are untested with eviction): use kv_cache_dtype='auto' {_DROP}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise VaseConfigError(f"vase runs speculative decoding on vLLM's CPU worker only (the n-gram verify steps are "
                              f"compared there; the GPU runner's spec-decode path is untested with eviction): drop "
                              f"speculative_config {_DROP}")
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) > 1:
        raise VaseConfigError(f"vase runs pipeline parallelism on vLLM's CPU worker only (each stage's eviction and "
                              f"replayed draws are tested there; the GPU worker sets up no stage): use "
                              f"pipeline_parallel_size=1 {_DROP}")
    if getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) > 1:
        raise VaseConfigError(f"vase's GPU worker does not support decode context parallelism: use "
                              f"decode_context_parallel_size=1 {_DROP}")
