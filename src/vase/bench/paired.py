"""Paired, alternating repeats: A, B, A, B, ... and each ratio taken within its round.

On a shared machine the load drifts during a benchmark. Running the configurations in turn, one
round after the other, lets each round's runs share the load of their moment; a ratio computed
within each round (B_r / A_r) and then summarised (median, and the range min..max) is then not
moved by the drift, where a ratio of the two medians would be.

    for rnd, cfg in alternating(["full", "vase-attnv"], repeats=5): ...
    median, lo, hi = paired_ratio(method_tok_s, full_tok_s)   # one value per round each
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from typing import TypeVar

__all__ = ["alternating", "paired_ratio"]

T = TypeVar("T")


def alternating(configs: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """(round, config) in the order A, B, ..., A, B, ...: every configuration once per round."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for rnd in range(repeats):
        for cfg in configs:
            yield rnd, cfg


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) over rounds r of num[r] / den[r]; rounds where either is missing or den is 0 are skipped.

    NaN's throughout when no round has both."""
    if len(num) != len(den):
        raise ValueError(f"paired ratios need one value per round in each list, got {len(num)} and {len(den)}")
    ratios = [a / b for a, b in zip(num, den) if a is not None and b is not None and not math.isnan(a)
              and not math.isnan(b) and b != 0]
    if not ratios:
        return math.nan, math.nan, math.nan
    return statistics.median(ratios), min(ratios), max(ratios)
