"""The storage registry: from the storage a request names to what holds its K/V and what counts its bytes.

A storage kind (`StorageKind`) ties together, for one way of holding K/V:

- `spec`: the class a request carries (`RequestSpec.storage`), with `KEYWORDS` (field -> the keyword
  callers spell it with, e.g. ``kv_bits``), `from_options(options)` and `resolve(policy, budget, window,
  seed)`, which checks it against the method (ValueError, one line) and returns the validated `config`
  (None: nothing to store differently, i.e. dense);
- `eager(config, window, layer_idx)`: the `vase.storage.protocol.KVStorage` of one `EvictionLayer`;
- `static(storage, index, pads, pad0, cap)`: the fixed-shape store of the compiled step
  (`vase.storage.static`), built from the eager storage once every row is steady; None: no static
  form, and `static_refusal(config)` says so in one line (also for a config the static store cannot run);
- `byte_model(model, policy, budget, window, spec)`: the per-sequence byte accounting the eval and the
  bench read (`held`, `byte_steps`, `allocated`, `write_bytes`; see `vase.storage.quantized.QuantBytes`), or
  None when the storage holds dense bytes per token.

Three kinds are registered here: dense (no spec: full precision, `DenseStorage` / `StaticDense`, bytes per
token), quantized (`QuantSpec`: `QuantStorage` / `StaticQuant` / `QuantBytes`) and fp8 (`Fp8Spec`, the
keyword `kv_dtype`: `Fp8Storage` / no static form / `Fp8Bytes`). A new storage is its own
module plus one `register_storage(...)` call (docs/architecture.md); nothing else names a storage class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .fp8 import Fp8Bytes, Fp8Config, Fp8Spec, Fp8Storage
from ..core.policies import Policy
from .quantized import QuantBytes, QuantConfig, QuantSpec, QuantStorage
from .static import StaticDense, StaticQuant
from .protocol import DenseStorage, KVStorage

__all__ = ["StorageKind", "register_storage", "storage_kinds", "storage_keywords", "spec_types", "spec_from_options",
           "kind_of", "eager_storage", "static_store", "static_refusal", "byte_model"]


@dataclass(frozen=True)
class StorageKind:
    """One way of holding K/V (see the module docstring)."""

    name: str
    spec: type | None  # None: dense (no spec)
    config: type  # what `spec.resolve` returns for this kind (type(None) for dense)
    eager: Callable[[Any, int, int], KVStorage]
    static: Callable[..., Any] | None = None
    static_refusal: Callable[[Any], str | None] = lambda config: None
    byte_model: Callable[..., Any] = lambda model, policy, budget, window, spec: None


_KINDS: list[StorageKind] = []


def register_storage(kind: StorageKind) -> StorageKind:
    """Register `kind` (replacing one of the same name); returns it."""
    _KINDS[:] = [k for k in _KINDS if k.name != kind.name] + [kind]
    return kind


def storage_kinds() -> list[StorageKind]:
    return list(_KINDS)


def spec_types() -> tuple[type, ...]:
    """The storage spec classes a request may carry."""
    return tuple(k.spec for k in _KINDS if k.spec is not None)


def storage_keywords() -> tuple[str, ...]:
    """Every keyword that spells a storage (``kv_bits``, ``quant_guard``, ...), in registration order."""
    return tuple(kw for k in _KINDS if k.spec is not None for kw in k.spec.KEYWORDS.values())


def spec_from_options(options: Mapping[str, Any]) -> Any:
    """The storage spec the storage keywords of `options` spell (others are ignored); None when they spell none.
    Keywords of two storages at once are refused in one line."""
    found = [(k, spec) for k in _KINDS if k.spec is not None
             for spec in [k.spec.from_options(options)] if spec is not None]
    if len(found) > 1:
        raise ValueError(f"the options spell two storages ({', '.join(k.name for k, _ in found)}): give one")
    return found[0][1] if found else None


def kind_of(config_or_spec: Any) -> StorageKind:
    """The kind a resolved config (None: dense) or a spec belongs to."""
    for k in _KINDS:
        if isinstance(config_or_spec, k.config) or (k.spec is not None and isinstance(config_or_spec, k.spec)):
            return k
    raise TypeError(f"no registered storage for {type(config_or_spec).__name__} (vase.storage.registry.register_storage)")


def eager_storage(config: Any, window: int, layer_idx: int) -> KVStorage:
    """The empty storage of one `EvictionLayer` for a resolved config (None: dense)."""
    return kind_of(config).eager(config, window, layer_idx)


def static_refusal(config: Any) -> str | None:
    """One line when the compiled step cannot hold this config's K/V (None: it can)."""
    kind = kind_of(config)
    if kind.static is None:
        return f"compile=True has no fixed-shape form of the {kind.name} storage: use compile=False"
    return kind.static_refusal(config)


def static_store(config: Any, storage: KVStorage, index: torch.Tensor, pads: torch.Tensor, pad0: list[int],
                 cap: int) -> Any:
    """The fixed-shape store of `storage` (an `EvictionLayer`'s): row r's real slots `index[r]` [kv_heads, cap]
    (from slot pads[r]) moved to the front; `pad0`: each row's prompt padding; `cap`: B + w."""
    return kind_of(config).static(storage, index, pads, pad0, cap)


def byte_model(model, policy: Policy, budget: int | None, window: int, storage: Any) -> Any:
    """The eval's and bench's byte accounting of `EvictionCache(model, policy, budget, window, storage=storage)`;
    None when it holds dense bytes per token. `storage`: a spec, keyword options (method parameters among
    them: only the storage keywords are read) or None."""
    spec = spec_from_options(storage) if isinstance(storage, Mapping) else storage
    if spec is None:
        return None
    return kind_of(spec).byte_model(model, policy, budget, window, spec)


# -- the built-in kinds ---------------------------------------------------------------------------------------
register_storage(StorageKind(
    name="dense", spec=None, config=type(None),
    eager=lambda config, window, layer_idx: DenseStorage(),
    static=lambda storage, index, pads, pad0, cap: StaticDense.from_eager(storage.keys, storage.values, index)))


def _quant_refusal(config: QuantConfig) -> str | None:
    if config.select != "value":
        return "compile=True keeps the reserve by the value guard's ranking only: drop quant_select='random' (or use " \
               "compile=False)"
    return None


register_storage(StorageKind(
    name="quantized", spec=QuantSpec, config=QuantConfig,
    eager=lambda config, window, layer_idx: QuantStorage(config, window, layer_idx),
    static=lambda storage, index, pads, pad0, cap: StaticQuant(storage, pads, pad0, cap),
    static_refusal=_quant_refusal,
    byte_model=QuantBytes.for_model))


register_storage(StorageKind(
    name="fp8", spec=Fp8Spec, config=Fp8Config,
    eager=lambda config, window, layer_idx: Fp8Storage(config),
    byte_model=Fp8Bytes.for_model))
