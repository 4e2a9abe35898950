"""Eviction policies: pure tensor code, registered by name.

    from vase.core.policies import get_policy
    policy = get_policy("vase-attnv", n_large=64, sinks=4)
    keep = policy.select(keys, values, queries, n_keep, generator=None)

The VaSE modifiers compose with any scoring policy through parameters: `value_guard`
(fraction of the budget) or `n_large` (slots) for the value reserve, `sample=True` for
stochastic selection, `protect_sinks=True` for the sinks; e.g.
`get_policy("tova", value_guard=0.25, sample=True)`.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, replace

from ..errors import SpecError
from ..scalars import plain
from .base import VALUE_METRICS, Policy, sample_without_replacement, value_magnitude
from .dkv import CurDKV, VaseDKV
from .evict_large_v import EvictLargeV
from .full import Full
from .h2o import H2O
from .knorm import KNorm
from .quest import Quest
from .random import RandomKeep
from .rkv import RKV
from .scores import AttentionScored, key_redundancy, window_attention
from .snapkv import SnapKV, SnapKVSample, SnapKVValueReserve, VaseAttnV
from .streaming import StreamingLLM
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    Full, StreamingLLM, RandomKeep, KNorm, SnapKV, RKV, H2O, TOVA, CurDKV, VaseDKV, VaseAttnV,
    EvictLargeV, SnapKVSample, SnapKVValueReserve, Quest,
)}


class UnknownMethodError(SpecError):
    """A method name or parameter that does not exist (a SpecError, so a ValueError)."""


def method_names() -> list[str]:
    return list(POLICIES)


def policy_parameters(name: str) -> dict:
    """The parameters of method `name` with their defaults."""
    return get_policy(name).params()


def get_policy(name: str | Policy, **params) -> Policy:
    """The policy registered as `name`, with `params` overriding its defaults.

    Raises UnknownMethodError naming close matches for an unknown method, and the accepted
    parameters for an unknown parameter.
    """
    params = {k: plain(v) for k, v in params.items()}  # np.int64(8) is 8 (vase.core.scalars)
    if isinstance(name, Policy):
        return replace(name, **params) if params else name
    key = name.strip().lower().replace("_", "-")
    if key not in POLICIES:
        close = difflib.get_close_matches(key, POLICIES, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnknownMethodError(f"unknown method {name!r}.{hint} Known: {', '.join(POLICIES)}.")
    cls = POLICIES[key]
    accepted = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise UnknownMethodError(f"method {key!r} takes no parameter {', '.join(map(repr, unknown))}; "
                                 f"it takes: {', '.join(sorted(accepted))}.")
    return cls(**params)


__all__ = [
    "POLICIES", "AttentionScored", "Policy", "UnknownMethodError", "VALUE_METRICS", "get_policy", "key_redundancy",
    "method_names", "policy_parameters", "sample_without_replacement", "value_magnitude", "window_attention",
]
