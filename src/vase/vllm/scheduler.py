"""Scheduler side of the plugin: block accounting by physical length, blocks above the bound go back.

`VaseScheduler` is vLLM's scheduler (set through `scheduler_cls`) with its KV cache manager
wrapped: a request that is past its first eviction is allocated blocks for its physical length
(`vase.schedule.physical_length` keyed by its prompt length), and after the step of each
eviction its blocks above ceil((B + w) / block_size) return to the pool. Multi-token steps end at
the request's eviction boundaries (`_reserve_prefill_lookahead`), so a request preempted and
resumed (vLLM recomputes its whole history as a prefill) replays its history in chunks, the
worker evicting between them exactly as decoding did (`vase.vllm.steps`): it gets its tokens,
its kept sets and its block count back, and never holds more than the uninterrupted schedule
plus the chunk in flight. The worker follows the same schedule; the blocks each request holds
are sent to it in the scheduler output (`vase_blocks`) for its invariant check.

With prefix caching (vLLM's default) a compaction never writes into a block another request holds or
that vLLM's prefix cache offers: before the step that evicts, such a block among those the compaction
rewrites is copied (the request gets a fresh block, the shared one keeps its content and hash) or, when
it is the request's own and not a whole prompt block (or the pool is short), dropped from the prefix
cache (`EvictingKVCacheManager.plan_copies`); the new block ids go to the workers in the scheduler
output (`vase_copies`). A resumed request's prefix-cache hit is cut at max(P0, B) (`max_prefix_hit`).
Those copies are counted before they are needed: every allocation that is not a compaction (a request admitted
from the waiting queue, a step of a running one) leaves free the blocks the running requests' first compactions
will copy (`EvictingKVCacheManager.pending_copies`), through vLLM's own `reserved_blocks` of `allocate_slots`; so
vLLM admits fewer children of a shared prompt at once instead of preempting them at their first compaction.

A model with sliding-window layers (Gemma 3, gpt-oss) has several KV cache groups
(`vase.vllm.groups`): all of the above applies to the full-attention group only. Its manager
allocates by the physical length (`PhysicalLengthManager`, in its place in vLLM's coordinator) while vLLM allocates and frees the
sliding-window groups' blocks by the logical length, as without vase.
"""

from __future__ import annotations

from collections import Counter

from vllm.v1.core.sched.scheduler import Scheduler

from .. import schedule
from .config import VaseConfigError, VaseVllmConfig
from .plugin import PREFIX_HYBRID_REFUSAL, STREAMING_REFUSAL
from .groups import full_attention_group
from .ring_size import ring_rows
from .steps import allocation_length, evicts_at, max_prefix_hit, next_boundary


class PhysicalLengthManager:
    """The full-attention group's `SingleTypeKVCacheManager`, in its place in the coordinator: while
    `vase_physical` names a request, its blocks are counted and allocated for that physical length instead of
    the logical one vLLM passes to every group. Delegates everything else (vLLM's managers are slotted classes,
    so a class swap is not possible)."""

    def __init__(self, inner):
        self._inner = inner
        self.vase_physical: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
        physical = self.vase_physical.get(request_id)
        if physical is not None:
            num_tokens = num_tokens_main_model = physical
        return self._inner.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                      total_computed_tokens, num_local_computed_tokens,
                                                      num_tokens_main_model, *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
        physical = self.vase_physical.get(request_id)
        if physical is not None:
            num_tokens = num_tokens_main_model = physical
        return self._inner.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model, *args, **kwargs)


class EvictingKVCacheManager:
    """vLLM's KVCacheManager, allocating for the physical length once a request evicts (delegates the rest)."""

    def __init__(self, inner, cfg: VaseVllmConfig, block_size: int, group: int = 0):
        self._inner = inner
        self.cfg = cfg
        self.block_size = block_size
        self.group = group  # the full-attention KV cache group: the one evicted, trimmed and counted
        managers = inner.coordinator.single_type_managers
        self.hybrid = len(managers) > 1
        if self.hybrid:
            wrapped = list(managers)
            wrapped[group] = PhysicalLengthManager(managers[group])
            inner.coordinator.single_type_managers = type(managers)(wrapped)
        if self.hybrid and getattr(inner, "enable_caching", False):  # the plugin turns it off first (plugin.py)
            raise VaseConfigError(PREFIX_HYBRID_REFUSAL)
        #: copy-on-write made while this step is scheduled: request id -> [(index, shared block, its new block)];
        #: the shared blocks keep the request's reference until `release_copies` (after the step is scheduled)
        self.copies: dict[str, list[tuple[int, object, object]]] = {}
        self.vase_copied_blocks = 0  # shared blocks copied on write so far
        self.vase_uncached_blocks = 0  # blocks of its own a request dropped from the prefix cache to rewrite them
        self.vase_hit_tokens = 0  # tokens taken from the prefix cache (after the cut below)
        self.vase_hits_cut = 0  # lookups whose hit was cut at max(P0, B)
        #: the scheduler's requests by id (set by `VaseScheduler`): who holds which blocks, before its compaction
        self.requests: dict = {}
        self.vase_reserve_refusals = 0  # allocations refused while copies were reserved (`pending_copies`)

    @property
    def full_manager(self):
        """The full-attention group's `SingleTypeKVCacheManager`."""
        return self._inner.coordinator.single_type_managers[self.group]

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def physical_after(self, request, n_tokens: int) -> int | None:
        """Physical length once `n_tokens` (logical) are written, or None while it equals the logical length. The
        uninterrupted schedule's, also while a recomputing prefill replays it (its chunks end at the boundaries)."""
        stored = allocation_length(request.num_prompt_tokens, n_tokens, self.cfg.budget, self.cfg.window)
        return stored if stored < n_tokens else None

    def get_computed_blocks(self, request):
        """vLLM's prefix-cache lookup, its hit cut to `steps.max_prefix_hit` blocks: a request resumed after a
        preemption could hit the blocks it decoded before its first eviction, and its replay must still compute the
        last w tokens before that eviction (the policy reads their queries). A new request's hit is within its
        prompt and never cut."""
        blocks, hits, *rest = self._inner.get_computed_blocks(request)
        cap = max_prefix_hit(request.num_prompt_tokens, self.cfg.budget, self.block_size)
        if hits > cap:
            n = cap // self.block_size
            blocks = self._inner.create_kv_cache_blocks(tuple(list(group[:n]) for group in blocks.blocks))
            hits = cap
            self.vase_hits_cut += 1
        self.vase_hit_tokens += hits
        return (blocks, hits, *rest)

    def plan_copies(self, request, free: int) -> tuple[list[int], list[int]]:
        """For a step of `request` that evicts (else ([], [])): which of the blocks its compaction rewrites (its
        first ceil((B + w) / block) blocks) it must not write into, given `free` blocks in the pool beyond the step's
        own need. Returns (to copy, to drop from the prefix cache):

        - a block another request holds too (a prefix-cache hit, a parent prompt of n > 1): copied, always;
        - a whole prompt block of its own in the prefix cache (the next request with that prompt would hit it):
          copied while the pool keeps a request's worth of blocks (ceil((B + w) / block)) free after the copies,
          else dropped from the prefix cache;
        - any other block of its own in the prefix cache (decoded tokens): dropped from the prefix cache, so that
          it is never offered as a hit for tokens it no longer holds (its content is rewritten in place).
        With prefix caching off every block is the request's alone and uncached: nothing to do."""
        if not evicts_at(request.num_prompt_tokens, request.num_computed_tokens, self.cfg.budget, self.cfg.window):
            return [], []
        manager = self.full_manager
        blocks = manager.req_to_blocks.get(request.request_id, ())
        keep = schedule.max_blocks(self.cfg.budget, self.cfg.window, self.block_size)
        writable = manager.block_pool.is_block_writable
        unwritable = [i for i in range(min(keep, len(blocks))) if not writable(blocks[i])]
        shared = [i for i in unwritable if blocks[i].ref_cnt > 1]
        in_prompt = request.num_prompt_tokens // self.block_size  # whole prompt blocks
        prompt = [i for i in unwritable if blocks[i].ref_cnt == 1 and i < in_prompt]
        if free - len(shared) - len(prompt) < keep:
            prompt = []
        copy = sorted(shared + prompt)
        return copy, [i for i in unwritable if i not in copy]

    def compacts_later(self, request) -> bool:
        """Whether `request` has its first compaction still ahead (at logical position max(P0, B) + w): not past it,
        and asked for enough tokens to reach it."""
        first = schedule.first_limit(request.num_prompt_tokens, self.cfg.budget, self.cfg.window)
        return (request.num_computed_tokens <= first
                and request.num_prompt_tokens + getattr(request, "max_tokens", first) > first)

    def pending_copies(self, admitted=None, hit_blocks=()) -> int:
        """Fresh blocks the running requests will take for copy-on-write at their first compaction (0 with prefix
        caching off), plus those of request `admitted` about to take `hit_blocks` (its prefix-cache hit, full-attention
        group) from the cache. A block among the first ceil((B + w) / block) of h such requests that more than one
        request holds is copied by each of those h: the last holder finds it its own only when the others compacted in
        an earlier step (in the same step their copies still read it), so h is an upper bound, reached by children of
        one prompt that compact together."""
        if not getattr(self._inner, "enable_caching", False):
            return 0
        keep = schedule.max_blocks(self.cfg.budget, self.cfg.window, self.block_size)
        holders: Counter = Counter()  # block id -> requests holding it among their first `keep`, compaction ahead
        refs: dict[int, int] = {}  # block id -> references (this step's copy-on-write holds the old blocks too)
        for rid, blocks in self.full_manager.req_to_blocks.items():
            request = self.requests.get(rid)
            if request is None or not self.compacts_later(request):
                continue
            for block in blocks[:keep]:
                holders[block.block_id] += 1
                refs.setdefault(block.block_id, block.ref_cnt)
        if admitted is not None and self.compacts_later(admitted):
            for block in list(hit_blocks)[:keep]:
                holders[block.block_id] += 1
                refs[block.block_id] = refs.get(block.block_id, block.ref_cnt) + 1
        return sum(h for b, h in holders.items() if refs[b] > 1)

    def copy_on_write(self, request_id: str, shared: list[int]) -> None:
        """Give request `request_id` a fresh block of its own in place of each shared one (`shared`: indices in its
        block list). The shared blocks are untouched (content, hash) and keep this request's reference until
        `release_copies`, so that no other request is given them before the worker has read them this step."""
        manager = self.full_manager
        blocks = manager.req_to_blocks[request_id]
        fresh = manager.block_pool.get_new_blocks(len(shared))
        if getattr(manager, "records_new_block_ids", False):  # zeroed by the worker before the compaction writes
            manager.new_block_ids.extend(b.block_id for b in fresh)
        self.vase_copied_blocks += len(fresh)
        swaps = self.copies.setdefault(request_id, [])
        for i, block in zip(shared, fresh):
            swaps.append((i, blocks[i], block))
            blocks[i] = block

    def release_copies(self, scheduled) -> dict[str, list[tuple[int, int, int]]]:
        """After a step is scheduled: drop this step's copy-on-write references to the shared blocks (freed by
        reference count: a cached block stays in the prefix cache) and return, for each request in `scheduled`,
        [(index, old block id, new block id)] for the worker. A request vLLM preempted after its copy was made
        gave its new blocks back with the rest; nothing is sent for it."""
        copies, self.copies = self.copies, {}
        old = [b for swaps in copies.values() for _, b, _ in swaps]
        if old:
            self.full_manager.block_pool.free_blocks(old)
        return {rid: [(i, a.block_id, b.block_id) for i, a, b in swaps] for rid, swaps in copies.items()
                if rid in scheduled}

    def allocate_slots(self, request, num_new_tokens: int, *args, **kwargs):
        """vLLM's `allocate_slots`; a step that evicts is allocated the physical length and its copy-on-write, any
        other step leaves the running requests' future copies free (`pending_copies`, as vLLM's `reserved_blocks`)."""
        physical = self.physical_after(request, request.num_computed_tokens + num_new_tokens)
        evicting = evicts_at(request.num_prompt_tokens, request.num_computed_tokens, self.cfg.budget, self.cfg.window)
        reserve = 0
        if not evicting:  # a compaction takes its own copies out of the reserve: not counted against itself
            hits = kwargs.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            hit_blocks = hits.blocks[self.group] if hits is not None and not self.hybrid else ()
            reserve = self.pending_copies(request, hit_blocks)  # hits: the waiting path only
        if physical is None:
            if reserve:
                base = kwargs.pop("reserved_blocks", 0)
                result = self._inner.allocate_slots(request, num_new_tokens, *args, reserved_blocks=base + reserve,
                                                    **kwargs)
                if result is None:
                    self.vase_reserve_refusals += 1
                return result
            return self._inner.allocate_slots(request, num_new_tokens, *args, **kwargs)
        inner = self._inner
        if self.hybrid:  # vLLM allocates every group, the full-attention one for the physical length
            full = self.full_manager
            full.vase_physical[request.request_id] = physical
            try:
                return inner.allocate_slots(request, num_new_tokens, *args, **kwargs)
            finally:
                del full.vase_physical[request.request_id]
        blocks = self.full_manager.req_to_blocks[request.request_id]
        needed = schedule.cdiv(physical, self.block_size) - len(blocks)
        free = inner.block_pool.get_num_free_blocks() - max(needed, 0)
        if needed > 0 and free < reserve:  # a step after the first compaction: the others' copies come first
            self.vase_reserve_refusals += 1
            return None
        copy, uncache = self.plan_copies(request, free)  # the blocks this step's compaction must not write into
        if len(copy) > free:
            return None
        if copy:
            self.copy_on_write(request.request_id, copy)
        if uncache:  # its own: rewritten in place, so never a prefix-cache hit again
            self.vase_uncached_blocks += len(uncache)
            inner.evict_blocks({blocks[i].block_id for i in uncache})
        if needed <= 0:
            return inner.empty_kv_cache_blocks
        return inner.create_kv_cache_blocks(inner.coordinator.allocate_new_blocks(request.request_id, physical,
                                                                                  physical))

    def trim(self, request) -> int:
        """Return the blocks of an evicting request above ceil((B + w) / block_size) to the pool, in the
        full-attention group only (a sliding-window group's are vLLM's to free); how many."""
        p = request.num_prompt_tokens
        if request.num_computed_tokens <= p:
            return 0  # inside the prompt (or its recompute): nothing evicted
        if schedule.num_evictions(p, self.cfg.budget, self.cfg.window, request.num_computed_tokens - p) == 0:
            return 0
        keep = schedule.max_blocks(self.cfg.budget, self.cfg.window, self.block_size)
        manager = self.full_manager
        blocks = manager.req_to_blocks.get(request.request_id)
        if blocks is None or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        manager.block_pool.free_blocks(reversed(tail))
        return len(tail)


class VaseScheduler(Scheduler):
    """vLLM's scheduler with vase's block accounting (see the module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs):
        super().__init__(vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs)
        self.vase_config = VaseVllmConfig.from_additional_config(vllm_config.additional_config)
        self.kv_cache_manager = EvictingKVCacheManager(self.kv_cache_manager, self.vase_config, self.block_size,
                                                       full_attention_group(kv_cache_config))
        self.kv_cache_manager.requests = self.requests
        # no more running requests than the workers' query ring has rows: those the pool holds at their bounded size
        full = kv_cache_config.kv_cache_groups[full_attention_group(kv_cache_config)].kv_cache_spec
        self.max_num_active_reqs = min(self.max_num_active_reqs, ring_rows(
            kv_cache_config.num_blocks, full.block_size, self.vase_config.budget, self.vase_config.window,
            self.max_num_running_reqs, self.vase_config.policy.needs_queries))
        self.vase_blocks_freed = 0
        self.vase_preemptions = 0

    def schedule(self, *args, **kwargs):
        """vLLM's schedule, telling the workers the blocks each scheduled request holds now (after this scheduler's
        trims, which the workers' block-table rows never see): `output.vase_blocks` {request id: blocks}."""
        output = super().schedule(*args, **kwargs)
        output.vase_blocks = {request_id: self.blocks_held(request_id) for request_id in output.num_scheduled_tokens}
        # copy-on-write: {request id: [(index, old block id, new block id)]}, the worker's block table learns the
        # new ids and its compaction reads the old blocks and writes the new ones this step
        output.vase_copies = self.kv_cache_manager.release_copies(output.num_scheduled_tokens)
        return output

    def add_request(self, request) -> None:
        if getattr(request, "resumable", False):  # the front end refuses these first (vase.vllm.plugin)
            raise VaseConfigError(STREAMING_REFUSAL)
        super().add_request(request)

    def _preempt_request(self, request, *args, **kwargs):
        self.vase_preemptions += 1
        return super()._preempt_request(request, *args, **kwargs)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's per-request cut of a step's tokens (called on the running and the waiting path, before blocks
        are allocated), then vase's: a multi-token step (a prefill chunk, a recomputing prefill) ends at the
        request's prompt end or its next eviction boundary, so that the worker can evict between chunks."""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        end = next_boundary(request.num_prompt_tokens, num_computed_tokens, self.vase_config.budget,
                            self.vase_config.window)
        return min(n, end - num_computed_tokens)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        manager: EvictingKVCacheManager = self.kv_cache_manager
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished():
                # the worker compacted during this step: the blocks above the bound are free now
                self.vase_blocks_freed += manager.trim(request)
        return outputs

    def blocks_held(self, request_id: str) -> int:
        """Blocks vLLM's KV cache manager holds for a request now in the full-attention group (0 when none)."""
        manager = self.kv_cache_manager.full_manager
        return len(manager.req_to_blocks.get(request_id, ()))
