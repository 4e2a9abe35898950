"""Per-request bookkeeping of the plugin's model runners, shared by the CPU and the GPU worker.

`VaseRunnerMixin` goes before vLLM's model runner in the bases of `VaseCPUModelRunner`
(`vase.vllm.worker`) and `VaseGPUModelRunner` (`vase.vllm.gpu_worker`). It keeps one
`VaseRequest` per running request (created at its prefill, renewed at a recomputing prefill,
dropped when it finishes), calls the runner's `_vase_step` after vLLM prepares a step's inputs,
clears the query capture plan after each step, and checks the invariant every write relies on.
It also makes the query ring once vLLM has built the KV pool, sized from it (`vase.vllm.ring_size`), and
attaches the evicted layers to it.
The runners bring vLLM's classes; from vLLM only its layer numbering is read here.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from vllm.model_executor.models.utils import extract_layer_index

from ..core import schedule
from .capture import QueryRing
from .config import CHILD_KEY, VaseConfigError, VaseVllmConfig
from .drafter import attach, draft_layer_names
from .groups import full_attention_group
from .heads import RankHeads, rank_policy
from .latent import query_size
from .paged import RequestPolicyState
from .refusals import check_evicted_layer, check_head_sizes, check_kv_tensor
from .ring_size import ring_bytes_per_request, ring_log_line, ring_reserve, ring_rows
from .steps import StepPlan, VaseStepError

logger = logging.getLogger("vase.vllm")


def eviction_seed(config_seed: int, request_seed: int | None, extra_args: dict | None) -> int:
    """The seed of a request's eviction stream: its own sampling seed when it has one (vLLM gives the k-th child
    of an `n > 1` request with seed s the seed s + k), else the config's seed plus its child index k (0 for a
    single request), so that unseeded children draw independently and reproducibly."""
    if request_seed is not None:
        return int(request_seed)
    return int(config_seed) + int((extra_args or {}).get(CHILD_KEY, 0))


class VaseRequest:
    """What a runner keeps per running request: its schedule key, last (re)prefill, ring slot and policy state."""

    def __init__(self, origin: int, prefill_len: int, slot: int | None, state: RequestPolicyState, seed: int = 0):
        self.origin = origin  # P0, the prompt length: the schedule's key for the request's whole life
        self.prefill_len = prefill_len  # tokens of its last (re)prefill (P0 until it is preempted; informational)
        self.slot = slot  # its query-ring slot while it runs; None while preempted
        self.state = state
        self.seed = seed  # its generator's seed: a recomputing prefill replays the draws from it
        #: when recording (CPU runner): per layer, the logical position of each stored slot [kv_heads, kept] at
        #: the last eviction, and the logical position where the tokens written since begin
        self.positions: list[torch.Tensor] | None = None
        self.positions_since = 0


class VaseRunnerMixin:
    """The per-request part of vase's model runners (see the module docstring).

    Its `__init__` is the one constructor of both runners: vLLM's, then vase's state (`vase_config`,
    `vase_policy`, `vase_requests`, `vase_ring`, the counters). The runner defines `_vase_step(scheduled)`;
    vLLM's runner brings `input_batch`, `requests`, `device`, `compilation_config` and `model_config`."""

    vase_config: VaseVllmConfig
    vase_requests: dict[str, VaseRequest]
    vase_ring: QueryRing | None
    vase_recomputes: int
    vase_layers: list[str]
    vase_block_size: int
    vase_group: int = 0

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.vase_config = VaseVllmConfig.from_additional_config(vllm_config.additional_config)
        self.vase_policy = self._vase_rank_policy(vllm_config)  # TP: kept sets independent of the degree
        self.vase_requests: dict[str, VaseRequest] = {}
        self.vase_ring: QueryRing | None = None
        self.vase_layers: list[str] = []
        self.vase_evictions = 0  # eviction events (all layers of one request at one step count once)
        self.vase_recomputes = 0  # replays of preempted requests (their policy state starts over, re-seeded)
        self.vase_recomputed_tokens = 0  # tokens those replays prefilled again

    def _vase_step(self, scheduled: np.ndarray) -> None:
        raise NotImplementedError

    def _vase_rank_policy(self, vllm_config):
        """The configured policy as this tensor-parallel rank runs it: selecting over all global KV heads, so
        that its kept set (random draws included) is TP = 1's (`vase.vllm.heads`)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        heads = RankHeads.of_rank(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                                  vllm_config.model_config.get_total_num_kv_heads())
        return rank_policy(self.vase_config.policy, heads)

    # -- vLLM's hooks ---------------------------------------------------------------------------------
    def _update_states(self, scheduler_output):
        # the blocks the scheduler holds for each scheduled request now (after its trims; `VaseScheduler.schedule`)
        self.vase_owned = getattr(scheduler_output, "vase_blocks", None)
        # speculative decoding: the draft tokens (or vLLM's placeholders) each request verifies this step
        self.vase_drafts = {req_id: len(tokens) for req_id, tokens in
                            (getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}).items()}
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._vase_preempted(req_id)
        # resumed after a preemption: its replay may start past 0 (a prefix-cache hit), the state starts over
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        self.vase_resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        result = super()._update_states(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._vase_forget(req_id)
        self.vase_copy_sources = self._vase_copy_on_write(getattr(scheduler_output, "vase_copies", None) or {})
        return result

    def _vase_copy_on_write(self, copies: dict[str, list[tuple[int, int, int]]]) -> dict[str, list[int]]:
        """The scheduler gave these requests fresh blocks in place of shared ones this step (`VaseScheduler.schedule`:
        {request id: [(index, old id, new id)]}): each one's block list and block-table row take the new ids, and
        the returned {request id: its block ids before} is what this step's compaction reads (the shared blocks
        are never written)."""
        sources = {}
        for req_id, swaps in copies.items():
            state = self.requests[req_id]
            ids = state.block_ids[self.vase_group]
            sources[req_id] = list(ids)
            for i, old, new in swaps:
                if ids[i] != old:
                    raise RuntimeError(f"vase: request {req_id} holds block {ids[i]} at {i}, the scheduler copied "
                                       f"block {old} there: the scheduler and the worker disagree on its blocks")
                ids[i] = new
            self.input_batch.block_table[self.vase_group].add_row(ids, self.input_batch.req_id_to_index[req_id])
        return sources

    def _vase_eviction_blocks(self, req_id: str, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks request `req_id` (row `index`) is evicted from [n_blocks], and those its kept slots go to
        (None: the same, in place; the block-table row's ids when this step copied shared blocks on write)."""
        table = self.input_batch.block_table[self.vase_group]
        row = torch.from_numpy(table.block_table.np[index, : table.num_blocks_per_row[index]].astype(np.int64))
        sources = getattr(self, "vase_copy_sources", {}).pop(req_id, None)
        if sources is None:
            return row.to(self.device), None
        return torch.tensor(sources[: row.numel()], dtype=torch.int64, device=self.device), row.to(self.device)

    def _vase_check_copies(self) -> None:
        """Every block copied on write this step was for a compaction that ran (its new blocks hold nothing yet)."""
        left = getattr(self, "vase_copy_sources", None)
        if left:
            raise VaseStepError(f"vase: requests {sorted(left)} got fresh blocks for a compaction that did not run "
                                f"this step: the scheduler and the worker disagree on their schedule")

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._vase_step(np.asarray(num_scheduled_tokens))
        return result

    def execute_model(self, *args, **kwargs):
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            if self.vase_ring is not None:
                self.vase_ring.plan = None

    def _vase_attention_impls(self):
        """(layer name, attention implementation) of each of this engine's layers that has one (after load_model)."""
        for name, layer in self.compilation_config.static_forward_context.items():
            impl = getattr(layer, "impl", None)
            if impl is not None:
                check_head_sizes(name, layer)  # FlashAttention/Triton take value heads of another size; eviction not
                yield name, impl

    def _vase_ring_layers(self) -> tuple[list, int, int]:
        """(the full-attention layers' KV specs, query heads, head size) from vLLM's `get_kv_cache_spec` and the
        attention layers: what the ring and its reserve are sized by (sliding-window layers have no ring row)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        evicted = (FullAttentionSpec, MLAAttentionSpec)  # an MLA model's latent caches (`vase.vllm.latent`)
        specs = [spec for spec in self.get_kv_cache_spec().values() if type(spec) in evicted]
        ctx = self.compilation_config.static_forward_context
        first = next(ctx[name] for name, _ in self._vase_attention_impls())
        return specs, int(first.num_heads), query_size(first)

    def _vase_ring_reserve(self, available: int) -> int:
        """Bytes the workers take from the KV memory vLLM measured, before it sizes the pool: the ring of the
        requests the pool will hold at their bounded size (`vase.vllm.ring_size`). 0 when the policy reads no
        queries, or when the KV memory was given (`kv_cache_memory_bytes`: the user sized the pool; the ring
        then sits outside it, as vLLM's activations do)."""
        if not self.vase_policy.needs_queries or self.vllm_config.cache_config.kv_cache_memory_bytes is not None:
            return 0
        cfg = self.vase_config
        specs, q_heads, head_size = self._vase_ring_layers()
        kv = sum(s.page_size_bytes * schedule.max_blocks(cfg.budget, cfg.window, s.block_size) for s in specs)
        rows = len(specs) - len(draft_layer_names(self))  # a draft model's layers hold K/V, no ring (vase.vllm.drafter)
        ring = ring_bytes_per_request(rows, q_heads, cfg.window, head_size, self.model_config.dtype.itemsize)
        return ring_reserve(int(available), kv, ring, int(self.vllm_config.scheduler_config.max_num_seqs))

    def _vase_make_ring(self, kv_cache_config) -> None:
        """After vLLM sized the KV pool: the query ring of the evicted layers (`vase_layers`), one row per request
        the pool holds at its bounded size, at most `max_num_seqs` (`vase.vllm.ring_size.ring_rows`; the scheduler
        admits no more running requests than that). Nothing stored for a policy that reads no queries. Never grown;
        one log line gives its bytes as a share of the pool."""
        cfg, max_seqs = self.vase_config, int(self.vllm_config.scheduler_config.max_num_seqs)
        block_size = kv_cache_config.kv_cache_groups[self.vase_group].kv_cache_spec.block_size
        stores = bool(self.vase_policy.needs_queries)
        rows = ring_rows(kv_cache_config.num_blocks, block_size, cfg.budget, cfg.window, max_seqs, stores)
        first = self.compilation_config.static_forward_context[self.vase_layers[0]]
        self.vase_ring = QueryRing(self.vase_layers, first.num_heads, query_size(first), cfg.window,
                                   self.model_config.dtype, self.device, slots=rows, store=stores)
        if stores:
            pool = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
            bounded = schedule.max_blocks(cfg.budget, cfg.window, block_size)
            logger.info(ring_log_line(rows, kv_cache_config.num_blocks // bounded, max_seqs, self.vase_ring.nbytes,
                                      pool, bounded))

    def _vase_attach_layers(self, kv_cache_config, hybrid: bool = False):
        """After vLLM's `initialize_kv_cache`: the full-attention group (`vase_group`; `hybrid`: other groups may be
        sliding-window ones) and its attention layers in order (`vase_layers`), attached to the query ring made
        here from the pool (`vase_ring`), the KV tensors checked, the scheduler's block size (`vase_block_size`).
        Returns the first attention layer (its head size and heads are every layer's)."""
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 and not hybrid:
            raise VaseConfigError(f"vase's GPU worker needs one KV cache group (full attention everywhere), this "
                                  f"model has {len(groups)}: use a model without sliding-window or hybrid layers")
        # the full-attention group, evicted; sliding-window groups are left to vLLM (vase.vllm.groups)
        latent = bool(getattr(self, "vase_latent", None))  # MLA: one group of latent caches (`vase.vllm.latent`)
        self.vase_group = full_attention_group(kv_cache_config)  # refuses local attention in the evicted group
        # a draft model's layers share the group (one KV spec) and are evicted apart, sink + recent (vase.vllm.drafter)
        draft = draft_layer_names(self)
        names = groups[self.vase_group].layer_names
        if draft - set(names):
            raise VaseConfigError(f"vase evicts a draft model's layers in the target's KV cache group, and "
                                  f"{sorted(draft - set(names))} sit in another: use a draft model with the target's "
                                  f"KV heads, head size and dtype, or drop speculative_config")
        self.vase_layers = sorted((n for n in names if n not in draft), key=extract_layer_index)
        self.vase_draft_layers = tuple(sorted((n for n in names if n in draft), key=extract_layer_index))
        if draft:
            attach(self.drafter, self)
        ctx = self.compilation_config.static_forward_context
        first = ctx[self.vase_layers[0]]
        self._vase_make_ring(kv_cache_config)  # sized from the pool vLLM just built
        for name in self.vase_layers + list(self.vase_draft_layers):
            if not latent:  # the MLA layer is vLLM's MLAAttention, taken by `latent.install_latent`
                check_evicted_layer(name, ctx[name])  # plain full attention only: an allow-list
            check_kv_tensor(name, ctx[name].kv_cache.dtype, self.model_config.dtype, self.cache_config.cache_dtype)
        for name in self.vase_layers:  # the draft layers record no queries (their kept set reads none)
            if latent:  # the MLA layer records its own queries (`latent.install_latent`)
                ctx[name].vase_ring = self.vase_ring
            else:
                ctx[name].impl.vase_ring = self.vase_ring
        self.vase_block_size = groups[self.vase_group].kv_cache_spec.block_size  # the scheduler's; a kernel's may be smaller
        return first

    # -- requests -------------------------------------------------------------------------------------
    def _vase_forget(self, req_id: str) -> None:
        req = self.vase_requests.pop(req_id, None)
        if req is not None and req.slot is not None and self.vase_ring is not None:
            self.vase_ring.release(req.slot)

    def _vase_preempted(self, req_id: str) -> None:
        """A preempted request gives its ring slot back (its recomputing prefill records the window again), so
        the slots in use never pass the requests running; its policy state and generator stay."""
        req = self.vase_requests.get(req_id)
        if req is not None and req.slot is not None and self.vase_ring is not None:
            self.vase_ring.release(req.slot)
            req.slot = None

    def _vase_request(self, req_id: str, index: int, computed: int) -> VaseRequest:
        """The state of request `req_id` (row `index` of the input batch, `computed` tokens written so far)."""
        req = self.vase_requests.get(req_id)
        # a new request, or one resumed after preemption: a (re)prefill starts here, at 0 or after a prefix-cache hit
        if req is None or computed == 0 or req_id in getattr(self, "vase_resumed", ()):
            prefill_len = int(self.input_batch.num_tokens_no_spec[index])
            if req is None:
                params = self.requests[req_id].sampling_params
                if params is None:  # a pooling request (the config check refuses pooling models first)
                    raise VaseConfigError(f"vase: request {req_id} has no sampling parameters (a pooling request): "
                                          f"use a generative model or drop additional_config['vase']")
                seed = eviction_seed(self.vase_config.seed, params.seed, getattr(params, "extra_args", None))
                generator = torch.Generator(device=self.device).manual_seed(seed)
                origin = int(self.requests[req_id].num_prompt_tokens)
                req = VaseRequest(origin, prefill_len, self.vase_ring.acquire(), RequestPolicyState(generator), seed)
                self.vase_requests[req_id] = req
            else:  # recomputed: the replay evicts again from the start, with fresh state and the same draws
                if req.slot is None:
                    req.slot = self.vase_ring.acquire()
                req.prefill_len = prefill_len
                req.state = RequestPolicyState(torch.Generator(device=self.device).manual_seed(req.seed))
                req.positions = None
                self.vase_recomputes += 1
                self.vase_recomputed_tokens = getattr(self, "vase_recomputed_tokens", 0) + prefill_len
        return req

    def _vase_check_room(self, req_id: str, req: VaseRequest, plan: StepPlan, room: int, computed: int,
                         scheduled: int = 1) -> None:
        """The invariant every write relies on, before the forward: the step's slots lie in the blocks the request
        owns now (the first blocks of its row: `room` slots in the worker's row, which never shrinks, cut to what
        the scheduler holds after its trims, `vase_owned`), and its physical length is within the schedule's
        current bound (max(P, B) + w before the first eviction, B + w after it; a recompute replays the same).
        VaseStepError in one line, naming the first slot outside, otherwise."""
        cfg = self.vase_config
        owned = getattr(self, "vase_owned", None)
        if owned is not None and req_id in owned:
            room = min(room, int(owned[req_id]) * self.vase_block_size)
        if computed >= req.origin and schedule.num_evictions(req.origin, cfg.budget, cfg.window,
                                                             computed + 1 - req.origin) > 0:
            bound = schedule.steady_limit(cfg.budget, cfg.window)
        else:
            bound = schedule.first_limit(req.origin, cfg.budget, cfg.window)
        limit = min(room, bound)
        if plan.physical_end > limit:
            first = max(limit, plan.physical_end - scheduled)
            raise VaseStepError(f"vase: request {req_id} would write slot {first} outside the {room} slots it owns "
                                f"(bound {bound}; prompt {req.origin}, prefill {req.prefill_len}, position "
                                f"{computed}): the scheduler and the worker disagree on its schedule")
