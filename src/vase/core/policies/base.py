"""The policy contract and the two VaSE modifiers (value guard, stochastic selection).

A policy is a small frozen dataclass. Its scorer says how much each candidate is worth
keeping; the shared `select` turns scores into kept indices:

1. reserve the sinks (when protected) and, with a value guard, the candidates whose value
   vectors have the largest magnitude;
2. fill the rest of the budget by top-k on the scores, or by sampling without replacement
   with probability proportional to the scores (Gumbel-top-k).

Tensor layout everywhere (no transformers import in this package):
    keys, values: [batch, kv_heads, n_candidates, head_dim]   (post-RoPE keys, raw values)
    queries:      [batch, q_heads, window, head_dim]          (post-RoPE), or None
    returned:     LongTensor [batch, kv_heads, n_keep], indices into the candidate axis.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from .params import check_parameter_types

VALUE_METRICS = ("range", "l2", "var")


def value_magnitude(values: torch.Tensor, metric: str = "range") -> torch.Tensor:
    """Per-token magnitude of the value vectors.

    values: [batch, kv_heads, n, head_dim] -> [batch, kv_heads, n] float32.
    `range` = max_d v - min_d v (the paper's choice), `l2` = ||v||, `var` = variance over d.
    """
    v = values.float()
    if metric == "range":
        return v.amax(-1) - v.amin(-1)
    if metric == "l2":
        return v.norm(dim=-1)
    if metric == "var":
        return v.var(-1, unbiased=False)
    raise ValueError(f"unknown value metric {metric!r}: use one of {', '.join(VALUE_METRICS)}")


def uniform_noise(shape: tuple[int, ...], generator, device: torch.device) -> torch.Tensor:
    """Uniform(0,1) noise of `shape` [batch, ...]; one generator per batch row when a list is given.

    Drawing each row from its own generator makes a row's choices independent of the batch.
    A noise source (an object with `draw(kind, shape, device)`, e.g. `vase.caches.noise_replay.NoiseReplay`
    replaying host draws inside a compiled step) is asked instead.
    """
    return _noise("uniform", shape, generator, device)


def normal_noise(shape: tuple[int, ...], generator, device: torch.device) -> torch.Tensor:
    """Standard normal noise of `shape` [batch, ...], per-row generators (or a noise source) as in `uniform_noise`."""
    return _noise("normal", shape, generator, device)


def _noise(kind: str, shape: tuple[int, ...], generator, device: torch.device) -> torch.Tensor:
    """`kind` ("uniform" or "normal") noise of `shape` [batch, ...]: from a noise source, one generator (or
    None) for the whole tensor, or one generator per row."""
    if hasattr(generator, "draw"):
        return generator.draw(kind, shape, device)
    draw = torch.rand if kind == "uniform" else torch.randn
    if generator is None or isinstance(generator, torch.Generator):
        return draw(shape, generator=generator, device=device)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]} rows")
    return torch.stack([draw(shape[1:], generator=g, device=device) for g in generator])


def sample_without_replacement(weights: torch.Tensor, k: int, generator) -> torch.Tensor:
    """Draw `k` indices per row of `weights` [..., n] without replacement, P(i) proportional to weights.

    Gumbel-top-k on log(weights): the same distribution as sequential draws from the
    renormalised remainder. Zero-weight entries come only after every positive one, and
    entries marked -inf in `weights` (excluded) never come before zero-weight ones.
    """
    return gumbel_keys(weights, generator).topk(k, dim=-1).indices


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest entries per row of `scores` [..., n], largest first: LongTensor [..., k].

    Equal scores rank the lower index first. `torch.topk` leaves ties to the kernel, and CPU and CUDA
    break them differently, so exact ties (the same token's value at layer 0, whose rows are equal) would
    keep different tokens on different devices; a stable sort keeps the same ones everywhere.
    """
    return scores.argsort(dim=-1, descending=True, stable=True)[..., :k]


def gumbel_keys(weights: torch.Tensor, generator) -> torch.Tensor:
    """The keys `sample_without_replacement` ranks: log(weights) + Gumbel noise, same shape as `weights`."""
    u = uniform_noise(tuple(weights.shape), generator, weights.device).clamp_(min=1e-20)
    gumbel = -torch.log(-torch.log(u))
    # Zero weights get a key below any positive one (log of the smallest float32 is about -104)
    # that still carries the noise, so they are drawn uniformly once the positive ones run out.
    keys = torch.where(weights > 0, weights.clamp(min=1e-45).log() + gumbel, gumbel - 1000.0)
    return torch.where(torch.isneginf(weights), torch.full_like(keys, float("-inf")), keys)


@dataclass(frozen=True)
class Policy:
    """Base of every eviction policy; subclasses implement `score`.

    `select` is the single entry point for every integration (the transformers cache, the
    vLLM plugin): `select(keys, values, queries, n_keep, generator=..., budget=..., **state)`.

    State hooks: a policy that keeps state across evictions declares it; an integration
    drives the two hooks below the same way for every policy and has no policy-specific code.

    1. Per-slot state, `slot_state` (a tuple of names): for each name the integration keeps a
       float32 tensor [batch, kv_heads, slots] aligned with the stored K/V slots: zero for a
       newly written token, moved with its slot when survivors are compacted, dropped with an
       evicted slot. At an eviction it passes each one sliced to the candidates,
       [batch, kv_heads, n_candidates], as the keyword argument of that name; `select` may
       update it in place, and the integration then writes it back to the candidates' slots
       (the slice may be a copy). H2O accumulates attention mass this way.
    2. Per-layer state, `init_layer_state(batch, kv_heads, head_dim, generators, device)`:
       called once per layer and sequence, right before that sequence's first eviction in the
       layer, with the sequences' own generators (one per sequence); returns named tensors with
       the batch on dim 0. The integration keeps each sequence's rows for the life of the
       sequence and passes them (rows of the evicting sequences) as keyword arguments of those
       names at every eviction. CurDKV draws its projection this way.

    `generator` is passed to `select` only when `stochastic` is true (one per sequence), and
    `queries` only when `needs_queries` is true (the last `w` post-RoPE queries), else None.

    sinks:          how many first tokens are attention sinks.
    protect_sinks:  always keep the sinks (first in the kept order).
    n_large:        value guard: reserve this many slots (sinks included) for the candidates
                    with the largest value magnitude. None = use `value_guard`.
    value_guard:    the reserve as a fraction of the budget (0 = no guard).
    metric:         value magnitude metric: range, l2 or var.
    sample:         keep by sampling proportional to the scores instead of top-k.
    """

    sinks: int = 4
    protect_sinks: bool = False
    n_large: int | None = None
    value_guard: float = 0.0
    metric: str = "range"
    sample: bool = False

    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False
    #: scores are non-negative weights (attention mass); others are shifted before sampling
    nonnegative_scores: ClassVar[bool] = True
    #: names of per-slot state (hook 1 in the class docstring), e.g. H2O's ("accumulated",)
    slot_state: ClassVar[tuple[str, ...]] = ()
    #: drops K/V pairs from the cache once it passes B + w
    evicts: ClassVar[bool] = True
    #: keeps the whole cache but attends a B-token selection at every step (Quest)
    selects: ClassVar[bool] = False
    #: why this method cannot choose one kept set shared by every head (multi-head latent attention,
    #: `vase.core.shared_heads`); None: it can (its `score` reads keys per head, values only by magnitude)
    shared_heads_refusal: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        check_parameter_types(self)  # types first (from the field annotations), so the range checks below can compare
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.n_large is not None and self.n_large < 0:
            raise ValueError(f"n_large must be >= 0, got {self.n_large}")
        if not 0.0 <= self.value_guard < 1.0:
            raise ValueError(f"value_guard is a fraction of the budget in [0, 1), got {self.value_guard}")
        if self.metric not in VALUE_METRICS:
            raise ValueError(f"unknown value metric {self.metric!r}: use one of {', '.join(VALUE_METRICS)}")

    @property
    def stochastic(self) -> bool:
        """Whether `select` draws random numbers (then pass a generator per batch row)."""
        return self.sample

    @property
    def guarded(self) -> bool:
        return self.n_large is not None or self.value_guard > 0

    @property
    def protected_slots(self) -> int:
        """Slots kept besides the window whatever the scores say: the sinks when protected."""
        return self.sinks if self.protect_sinks else 0

    def check(self, budget: int, window: int) -> None:
        """Refuse a budget B and window w this policy cannot honour: ValueError naming the fix.

        The one owner of the budget rule, asked by the cache, `vase generate`, `vase eval`, the bench and the
        vLLM config alike: a policy that evicts or selects needs B > w + `protected_slots`."""
        if (self.evicts or self.selects) and budget <= window + self.protected_slots:
            raise ValueError(f"budget ({budget}) must be larger than window + protected sinks "
                             f"({window} + {self.protected_slots}): raise --budget or lower --window")

    def attend_mask(self, keys: torch.Tensor, queries: torch.Tensor, q_start: int, budget: int,
                    window: int) -> torch.Tensor:
        """What each query attends, for a policy that `selects` (keeps the whole cache, attends B tokens per step).

        keys [batch, kv_heads, L, head_dim] (post-RoPE, the stored slots in order), queries [batch, q_heads, q,
        head_dim] (query i at slot q_start + i) -> bool [batch, kv_heads, q, L], causal order included. The cache
        asks it when `selects` is true; an evicting policy never implements it."""
        raise NotImplementedError(f"{self.name} evicts; only a policy with selects = True has an attend_mask")

    def attends_densely(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` skips the policy and attends its whole cache (Quest's dense first layers)."""
        return False

    def reserve_size(self, n_keep: int, budget: int | None = None) -> int:
        """Slots reserved before scoring: the value guard (sinks included) or the protected sinks."""
        sinks = self.sinks if self.protect_sinks else 0
        if self.n_large is not None:
            reserve = self.n_large
        elif self.value_guard > 0:
            reserve = round(self.value_guard * (budget if budget is not None else n_keep))
        else:
            reserve = 0
        return min(max(reserve, sinks), n_keep)

    def init_layer_state(self, batch: int, kv_heads: int, head_dim: int, generators,
                         device: torch.device) -> dict[str, torch.Tensor]:
        """Per-layer state of `batch` sequences before their first eviction (hook 2): name -> [batch, ...].

        `generators`: one torch.Generator per sequence (or None). Default: no state."""
        return {}

    def params(self) -> dict:
        """Every parameter with its value: the method's identity in saved results."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- the part a method implements -------------------------------------------------------
    def score(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
              generator=None, **extra) -> torch.Tensor:
        """Worth of each candidate: [batch, kv_heads, n_candidates] float32, higher keeps."""
        raise NotImplementedError

    # -- the shared selection ---------------------------------------------------------------
    def select(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
               n_keep: int, generator=None, budget: int | None = None, **extra) -> torch.Tensor:
        """Indices of the candidates to keep: LongTensor [batch, kv_heads, n_keep].

        Reserved candidates come first (sinks, then the largest values), then the chosen ones.
        `generator` is a torch.Generator or one per batch row; `budget` (B) sizes a
        fractional value guard (default: n_keep).
        """
        self._check_shapes(keys, values, queries, n_keep)
        return self.select_by(tuple(keys.shape[:3]), n_keep, lambda: value_magnitude(values, self.metric),
                              lambda: self.score(keys, values, queries, generator=generator, **extra),
                              generator=generator, budget=budget, device=keys.device)

    def select_by(self, shape: tuple[int, int, int], n_keep: int, magnitude, scores, generator=None,
                  budget: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """`select` given how to get the value magnitudes and the scores: LongTensor [batch, heads, n_keep].

        shape: (batch, heads, n) of the candidates; magnitude, scores: callables returning [batch, heads, n]
        (asked only when the value guard or the scores are needed). `select` asks `value_magnitude` and
        `score` of its keys and values; a layer whose heads share one kept set (`vase.core.shared_heads`) asks
        the heads' reductions."""
        b, h, n = shape
        if n_keep == n:
            return torch.arange(n, device=device).expand(b, h, n).clone()

        n_sinks = min(self.sinks, n, n_keep) if self.protect_sinks else 0
        n_reserve = self.reserve_size(n_keep, budget)
        excluded = torch.zeros(b, h, n, dtype=torch.bool, device=device)
        parts = []
        if n_sinks:
            parts.append(torch.arange(n_sinks, device=device).expand(b, h, n_sinks))
            excluded[..., :n_sinks] = True
        if n_reserve > n_sinks:
            large = top_k_indices(magnitude().masked_fill(excluded, float("-inf")), n_reserve - n_sinks)
            parts.append(large)
            excluded.scatter_(-1, large, True)

        n_rest = n_keep - max(n_reserve, n_sinks)
        if n_rest > 0:
            scored = scores().float()
            if scored.shape != (b, h, n):
                raise ValueError(f"{self.name}.score returned {tuple(scored.shape)}, expected {(b, h, n)}")
            if self.sample:
                weights = scored if self.nonnegative_scores else scored - scored.amin(-1, keepdim=True)
                weights = weights.masked_fill(excluded, float("-inf"))
                parts.append(sample_without_replacement(weights, n_rest, generator))
            else:
                parts.append(top_k_indices(scored.masked_fill(excluded, float("-inf")), n_rest))
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0].clone()

    def _check_shapes(self, keys, values, queries, n_keep) -> None:
        if keys.dim() != 4 or keys.shape != values.shape:
            raise ValueError(f"keys and values must both be [batch, kv_heads, n, head_dim]; got "
                             f"{tuple(keys.shape)} and {tuple(values.shape)}")
        if not 0 < n_keep <= keys.shape[2]:
            raise ValueError(f"n_keep must be in 1..{keys.shape[2]} (the number of candidates), got {n_keep}")
        if self.needs_queries:
            if queries is None:
                raise ValueError(f"{self.name} scores candidates by attention and needs the query window")
            if queries.dim() != 4 or queries.shape[0] != keys.shape[0] or queries.shape[-1] != keys.shape[-1] \
                    or queries.shape[1] % keys.shape[1]:
                raise ValueError(f"queries must be [batch, q_heads, window, head_dim] with q_heads a multiple "
                                 f"of kv_heads; got {tuple(queries.shape)} for keys {tuple(keys.shape)}")
