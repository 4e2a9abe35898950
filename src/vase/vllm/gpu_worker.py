"""GPU side of the plugin: vLLM's V1 GPU worker and model runner with vase's eviction (not yet run on a GPU).

`VaseGPUWorker` (set through `worker_cls` on a CUDA platform) builds `VaseGPUModelRunner`, vLLM's
GPU model runner with the same three additions as the CPU worker (`vase.vllm.worker`), the step itself
shared with it (`vase.vllm.runner_step.VaseStepMixin`):

1. after vLLM prepares a step's inputs, each request whose step starts on an eviction boundary
   (decoding, or replaying its history after a preemption) is evicted in every layer
   (`paged.evict_paged` on the layer's strided key/value views, `layouts.split_kv`), before the
   forward writes the step's tokens;
2. RoPE positions stay logical; the metadata fields the GPU backends read for lengths and slots
   are made physical (`offsets`): `seq_lens` (GPU; FlashAttention's `seqused_k`, Triton's
   `seqused_k`, FlashInfer's paged-KV lengths), `optimistic_seq_lens_cpu` (read as
   `CommonAttentionMetadata.seq_lens_cpu_upper_bound` and for `max_seq_len`; FlashAttention's
   scheduler metadata and FlashInfer's plan use them) and the slot mapping (recomputed from the
   physical positions through vLLM's own `compute_slot_mapping`);
3. each attention layer records the last w post-RoPE queries of each request (`capture.install`).

The engine-level conditions (piecewise CUDA graphs or none, no async scheduling, one of the
FlashAttention / FlashInfer / Triton backends) are set or refused before the engine starts
(`vase.vllm.platforms`). Everything here but the kernels is exercised on CPU by the tests; see
docs/vllm-gpu.md for what has not run on a GPU.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from .capture import install
from .layouts import backend_of, split_kv
from .plugin import check_at_start
from .refusals import check_attention_layer
from .runner_step import VaseStepMixin


class VaseGPUModelRunner(VaseStepMixin, GPUModelRunner):
    """vLLM's V1 GPU model runner with vase's eviction (see the module docstring; the step and per-request state:
    the mixins, `vase.vllm.runner_step` and `vase.vllm.requests`, whose `__init__` is its constructor)."""

    vase_backend: str | None = None  # the attention backend of its layers (set at load_model)

    # -- setup ---------------------------------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        for name, impl in self._vase_attention_impls():
            self.vase_backend = backend_of(impl)  # refuses MLA and every backend not written for
            check_attention_layer(name, impl, self.model_config.dtype)
            install(impl)  # this engine's layers only (the backend registry is per process)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self.vase_head_size = self._vase_attach_layers(kv_cache_config).head_size

    def _kv_views(self, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's key and value caches as [num_blocks, kv_heads, kernel_block_size, head_dim] strided views."""
        return split_kv(self.compilation_config.static_forward_context[layer_name].kv_cache, self.vase_head_size)


class VaseGPUWorker(Worker):
    """vLLM's GPU worker building `VaseGPUModelRunner` through vLLM's hook (V1 runner only: `check_at_start` refuses
    V2, `refusals.check_built_config`)."""

    def _make_model_runner(self) -> VaseGPUModelRunner:
        check_at_start(self.vllm_config, "GPU worker")  # a VllmConfig built by hand skips EngineArgs' checks
        return VaseGPUModelRunner(self.vllm_config, self.device)

    def determine_available_memory(self) -> int:
        """vLLM's measured KV memory less the query ring of the requests the pool will hold (`vase.vllm.ring_size`):
        the ring is made after the pool, from it, and paid for by it."""
        available = super().determine_available_memory()
        return available - self.model_runner._vase_ring_reserve(available)
