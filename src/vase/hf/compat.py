"""The differences between the transformers versions vase supports (>= 5.16.1, < 6), in one place.

- The model call (and `generate`) takes the cache as `cache=` from 5.24 on, where
  `past_key_values=` is deprecated (removal announced for 5.40); before 5.24 only
  `past_key_values=` exists, and an unknown `cache=` would be swallowed by the model's
  `**kwargs` and silently ignored. Call models with `**cache_kwargs(cache)`.
"""

from __future__ import annotations

import re

import transformers

__all__ = ["CACHE_KWARG", "TRANSFORMERS_VERSION", "cache_kwargs", "generate_kwargs"]


def _release(version: str) -> tuple[int, ...]:
    """(5, 24, 0) from '5.24.0', '5.24.0.dev0' or '5.24.0rc1' (the numeric release part only)."""
    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", version).group(0).split("."))


TRANSFORMERS_VERSION: tuple[int, ...] = _release(transformers.__version__)

#: the keyword under which a model call takes its cache
CACHE_KWARG = "cache" if TRANSFORMERS_VERSION >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{CACHE_KWARG: cache}`: pass to a model call or `generate` as `**cache_kwargs(cache)`.

    TypeError for anything but a transformers `Cache` (a model would otherwise ignore it, or fail deep inside)."""
    from transformers.cache_utils import Cache

    if not isinstance(cache, Cache):
        raise TypeError(f"cache_kwargs takes a cache (vase.EvictionCache, vase.CompiledEvictionCache or another "
                        f"transformers Cache), got {cache!r} ({type(cache).__name__})")
    return {CACHE_KWARG: cache}


def generate_kwargs(cache) -> dict:
    """`cache_kwargs(cache)` plus what the cache asks `model.generate` for (a `CompiledEvictionCache`:
    its step hook and compile config): pass to `generate` as `**generate_kwargs(cache)`."""
    options = getattr(cache, "generate_options", None)
    return {**cache_kwargs(cache), **(options() if options is not None else {})}
