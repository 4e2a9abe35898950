"""GPU side of the plugin: vLLM's V1 GPU worker and model runner with vase's eviction (not yet run on a GPU).

`VaseGPUWorker` (set through `worker_cls` on a CUDA platform) builds `VaseGPUModelRunner`, vLLM's
GPU model runner with the same three additions as the CPU worker (`vase.vllm.worker`):

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

import numpy as np
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from .capture import CapturePlan, QueryRing, install
from .config import VaseConfigError, VaseVllmConfig
from .layouts import backend_of, split_kv
from .offsets import capture_rows, physical_positions, physical_seq_lens, plan_batch
from .paged import evict_paged
from .refusals import check_attention_layer, v2_runner_reason
from .requests import VaseRequest, VaseRunnerMixin


class VaseGPUModelRunner(VaseRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU model runner with vase's eviction (see the module docstring; per-request state: the mixin)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.vase_config = VaseVllmConfig.from_additional_config(vllm_config.additional_config)
        self.vase_policy = self._vase_rank_policy(vllm_config)  # TP: kept sets independent of the degree
        self.vase_requests: dict[str, VaseRequest] = {}
        self.vase_ring: QueryRing | None = None
        self.vase_layers: list[str] = []
        self.vase_backend: str | None = None
        self.vase_evictions = 0
        self.vase_recomputes = 0
        self.vase_recomputed_tokens = 0  # tokens those replays prefilled again

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

    # -- the step (after vLLM's `_prepare_inputs`, through the mixin) ----------------------------------
    def _vase_step(self, scheduled: np.ndarray) -> None:
        """Evict, plan the capture and make the step's lengths and slots physical (after vLLM's `_prepare_inputs`)."""
        cfg, batch = self.vase_config, self.input_batch
        num_reqs = batch.num_reqs
        scheduled = scheduled[:num_reqs].astype(np.int64)
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        starts = self.query_start_loc.np[:num_reqs].astype(np.int64)
        req_ids = list(batch.req_ids[:num_reqs])
        reqs = [self._vase_request(req_id, i, int(computed[i])) for i, req_id in enumerate(req_ids)]
        plans = plan_batch(req_ids, np.array([r.origin for r in reqs]), computed, scheduled, cfg.budget, cfg.window)
        table = batch.block_table[0]
        for i, (req, plan) in enumerate(zip(reqs, plans)):
            self._vase_check_room(req_ids[i], req, plan, int(table.num_blocks_per_row[i]) * self.vase_block_size,
                                  int(computed[i]), int(scheduled[i]))
        for i, plan in enumerate(plans):
            if plan.evict_from:
                self._vase_evict(req_ids[i], reqs[i], i, plan.evict_from, plan.evict_to, seen=int(computed[i]))
        self._vase_check_copies()
        as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)
        src, slot, pos = capture_rows(starts, computed, scheduled, np.array([r.slot for r in reqs]), cfg.window)
        self.vase_ring.plan = CapturePlan(src=as_long(src), slot=as_long(slot), pos=as_long(pos))
        offsets = np.array([p.offset for p in plans], dtype=np.int64)
        if not offsets.any():
            return
        # seq_lens (device) -> the kernels' per-request KV lengths; optimistic_seq_lens_cpu -> seq_lens_cpu_upper_bound
        # and max_seq_len, read by the metadata builders after this hook.
        self.seq_lens[:num_reqs] -= as_long(offsets).to(self.seq_lens.dtype)
        upper = self.optimistic_seq_lens_cpu[:num_reqs]
        upper.copy_(torch.from_numpy(physical_seq_lens(upper.numpy().astype(np.int64), offsets)))
        logical = np.repeat(computed, scheduled) + (np.arange(int(scheduled.sum())) - np.repeat(starts, scheduled))
        physical = as_long(physical_positions(logical, offsets, scheduled))
        batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical)

    def _vase_evict(self, req_id: str, req: VaseRequest, index: int, length: int, keep: int, seen: int) -> None:
        """Bring request `index` from `length` stored tokens to `keep` in every layer (in place, or into the fresh
        blocks the scheduler gave it for shared ones this step)."""
        cfg = self.vase_config
        block_ids, target = self._vase_eviction_blocks(req_id, index)
        for layer, name in enumerate(self.vase_layers):
            keys, values = self._kv_views(name)
            queries = self.vase_ring.window_of(layer, req.slot, seen) if self.vase_policy.needs_queries else None
            evict_paged(keys, values, block_ids, length, queries, self.vase_policy, keep, cfg.window, req.state, layer,
                        sort_kept=cfg.sort_kept, block_size=self.vase_block_size, target_block_ids=target)
        req.state.evictions += 1
        self.vase_evictions += 1


class VaseGPUWorker(Worker):
    """vLLM's GPU worker building `VaseGPUModelRunner` (V1 runner only)."""

    def _make_model_runner(self):
        if getattr(self, "use_v2_model_runner", False):  # the config check refuses this first; kept as a backstop
            raise VaseConfigError(f"vase's vLLM plugin hooks vLLM's V1 model runner, and this engine would run V2 "
                                  f"because {v2_runner_reason(self.vllm_config)}")
        return VaseGPUModelRunner(self.vllm_config, self.device)
