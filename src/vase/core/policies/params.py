"""Type checks of method parameters, from the policy dataclass's declared field types.

A policy's fields are its parameters (``sinks: int``, ``sample: bool``, ``n_large: int | None``,
``temperature: float``, ``metric: str``). They arrive from Python, YAML configs and ``-p KEY=VALUE``
flags, so ``sample="maybe"`` or ``n_large=1.5`` must be refused at construction, before any model
loads, with one line naming the method, the parameter, the value and what is accepted. Ranges stay
in each policy's ``__post_init__`` (which runs after this check, on values of the right type).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from ..errors import SpecError

__all__ = ["ParameterError", "check_parameter_types"]


class ParameterError(SpecError):
    """A method parameter of the wrong type (a SpecError: a TypeError, and a ValueError for callers catching those)."""


_WHAT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _kinds(hint: Any) -> tuple[tuple[type, ...], bool]:
    """(accepted scalar types, None allowed) of a field's type hint; () when the hint is not a plain scalar."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        args = typing.get_args(hint)
        kinds = tuple(a for a in args if a is not type(None))
        if all(k in _WHAT for k in kinds):
            return kinds, type(None) in args
        return (), True
    if hint in _WHAT:
        return (hint,), False
    return (), True


def _fits(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:  # True is an int to Python, not to a user; 64.0 is not an integer slot count
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def check_parameter_types(policy: Any) -> None:
    """Raise ParameterError if a field of the (dataclass) ``policy`` does not fit its declared type.

    An int given for a float field is stored as a float (``temperature=1`` is ``temperature=1.0``).

    Fields with hints other than bool/int/float/str (optionally ``| None``) are not checked here.
    """
    cls = type(policy)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(policy):
        kinds, optional = _kinds(hints.get(f.name))
        if not kinds:
            continue
        value = getattr(policy, f.name)
        if value is None and optional:
            continue
        if any(_fits(value, k) for k in kinds):
            if float in kinds and int not in kinds and not isinstance(value, float):
                # 1 and 1.0 are one setting: keep one repr, so the saved run identity does not depend on it
                object.__setattr__(policy, f.name, float(value))
            continue
        want = " or ".join(_WHAT[k] for k in kinds) + (" (or unset)" if optional else "")
        if float in kinds and isinstance(value, float):
            want = "a finite number"
        raise ParameterError(f"method {getattr(cls, 'name', cls.__name__)!r}: parameter {f.name} must be {want}, "
                             f"got {value!r}")
