"""Argument checks at the doors of the Python API (generate, inspect) and the CLI: prompts, sampling, seeds and
switches. The request itself (method, parameters, budget, window, storage) is `vase.core.spec`'s.

Each check raises a TypeError (wrong type) or ValueError (wrong value) whose one-line message
names the argument, the value given and what is accepted, before any tensor work or model load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["check_int", "check_budget_window", "check_prompts", "check_sampling", "check_seed",
           "check_flags"]


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int: TypeError unless it is an int (not a bool, not 40.5), ValueError below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {_shown(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_budget_window(budget: Any, window: Any, policy: Any = None) -> None:
    """Budget B and window w (and, given a policy, the budget rule): the request spec's checks of these alone
    (`vase.core.spec.RequestSpec.validate`, which owns them; kept for callers of this name)."""
    from .spec import RequestSpec

    RequestSpec(policy if policy is not None else "full", budget, window).validate()


def check_prompts(prompts: Any) -> list[str]:
    """A prompt or a sequence of prompts -> a non-empty list of strings (or of token id lists)."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string or a list of strings, got {_shown(prompts)}")
    out = list(prompts)
    if not out:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, p in enumerate(out):
        token_ids = isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        if not isinstance(p, str) and not token_ids:  # token id lists pass through to the tokenizer
            raise TypeError(f"prompts[{i}] must be a string, got {_shown(p)}")
    return out


def check_seed(seed: Any, batch: int) -> None:
    """An int seed, or one int per prompt."""
    if isinstance(seed, Sequence) and not isinstance(seed, str):
        if len(seed) != batch:
            raise ValueError(f"seed lists {len(seed)} seeds for {batch} prompts: give one per prompt, or one int")
        for i, s in enumerate(seed):
            check_int(f"seed[{i}]", s)
    else:
        check_int("seed", seed)


def check_sampling(*, max_new_tokens: Any, temperature: Any, top_p: Any, top_k: Any, greedy: Any) -> None:
    """Length cap and sampling settings: types and ranges."""
    check_int("max_new_tokens", max_new_tokens, 1)
    if not isinstance(greedy, bool):
        raise TypeError(f"greedy must be True or False, got {_shown(greedy)}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite number, got {_shown(value)}")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0 (or greedy=True for argmax), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None:
        check_int("top_k", top_k)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for no top-k), got {top_k}")


def check_flags(**flags: Any) -> None:
    """Switches must be True or False: ``ignore_eos="no"`` is a truthy string that would turn EOS stopping off."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {_shown(value)}")
