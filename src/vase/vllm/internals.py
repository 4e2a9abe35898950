"""Every vLLM-internal symbol the plugin relies on, with what it expects of it (pinned by tests/test_vllm_internals.py).

vLLM 0.32 has no public extension point for what the plugin does (read `additional_config`
before the engine is built, allocate blocks by a physical length, change a step's slots and
lengths after its inputs are prepared, record queries inside attention), so the plugin
subclasses, wraps or reads the internals below. Each entry names the symbol, the parameters
(for a callable) or the attributes (for a class: instance attributes its source sets, fields,
properties) the plugin's code depends on, and which plugin code uses it. The test resolves
each symbol in the installed vLLM and fails, naming the entry, when one is gone or changed;
docs/vllm.md lists the same symbols. No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    """One vLLM symbol: `params` (callable: its parameter names, in order, as the plugin calls or overrides it),
    `attrs` (class: names its source defines, `self.<name> =`, a field or a property), `source_only` (resolved
    by reading the module's file, for modules that do not import on a CPU build), `used_by` (plugin code)."""

    symbol: str
    used_by: str
    params: tuple[str, ...] | None = None
    attrs: tuple[str, ...] = ()
    source_only: bool = False


_SCHED = "vllm.v1.core.sched.scheduler.Scheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer"
_IMPL_FORWARD = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")

VLLM_INTERNALS: tuple[Internal, ...] = (
    # -- the engine front end (plugin.py) ----------------------------------------------------------------
    Internal("vllm.engine.arg_utils.EngineArgs.create_engine_config", "plugin: wrapped to check and configure "
             "engines with a vase section", params=("self", "usage_context", "headless"),
             attrs=("additional_config", "speculative_config", "kv_cache_dtype", "kv_transfer_config",
                    "enable_prefix_caching", "scheduler_cls", "worker_cls", "async_scheduling",
                    "attention_backend", "enforce_eager", "compilation_config")),
    Internal("vllm.v1.engine.async_llm.AsyncLLM._add_streaming_input_request", "plugin: wrapped to refuse "
             "streaming input", params=("self", "request_id", "input_stream", "sampling_params")),
    Internal("vllm.entrypoints.generate.beam_search.offline.BeamSearchOfflineMixin.beam_search", "plugin: wrapped "
             "to refuse beam search (LLM.beam_search)", params=("self", "prompts", "params")),
    Internal("vllm.entrypoints.generate.beam_search.online.BeamSearchOnlineMixin.beam_search", "plugin: wrapped to "
             "refuse beam search (the server's use_beam_search)", params=("self", "prompt", "request_id", "params")),
    Internal("vllm.config.vllm.VllmConfig.use_v2_model_runner", "platforms.select_v1_runner, refusals: the runner "
             "vLLM picks, from VLLM_USE_V2_MODEL_RUNNER"),
    Internal("vllm.envs._is_envs_cache_enabled", "platforms.select_v1_runner: re-read vLLM's environment after "
             "setting VLLM_USE_V2_MODEL_RUNNER", params=()),
    # -- the scheduler (scheduler.py) ---------------------------------------------------------------------
    Internal(f"{_SCHED}.__init__", "VaseScheduler (scheduler_cls); scheduler_reserve_full_isl: the waiting path "
             "passes it to allocate_slots as full_sequence_must_fit, which EvictingKVCacheManager.admits replaces by "
             "the bounded peak; num_prefill_lookahead: 0 lets a decode step skip vLLM's chunk cut",
             params=("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size"),
             attrs=("kv_cache_manager", "requests", "block_size", "scheduler_reserve_full_isl",
                    "num_prefill_lookahead", "running")),
    Internal("vllm.config.scheduler.SchedulerConfig", "EvictingKVCacheManager.admits (scheduler_reserve_full_isl: "
             "vLLM's full-sequence admission gate, default True, replaced for bounded requests); "
             "model_refusals.local_layers_refusal (disable_hybrid_kv_cache_manager: local-attention layers would "
             "join the evicted group)", attrs=("scheduler_reserve_full_isl", "disable_hybrid_kv_cache_manager",
                                               "max_num_seqs")),
    Internal(f"{_SCHED}.schedule", "VaseScheduler.schedule: adds vase_blocks to the output", params=("self",
                                                                                                     "throttle_prefills")),
    Internal(f"{_SCHED}.add_request", "VaseScheduler.add_request: refuses resumable requests",
             params=("self", "request")),
    Internal(f"{_SCHED}._reserve_prefill_lookahead", "VaseScheduler: cuts multi-token steps at eviction boundaries "
             "(called per request on the running and waiting paths before allocation)",
             params=("self", "request", "num_computed_tokens", "num_new_tokens")),
    Internal(f"{_SCHED}._preempt_request", "VaseScheduler._preempt_request: counts preemptions",
             params=("self", "request", "timestamp")),
    Internal(f"{_SCHED}.update_from_output", "VaseScheduler.update_from_output: trims blocks above the bound",
             params=("self", "scheduler_output", "model_runner_output")),
    Internal("vllm.v1.core.sched.output.SchedulerOutput", "scheduler and workers: the step's requests",
             attrs=("num_scheduled_tokens", "finished_req_ids", "preempted_req_ids", "scheduled_cached_reqs",
                    "scheduled_spec_decode_tokens")),
    Internal("vllm.v1.core.sched.output.CachedRequestData", "VaseRunnerMixin._update_states: requests resumed after "
             "a preemption (their replay may start at a prefix-cache hit)", attrs=("resumed_req_ids",)),
    Internal("vllm.v1.request.Request", "EvictingKVCacheManager, VaseScheduler",
             attrs=("request_id", "num_computed_tokens", "num_prompt_tokens", "num_tokens", "resumable",
                    "is_finished", "max_tokens", "status")),
    Internal("vllm.v1.request.RequestStatus", "EvictingKVCacheManager.admits (vLLM's watermark applies to WAITING "
             "and PREEMPTED requests), allocate_slots (a RUNNING request's step)",
             attrs=("WAITING", "PREEMPTED", "RUNNING")),
    Internal("vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots", "EvictingKVCacheManager.allocate_slots "
             "(wraps it; passes the copies its running requests will make as `reserved_blocks`, reads the waiting "
             "path's `new_computed_blocks`)",
             params=("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
                     "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens",
                     "full_sequence_must_fit", "reserved_blocks")),
    Internal("vllm.v1.core.kv_cache_manager.KVCacheManager", "EvictingKVCacheManager",
             attrs=("coordinator", "block_pool", "empty_kv_cache_blocks", "create_kv_cache_blocks", "enable_caching",
                    "max_model_len", "watermark_blocks")),
    Internal("vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.get_num_blocks_to_allocate", "EvictingKVCacheManager."
             "admits: the blocks a waiting request needs at its bounded peak (called by keyword, as vLLM's own "
             "full-sequence gate calls it)", params=("self", "request_id", "num_tokens", "new_computed_blocks",
                                                     "num_encoder_tokens", "total_computed_tokens",
                                                     "num_local_computed_tokens", "num_tokens_main_model",
                                                     "apply_admission_cap", "prefill_end")),
    Internal("vllm.v1.core.kv_cache_manager.KVCacheManager.get_computed_blocks", "EvictingKVCacheManager."
             "get_computed_blocks (wraps it: a resumed request's hit cut at max(P0, B)); returns (blocks, tokens, ...)",
             params=("self", "request")),
    Internal("vllm.v1.core.kv_cache_manager.KVCacheManager.evict_blocks", "EvictingKVCacheManager.allocate_slots: "
             "a request's own cached block dropped from the prefix cache before its compaction rewrites it",
             params=("self", "block_ids")),
    Internal("vllm.v1.core.kv_cache_manager.KVCacheBlocks", "EvictingKVCacheManager.get_computed_blocks: blocks "
             "per group", attrs=("blocks",)),
    Internal("vllm.v1.core.kv_cache_utils.KVCacheBlock", "EvictingKVCacheManager: copy-on-write of shared blocks",
             attrs=("block_id", "ref_cnt", "block_hash")),
    Internal("vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.allocate_new_blocks", "EvictingKVCacheManager: "
             "blocks for the physical length", params=("self", "request_id", "num_tokens", "num_tokens_main_model")),
    Internal("vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator", "EvictingKVCacheManager",
             attrs=("single_type_managers",)),
    Internal("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager", "EvictingKVCacheManager.trim, "
             "copy_on_write (its fresh blocks zeroed where vLLM zeroes new blocks), VaseScheduler.blocks_held",
             attrs=("req_to_blocks", "block_pool", "new_block_ids", "records_new_block_ids")),
    Internal("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate",
             "PhysicalLengthManager (the full-attention group's, beside sliding-window groups): counts blocks for "
             "the physical length", params=("self", "request_id", "num_tokens", "new_computed_blocks",
                                            "total_computed_tokens", "num_local_computed_tokens",
                                            "num_tokens_main_model")),
    Internal("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.allocate_new_blocks",
             "PhysicalLengthManager: allocates for the physical length",
             params=("self", "request_id", "num_tokens", "num_tokens_main_model")),
    Internal("vllm.v1.kv_cache_interface.KVCacheConfig", "groups.full_attention_group, both runners; the query "
             "ring's rows and its share of the pool (VaseRunnerMixin._vase_make_ring, VaseScheduler)",
             attrs=("kv_cache_groups", "num_blocks", "kv_cache_tensors")),
    Internal("vllm.v1.kv_cache_interface.KVCacheGroupSpec", "groups.full_attention_group, both runners: a group's "
             "layers and spec", attrs=("kv_cache_spec", "layer_names")),
    Internal("vllm.v1.kv_cache_interface.FullAttentionSpec", "groups.full_attention_group: the group evicted; with "
             "the hybrid manager off vLLM records sliding or chunked layers' windows on it (refused)",
             attrs=("sliding_window", "attention_chunk_size", "non_causal")),
    Internal("vllm.v1.kv_cache_interface.SlidingWindowSpec", "groups.full_attention_group: groups left to vLLM"),
    # -- multi-head latent attention (latent.py) ------------------------------------------------------------
    Internal("vllm.v1.kv_cache_interface.MLAAttentionSpec", "groups.full_attention_group (an MLA model's one group, "
             "by class name), VaseRunnerMixin._vase_ring_layers"),
    Internal("vllm.model_executor.layers.attention.mla_attention.MLAAttention.forward_impl", "latent.install_latent: "
             "overridden by a class swap to record the post-RoPE query first",
             params=("self", "q", "k_c_normed", "k_pe", "kv_cache", "attn_metadata", "output"),
             attrs=("layer_name", "kv_cache", "kv_b_proj", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "indexer", "sliding_window")),
    Internal("vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl.do_kv_cache_update", "latent: the latent row of "
             "slot s at kv_cache.view(-1, row)[block * block_size + offset] (gather_rows / scatter_rows)",
             params=("self", "kv_c_normed", "k_pe", "kv_cache", "slot_mapping")),
    Internal("vllm.v1.core.block_pool.BlockPool.free_blocks", "EvictingKVCacheManager.trim, release_copies "
             "(by reference count: a cached block stays in the prefix cache)", params=("self", "ordered_blocks")),
    Internal("vllm.v1.core.block_pool.BlockPool.is_block_writable", "EvictingKVCacheManager.shared_kept_blocks: "
             "a block a compaction may rewrite (its request's alone, in no prefix cache)", params=("self", "block")),
    Internal("vllm.v1.core.block_pool.BlockPool.get_new_blocks", "EvictingKVCacheManager.copy_on_write",
             params=("self", "num_blocks")),
    Internal("vllm.v1.core.block_pool.BlockPool.get_num_free_blocks", "EvictingKVCacheManager.allocate_slots",
             params=("self",)),
    # -- the model runners (requests.py, worker.py, gpu_worker.py) ------------------------------------------
    Internal(f"{_RUNNER}._update_states", "VaseRunnerMixin: requests finished, preempted, blocks owned",
             params=("self", "scheduler_output")),
    Internal(f"{_RUNNER}._prepare_inputs", "VaseRunnerMixin: the step hook runs after it",
             params=("self", "scheduler_output", "num_scheduled_tokens")),
    Internal(f"{_RUNNER}.execute_model", "VaseRunnerMixin: clears the capture plan",
             params=("self", "scheduler_output", "intermediate_tensors")),
    Internal(f"{_RUNNER}.load_model", "both runners: attention class swap",
             params=("self", "load_dummy_weights")),
    Internal(f"{_RUNNER}.initialize_kv_cache", "both runners: the query ring made from the pool, layers attached",
             params=("self", "kv_cache_config")),
    Internal(_RUNNER, "both runners: the step's prepared inputs, made physical",
             attrs=("input_batch", "requests", "query_start_loc", "seq_lens", "optimistic_seq_lens_cpu",
                    "positions", "compilation_config", "model_config", "vllm_config", "device",
                    "discard_request_mask", "attn_groups")),
    Internal(f"{_RUNNER}._sample", "VaseCPUModelRunner._sample: discarded rows sample without their generator",
             params=("self", "logits", "spec_decode_metadata")),
    Internal(f"{_RUNNER}._bookkeeping_sync", "VaseCPUModelRunner: generators put back after vLLM's rewind loop",
             params=("self",)),
    Internal("vllm.v1.worker.gpu_input_batch.InputBatch", "both runners",
             attrs=("num_reqs", "req_ids", "num_computed_tokens_cpu", "num_tokens_no_spec", "block_table",
                    "generators", "req_id_to_index")),
    Internal("vllm.v1.worker.gpu_input_batch.CachedRequestState", "VaseRunnerMixin._vase_request, "
             "_vase_copy_on_write (the request's block ids per group)", attrs=("sampling_params", "num_prompt_tokens",
                                                                               "block_ids")),
    Internal("vllm.v1.worker.block_table.BlockTable", "both runners: a request's blocks",
             attrs=("num_blocks_per_row", "block_table")),
    Internal("vllm.v1.worker.block_table.BlockTable.add_row", "VaseRunnerMixin._vase_copy_on_write: a row rewritten "
             "with the blocks copied on write (vLLM's scheduler output only appends block ids to a running request)",
             params=("self", "block_ids", "row_idx")),
    Internal("vllm.v1.engine.parallel_sampling.ParentRequest.get_child_info", "plugin: wrapped to give each unseeded "
             "child of an n > 1 request its index (SamplingParams.extra_args['vase_child']); child ids k_<parent>",
             params=("self", "index")),
    Internal("vllm.sampling_params.SamplingParams", "VaseRunnerMixin: the eviction seed (seed; extra_args: the child "
             "index)", attrs=("seed", "extra_args", "n")),
    Internal("vllm.v1.worker.block_table.MultiGroupBlockTable.compute_slot_mapping", "GPU runner: slots from "
             "physical positions", params=("self", "num_reqs", "query_start_loc", "positions")),
    Internal("vllm.v1.worker.block_table.BlockTable.compute_slot_mapping", "CPU runner: the full-attention "
             "group's slots from physical positions", params=("self", "num_reqs", "query_start_loc", "positions")),
    Internal("vllm.v1.worker.block_table.MultiGroupBlockTable", "both runners: one block table per KV cache group "
             "(indexed by group)", attrs=("block_tables", "__getitem__")),
    Internal("vllm.v1.worker.utils.AttentionGroup", "VaseCPUModelRunner: the sliding-window groups' builders",
             attrs=("metadata_builders",)),
    Internal("vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder.build", "VaseLogicalLengthsBuilder "
             "(sliding-window groups: logical sequence lengths)", params=("self", "common_prefix_len",
                                                                          "common_attn_metadata")),
    Internal("vllm.v1.attention.backend.CommonAttentionMetadata", "VaseLogicalLengthsBuilder",
             attrs=("seq_lens", "max_seq_len")),
    Internal("vllm.model_executor.layers.attention.attention.Attention", "both runners: the layers in "
             "static_forward_context; refusals.EVICTABLE_LAYERS: the one layer class evicted (an allow-list)",
             attrs=("kv_cache", "impl", "num_heads", "head_size", "head_size_v", "layer_name", "sliding_window")),
    Internal("vllm.model_executor.models.utils.extract_layer_index", "VaseRunnerMixin: layer order",
             params=("layer_name", "num_attn_module")),
    Internal("vllm.v1.worker.cpu_model_runner.CPUModelRunner", "VaseCPUModelRunner (subclass)"),
    Internal("vllm.v1.worker.cpu_worker.CPUWorker.init_device", "VaseCPUWorker: builds the stock runner inline (no "
             "hook), which vase's replaces", params=("self",)),
    Internal("vllm.v1.worker.gpu_worker.Worker._make_model_runner", "VaseGPUWorker: builds vase's runner (the hook; "
             "VaseCPUWorker overrides it too, called from its init_device)", params=("self",)),
    Internal("vllm._custom_ops.cpu_attn_reshape_and_cache", "worker.cpu_kernel_layout: reads the CPU block layout",
             params=("key", "value", "key_cache", "value_cache", "slot_mapping", "isa", "k_scale", "v_scale",
                     "kv_cache_dtype")),
    Internal("vllm.v1.attention.backends.cpu_attn._get_attn_isa", "worker.cpu_kernel_layout",
             params=("dtype", "block_size", "head_size", "kv_cache_dtype")),
    Internal("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward", "capture: records queries, "
             "then attends", params=_IMPL_FORWARD),
    Internal("vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward", "capture (GPU)",
             params=_IMPL_FORWARD),
    Internal("vllm.v1.attention.backends.triton_attn.TritonAttentionImpl.forward", "capture (GPU)",
             params=_IMPL_FORWARD),
    Internal("vllm.v1.attention.backends.flashinfer.FlashInferImpl.forward", "capture (GPU)", params=_IMPL_FORWARD,
             source_only=True),
    # -- the query ring, sized from the KV pool (ring_size.py) ----------------------------------------------
    Internal(_SCHED, "VaseScheduler.__init__: no more running requests than the query ring has rows",
             attrs=("max_num_active_reqs", "max_num_running_reqs")),
    Internal("vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory", "VaseCPUWorker: the ring's rows "
             "taken from the KV memory before the pool is sized", params=("self",)),
    Internal("vllm.v1.worker.gpu_worker.Worker.determine_available_memory", "VaseGPUWorker: the ring's rows taken "
             "from the measured KV memory before the pool is sized", params=("self",)),
    Internal(f"{_RUNNER}.get_kv_cache_spec", "VaseRunnerMixin._vase_ring_reserve: the full-attention layers' "
             "page sizes", params=("self",)),
    Internal("vllm.v1.kv_cache_interface.FullAttentionSpec", "VaseRunnerMixin._vase_ring_reserve: a layer's bytes "
             "per block", attrs=("block_size", "page_size_bytes")),
    Internal("vllm.v1.kv_cache_interface.KVCacheTensor", "VaseRunnerMixin._vase_make_ring: the pool's bytes",
             attrs=("size",)),
    Internal("vllm.config.cache.CacheConfig", "VaseRunnerMixin._vase_ring_reserve: no reserve when the user gave "
             "the KV memory", attrs=("kv_cache_memory_bytes",)),
    # -- a draft model's own KV cache (drafter.py) ----------------------------------------------------------
    Internal(f"{_PROPOSER}.set_inputs_first_pass", "drafter: its slot mapping made physical (overridden)",
             params=("self", "target_token_ids", "next_token_ids", "target_positions", "target_hidden_states",
                     "token_indices_to_sample", "cad", "num_rejected_tokens_gpu")),
    Internal(f"{_PROPOSER}._update_positions_dependent_metadata", "drafter: each later draft pass's slots made "
             "physical (overridden)", params=("self", "positions", "common_attn_metadata", "batch_size",
                                             "input_batch_size", "block_size")),
    Internal(_PROPOSER, "drafter: the draft layers, its positions and slot buffers",
             attrs=("needs_extra_input_slots", "positions", "_slot_mapping_buffer", "block_size",
                    "_draft_attn_layer_names")),
    Internal("vllm.v1.attention.backend.CommonAttentionMetadata", "drafter: a draft pass's requests and slots",
             attrs=("query_start_loc_cpu", "slot_mapping", "block_table_tensor")),
    Internal("vllm.v1.spec_decode.utils.PADDING_SLOT_ID", "drafter.PADDING_SLOT_ID: a slot the KV write skips"),
    Internal("vllm.v1.kv_cache_interface.UniformTypeKVCacheSpecs", "groups.full_attention_group: one group of mixed "
             "specs (a draft model with other KV heads than the target's), refused"),
)
