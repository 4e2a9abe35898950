"""What one sample row of a run is made of besides the model's text: its seed, how messages name its problem,
the cache stats its length implies (the eviction schedule), and the finite-or-None of a timing."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from vase.core import schedule

__all__ = ["sample_seed", "problem_label", "row_cache_stats", "finite"]


def sample_seed(seed: int, problem_index: int, sample: int) -> int:
    """The seed of sample ``sample`` of problem ``problem_index``: the same for every method.

    A hash (not ``seed + i``) so that neighbouring runs and problems never share streams; 31 bits.
    """
    digest = hashlib.sha256(f"vase-eval:{int(seed)}:{int(problem_index)}:{int(sample)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF


def problem_label(problem: Any) -> str:
    """``problem 'mine-2' (row 2 of data/mine.jsonl)``: how a message names one problem of the run."""
    meta = getattr(problem, "meta", None) or {}
    row = f" (row {meta['index'] + 1} of {meta['source']})" if isinstance(meta.get("index"), int) and \
        meta.get("source") else ""
    return f"problem {problem.id!r}{row}"


def row_cache_stats(prompt_length: int, n_generated: int, finished: bool, *, budget: int | None, window: int,
                    evicts: bool, bytes_per_token: int) -> dict[str, int]:
    """What one sequence's cache held, from the eviction schedule (`vase.core.schedule`, docs/methods.md).

    ``generate``'s stats describe the whole batch at its end (finished rows have left), so the
    per-sequence numbers are derived: tokens fed = prompt + generated (the token sampled at the
    length cap is never fed); a row evicts when it would pass ``max(P, B) + w`` (then ``B + w``)
    and drops to ``B``. Returns evictions, stored/seen/peak lengths and the matching bytes.
    """
    written = n_generated - (0 if finished or n_generated == 0 else 1)
    s = schedule.sequence_stats(prompt_length, budget if evicts else None, window, written)
    return {
        "evictions": s.evictions,
        "stored_length": s.stored,
        "seen_length": s.seen,
        "peak_length": s.peak,
        "kv_bytes": s.stored * bytes_per_token,
        "kv_bytes_peak": s.peak * bytes_per_token,
        "kv_bytes_full": s.seen * bytes_per_token,
    }


def finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
