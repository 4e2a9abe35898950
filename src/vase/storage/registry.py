"""The storage registry: from the storage a request names to what holds its K/V and what counts its bytes.

A storage kind (`StorageKind`) ties together, for one way of holding K/V:

- `spec`: the class a request carries (`RequestSpec.storage`; the built-in ones and the spec registry the
  request reads live below the implementations, in `vase.core.storage_specs`), with `KEYWORDS` (field -> the keyword
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

from ..core.storage_specs import (Fp8Config, Fp8Spec, QuantConfig, QuantSpec, register_spec, spec_from_options,
                                  spec_types, storage_keywords, unregister_spec)
from .fp8 import Fp8Bytes, Fp8Storage
from ..core.policies import Policy
from .quantized import QuantBytes, QuantStorage
from .static import StaticDense, StaticQuant
from .dense import DenseStorage
from .protocol import KVStorage

__all__ = ["StorageKind", "register_storage", "unregister_storage", "storage_kinds", "storage_keywords", "spec_types", "spec_from_options",
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
    if kind.spec is not None:  # the request spec reads the spec types from the core (vase.core.storage_specs)
        register_spec(kind.name, kind.spec)
    return kind


def unregister_storage(name: str) -> None:
    """Remove the kind `name` (and its spec from the request's spec types); nothing when none is registered."""
    _KINDS[:] = [k for k in _KINDS if k.name != name]
    unregister_spec(name)


def storage_kinds() -> list[StorageKind]:
    return list(_KINDS)


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
