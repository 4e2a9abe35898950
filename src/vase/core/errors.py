"""The one error type of a request that cannot run (method, parameters, budget, window, storage, seed).

It lives below everything (no imports) so the policies' own refusals (an unknown method, a parameter of the
wrong type) are of the same type as the request spec's (`vase.core.spec`): a caller catches `SpecError` once. It is
both a TypeError (a wrong type: ``budget="abc"``) and a ValueError (a wrong value: ``budget=12`` with ``window=12``),
so callers that catch either keep working.
"""

from __future__ import annotations

__all__ = ["SpecError"]


class SpecError(TypeError, ValueError):
    """A request that cannot run; the one-line message names the value and what to change."""
