"""Worker side of the plugin: query capture, paged eviction, physical slot mapping and sequence lengths.

`VaseCPUWorker` (set through `worker_cls`) runs `VaseCPUModelRunner`, vLLM's CPU model runner
with three additions, all driven by `vase.vllm.steps.plan_step` from each request's prompt
length P0 and its logical length (the scheduler sends only the blocks each request holds, for
the invariant check):

The step itself (1. and 2.) is `vase.vllm.runner_step.VaseStepMixin`, shared with the GPU runner:

1. after vLLM prepares a step's inputs: a request whose step starts on an eviction boundary (a
   decode step, or a chunk of the recomputing prefill that replays a preempted request's
   history) is evicted in every layer (`vase.vllm.paged.evict_paged`, the same `policy.select`
   as the transformers path), before the forward writes the step's tokens; a step that would
   write outside the request's blocks stops with one line (`VaseStepError`);
2. RoPE positions stay logical; the slot mapping and sequence lengths use the physical length
   (logical minus the tokens evicted so far);
3. each attention layer records the last w post-RoPE queries of each request (`capture.install`, as on the GPU).

With sliding-window layers (Gemma 3, gpt-oss: several KV cache groups, `vase.vllm.groups`) all of
this applies to the full-attention group only: its layers are evicted, its block table and slot
mapping are made physical; the sliding-window groups keep vLLM's logical slots, and their
metadata builders (`VaseLogicalLengthsBuilder`) the logical sequence lengths. Beside linear attention
(Qwen3-Next: recurrent-state groups, `MambaSpec`) the same: vLLM's gated-delta-net metadata builder
(`VaseLogicalGDNBuilder`) reads the logical lengths it reads without vase. An MLA model (DeepSeek-V2/V3: vLLM's CPU
MLA backend, one group of latent caches) has its latent rows evicted instead of K/V (`vase.vllm.latent`: each
layer's queries recorded by a class swap of the layer, the candidates up-projected with its `kv_b_proj`).
"""

from __future__ import annotations

from copy import copy

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder, _get_attn_isa
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from .capture import install
from ..storage.fp8 import FORMATS
from .config import VaseConfigError
from .fp8 import storage_dtype
from .latent import LatentProjection, check_latent_layer, install_latent, is_latent_model
from .paged import Layout
from .plugin import check_at_start
from .refusals import check_attention_layer
from .runner_step import VaseStepMixin
from .stages import stage_span


def cpu_kernel_layout(block_size: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> Layout:
    """How vLLM's CPU kernel stores one block's key and value rows, found by writing coded rows through it.

    Each pass writes one base-8 digit of every element's plain index `offset * head_dim + dim` as its value
    (0..7: exact in the model dtype and in both fp8 formats), so each storage position names the (offset, dim)
    it holds. `dtype`: the model's; `kv_cache_dtype`: vLLM's ("auto", or an fp8 format stored as uint8)."""
    isa = _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)
    fp8 = FORMATS.get(kv_cache_dtype)  # fp8: the float8 format the uint8 codes hold
    plain = torch.arange(block_size * head_dim).view(block_size, head_dim)
    read = [torch.zeros(block_size * head_dim, dtype=torch.long) for _ in range(2)]
    digit = 1
    while digit < block_size * head_dim:
        kv = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=storage_dtype(kv_cache_dtype, dtype))
        key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        rows = ((plain // digit) % 8).to(dtype)[:, None, :].contiguous()  # [tokens, kv_heads=1, head_dim]
        ops.cpu_attn_reshape_and_cache(rows, rows, key_cache, value_cache, torch.arange(block_size), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
        for side, cache in enumerate((key_cache, value_cache)):
            stored = cache.reshape(-1) if fp8 is None else cache.reshape(-1).view(fp8)
            read[side] += stored.float().long() * digit
        digit *= 8
    where = []
    for plain_at in read:  # storage position -> plain (offset, dim) index
        if not torch.equal(plain_at.sort().values, torch.arange(block_size * head_dim)):
            raise RuntimeError(f"vase cannot read vLLM's CPU KV layout (block_size {block_size}, head_dim {head_dim}, "
                               f"{dtype}, kv_cache_dtype {kv_cache_dtype}): it is not a permutation of the block's "
                               f"elements")
        index = torch.empty_like(plain_at)
        index[plain_at] = torch.arange(plain_at.numel())
        where.append(index.view(block_size, head_dim))
    return Layout(*where)


def logical_metadata(runner, common_attn_metadata):
    """`common_attn_metadata` with the logical sequence lengths (`runner.vase_logical_seq_lens`, [num_reqs]) in
    place of the full-attention group's physical ones (seq_lens, max_seq_len and, where present, the CPU upper
    bound); unchanged when no request in the step has evicted."""
    logical = getattr(runner, "vase_logical_seq_lens", None)
    if logical is None:
        return common_attn_metadata
    m = copy(common_attn_metadata)
    n = m.seq_lens.shape[0]
    m.seq_lens = logical[:n]
    m.max_seq_len = int(logical[:n].max())
    if getattr(m, "seq_lens_cpu_upper_bound", None) is not None:
        m.seq_lens_cpu_upper_bound = logical[:n].to("cpu", m.seq_lens_cpu_upper_bound.dtype)
    return m


class VaseLogicalLengthsBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder for a sliding-window group: its layers read the logical sequence lengths
    (`vase_runner.vase_logical_seq_lens`), while the runner's shared `seq_lens` are the full-attention group's
    physical ones. Set on the instance by a class swap."""

    vase_runner = None

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        return super().build(common_prefix_len, logical_metadata(self.vase_runner, common_attn_metadata),
                             *args, **kwargs)


class VaseLogicalGDNBuilder(GDNAttentionMetadataBuilder):
    """vLLM's gated-delta-net (linear attention) metadata builder for a recurrent-state group (Qwen3-Next): the
    logical sequence lengths, as `VaseLogicalLengthsBuilder`. Set on the instance by a class swap."""

    vase_runner = None

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        return super().build(common_prefix_len, logical_metadata(self.vase_runner, common_attn_metadata),
                             *args, **kwargs)


#: vLLM's metadata builder of a group left to vLLM -> vase's, which reads the logical lengths.
_LOGICAL_BUILDERS = {CPUAttentionMetadataBuilder: VaseLogicalLengthsBuilder,
                     GDNAttentionMetadataBuilder: VaseLogicalGDNBuilder}


def logical_builder(cls: type) -> type | None:
    """vase's class for a metadata builder of a group left to vLLM (None: not one vase knows). Llama 4's chunked-local
    group builds with a class vLLM makes per chunk size over the CPU builder (`ChunkedLocalAttentionBuilder`, which
    splits each request into chunks by its sequence length): subclassed here so that it splits the logical lengths."""
    if cls in _LOGICAL_BUILDERS:
        return _LOGICAL_BUILDERS[cls]
    if issubclass(cls, CPUAttentionMetadataBuilder) and cls.__name__ == "ChunkedLocalAttentionBuilder":
        def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
            return cls.build(self, common_prefix_len, logical_metadata(self.vase_runner, common_attn_metadata),
                             *args, **kwargs)

        ours = type(f"VaseLogical{cls.__name__}", (cls,), {"vase_runner": None, "build": build})
        _LOGICAL_BUILDERS[cls] = ours
        return ours
    return None


class VaseCPUModelRunner(VaseStepMixin, CPUModelRunner):
    """vLLM's CPU model runner with vase's eviction (see the module docstring; the step and per-request state: the
    mixins, `vase.vllm.runner_step` and `vase.vllm.requests`, whose `__init__` is its constructor)."""

    # -- setup ---------------------------------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # Swap the implementation class of this engine's attention layers only: vLLM caches backend
        # selection per process, so registering a backend would also change other engines.
        latent = is_latent_model(self.model_config)
        self.vase_latent = {}  # MLA: layer name -> its up-projection (`vase.vllm.latent`)
        for name, impl in self._vase_attention_impls():
            if latent:  # the latent cache, scored from the layer's own queries
                layer = self.compilation_config.static_forward_context[name]
                check_latent_layer(name, layer, impl)
                install_latent(layer)
                self.vase_latent[name] = LatentProjection.of_layer(layer)
                continue
            if type(impl) is not CPUAttentionBackendImpl:
                raise VaseConfigError(f"vase needs vLLM's CPU attention, layer {name} uses {type(impl).__name__}: "
                                      f"use a model with standard attention")
            check_attention_layer(name, impl, self.model_config.dtype, sliding=True)  # fp8 formats pass: vase.vllm.fp8
            install(impl)  # records its queries (`vase.vllm.capture`, the one mechanism)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        first = self._vase_attach_layers(kv_cache_config, hybrid=True)
        for gid, groups in enumerate(self.attn_groups):  # sliding-window and recurrent groups: logical lengths
            if gid == self.vase_group:
                continue
            for group in groups:
                for builder in group.metadata_builders:
                    ours = logical_builder(type(builder))
                    if ours is None:
                        raise VaseConfigError(f"vase needs vLLM's CPU attention or gated-delta-net linear attention "
                                              f"in every other KV cache group, group {gid} builds "
                                              f"{type(builder).__name__}: use a model with standard attention")
                    builder.__class__ = ours
                    builder.vase_runner = self
        self.vase_layout = None if self.vase_latent else cpu_kernel_layout(
            self.vase_block_size, first.head_size, self.model_config.dtype, str(self.cache_config.cache_dtype))
        self._vase_pipeline_stage()

    def _vase_pipeline_stage(self) -> None:
        """Pipeline parallelism: where this stage's evicted layers sit (`vase_pp_span`), and a later stage's buffer
        for the hidden states it receives, which vLLM's CPU runner allocates only in its compile warm-up
        (`profile_run` -> `_dummy_run`): eager (`enforce_eager`) it is never made and the stage's first step fails
        (`assert self.intermediate_tensors is not None`; stock vLLM 0.32 too)."""
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        if group.world_size > 1:  # where this stage's layers sit: it replays the others' draws (vase.vllm.stages)
            self.vase_pp_span = stage_span([extract_layer_index(n) for n in self.vase_layers],
                                           self.model_config.get_total_num_hidden_layers(), group.rank_in_group,
                                           group.world_size)
        if not group.is_first_rank and getattr(self, "intermediate_tensors", None) is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)

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


class VaseCPUWorker(CPUWorker):
    """vLLM's CPU worker running `VaseCPUModelRunner`.

    vLLM 0.32's `CPUWorker.init_device` builds its stock runner inline (no hook, unlike `Worker._make_model_runner`,
    which the CPU worker inherits and never calls): vase's runner replaces it there, built by the same method name
    as on the GPU worker. The V2 runner is refused by `check_at_start` (`refusals.check_built_config`)."""

    def init_device(self):
        check_at_start(self.vllm_config, "CPU worker")  # a VllmConfig built by hand skips EngineArgs' checks
        super().init_device()
        self.model_runner = self._make_model_runner()

    def _make_model_runner(self) -> VaseCPUModelRunner:
        return VaseCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def determine_available_memory(self) -> int:
        """vLLM's KV memory less the query ring of the requests the pool will hold (`vase.vllm.ring_size`)."""
        available = super().determine_available_memory()
        return available - self.model_runner._vase_ring_reserve(available)
