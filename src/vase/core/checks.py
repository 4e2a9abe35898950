"""Argument checks at the doors of the Python API (generate, inspect) and the CLI: prompts, sampling, seeds and
switches; the one seed check (the request spec's too). The request itself (method, parameters, budget,
window, storage) is `vase.core.spec`'s, which imports this module, never the other way.

Each check raises a TypeError (wrong type) or ValueError (wrong value) whose one-line message
names the argument, the value given and what is accepted, before any tensor work or model load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .errors import SpecError

__all__ = ["check_int", "check_prompts", "check_sampling", "check_seed", "check_flags", "SEED_MAX"]

#: Seeds torch's generators take.
SEED_MAX = 2**63 - 1


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int: TypeError unless it is an int (not a bool, not 40.5), ValueError below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {_shown(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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


def check_seed(seed: Any, batch: int | None = None) -> None:
    """The one seed check (the request spec's and `generate`'s): an int, or one int per prompt (`batch` prompts,
    when given), each within torch's generator range; SpecError (a TypeError and a ValueError), one line."""
    seeds = list(seed) if isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)) else [seed]
    if not seeds:
        raise SpecError("seed is an empty list: give one int, or one per prompt")
    if batch is not None and seeds != [seed] and len(seeds) != batch:
        raise SpecError(f"seed lists {len(seeds)} seeds for {batch} prompts: give one per prompt, or one int")
    for i, s in enumerate(seeds):
        name = "seed" if seeds == [seed] else f"seed[{i}]"
        if isinstance(s, bool) or not isinstance(s, int):
            raise SpecError(f"{name} must be an integer, got {_shown(s)}")
        if abs(s) > SEED_MAX:  # -(2**63) is too small, not too large
            raise SpecError(f"{name} {s} is too {'small' if s < 0 else 'large'} (at "
                            f"{'least' if s < 0 else 'most'} {-SEED_MAX if s < 0 else SEED_MAX})")


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
