"""Paired comparisons of a method against the full cache (or any two methods) on shared seeds.

Sample ``s`` of problem ``i`` uses the same seed under every method, so each completion has a
partner: the full cache's completion of the same (problem, sample). Differences are taken per
pair, averaged within a problem, and the interval comes from a bootstrap over problems (the unit
that was sampled). The p-value is a sign-flip permutation test on the same per-problem
differences (samples of one problem are not independent, so the test works on problems too); with
one sample per problem it equals McNemar's exact test on the discordant pairs.

    diffs = paired_problem_diffs(method_records, full_records, key="correct")
    mean, lo, hi = bootstrap_ci(list(diffs.values()))
    p, exact = sign_flip_test(list(diffs.values()))
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from vase.generation.batched import first_divergence  # the core's (vase generate --compare uses it too)

__all__ = [
    "pair_records",
    "paired_problem_diffs",
    "bootstrap_ci",
    "mcnemar_exact",
    "sign_flip_test",
    "SIGN_FLIP_EXACT_MAX",
    "SIGN_FLIP_RESAMPLES",
    "discordant",
    "first_divergence",
    "BOOTSTRAP_RESAMPLES",
]

Record = Mapping[str, Any]
#: Bootstrap resamples: the 2.5 % / 97.5 % quantiles move by well under 1 % of their value past this.
BOOTSTRAP_RESAMPLES = 4000
#: Up to this many nonzero per-problem differences the sign-flip test enumerates all 2**n sign vectors.
SIGN_FLIP_EXACT_MAX = 20
#: Random sign vectors above SIGN_FLIP_EXACT_MAX (fixed seed): the p-value's Monte Carlo standard error
#: is at most 0.5 / sqrt(20000) = 0.0035, about 0.0015 near p = 0.05.
SIGN_FLIP_RESAMPLES = 20000


def pair_records(method: Sequence[Record], reference: Sequence[Record], *, problem_key: str = "problem_id",
                 sample_key: str = "sample") -> list[tuple[Record, Record]]:
    """(method record, reference record) for every (problem, sample) both have, sorted by key.

    Raises:
        ValueError: a (problem, sample) key appears twice in one list.
    """
    def index(records: Sequence[Record], what: str) -> dict[tuple, Record]:
        out: dict[tuple, Record] = {}
        for r in records:
            k = (str(r[problem_key]), int(r[sample_key]))
            if k in out:
                raise ValueError(f"pair_records: duplicate {what} record {k}")
            out[k] = r
        return out

    a, b = index(method, "method"), index(reference, "reference")
    return [(a[k], b[k]) for k in sorted(set(a) & set(b))]


def paired_problem_diffs(method: Sequence[Record], reference: Sequence[Record], *,
                         key: str | Callable[[Record], float | None] = "correct",
                         problem_key: str = "problem_id") -> dict[str, float]:
    """Per problem: mean over its paired samples of ``value(method) - value(reference)``.

    ``key`` is a record field (bools count as 0/1) or a function of a record; pairs where either
    value is None are left out, and a problem with no pair left is absent from the result.
    """
    get = key if callable(key) else (lambda r: r.get(key))
    per: dict[str, list[float]] = defaultdict(list)
    for m, r in pair_records(method, reference, problem_key=problem_key):
        a, b = get(m), get(r)
        if a is None or b is None:
            continue
        per[str(m[problem_key])].append(float(a) - float(b))
    return {p: sum(v) / len(v) for p, v in sorted(per.items())}


def bootstrap_ci(values: Sequence[float], *, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float, float] | None:
    """Mean of ``values`` and its percentile-bootstrap interval: (mean, low, high).

    ``values`` are one number per problem (the resampled unit). The seed is fixed so a summary
    is reproducible. One value gives the degenerate interval (v, v, v); no value gives None.
    """
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.size == 0:
        return None
    mean = float(x.mean())
    if x.size == 1:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return mean, float(lo), float(hi)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts.

    ``b``: pairs where only the method is right, ``c``: only the reference. Under the null each
    discordant pair goes either way with probability 1/2: p = min(1, 2 P[X <= min(b, c)]),
    X ~ Binomial(b + c, 1/2). No discordant pair gives p = 1.
    """
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact: counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def sign_flip_test(diffs: Sequence[float], *, resamples: int = SIGN_FLIP_RESAMPLES, seed: int = 0,
                   exact_max: int = SIGN_FLIP_EXACT_MAX) -> tuple[float, bool]:
    """Two-sided paired permutation test of "no difference" on one paired difference per problem.

    Under the null the method and the reference are exchangeable within a problem, so each problem's
    difference is as likely to have either sign. The statistic is ``|sum(diffs)|``; the p-value is
    the share of the 2**n sign vectors whose ``|sum(+-d_i)|`` is at least the observed one (problems
    with a zero difference change nothing and are dropped). Up to ``exact_max`` nonzero differences
    every sign vector is enumerated (exact); above that ``resamples`` random sign vectors drawn with
    ``seed`` give ``(1 + hits) / (1 + resamples)`` (a valid Monte Carlo p-value, reproducible).
    With one 0/1 outcome per problem the differences are +-1 and the test is McNemar's exact test.

    Returns:
        (p, exact): the p-value, and whether it was enumerated exactly. No nonzero difference: (1.0, True).
    """
    d = np.asarray([float(v) for v in diffs], dtype=np.float64)
    d = d[d != 0.0]
    if d.size == 0:
        return 1.0, True
    observed = abs(float(d.sum()))
    tol = 1e-9 * max(1.0, float(np.abs(d).sum()))  # sums of the same terms in another order round differently
    if d.size <= exact_max:
        sums = np.zeros(1, dtype=np.float64)
        for v in d:  # all 2**n signed sums, doubling per problem
            sums = np.concatenate([sums + v, sums - v])
        return float(np.mean(np.abs(sums) >= observed - tol)), True
    rng = np.random.default_rng(seed)
    hits, left = 0, int(resamples)
    while left > 0:  # in blocks: resamples x n signs would not fit in memory for large n
        k = min(left, max(1, 2_000_000 // d.size))
        signs = rng.integers(0, 2, size=(k, d.size), dtype=np.int8) * 2 - 1
        hits += int(np.count_nonzero(np.abs(signs @ d) >= observed - tol))
        left -= k
    return (1 + hits) / (1 + int(resamples)), False


def discordant(method: Sequence[Record], reference: Sequence[Record], *, key: str = "correct") -> tuple[int, int]:
    """(method right and reference wrong, method wrong and reference right) over the paired samples."""
    b = c = 0
    for m, r in pair_records(method, reference):
        a, z = bool(m.get(key)), bool(r.get(key))
        b += a and not z
        c += z and not a
    return b, c
