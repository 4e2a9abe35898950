"""Worker side of the plugin: query capture, paged eviction, physical slot mapping and sequence lengths.

`VaseCPUWorker` (set through `worker_cls`) runs `VaseCPUModelRunner`, vLLM's CPU model runner
with three additions, all driven by `vase.vllm.steps.plan_step` from each request's prompt
length P0 and its logical length (the scheduler sends only the blocks each request holds, for
the invariant check):

1. after vLLM prepares a step's inputs: a request whose step starts on an eviction boundary (a
   decode step, or a chunk of the recomputing prefill that replays a preempted request's
   history) is evicted in every layer (`vase.vllm.paged.evict_paged`, the same `policy.select`
   as the transformers path), before the forward writes the step's tokens; a step that would
   write outside the request's blocks stops with one line (`VaseStepError`);
2. RoPE positions stay logical; the slot mapping and sequence lengths use the physical length
   (logical minus the tokens evicted so far);
3. each attention layer records the last w post-RoPE queries of each request.

With sliding-window layers (Gemma 3, gpt-oss: several KV cache groups, `vase.vllm.groups`) all of
this applies to the full-attention group only: its layers are evicted, its block table and slot
mapping are made physical; the sliding-window groups keep vLLM's logical slots, and their
metadata builders (`VaseLogicalLengthsBuilder`) the logical sequence lengths.
"""

from __future__ import annotations

from copy import copy

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder, _get_attn_isa
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from .capture import CapturePlan, QueryRing
from .config import VaseConfigError, VaseVllmConfig
from .offsets import capture_rows, token_offsets
from .paged import Layout, evict_paged
from .refusals import check_attention_layer, v2_runner_reason
from .requests import VaseRequest, VaseRunnerMixin
from .steps import plan_step


def cpu_kernel_layout(block_size: int, head_dim: int, dtype: torch.dtype) -> Layout:
    """How vLLM's CPU kernel stores one block's key and value rows, found by writing coded rows through it.

    Two passes write the token offset, then the dimension, as the element values (exact in any float
    dtype up to 256), so each storage position names the (offset, dim) it holds."""
    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    offset = torch.arange(block_size)[:, None].expand(block_size, head_dim)
    dim = torch.arange(head_dim)[None, :].expand(block_size, head_dim)
    read = []
    for code in (offset, dim):
        kv = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        rows = code.to(dtype)[:, None, :].contiguous()  # [tokens, kv_heads=1, head_dim]
        ops.cpu_attn_reshape_and_cache(rows, rows, key_cache, value_cache, torch.arange(block_size), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        read.append((key_cache.reshape(-1).long(), value_cache.reshape(-1).long()))
    where = []
    for side in range(2):
        plain = read[0][side] * head_dim + read[1][side]  # storage position -> plain (offset, dim) index
        if not torch.equal(plain.sort().values, torch.arange(block_size * head_dim)):
            raise RuntimeError(f"vase cannot read vLLM's CPU KV layout (block_size {block_size}, head_dim {head_dim}, "
                               f"{dtype}): it is not a permutation of the block's elements")
        index = torch.empty_like(plain)
        index[plain] = torch.arange(plain.numel())
        where.append(index.view(block_size, head_dim))
    return Layout(*where)


class VaseCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, recording the query window first (`vase_ring` is set on the instance by the runner)."""

    vase_ring: QueryRing | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        ring = self.vase_ring
        if ring is not None and attn_metadata is not None:
            ring.record(layer.layer_name, query)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


class VaseLogicalLengthsBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder for a sliding-window group: its layers read the logical sequence lengths
    (`vase_runner.vase_logical_seq_lens`), while the runner's shared `seq_lens` are the full-attention group's
    physical ones. Set on the instance by a class swap."""

    vase_runner = None

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        logical = getattr(self.vase_runner, "vase_logical_seq_lens", None)
        if logical is not None:
            common_attn_metadata = copy(common_attn_metadata)
            n = common_attn_metadata.seq_lens.shape[0]
            common_attn_metadata.seq_lens = logical[:n]
            common_attn_metadata.max_seq_len = int(logical[:n].max())
        return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)


class VaseCPUModelRunner(VaseRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with vase's eviction (see the module docstring; per-request state: the mixin)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.vase_config = VaseVllmConfig.from_additional_config(vllm_config.additional_config)
        self.vase_policy = self._vase_rank_policy(vllm_config)
        self.vase_requests: dict[str, VaseRequest] = {}
        self.vase_ring: QueryRing | None = None
        self.vase_layers: list[str] = []
        self.vase_evictions = 0  # eviction events (all layers of one request at one step count once)
        self.vase_recomputes = 0  # replays of preempted requests (their policy state starts over, re-seeded)
        self.vase_recomputed_tokens = 0  # tokens those replays prefilled again
        #: set to a dict to record, per request id, its evictions and the slots its first eviction kept per layer
        self.vase_record: dict | None = None

    # -- setup ---------------------------------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # Swap the implementation class of this engine's attention layers only: vLLM caches backend
        # selection per process, so registering a backend would also change other engines.
        for name, impl in self._vase_attention_impls():
            if type(impl) is not CPUAttentionBackendImpl:
                raise VaseConfigError(f"vase needs vLLM's CPU attention, layer {name} uses {type(impl).__name__}: "
                                      f"use a model with standard attention")
            check_attention_layer(name, impl, self.model_config.dtype, sliding=True)
            impl.__class__ = VaseCPUAttentionImpl

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        first = self._vase_attach_layers(kv_cache_config, hybrid=True)
        for gid, groups in enumerate(self.attn_groups):  # sliding-window groups: logical lengths
            if gid == self.vase_group:
                continue
            for group in groups:
                for builder in group.metadata_builders:
                    if type(builder) is not CPUAttentionMetadataBuilder:
                        raise VaseConfigError(f"vase needs vLLM's CPU attention in every KV cache group, group {gid} "
                                              f"builds {type(builder).__name__}: use a model with standard attention")
                    builder.__class__ = VaseLogicalLengthsBuilder
                    builder.vase_runner = self
        self.vase_layout = cpu_kernel_layout(self.vase_block_size, first.head_size, self.kv_cache_dtype_torch())

    def kv_cache_dtype_torch(self) -> torch.dtype:
        name = self.vase_layers[0]
        return self.compilation_config.static_forward_context[name].kv_cache.dtype

    def _kv_views(self, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's key and value caches as [num_blocks, kv_heads, block_size, head_dim] views (CPU layout)."""
        kv = self.compilation_config.static_forward_context[layer_name].kv_cache
        nb, h, bs, _ = kv.shape
        return kv.view(nb, h, 2 * bs, -1).chunk(2, dim=2)

    # -- sampling: a discarded sample draws nothing from its request's seeded generator ------------------------
    def _sample(self, *args, **kwargs):
        """A request whose sample this step is discarded (a prefill chunk that is not its last, e.g. a
        recomputing prefill cut at its eviction boundaries) samples without its seeded generator: vLLM would
        draw from it and then rewind it (`set_offset`), which CPU generators cannot do ("CPU Generator does not
        use offset"); not drawing leaves it exactly where the rewind would have. Put back after bookkeeping."""
        self._vase_restore_generators()  # in case a step sampled without bookkeeping
        gens = self.input_batch.generators
        discard = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        self.vase_held_generators = {int(i): gens.pop(int(i)) for i in discard if int(i) in gens}
        try:
            return super()._sample(*args, **kwargs)
        except BaseException:
            self._vase_restore_generators()
            raise

    def _bookkeeping_sync(self, *args, **kwargs):
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            self._vase_restore_generators()

    def _vase_restore_generators(self) -> None:
        held = getattr(self, "vase_held_generators", None)
        if held:
            self.input_batch.generators.update(held)
        self.vase_held_generators = {}

    # -- the step (after vLLM's `_prepare_inputs`, through the mixin) ----------------------------------
    def _vase_step(self, scheduled: np.ndarray) -> None:
        cfg, batch = self.vase_config, self.input_batch
        B, w = cfg.budget, cfg.window
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        starts = self.query_start_loc.np[:num_reqs].astype(np.int64)
        table = batch.block_table[self.vase_group]
        self.vase_logical_seq_lens = None
        offsets = np.zeros(num_reqs, dtype=np.int64)  # logical - physical, per request
        ring_slots = np.zeros(num_reqs, dtype=np.int64)
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            c, n = int(computed[i]), int(scheduled[i])
            req = self._vase_request(req_id, i, c)
            plan = plan_step(req_id, req.origin, c, n, B, w)
            self._vase_check_room(req_id, req, plan, int(table.num_blocks_per_row[i]) * self.vase_block_size, c, n)
            if plan.evict_from:
                self._vase_evict(req_id, req, i, plan.evict_from, plan.evict_to, seen=c)
            offsets[i], ring_slots[i] = plan.offset, req.slot
        self._vase_check_copies()
        # the last w queries of this step join each request's window (shared with the GPU worker: vase.vllm.offsets)
        src, slot, pos = capture_rows(starts, computed, scheduled[:num_reqs], ring_slots, w)
        as_long = lambda a: torch.from_numpy(a).to(self.device)
        self.vase_ring.plan = CapturePlan(src=as_long(src), slot=as_long(slot), pos=as_long(pos))
        if offsets.any():
            off = torch.from_numpy(offsets).to(self.device)
            if len(batch.block_table.block_tables) > 1:  # the sliding-window groups keep the logical lengths
                self.vase_logical_seq_lens = self.seq_lens.clone()
            self.seq_lens[:num_reqs] -= off.to(self.seq_lens.dtype)
            self.optimistic_seq_lens_cpu[:num_reqs] -= torch.from_numpy(offsets).to(self.optimistic_seq_lens_cpu.dtype)
            total = int(scheduled.sum())
            per_token = torch.from_numpy(token_offsets(offsets, scheduled[:num_reqs])).to(self.device)
            physical = self.positions[:total] - per_token.to(self.positions.dtype)
            table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical)

    def _vase_evict(self, req_id: str, req: VaseRequest, index: int, length: int, keep: int, seen: int) -> None:
        """Bring request `index` from `length` stored tokens to `keep` (B) in every layer of the full-attention
        group, in place (sliding-window groups are vLLM's). `seen`: logical tokens written so far."""
        cfg = self.vase_config
        block_ids, target = self._vase_eviction_blocks(req_id, index)  # target: fresh blocks in place of shared ones
        kept = []
        for layer, name in enumerate(self.vase_layers):  # the full-attention group's layers only
            keys, values = self._kv_views(name)
            ring = self.vase_ring.index[name]
            queries = self.vase_ring.window_of(ring, req.slot, seen) if self.vase_policy.needs_queries else None
            kept.append(evict_paged(keys, values, block_ids, length, queries, self.vase_policy, keep, cfg.window,
                        req.state, layer, sort_kept=cfg.sort_kept, layout=self.vase_layout,
                        target_block_ids=target))
        req.state.evictions += 1
        self.vase_evictions += 1
        if self.vase_record is not None:
            self._vase_record_eviction(req_id, req, kept, length, seen)

    def _vase_record_eviction(self, req_id: str, req: VaseRequest, kept: list[torch.Tensor], length: int,
                              seen: int) -> None:
        """Record the logical positions each layer and KV head kept (`kept`: per layer [1, kv_heads, keep] slots)."""
        h = kept[0].shape[1]
        if req.positions is None:  # nothing evicted since the last (re)prefill: slot = logical position
            stored = [torch.arange(length).expand(h, length)] * len(kept)
        else:
            new = torch.arange(req.positions_since, seen).expand(h, -1)
            stored = [torch.cat([p, new], dim=-1) for p in req.positions]
        req.positions = [s.gather(-1, k[0].cpu()) for s, k in zip(stored, kept)]
        req.positions_since = seen
        entry = self.vase_record.setdefault(req_id, {"evictions": 0, "first_kept": None, "kept": []})
        entry["evictions"] += 1
        entry["kept"].append({"seen": seen, "positions": [p.tolist() for p in req.positions]})
        if entry["first_kept"] is None:  # slots are logical positions until the first eviction
            entry["first_kept"] = [k[0].tolist() for k in kept]


class VaseCPUWorker(CPUWorker):
    """vLLM's CPU worker running `VaseCPUModelRunner`."""

    def init_device(self):
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):  # the config check refuses this first; kept as a backstop
            raise VaseConfigError(f"vase's vLLM plugin hooks vLLM's V1 model runner, and this engine would run V2 "
                                  f"because {v2_runner_reason(self.vllm_config)}")
        self.model_runner = VaseCPUModelRunner(self.vllm_config, torch.device("cpu"))
