"""What a request may ask of a storage: the storages' spec types, their keywords and their rules, below the
storage implementations (`vase.storage`), so that the request spec (`vase.core.spec`) checks a storage without
importing one.

A spec class has `KEYWORDS` (field -> the keyword callers spell it with, e.g. ``kv_bits``), `from_options(options)`,
`options()` and `resolve(policy, budget, window, seed)`, which checks it against the method (ValueError, one line)
and returns the validated config (None: nothing stored differently). The built-in ones are here: the quantized
storage's (`QuantSpec` -> `QuantConfig`) and fp8's (`Fp8Spec` -> `Fp8Config`); a new storage's spec is registered
with its implementation (`vase.storage.registry.register_storage`), which calls `register_spec`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .policies import Policy

__all__ = ["BITS", "CACHE_STORAGE_OPTIONS", "SELECT", "FORMATS", "ROUNDINGS", "bits_problem", "check_format",
           "QuantSpec", "QuantConfig", "quant_config", "Fp8Spec", "Fp8Config", "register_spec", "unregister_spec", "spec_types",
           "storage_keywords", "spec_from_options"]

BITS = (8, 4, 2)
#: EvictionCache keywords of the quantized storage (eval configs pass them with a method's parameters).
CACHE_STORAGE_OPTIONS = ("kv_bits", "quant_guard", "quant_group", "quant_select", "flush_every", "quant_key_scale")


def bits_problem(bits) -> str:
    """The one message for a kv_bits vase cannot store (the request spec, the quantizer and the CLI say it alike)."""
    return f"kv_bits must be 16 (no quantization) or one of {', '.join(map(str, BITS))}; got {bits}"


def check_format(bits: int, group: int, dim: int) -> None:
    """Raise a one-line ValueError unless `bits`/`group` can quantize vectors of `dim` elements."""
    if bits not in BITS:
        raise ValueError(bits_problem(bits))
    if group < 1 or dim % group:
        raise ValueError(f"quant_group ({group}) must divide head_dim ({dim}): use e.g. {dim} or a divisor of it")
    if group % (8 // bits):
        raise ValueError(f"quant_group ({group}) must be a multiple of {8 // bits} to pack {bits}-bit codes")


# -- the quantized storage (vase.storage.quantized) ---------------------------------------------------------
SELECT = ("value", "random")


@dataclass(frozen=True)
class QuantSpec:
    """What a caller asks of the quantized storage: `EvictionCache(..., storage=QuantSpec(bits=4, guard=8))`.

    bits: 8, 4 or 2 (16 = full precision); guard: R, old tokens per KV head kept in full precision
    (None: the method's own reserve); group: quantization group along head_dim (None: min(32,
    head_dim)); select: "value" (the value guard's ranking) or "random"; flush_every: tokens
    between flushes into the packed store; key_scale: a per-channel key scale before the groups.
    Checked against the method by `resolve` (so a spec can be built before any model or policy)."""

    bits: int
    guard: int | None = None
    group: int | None = None
    select: str = "value"
    flush_every: int = 16
    key_scale: bool = False

    #: the EvictionCache keyword (`vase.storage.packing.CACHE_STORAGE_OPTIONS`) of each field
    KEYWORDS: ClassVar[dict[str, str]] = {"bits": "kv_bits", "guard": "quant_guard", "group": "quant_group",
                                          "select": "quant_select", "flush_every": "flush_every",
                                          "key_scale": "quant_key_scale"}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "QuantSpec | None":
        """The spec the keywords `kv_bits`, `quant_guard`, ... of `options` spell (others are ignored); None when
        `options` holds none of them. Not checked here: `resolve` checks."""
        given = {field: options[key] for field, key in cls.KEYWORDS.items() if key in options}
        if not given:
            return None
        return cls(**{"bits": 16, **given})

    def options(self) -> dict[str, Any]:
        """The EvictionCache keywords of this spec (the inverse of `from_options`)."""
        return {key: getattr(self, field) for field, key in self.KEYWORDS.items()}

    def resolve(self, policy: Policy, budget: int, window: int, seed: int | Sequence[int]) -> "QuantConfig | None":
        """The validated configuration for `policy` (`quant_config`); None when nothing is quantized (bits 16)."""
        if self.bits == 16 and self.guard is None:  # full precision: the other fields are not read
            return None
        return quant_config(policy, budget, window, self.bits, self.guard, self.group, self.select,
                            self.flush_every, seed, self.key_scale)


@dataclass(frozen=True)
class QuantConfig:
    """kv_bits, group size, and the full-precision reserve of old tokens per KV head."""

    bits: int
    group: int | None  # None: min(32, head_dim)
    guard: int  # R: old tokens per KV head kept in full precision (sinks first)
    select: str  # "value": the value guard's ranking; "random": a control with R random tokens
    metric: str
    sinks: int
    flush_every: int
    seed: int
    key_scale: bool = False  # divide keys by a per-channel scale (from the prompt) before per-token groups


def quant_config(policy: Policy, budget: int, window: int, kv_bits: int, quant_guard: int | None,
                 quant_group: int | None, quant_select: str, flush_every: int, seed: int,
                 key_scale: bool = False) -> QuantConfig | None:
    """Validate the quantization options; None when kv_bits is 16 (no quantization).

    quant_guard None = the method's own reserve (sinks + value guard slots, at least the sinks).
    """
    if kv_bits == 16:
        if quant_guard is not None or quant_select != "value" or key_scale:
            raise ValueError("quant_guard/quant_select/quant_key_scale only apply to a quantized cache: pass "
                             "kv_bits=8, 4 or 2 (--kv-bits)")
        return None
    if policy.selects:
        raise ValueError(f"{policy.name} selects from a full cache at every step; kv_bits applies to the owned "
                         "cache of an eviction method or 'full'")
    if kv_bits not in BITS:
        raise ValueError(bits_problem(kv_bits))
    if quant_select not in SELECT:
        raise ValueError(f"quant_select must be one of {', '.join(SELECT)}; got {quant_select!r}")
    if flush_every < 1:
        raise ValueError(f"flush_every must be >= 1, got {flush_every}")
    if quant_guard is None:
        quant_guard = max(policy.reserve_size(max(budget - window, 1), budget), policy.sinks) if policy.evicts \
            else policy.sinks
    if quant_guard < 0:
        raise ValueError(f"quant_guard is a number of tokens per KV head (0 = quantize every old token); got "
                         f"{quant_guard}")
    if quant_group is not None:  # head_dim is checked when the first K/V arrive
        check_format(kv_bits, quant_group, quant_group * (8 // kv_bits))
    return QuantConfig(bits=kv_bits, group=quant_group, guard=int(quant_guard), select=quant_select,
                       metric=policy.metric, sinks=policy.sinks, flush_every=flush_every,
                       seed=seed if isinstance(seed, int) else int(seed[0]), key_scale=bool(key_scale))


# -- fp8 (vase.storage.fp8) -----------------------------------------------------------------------------------
#: kv_dtype spellings (vLLM's `kv_cache_dtype` names) -> torch dtype; "fp8" is e4m3, as in vLLM
FORMATS: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                   "fp8_e5m2": torch.float8_e5m2}

#: how `to_fp8` rounds: to nearest even (torch's cast) or toward zero (vLLM's CPU kernel)
ROUNDINGS = ("nearest", "zero")


@dataclass(frozen=True)
class Fp8Spec:
    """What a caller asks: `kv_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2" ("auto": the model's dtype, nothing stored
    differently). Checked by `resolve`."""

    dtype: str = "fp8"
    #: "nearest" (torch's cast) or "zero" (vLLM's CPU kernel, so that a run here stands for vLLM's fp8 on a CPU)
    rounding: str = "nearest"
    KEYWORDS: ClassVar[dict[str, str]] = {"dtype": "kv_dtype", "rounding": "kv_rounding"}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "Fp8Spec | None":
        """The spec the keywords `kv_dtype` and `kv_rounding` of `options` spell; None when both are absent."""
        if "kv_dtype" not in options and "kv_rounding" not in options:
            return None
        return cls(options.get("kv_dtype", "auto"), options.get("kv_rounding", "nearest"))

    def options(self) -> dict[str, Any]:
        """The EvictionCache keywords of this spec (the inverse of `from_options`); a rounding other than torch's
        is named too, so that a run's identity tells the two apart."""
        return {"kv_dtype": self.dtype, **({"kv_rounding": self.rounding} if self.rounding != "nearest" else {})}

    def resolve(self, policy: Policy, budget: int, window: int, seed: int | Sequence[int]) -> "Fp8Config | None":
        """The validated configuration (None for "auto"); ValueError naming the accepted spellings."""
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"kv_rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.dtype == "auto":
            if self.rounding != "nearest":
                raise ValueError(f"kv_rounding={self.rounding} rounds fp8 codes: add kv_dtype=fp8 (or fp8_e4m3, "
                                 f"fp8_e5m2), or drop kv_rounding")
            return None
        if not isinstance(self.dtype, str) or self.dtype not in FORMATS:
            raise ValueError(f"kv_dtype must be one of auto, {', '.join(FORMATS)}, got {self.dtype!r}")
        if policy.selects:  # its page selection reads the stored keys directly
            raise ValueError(f"kv_dtype={self.dtype} does not run with {policy.name}, which selects pages from the "
                             f"stored keys: use kv_dtype=auto")
        return Fp8Config(format=self.dtype, rounding=self.rounding)


@dataclass(frozen=True)
class Fp8Config:
    """The float8 format and the per-layer scales (vLLM's default 1.0)."""

    format: str
    k_scale: float = 1.0
    v_scale: float = 1.0
    rounding: str = "nearest"

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.format]


# -- the spec registry ---------------------------------------------------------------------------------------------
_SPECS: dict[str, type] = {}


def register_spec(name: str, spec: type) -> None:
    """Register storage `name`'s spec class (replacing one of the same name; the order is registration order)."""
    _SPECS.pop(name, None)
    _SPECS[name] = spec


def unregister_spec(name: str) -> None:
    """Remove storage `name`'s spec class; nothing when none is registered."""
    _SPECS.pop(name, None)


def spec_types() -> tuple[type, ...]:
    """The storage spec classes a request may carry."""
    return tuple(_SPECS.values())


def storage_keywords() -> tuple[str, ...]:
    """Every keyword that spells a storage (``kv_bits``, ``quant_guard``, ...), in registration order."""
    return tuple(kw for spec in _SPECS.values() for kw in spec.KEYWORDS.values())


def spec_from_options(options: Mapping[str, Any]) -> Any:
    """The storage spec the storage keywords of `options` spell (others are ignored); None when they spell none.
    Keywords of two storages at once are refused in one line."""
    found = [(name, spec) for name, cls in _SPECS.items() for spec in [cls.from_options(options)] if spec is not None]
    if len(found) > 1:
        raise ValueError(f"the options spell two storages ({', '.join(name for name, _ in found)}): give one")
    return found[0][1] if found else None


register_spec("quantized", QuantSpec)
register_spec("fp8", Fp8Spec)
