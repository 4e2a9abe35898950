"""One kept set per layer, shared by every head: the eviction of multi-head latent attention (MLA).

An MLA layer (DeepSeek-V2/V3/R1, Kimi K2) stores one latent vector per token, shared by every query head;
each head's key and value are up-projections of it. Dropping a token drops it for every head, so one
eviction chooses one kept set per layer, from the heads' up-projected keys and values of the candidates
(docs/methods.md, "Multi-head latent attention"):

- scores: the policy's own per-head score (`Policy.score` on the heads' keys [b, h, n, dk] and the query
  window [b, h, w, dk]), averaged over the heads: a token's score is the mean over heads of its score in
  each head (for the windowed-attention methods, the attention mass the window gives it, averaged over heads);
- value magnitude (the value guard, and Evict-Large-V's score): the policy's metric of the token's values
  concatenated over the heads, [h * dv] (for `range`, the largest coordinate of any head's value minus the
  smallest), so a token with one outlier head is guarded;
- per-slot state (H2O's accumulator) is one number per token, [b, 1, n]: every head's score reads it and the
  heads' updates are averaged back, so H2O accumulates the heads' mean window attention;
- the kept index is the latent cache's, [b, 1, k].

A policy whose score mixes a head's key with its value (CurDKV, VaSE-DKV: one projection of both) or that
selects per KV head at every step (Quest) says why in `Policy.shared_heads_refusal` and is refused
(`shared_heads_problem`). Torch only.
"""

from __future__ import annotations

from typing import Any

import torch

from .policies import Policy, value_magnitude

__all__ = ["choose_shared", "shared_heads_problem", "shared_magnitude", "shared_values"]


def shared_heads_problem(policy: Policy) -> str | None:
    """Why `policy` cannot evict a layer whose heads share one kept set, in one line (None when it can)."""
    if policy.shared_heads_refusal is None:
        return None
    return (f"{policy.name} cannot evict multi-head latent attention (one kept set shared by every head): "
            f"{policy.shared_heads_refusal}; use another method, e.g. snapkv, h2o or vase-attnv")


def shared_values(values: torch.Tensor) -> torch.Tensor:
    """Each token's values concatenated over the heads: [b, h, n, dv] -> [b, 1, n, h * dv]."""
    b, h, n, d = values.shape
    return values.transpose(1, 2).reshape(b, 1, n, h * d)


def shared_magnitude(values: torch.Tensor, metric: str = "range") -> torch.Tensor:
    """The value magnitude of each token over every head: [b, h, n, dv] -> [b, 1, n] float32
    (`value_magnitude` of the values concatenated over the heads)."""
    return value_magnitude(shared_values(values), metric)


def choose_shared(policy: Policy, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
                  budget: int, window: int, generator: Any = None,
                  state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The candidates the policy keeps for every head: int64 [b, 1, B - w] indices into the candidates.

    keys [b, h, n, dk], values [b, h, n, dv]: the heads' up-projected keys (post-RoPE) and values of the
    candidates; queries: the last w post-RoPE queries [b, h, w, dk] (passed only to a policy that reads them);
    state: the policy's per-slot state [b, 1, n] (one per token, updated in place) and per-layer state.
    The `vase.core.kernel.choose` of a shared-heads layer (module docstring)."""
    problem = shared_heads_problem(policy)
    if problem:
        raise ValueError(problem)
    b, h, n, _ = keys.shape
    if values.dim() != 4 or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"keys [b, h, n, dk] and values [b, h, n, dv] must share b, h, n; got {tuple(keys.shape)} "
                         f"and {tuple(values.shape)}")
    n_keep = budget - window
    if not 0 < n_keep <= n:
        raise ValueError(f"B - w = {n_keep} must be in 1..{n} (the number of candidates)")
    if policy.needs_queries and (queries is None or queries.shape[:2] != (b, h) or queries.shape[-1] != keys.shape[-1]):
        got = None if queries is None else tuple(queries.shape)
        raise ValueError(f"{policy.name} needs the query window [b, h, w, dk] = [{b}, {h}, w, {keys.shape[-1]}], got {got}")
    state = state if state is not None else {}
    generator = generator if policy.stochastic else None

    def scores() -> torch.Tensor:
        per_head = {name: t.expand(b, h, n).clone() for name, t in state.items() if name in policy.slot_state}
        layer = {name: t for name, t in state.items() if name not in per_head}
        scored = policy.score(keys, shared_values(values), queries if policy.needs_queries else None,
                              generator=generator, **per_head, **layer).float()
        for name, t in per_head.items():  # the heads' updates of a per-token state, averaged back
            state[name].copy_(t.mean(1, keepdim=True))
        return scored.mean(1, keepdim=True)

    return policy.select_by((b, 1, n), n_keep, lambda: shared_magnitude(values, policy.metric), scores,
                            generator=generator, budget=budget, device=keys.device)
