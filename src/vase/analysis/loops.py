"""When did a completion fall into a repetition loop?"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..eval.failures import has_loop


def loop_onset(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int | None:
    """The first generated token after which the text ends in a phrase loop, or None if it never does.

    Uses the loop rule of the failure classes (:func:`vase.eval.failures.has_loop`: sentence
    blocks or short phrases repeated to the end, digits normalised) on prefixes, by binary
    search: it assumes that once the text loops it keeps looping, which holds for the loops
    eviction causes (they run to the length cap).
    """
    if not has_loop(decode(list(token_ids))):
        return None
    lo, hi = 1, len(token_ids)  # the shortest looping prefix lies in (lo - 1, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if has_loop(decode(list(token_ids[:mid]))):
            hi = mid
        else:
            lo = mid + 1
    return lo
