"""numpy scalars as the Python numbers they hold, at the doors that check types.

``np.int64(32)`` is what numpy code passes for a budget, a seed or a length (``np.arange``, ``df["B"][0]``); it is
no ``int`` to ``isinstance``, so the checks refused it ("must be an integer, got np.int64(32)"). `plain` turns a
numpy scalar (or 0-d array) into its ``int`` / ``float`` / ``bool`` before the checks, so the value is then
checked (and saved to JSON) like the number it is. numpy is not imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["plain", "plain_items", "plain_seed"]


def plain(value: Any) -> Any:
    """A numpy scalar's Python value (``np.int64(32)`` -> 32, ``np.bool_(True)`` -> True); anything else as is."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()
        if isinstance(item, (bool, int, float)):
            return item
    return value


def plain_items(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with each value `plain` (a method's parameters, storage keywords)."""
    return {k: plain(v) for k, v in options.items()}


def plain_seed(seed: Any) -> Any:
    """A seed, or a list / tuple / 1-d numpy array of them (one per row), each `plain`."""
    if type(seed).__module__ == "numpy" and getattr(seed, "ndim", None) == 1:
        seed = seed.tolist()
    if isinstance(seed, (list, tuple)):
        return type(seed)(plain(s) for s in seed)
    return plain(seed)
