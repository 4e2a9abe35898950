"""Scheduler side of the plugin: block accounting by physical length, blocks above the bound go back.

`VaseScheduler` is vLLM's scheduler (set through `scheduler_cls`) with its KV cache manager
wrapped: a request that is past its first eviction is allocated blocks for its physical length
(`vase.core.schedule.physical_length` keyed by its prompt length), and after the step of each
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

from types import MethodType

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from ..core import schedule
from .config import VaseConfigError, VaseVllmConfig
from .copy_reserve import CopyReserve, scan_reserve
from .plugin import PREFIX_HYBRID_REFUSAL, STREAMING_REFUSAL, check_at_start
from .groups import full_attention_group
from .ring_size import ring_rows
from .steps import VaseStepError, allocation_length, evicts_at, max_prefix_hit, step_end


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
        self.block_size = block_size
        self.cfg = cfg
        self.group = group  # the full-attention KV cache group: the one evicted, trimmed and counted
        managers = inner.coordinator.single_type_managers
        self.hybrid = len(managers) > 1
        if self.hybrid:
            wrapped = list(managers)
            wrapped[group] = PhysicalLengthManager(managers[group])
            inner.coordinator.single_type_managers = type(managers)(wrapped)
        self._full = inner.coordinator.single_type_managers[group]
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
        self.evicted: list = []  # requests allocated a step that evicts since the last trims
        self.vase_admissions = 0  # waiting requests admitted by their bounded peak (`admits`)
        self.vase_admissions_refused = 0  # waiting requests whose bounded peak did not fit

    @property
    def cfg(self) -> VaseVllmConfig:
        """The eviction settings the blocks are counted for."""
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: VaseVllmConfig) -> None:
        # B and w are read on the hot path (`allocate_slots`) as plain attributes; a new config renews them and
        # the copy reserve's bound (tests swap the config to make the scheduler and the worker disagree)
        self._cfg, self._budget, self._window = cfg, cfg.budget, cfg.window
        self.reserve = CopyReserve(schedule.max_blocks(cfg.budget, cfg.window, self.block_size))

    @property
    def full_manager(self):
        """The full-attention group's `SingleTypeKVCacheManager`."""
        return self._full

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if isinstance(value, MethodType):  # vLLM's scheduler calls these per request per step: bound once
            setattr(self, name, value)
        return value

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

    def plan_copies(self, request, free: int, computed: int | None = None) -> tuple[list[int], list[int]]:
        """For a step of `request` that evicts (else ([], [])): which of the blocks its compaction rewrites (its
        first ceil((B + w) / block) blocks) it must not write into, given `free` blocks in the pool beyond the step's
        own need. Returns (to copy, to drop from the prefix cache):

        - a block another request holds too (a prefix-cache hit, a parent prompt of n > 1): copied, always;
        - a whole prompt block of its own in the prefix cache (the next request with that prompt would hit it):
          copied while the pool keeps a request's worth of blocks (ceil((B + w) / block)) free after the copies,
          else dropped from the prefix cache;
        - any other block of its own in the prefix cache (decoded tokens): dropped from the prefix cache, so that
          it is never offered as a hit for tokens it no longer holds (its content is rewritten in place).
        With prefix caching off every block is the request's alone and uncached: nothing to do. `computed`: where
        the step starts (its computed tokens by default)."""
        computed = request.num_computed_tokens if computed is None else computed
        if not evicts_at(request.num_prompt_tokens, computed, self.cfg.budget, self.cfg.window):
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

    def compacts_later(self, request, computed: int | None = None) -> bool:
        """Whether `request` has its first compaction still ahead (at logical position max(P0, B) + w): not past it
        (`computed`: where its next step starts, its computed tokens by default), and asked for enough tokens to
        reach it."""
        first = schedule.first_limit(request.num_prompt_tokens, self.cfg.budget, self.cfg.window)
        computed = request.num_computed_tokens if computed is None else computed
        return computed <= first and request.num_prompt_tokens + getattr(request, "max_tokens", first) > first

    def _compacts_later_id(self, rid: str) -> bool:
        """`compacts_later` by request id, inline (called per request per step)."""
        request = self.requests.get(rid)
        if request is None:
            return False
        prompt, budget = request.num_prompt_tokens, self._budget
        first = (prompt if prompt > budget else budget) + self._window
        return request.num_computed_tokens <= first and prompt + getattr(request, "max_tokens", first) > first

    def begin_schedule(self) -> None:
        """Before vLLM's `schedule()`: count the copy reserve once (`vase.vllm.copy_reserve`)."""
        if getattr(self._inner, "enable_caching", False):
            self.reserve.begin(self.full_manager.req_to_blocks, self._compacts_later_id)

    def end_schedule(self) -> None:
        self.reserve.end()

    def pending_copies(self, admitted=None, hit_blocks=(), computed: int | None = None) -> int:
        """Fresh blocks the running requests will take for copy-on-write at their first compaction (0 with prefix
        caching off), plus those of request `admitted` (its next step starting at `computed`) about to take
        `hit_blocks` (its prefix-cache hit, full-attention group) from the cache. A block among the first
        ceil((B + w) / block) of h such requests that more than one request holds is copied by each of those h: the
        last holder finds it its own only when the others compacted in an earlier step (in the same step their
        copies still read it), so h is an upper bound, reached by children of one prompt that compact together.
        Inside a `schedule()` the count is kept up to date (O(blocks kept) per call); outside it, scanned."""
        if not getattr(self._inner, "enable_caching", False):
            return 0
        compacts = admitted is not None and self.compacts_later(admitted, computed)
        if self.reserve.active:
            return self.reserve.with_hits(hit_blocks, compacts)
        return self.scan_copies(admitted, hit_blocks, computed)

    def scan_copies(self, admitted=None, hit_blocks=(), computed: int | None = None) -> int:
        """`pending_copies` counted from scratch over every request's first blocks (O(requests x blocks kept))."""
        if not getattr(self._inner, "enable_caching", False):
            return 0
        compacts = admitted is not None and self.compacts_later(admitted, computed)
        return scan_reserve(self.full_manager.req_to_blocks, self.reserve.keep, self._compacts_later_id,
                            hit_blocks, compacts)

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
            if self.reserve.active:
                self.reserve.swap(request_id, i, blocks[i].block_id, block)
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

    def admits(self, request, computed: int, local: int, new_computed_blocks, reserve: int,
               has_scheduled_reqs: bool = True, num_encoder_tokens: int = 0) -> bool:
        """vLLM's full-sequence admission gate (`scheduler_reserve_full_isl`) for a bounded request: whether the
        blocks it holds at the peak of the uninterrupted schedule up to its length now, ceil(min(num_tokens,
        max(P0, B) + w) / block) (its replay after a preemption never holds more), less its prefix-cache hit, fit
        in the free blocks less the copy reserve (and vLLM's watermark). vLLM's own gate asked for its whole
        logical history, so a request preempted after it evicted waited, with the queue behind it, until that fit.
        `computed`: tokens computed once the hit is taken (`local` of them vLLM's own)."""
        inner = self._inner
        full_tokens = min(request.num_tokens, inner.max_model_len)
        peak = min(full_tokens, schedule.first_limit(request.num_prompt_tokens, self.cfg.budget, self.cfg.window))
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else inner.empty_kv_cache_blocks.blocks
        kwargs = dict(request_id=request.request_id, new_computed_blocks=hits, num_encoder_tokens=num_encoder_tokens,
                      total_computed_tokens=min(computed, inner.max_model_len), num_local_computed_tokens=local,
                      apply_admission_cap=True, prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))
        if self.hybrid:  # the full-attention group counts the peak, the sliding-window groups vLLM's own length
            full = self.full_manager
            full.vase_physical[request.request_id] = peak
            try:
                need = inner.coordinator.get_num_blocks_to_allocate(num_tokens=full_tokens,
                                                                    num_tokens_main_model=full_tokens, **kwargs)
            finally:
                del full.vase_physical[request.request_id]
        else:
            need = inner.coordinator.get_num_blocks_to_allocate(num_tokens=peak, num_tokens_main_model=peak, **kwargs)
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = inner.watermark_blocks
        free = inner.block_pool.get_num_free_blocks()
        if need + watermark <= free - reserve:
            return True
        if need + watermark <= free:  # it would fit but for the running requests' future copies
            self.vase_reserve_refusals += 1
        return False

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0, new_computed_blocks=None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0, **kwargs):
        """vLLM's `allocate_slots`; a step that evicts is allocated the physical length and its copy-on-write, any
        other step leaves the running requests' future copies free (`pending_copies`, as vLLM's `reserved_blocks`).
        The step starts at the request's computed tokens plus this call's prefix-cache hit (on the waiting path vLLM
        sets `num_computed_tokens` to the hit only after this call). vLLM's full-sequence gate is replaced by
        `admits` (the bounded peak). Called per running request per step: kept lean."""
        local = request.num_computed_tokens + num_new_computed_tokens
        computed = local + num_external_computed_tokens
        prompt, budget, window = request.num_prompt_tokens, self._budget, self._window
        first = (prompt if prompt > budget else budget) + window  # max(P0, B) + w
        evicting = computed >= first and (computed - first) % window == 0  # `steps.evicts_at`
        hit = num_new_computed_tokens + num_external_computed_tokens
        reserve = self.reserve
        if not hit and not full_sequence_must_fit and not evicting and computed + num_new_tokens <= first:
            # a step of a running request before its first eviction: vLLM's allocation, the copies kept free
            pending = reserve.total if reserve.active else self.pending_copies(request, (), computed)
            result = self._inner.allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens,
                                                reserved_blocks=reserved_blocks + pending, **kwargs)
            if result is None:
                self.vase_reserve_refusals += pending > 0
            elif reserve.active:
                member = reserve.members.get(request.request_id)
                if member is not None and len(member[0]) < reserve.keep:  # a holder given a new first block
                    reserve.sync(request.request_id, self._full.req_to_blocks[request.request_id], True)
            return result
        if not hit and not full_sequence_must_fit and not evicting and not self.hybrid:
            # a step after the first eviction that does not evict: the physical length, no copies
            end = computed + num_new_tokens
            physical = budget + (end - first - 1) % window + 1  # `schedule.physical_length` past the first eviction
            blocks = self._full.req_to_blocks[request.request_id]
            needed = -(-physical // self.block_size) - len(blocks)
            if needed <= 0:
                return self._inner.empty_kv_cache_blocks
            pending = reserve.total if reserve.active else self.pending_copies(request, (), computed)
            if self._inner.block_pool.get_num_free_blocks() - needed < reserved_blocks + pending:
                self.vase_reserve_refusals += pending > 0
                return None
            return self._inner.create_kv_cache_blocks(self._inner.coordinator.allocate_new_blocks(
                request.request_id, physical, physical))
        if hit and computed > (prompt if prompt > budget else budget):
            # the waiting path: `get_computed_blocks` cuts hits at max(P0, B), so that the replay computes the queries
            # its first eviction reads and never starts past it (its compaction would rewrite hit blocks)
            raise VaseStepError(f"vase: request {request.request_id} would resume at a prefix-cache hit of {hit} "
                                f"tokens, past max(P0, B) = {max(prompt, budget)} (prompt {prompt}): the scheduler "
                                f"and vase's hit cut disagree")
        physical = self.physical_after(request, computed + num_new_tokens)
        pending, hit_blocks = 0, ()
        if not evicting:  # a compaction takes its own copies out of the reserve: not counted against itself
            if new_computed_blocks is not None and not self.hybrid:
                hit_blocks = new_computed_blocks.blocks[self.group]
            pending = self.pending_copies(request, hit_blocks, computed)  # hits: the waiting path only
        if full_sequence_must_fit:
            if not self.admits(request, computed, local, new_computed_blocks, pending,
                               kwargs.get("has_scheduled_reqs", True), kwargs.get("num_encoder_tokens", 0)):
                self.vase_admissions_refused += 1
                return None
            self.vase_admissions += 1
        kwargs.update(num_new_computed_tokens=num_new_computed_tokens, new_computed_blocks=new_computed_blocks,
                      num_lookahead_tokens=num_lookahead_tokens,
                      num_external_computed_tokens=num_external_computed_tokens)
        result = self._allocate(request, num_new_tokens, physical, pending, reserved_blocks, computed, kwargs)
        if evicting and result is not None:
            self.evicted.append(request)  # its blocks above the bound go back after the step (`trim`)
        if result is not None and reserve.active:
            blocks = self._full.req_to_blocks.get(request.request_id, ())
            member = reserve.members.get(request.request_id)
            if (request.status != RequestStatus.RUNNING if member is None
                    else len(member[0]) < min(len(blocks), reserve.keep)):
                # admitted from the waiting queue, or a holder given a new first block
                reserve.sync(request.request_id, blocks, self.compacts_later(request, computed))
        return result

    def _allocate(self, request, num_new_tokens: int, physical: int | None, reserve: int, reserved_blocks: int,
                  computed: int, kwargs: dict):
        """`allocate_slots` after the checks: vLLM's own (logical length, or the full-attention group's physical
        length beside sliding-window groups), or the physical length with copy-on-write (full attention only)."""
        inner = self._inner
        if physical is None:
            result = inner.allocate_slots(request, num_new_tokens, reserved_blocks=reserved_blocks + reserve,
                                          **kwargs)
            if result is None and reserve:
                self.vase_reserve_refusals += 1
            return result
        if self.hybrid:  # vLLM allocates every group, the full-attention one for the physical length
            full = self.full_manager
            full.vase_physical[request.request_id] = physical
            try:
                return inner.allocate_slots(request, num_new_tokens, reserved_blocks=reserved_blocks, **kwargs)
            finally:
                del full.vase_physical[request.request_id]
        blocks = self.full_manager.req_to_blocks[request.request_id]
        needed = schedule.cdiv(physical, self.block_size) - len(blocks)
        free = inner.block_pool.get_num_free_blocks() - max(needed, 0)
        if needed > 0 and free < reserve + reserved_blocks:  # the others' copies come first
            self.vase_reserve_refusals += 1
            return None
        copy, uncache = self.plan_copies(request, free, computed)  # the blocks this step's compaction must not write into
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
        keep = self.reserve.keep  # ceil((B + w) / block_size)
        manager = self._full
        blocks = manager.req_to_blocks.get(request.request_id)
        if blocks is None or len(blocks) <= keep:
            return 0
        p, budget = request.num_prompt_tokens, self.cfg.budget
        if request.num_computed_tokens <= (p if p > budget else budget) + self.cfg.window:
            return 0  # not past its first eviction (max(P0, B) + w): nothing evicted yet
        tail = blocks[keep:]
        del blocks[keep:]
        manager.block_pool.free_blocks(reversed(tail))
        return len(tail)


class VaseScheduler(Scheduler):
    """vLLM's scheduler with vase's block accounting (see the module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs):
        check_at_start(vllm_config, "scheduler")  # a VllmConfig built by hand skips EngineArgs' checks
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
        self.vase_draft_cuts = 0  # verify steps whose drafts were cut at an eviction boundary

    def schedule(self, *args, **kwargs):
        """vLLM's schedule, telling the workers the blocks each scheduled request holds now (after this scheduler's
        trims, which the workers' block-table rows never see): `output.vase_blocks` {request id: blocks}."""
        self.kv_cache_manager.begin_schedule()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.kv_cache_manager.end_schedule()
        held = self.kv_cache_manager.full_manager.req_to_blocks
        output.vase_blocks = {request_id: len(held.get(request_id, ())) for request_id in output.num_scheduled_tokens}
        # copy-on-write: {request id: [(index, old block id, new block id)]}, the worker's block table learns the
        # new ids and its compaction reads the old blocks and writes the new ones this step
        output.vase_copies = self.kv_cache_manager.release_copies(output.num_scheduled_tokens)
        # the requests whose step evicts: their blocks above the bound are trimmed once it ran (`update_from_output`);
        # by id, since the output is pickled to the workers of a multiprocess engine and a Request is not picklable
        output.vase_evicted = [request.request_id for request in self.kv_cache_manager.evicted]
        self.kv_cache_manager.evicted = []
        return output

    def add_request(self, request) -> None:
        if getattr(request, "resumable", False):  # the front end refuses these first (vase.vllm.plugin)
            raise VaseConfigError(STREAMING_REFUSAL)
        super().add_request(request)

    def _preempt_request(self, request, *args, **kwargs):
        self.vase_preemptions += 1
        manager = self.kv_cache_manager
        if manager.reserve.active:  # its blocks go back now
            manager.reserve.remove(request.request_id, manager.full_manager.req_to_blocks.get(request.request_id, ()))
        return super()._preempt_request(request, *args, **kwargs)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's per-request cut of a step's tokens (called on the running and the waiting path, before blocks
        are allocated), then vase's: a multi-token step (a prefill chunk, a recomputing prefill, a verify step's
        drafts) ends at the request's prompt end or its next eviction boundary (`steps.step_end`)."""
        if num_new_tokens <= 1 and not self.num_prefill_lookahead:  # a decode step: never crosses a boundary
            return max(num_new_tokens, 0)
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        real = request.num_tokens - num_computed_tokens  # the rest of the step: draft tokens (or vLLM's placeholders)
        end = step_end(request.num_prompt_tokens, num_computed_tokens, real, self.vase_config.budget,
                       self.vase_config.window)
        if n > end - num_computed_tokens and n > real:  # a verify step cut at a boundary: vLLM drops the last drafts
            self.vase_draft_cuts += 1
        return min(n, end - num_computed_tokens)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        manager: EvictingKVCacheManager = self.kv_cache_manager
        for request_id in getattr(scheduler_output, "vase_evicted", ()):  # the others hold no block above the bound
            request = self.requests.get(request_id)  # None once finished and freed
            if request is not None and request_id in scheduler_output.num_scheduled_tokens \
                    and not request.is_finished():
                # the worker compacted during this step: the blocks above the bound are free now
                self.vase_blocks_freed += manager.trim(request)
        return outputs

    def blocks_held(self, request_id: str) -> int:
        """Blocks vLLM's KV cache manager holds for a request now in the full-attention group (0 when none)."""
        manager = self.kv_cache_manager.full_manager
        return len(manager.req_to_blocks.get(request_id, ()))
