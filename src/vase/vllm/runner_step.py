"""The one worker step of the plugin: evict, plan the query capture, make lengths and slots physical.

Both model runners, vLLM's CPU one (`vase.vllm.worker`) and its GPU one (`vase.vllm.gpu_worker`),
take `VaseStepMixin`: after vLLM's `_prepare_inputs` (through `VaseRunnerMixin`), `_vase_step`

1. plans each request's step (`vase.vllm.offsets.plan_batch`) and checks its blocks hold it;
2. evicts the requests whose step starts on an eviction boundary in every layer of the
   full-attention group, those of one length together (`_vase_evict`: `vase.vllm.paged.evict_paged_batch`,
   one gather, one policy call and one scatter per layer for all of them; a draft model's layers in that group
   are compacted at the same steps, sink + recent, and its own slots made physical: `vase.vllm.drafter`);
3. plans the step's query-window copies into the ring (`capture_rows`);
4. makes the full-attention group's sequence lengths and slot mapping physical (RoPE positions
   stay logical); sliding-window groups (CPU) keep vLLM's logical slots, and their metadata
   builders the logical lengths (`vase_logical_seq_lens`).

What differs between the runners stays in their modules: where the KV views come from
(`_kv_views`) and how a block's rows are stored (`vase_layout`: the CPU kernel's packed layout,
None for the GPU backends' strided views). A fix to the step lands once, here.
"""

from __future__ import annotations

import numpy as np
import torch

from .capture import CapturePlan
from .drafter import evict_draft_layers
from .fp8 import Fp8Codec, layer_codec
from .latent import evict_latent_batch, latent_cache
from .offsets import capture_rows, physical_positions, physical_seq_lens, plan_batch
from .paged import EvictionJob, Layout, evict_paged_batch
from .requests import VaseRequest, VaseRunnerMixin
from .stages import draws
from .steps import draft_limit


class VaseStepMixin(VaseRunnerMixin):
    """`_vase_step` and `_vase_evict` of both vLLM model runners (see the module docstring)."""

    vase_layout: Layout | None = None  # the CPU kernel's packed block layout; None: strided views (GPU)
    #: set to a dict to record, per request id, its evictions and the slots its first eviction kept per layer
    vase_record: dict | None = None
    vase_logical_seq_lens: torch.Tensor | None = None
    #: pipeline parallelism: (evicted layers on earlier stages, on later stages); (0, 0) for one stage
    vase_pp_span: tuple[int, int] = (0, 0)
    #: a draft model's layers in the evicted group (`vase.vllm.drafter`), and per request row this step's offset and
    #: first position without a draft slot ([R] int64; None without a draft model)
    vase_draft_layers: tuple[str, ...] = ()
    vase_draft_offsets: torch.Tensor | None = None
    vase_draft_limits: torch.Tensor | None = None

    def _kv_views(self, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _vase_step(self, scheduled: np.ndarray) -> None:
        """Evict, plan the capture and make the step's lengths and slots physical (after vLLM's `_prepare_inputs`)."""
        cfg, batch = self.vase_config, self.input_batch
        num_reqs = batch.num_reqs
        scheduled = scheduled[:num_reqs].astype(np.int64)
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        starts = self.query_start_loc.np[:num_reqs].astype(np.int64)
        req_ids = list(batch.req_ids[:num_reqs])
        table = batch.block_table[self.vase_group]
        self.vase_logical_seq_lens = None
        reqs = [self._vase_request(req_id, i, int(computed[i])) for i, req_id in enumerate(req_ids)]
        drafts = getattr(self, "vase_drafts", None) or {}  # speculative decoding: draft tokens per request
        plans = plan_batch(req_ids, np.array([r.origin for r in reqs]), computed, scheduled, cfg.budget, cfg.window,
                           np.array([drafts.get(req_id, 0) for req_id in req_ids]))
        for i, (req, plan) in enumerate(zip(reqs, plans)):
            self._vase_check_room(req_ids[i], req, plan, int(table.num_blocks_per_row[i]) * self.vase_block_size,
                                  int(computed[i]), int(scheduled[i]))
        # the requests evicting this step, by (length, kept): each group in one batch per layer
        groups: dict[tuple[int, int], list[int]] = {}
        for i, plan in enumerate(plans):
            if plan.evict_from:
                groups.setdefault((plan.evict_from, plan.evict_to), []).append(i)
        for (length, keep), rows in groups.items():
            self._vase_evict([req_ids[i] for i in rows], [reqs[i] for i in rows], rows, length, keep,
                             [int(computed[i]) for i in rows])
        self._vase_check_copies()
        as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)
        # the last w queries of this step join each request's window
        src, slot, pos = capture_rows(starts, computed, scheduled, np.array([r.slot for r in reqs]), cfg.window)
        self.vase_ring.plan = CapturePlan(src=as_long(src), slot=as_long(slot), pos=as_long(pos))
        offsets = np.array([p.offset for p in plans], dtype=np.int64)
        if self.vase_draft_layers:  # the draft model's writes this step: physical slots (`vase.vllm.drafter`)
            self.vase_draft_offsets = as_long(offsets)
            self.vase_draft_limits = as_long([draft_limit(r.origin, int(c), cfg.budget, cfg.window)
                                              for r, c in zip(reqs, computed)])
        if not offsets.any():
            return
        tables = batch.block_table
        hybrid = len(getattr(tables, "block_tables", ())) > 1
        if hybrid:  # the sliding-window groups keep the logical lengths
            self.vase_logical_seq_lens = self.seq_lens.clone()
        # seq_lens (device) -> the kernels' per-request KV lengths; optimistic_seq_lens_cpu -> seq_lens_cpu_upper_bound
        # and max_seq_len, read by the metadata builders after this hook.
        self.seq_lens[:num_reqs] -= as_long(offsets).to(self.seq_lens.dtype)
        upper = self.optimistic_seq_lens_cpu[:num_reqs]
        upper.copy_(torch.from_numpy(physical_seq_lens(upper.numpy().astype(np.int64), offsets)))
        logical = np.repeat(computed, scheduled) + (np.arange(int(scheduled.sum())) - np.repeat(starts, scheduled))
        physical = as_long(physical_positions(logical, offsets, scheduled))
        # every group's slot mapping when there is one group; else the full-attention group's alone
        (table if hybrid else tables).compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1],
                                                           physical)

    def _vase_evict(self, req_ids: list[str], reqs: list[VaseRequest], indices: list[int], length: int, keep: int,
                    seen: list[int]) -> None:
        """Bring the k requests `req_ids` (rows `indices`, each with `length` stored tokens) to `keep` (B) in every
        layer of the full-attention group, all k at once per layer (`evict_paged_batch`: one gather, one policy
        call, one scatter), in place or, for blocks shared with other requests, into the fresh blocks the
        scheduler gave this step (copy-on-write; sliding-window groups are vLLM's). `seen`: logical tokens written
        so far, per request."""
        cfg = self.vase_config
        jobs = []
        for req_id, req, index in zip(req_ids, reqs, indices):
            block_ids, target = self._vase_eviction_blocks(req_id, index)  # target: None, or fresh blocks
            jobs.append(EvictionJob(block_ids, req.state, target))
        reads = self.vase_policy.needs_queries
        if reads:
            slots = torch.tensor([req.slot for req in reqs], dtype=torch.int64, device=self.device)
            seen_t = torch.tensor(seen, dtype=torch.int64, device=self.device)
        kept = []
        latent = getattr(self, "vase_latent", None)  # MLA: layer name -> its up-projection (`vase.vllm.latent`)
        for layer, name, own in self._vase_layer_order():  # the full-attention group's layers only
            queries = self.vase_ring.windows_of(self.vase_ring.index[name], slots, seen_t) if reads else None
            if latent:  # one kept set per layer for every head, whole latent rows moved
                cache = latent_cache(self.compilation_config.static_forward_context[name].kv_cache)
                index = evict_latent_batch(cache, jobs, length, queries, self.vase_policy, keep, cfg.window, layer,
                                           latent[name], block_size=self.vase_block_size, sort_kept=cfg.sort_kept,
                                           write=own)
                if own:
                    kept.append(index)
                continue
            keys, values = self._kv_views(name)
            index = evict_paged_batch(keys, values, jobs, length, queries, self.vase_policy, keep, cfg.window,
                                      layer, sort_kept=cfg.sort_kept, layout=self.vase_layout,
                                      block_size=self.vase_block_size, codec=self._vase_codec(name), write=own)
            if own:
                kept.append(index)
        if self.vase_draft_layers:  # the draft model's layers: the same steps and lengths, sink + recent
            evict_draft_layers(self._kv_views, list(self.vase_draft_layers), jobs, length, keep, cfg.window,
                               self.vase_layout, self.vase_block_size)
        for j, (req_id, req) in enumerate(zip(req_ids, reqs)):
            req.state.evictions += 1
            self.vase_evictions += 1
            if self.vase_record is not None:
                self._vase_record_eviction(req_id, req, [k[j:j + 1] for k in kept], length, seen[j])

    def _vase_layer_order(self) -> list[tuple[int, str, bool]]:
        """(global layer index, the layer whose K/V it reads, whether it is this stage's own) in model order. Without
        pipeline parallelism: this runner's layers. A later or earlier pipeline stage also replays the other stages'
        layers when the policy draws, on its first or last layer's K/V, writing nothing (`vase.vllm.stages`)."""
        before, after = self.vase_pp_span
        own = [(before + i, name, True) for i, name in enumerate(self.vase_layers)]
        if not (before or after) or not draws(self.vase_policy):
            return own
        first, last = self.vase_layers[0], self.vase_layers[-1]
        return ([(g, first, False) for g in range(before)] + own
                + [(before + len(own) + g, last, False) for g in range(after)])

    def _vase_codec(self, layer_name: str) -> Fp8Codec | None:
        """How the policy reads this layer's stored K/V: None (unquantised), or an fp8 cache's codes decoded with the
        layer's k_scale / v_scale (`vase.vllm.fp8`)."""
        layer = self.compilation_config.static_forward_context[layer_name]
        return layer_codec(layer, self.cache_config.cache_dtype, self.model_config.dtype)

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
