"""The copy reserve: fresh blocks the running requests' first compactions will take for copy-on-write.

A block among the first ceil((B + w) / block) blocks of h requests whose first compaction is still
ahead, that more than one request holds (its reference count > 1), is copied by each of those h
(`vase.vllm.scheduler.EvictingKVCacheManager.plan_copies`). The reserve is the sum of h over such
blocks. Scanning every running request's first blocks at every allocation made the scheduler
quadratic in the running requests; `CopyReserve` scans once per `schedule()` and then follows each
change the scheduler makes to those blocks during the step (a request allocated more blocks, one
admitted, one preempted, a compaction's copy-on-write), so a step costs O(running x blocks kept).
Outside a `schedule()` call it is inactive (the caller scans). No vLLM import: blocks are duck-typed
(`block_id`, `ref_cnt`).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Sequence


class CopyReserve:
    """Holder and reference counts of the blocks the running requests keep through their first compaction.

    `holders[b]`: requests holding block b among their first `keep` blocks whose first compaction is ahead;
    `refs[b]`: references to b (every request holding it, and this step's copy-on-write of it);
    `total`: sum of holders[b] over blocks with refs[b] > 1 (the reserve)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.active = False
        self.holders: Counter = Counter()
        self.refs: dict[int, int] = {}
        self.members: dict[str, tuple[list[int], bool]] = {}  # request id -> (its first block ids, compacts later)
        self.total = 0

    def _value(self, block_id: int) -> int:
        return self.holders[block_id] if self.refs.get(block_id, 0) > 1 else 0

    def _change(self, block_id: int, holder: int, ref: int = 0, ref_now: int | None = None) -> None:
        """Add `holder` holders to a block, and `ref` references (or set them to `ref_now`, read off the block)."""
        self.total -= self._value(block_id)
        self.refs[block_id] = ref_now if ref_now is not None else self.refs.get(block_id, 0) + ref
        self.holders[block_id] += holder
        self.total += self._value(block_id)

    def begin(self, req_to_blocks: dict[str, Sequence], holder: Callable[[str], bool]) -> None:
        """At the start of a `schedule()`: scan the first `keep` blocks of each request whose first compaction is
        ahead (`holder(request id)`) once; the other requests' references are read off the blocks."""
        holders: Counter = Counter()
        refs: dict[int, int] = {}
        members: dict[str, tuple[list[int], bool]] = {}
        keep = self.keep
        for rid, blocks in req_to_blocks.items():
            if not holder(rid):
                continue
            first = blocks[:keep]
            members[rid] = ([b.block_id for b in first], True)
            for b in first:
                holders[b.block_id] += 1
                refs[b.block_id] = b.ref_cnt
        self.holders, self.refs, self.members = holders, refs, members
        self.total = sum(h for b, h in holders.items() if refs[b] > 1)
        self.active = True

    def end(self) -> None:
        """After a `schedule()`: inactive until the next one (blocks change outside it: trims, finished requests)."""
        self.active = False
        self.holders, self.refs, self.members, self.total = Counter(), {}, {}, 0

    def sync(self, rid: str, blocks: Sequence, compacts: bool) -> None:
        """Request `rid` holds `blocks` now: count the ones among its first `keep` it did not hold before (a
        request's blocks are only appended to, except by `swap`)."""
        member = self.members.get(rid)
        if member is None:
            if not compacts:  # not a holder: its references to tracked blocks only
                for block in blocks[:self.keep]:
                    if block.block_id in self.refs:
                        self._change(block.block_id, 0, ref_now=block.ref_cnt)
                return
            member = self.members[rid] = ([], True)
        ids = member[0]
        for block in list(blocks[len(ids):self.keep]):
            ids.append(block.block_id)
            self._change(block.block_id, 1, ref_now=block.ref_cnt)

    def swap(self, rid: str, index: int, old_id: int, new_block) -> None:
        """Copy-on-write gave request `rid` block `new_block` at `index` in place of `old_id` (which keeps the
        copy's reference until the step is scheduled: its count does not change)."""
        member = self.members.get(rid)
        if member is None or index >= len(member[0]):
            return
        ids, compacts = member
        self._change(old_id, -int(compacts))
        ids[index] = new_block.block_id
        self._change(new_block.block_id, int(compacts), ref_now=new_block.ref_cnt)

    def remove(self, rid: str, blocks: Sequence = ()) -> None:
        """Request `rid` is about to give its blocks back (preempted; `blocks`: those it holds): its holds and
        references go."""
        member = self.members.pop(rid, None)
        if member is None:  # not a holder: only its references to tracked blocks
            for block in blocks[:self.keep]:
                if block.block_id in self.refs:
                    self._change(block.block_id, 0, -1)
            return
        ids, compacts = member
        for block_id in ids:
            self._change(block_id, -int(compacts), -1)

    def with_hits(self, hits: Iterable, compacts: bool) -> int:
        """The reserve if a request about to be admitted took `hits` (its prefix-cache hit) from the cache."""
        total = self.total
        for block in list(hits)[:self.keep]:
            b = block.block_id
            h = self.holders[b] + int(compacts)
            r = self.refs[b] + 1 if b in self.refs else block.ref_cnt + 1
            total += (h if r > 1 else 0) - self._value(b)
        return total


def scan_reserve(req_to_blocks: dict[str, Sequence], keep: int, compacts_later: Callable[[str], bool],
                 hits: Iterable = (), hit_compacts: bool = False) -> int:
    """The reserve counted from scratch (O(requests x keep)): what `CopyReserve` keeps up to date, and its check."""
    holders: Counter = Counter()
    refs: dict[int, int] = {}
    for rid, blocks in req_to_blocks.items():
        if not compacts_later(rid):
            continue
        for block in blocks[:keep]:
            holders[block.block_id] += 1
            refs.setdefault(block.block_id, block.ref_cnt)
    if hit_compacts:
        for block in list(hits)[:keep]:
            holders[block.block_id] += 1
            refs[block.block_id] = refs.get(block.block_id, block.ref_cnt) + 1
    return sum(h for b, h in holders.items() if refs[b] > 1)
