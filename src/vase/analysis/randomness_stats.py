"""The measures of the randomness study: kept-set overlap and coverage, per-token KL against the full cache (and
against a mixture of seeds), attention output error, and bootstrap intervals of ratios of sums."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch



def jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Jaccard index |a & b| / |a | b| of bool sets [..., N] -> float [...] (1.0 for two empty sets)."""
    inter = (a & b).sum(-1).double()
    union = (a | b).sum(-1).double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def consecutive_overlap(kept: Sequence[torch.Tensor]) -> torch.Tensor:
    """Jaccard of each kept set with the next: [E - 1, ...] for E sets of bool [..., N]."""
    if len(kept) < 2:
        return torch.empty(0)
    return torch.stack([jaccard(a, b) for a, b in zip(kept[:-1], kept[1:])])


def coverage(kept: Sequence[torch.Tensor], candidates: Sequence[torch.Tensor]) -> torch.Tensor:
    """Share of the positions ever offered to an eviction that survived at least one: float [...].

    kept[e], candidates[e]: bool [..., N], what eviction e kept of what it was offered.
    """
    if not kept:
        raise ValueError("coverage needs at least one eviction")
    ever_kept = torch.stack(list(kept)).any(0)
    ever_offered = torch.stack(list(candidates)).any(0)
    return (ever_kept & ever_offered).sum(-1).double() / ever_offered.sum(-1).double().clamp(min=1)


def token_kl(full_lp: torch.Tensor, comp_lp: torch.Tensor) -> torch.Tensor:
    """KL(full || comp) per row: log-probs [T, V] -> float64 [T] (rows renormalised)."""
    lf = full_lp.double().log_softmax(-1)
    lc = comp_lp.double().log_softmax(-1)
    p = lf.exp()
    return torch.where(p > 0, p * (lf - lc), torch.zeros_like(p)).sum(-1)


class Mixture:
    """Running seed-average of next-token distributions, kept in log space: add [T, V] log-probs."""

    def __init__(self) -> None:
        self.log_sum: torch.Tensor | None = None
        self.count = 0

    def add(self, lp: torch.Tensor) -> None:
        lp = lp.double().log_softmax(-1)
        self.log_sum = lp if self.log_sum is None else torch.logaddexp(self.log_sum, lp)
        self.count += 1

    def log_probs(self) -> torch.Tensor:
        """log of the mean distribution: [T, V] float64."""
        return self.log_sum - math.log(self.count)


def ensemble_kl(full_lp: torch.Tensor, seed_lps: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(full || mean over seeds), mean over seeds of KL(full || seed)), each float64 [T]."""
    mix = Mixture()
    singles = []
    for lp in seed_lps:
        mix.add(lp)
        singles.append(token_kl(full_lp, lp))
    return token_kl(full_lp, mix.log_probs()), torch.stack(singles).mean(0)


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], *, n_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """(ratio, lo, hi): sum(num) / sum(den) over problems and its percentile bootstrap interval,
    resampling problems with replacement. num, den: one value per problem (e.g. the mean mixture
    KL and the mean single-seed KL of each problem)."""
    return _bootstrap(lambda idx: _ratio(num, den, idx), len(num), len(den), n_boot, seed, level)


def bootstrap_ratio_difference(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                               den_b: Sequence[float], *, n_boot: int = 2000, seed: int = 0,
                               level: float = 0.95) -> tuple[float, float, float]:
    """(ratio_a - ratio_b, lo, hi), the same problems drawn for both in each resample (paired)."""
    n = len(num_a)
    if not n == len(den_a) == len(num_b) == len(den_b):
        raise ValueError(f"paired ratios need one value per problem in each list, got {len(num_a)}, {len(den_a)}, "
                         f"{len(num_b)}, {len(den_b)}")
    return _bootstrap(lambda idx: _ratio(num_a, den_a, idx) - _ratio(num_b, den_b, idx), n, n, n_boot, seed, level)


def _ratio(num: Sequence[float], den: Sequence[float], idx: Sequence[int]) -> float:
    d = sum(den[i] for i in idx)
    return sum(num[i] for i in idx) / d if d > 0 else math.nan


def _bootstrap(stat: Callable[[Sequence[int]], float], n: int, n_den: int, n_boot: int, seed: int,
               level: float) -> tuple[float, float, float]:
    if n == 0 or n != n_den:
        raise ValueError(f"bootstrap needs one numerator and one denominator per problem, got {n} and {n_den}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, n, (n_boot, n), generator=gen).tolist()
    values = torch.tensor(sorted(stat(d) for d in draws), dtype=torch.float64)
    values = values[~values.isnan()]
    if values.numel() == 0:
        return stat(range(n)), math.nan, math.nan
    lo, hi = torch.quantile(values, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return stat(range(n)), lo, hi


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||out - ref|| / ||ref|| over the last dim: [..., D] -> float32 [...]."""
    return (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp(min=1e-12)
