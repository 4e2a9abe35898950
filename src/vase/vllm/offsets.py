"""The batch-level step arithmetic both vLLM workers (CPU and GPU) share, as pure functions of numpy arrays.

Per request, `vase.vllm.steps.plan_step` says what one request evicts and how far its physical
position lags its logical one (`offset`). Per batch, the runner then needs: which flat query rows
join which request's query window (`capture_rows`), each token's physical position for the slot
mapping (`physical_positions`; RoPE keeps the logical positions), and the physical sequence
lengths attention reads (`physical_seq_lens`). R requests, T scheduled tokens, w the window.
No torch, no vLLM here.
"""

from __future__ import annotations

import numpy as np

from .steps import StepPlan, plan_step


def plan_batch(req_ids: list[str], origins: np.ndarray, computed: np.ndarray, scheduled: np.ndarray, budget: int,
               window: int, drafts: np.ndarray | None = None) -> list[StepPlan]:
    """`plan_step` of each of R requests (origins, computed, scheduled, drafts: [R] integers; drafts: the draft
    tokens among the scheduled ones, none by default)."""
    return [plan_step(req_ids[i], int(origins[i]), int(computed[i]), int(scheduled[i]), budget, window,
                      0 if drafts is None else int(drafts[i])) for i in range(len(req_ids))]


def capture_rows(query_starts: np.ndarray, computed: np.ndarray, scheduled: np.ndarray, ring_slots: np.ndarray,
                 window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's query-window copies: flat token src[k] -> ring slot slot[k] at window position pos[k] ([K] int64 each).

    The last min(n, w) scheduled tokens of each request join its window; window position is the
    logical position modulo w, so the ring always holds the last w queries (all args [R])."""
    n = scheduled.astype(np.int64)
    take = np.minimum(n, window)
    req = np.repeat(np.arange(len(n)), take)
    first = np.cumsum(take) - take  # index of each request's first copy
    j = np.arange(int(take.sum())) - first[req]  # 0..take-1 within each request
    skip = (n - take)[req] + j  # position of the copy among the request's scheduled tokens
    src = query_starts.astype(np.int64)[req] + skip
    pos = (computed.astype(np.int64)[req] + skip) % window
    return src, ring_slots.astype(np.int64)[req], pos


def token_offsets(offsets: np.ndarray, scheduled: np.ndarray) -> np.ndarray:
    """Each scheduled token's request offset: [T] int64 from offsets [R] and scheduled [R]."""
    return np.repeat(offsets.astype(np.int64), scheduled.astype(np.int64))


def physical_positions(positions: np.ndarray, offsets: np.ndarray, scheduled: np.ndarray) -> np.ndarray:
    """Physical slot positions [T] of the step's tokens from their logical `positions` [T] (the slot mapping's input)."""
    return positions - token_offsets(offsets, scheduled)


def physical_seq_lens(seq_lens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Physical sequence lengths [R] (what attention reads) from the logical ones [R]."""
    return seq_lens - offsets
