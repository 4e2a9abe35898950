"""One request spec for every door: (method, policy parameters, B, w, storage, seed), validated once.

    spec = RequestSpec.of("snapkv", 512, 64, n_large=64, kv_bits=4)   # storage keywords split from the method's
    req = spec.validate()             # Request: the policy, B, w, the storage and its validated configuration

`validate()` owns every rule of a request, in this order, and raises `vase.core.errors.SpecError` (a TypeError and
a ValueError) with one line per problem, naming the value and the fix:

1. types and ranges: a method name or Policy, B and w whole numbers in 1..2**31-1 (torch holds them), a seed
   (an int, or one int per row); the storage a `QuantSpec` (or its keywords ``kv_bits``, ``quant_guard``, ...);
2. the method and its parameters (`vase.core.policies.get_policy`: unknown names, parameter types and ranges);
3. the budget rule (`Policy.check`: B > w + protected slots); B = None only for a method that keeps every
   token, which gets the one placeholder budget (`placeholder_budget`);
4. the reserve rule: slots a method reserves must fit in what the budget leaves: ``n_large`` (the value
   guard, sinks included) within the B - w old tokens each eviction keeps, ``quant_guard`` (old tokens kept in
   full precision) within B;
5. the storage rule (`vase.storage.quantized.quant_config`: kv_bits 16/8/4/2, the options that need quantization,
   a selecting method refused);
6. optionally, what the engine can run (`vase.core.capabilities`: vLLM has no quantized storage).

Every door builds one: `EvictionCache` (and so `CompiledEvictionCache`, `vase.generate`, `forced_log_probs`),
the CLI's checks before a model loads (`vase generate`, `bench`, `inspect`), `vase eval`'s config, the vLLM
plugin's `additional_config` parsing (and so `vase.vllm.additional_config` and `vase serve`). Doors add their
context (``snapkv: ...``, ``vase config: ...``) before the same message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .capabilities import engine_info, refuse_unsupported
from .checks import SEED_MAX, check_seed
from .errors import SpecError
from .policies import Policy, get_policy
from .scalars import plain, plain_items, plain_seed
from .schedule import placeholder_budget
from .storage_specs import CACHE_STORAGE_OPTIONS, QuantConfig, QuantSpec, spec_from_options, spec_types, storage_keywords

__all__ = ["SpecError", "RequestSpec", "Request", "carried", "set_beside", "placeholder_budget", "split_storage", "INT_MAX",
           "SEED_MAX", "STORAGE_KEYWORDS"]

#: Integers torch must hold (a larger budget or length overflows a C long deep inside torch).
INT_MAX = 2**31 - 1
#: The keywords that spell the built-in quantized storage (`QuantSpec.from_options`); `split_storage` reads every
#: registered storage's (`vase.core.storage_specs.storage_keywords`); everything else is the method's.
STORAGE_KEYWORDS = CACHE_STORAGE_OPTIONS


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def split_storage(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the method's parameters, the storage keywords) of mixed keyword options (``n_large=64, kv_bits=4``)."""
    keywords = storage_keywords()
    params = {k: v for k, v in options.items() if k not in keywords}
    return params, {k: v for k, v in options.items() if k in keywords}


def _whole(name: str, value: Any, maximum: int = INT_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name} must be an integer, got {_shown(value)}")
    if value < 1:
        raise SpecError(f"{name} must be a positive number of tokens, got {value}")
    if value > maximum:
        raise SpecError(f"{name} {value} is too large (at most {maximum})")
    return value


def whole_tokens(name: str, value: Any, maximum: int = INT_MAX) -> int:
    """`value` as a positive number of tokens (a budget, a window, a length), else SpecError naming `name`."""
    return _whole(name, value, maximum)


_STORAGE_TYPES = {"bits": (int, "an integer (16, 8, 4 or 2)"), "guard": (int, "a number of tokens (or unset)"),
                  "group": (int, "an integer (or unset)"), "select": (str, "'value' or 'random'"),
                  "flush_every": (int, "a number of tokens"), "key_scale": (bool, "true or false")}


def _storage_types(storage: QuantSpec) -> None:
    for fname, key in QuantSpec.KEYWORDS.items():
        value = getattr(storage, fname)
        kind, what = _STORAGE_TYPES[fname]
        if value is None and fname in ("guard", "group"):
            continue
        if (kind is not bool and isinstance(value, bool)) or not isinstance(value, kind):
            raise SpecError(f"{key} must be {what}, got {_shown(value)}")


@dataclass(frozen=True)
class Request:
    """A validated request: what the cache, the compiled step and the vLLM plugin build from."""

    policy: Policy
    budget: int  # B (the placeholder for a method that keeps every token)
    window: int
    storage: Any  # the storage spec as asked (a registered spec type, `vase.core.storage_specs`; None: full precision)
    storage_config: Any  # its validated configuration (QuantConfig, Fp8Config, ...; None: full precision)
    seed: Any
    params: Mapping[str, Any] = field(default_factory=dict)  # the method's parameters as asked (the vLLM section's)

    @property
    def method(self) -> str:
        return self.policy.name

    @property
    def quant(self) -> Any:
        """The old name of `storage_config` (it holds any storage's configuration, not only the quantized one's)."""
        return self.storage_config


@dataclass(frozen=True)
class RequestSpec:
    """What a caller asks for; nothing is checked until `validate()`.

    method: a registered name or a Policy; params: the method's parameters; budget: B (None for a method that
    keeps every token); window: w; storage: None (full precision) or a storage spec (`QuantSpec`, `Fp8Spec`, ...); seed: an int or one per row.
    """

    method: Any = "vase-attnv"
    budget: Any = 512
    window: Any = 64
    params: Mapping[str, Any] = field(default_factory=dict)
    storage: Any = None
    seed: Any = 0

    def __post_init__(self) -> None:  # numpy scalars are the numbers they hold (vase.core.scalars)
        object.__setattr__(self, "budget", plain(self.budget))
        object.__setattr__(self, "window", plain(self.window))
        object.__setattr__(self, "seed", plain_seed(self.seed))
        if isinstance(self.params, Mapping):
            object.__setattr__(self, "params", plain_items(self.params))

    @classmethod
    def of(cls, method: Any, budget: Any = 512, window: Any = 64, *, seed: Any = 0, storage: Any = None,
           **options: Any) -> "RequestSpec":
        """A spec from keyword options as callers pass them: the method's parameters and the storage keywords
        (``kv_bits``, ``quant_guard``, ...) mixed; the storage given once (`storage=` or the keywords)."""
        params, spelled = split_storage(plain_items(options))
        if spelled:
            if storage is not None:
                raise SpecError(f"pass the storage once: storage={storage!r} or {', '.join(spelled)}, not both")
            try:
                storage = spec_from_options(spelled)
            except ValueError as exc:
                raise SpecError(str(exc)) from None
        return cls(method=method, budget=budget, window=window, params=params, storage=storage, seed=seed)

    def validate(self, engine: str | None = None) -> Request:
        """The validated request; SpecError (one line) for the first problem. `engine`: also refuse what that
        engine cannot run (see `vase.core.capabilities`)."""
        if not isinstance(self.method, (str, Policy)):
            raise SpecError(f"method must be a method name such as 'vase-attnv' (see `vase methods`) or a Policy, "
                            f"got {_shown(self.method)}")
        if self.budget is not None:
            _whole("budget", self.budget)
        window = _whole("window", self.window)
        check_seed(self.seed)
        if self.storage is not None and not isinstance(self.storage, spec_types()):
            raise SpecError(f"storage must be None (full precision) or a storage spec ("
                            f"{', '.join(t.__name__ for t in spec_types())}), "
                            f"got {self.storage!r}")
        policy = self.build_policy()
        self._sinks_used(policy)
        budget = self.budget
        if budget is None:
            if policy.evicts or policy.selects:
                raise SpecError(f"method {policy.name!r} needs a budget: give budget B (KV pairs kept per layer "
                                f"and KV head)")
            budget = placeholder_budget(window)
        try:
            policy.check(budget, window)  # the budget rule, owned by the policy
        except SpecError:
            raise
        except ValueError as exc:
            raise SpecError(str(exc)) from None
        self._reserves(policy, budget, window)
        config = None
        if self.storage is not None:
            if isinstance(self.storage, QuantSpec):
                _storage_types(self.storage)
            try:
                config = self.storage.resolve(policy, budget, window, self.seed)
            except SpecError:
                raise
            except ValueError as exc:
                raise SpecError(str(exc)) from None
            if engine is not None:
                refuse_unsupported(engine, storage=True)
        elif engine is not None:
            engine_info(engine)
        return Request(policy=policy, budget=budget, window=window, storage=self.storage, storage_config=config,
                       seed=self.seed, params=dict(self.params))

    def build_policy(self) -> Policy:
        """Step 2 of `validate` alone: the method with its parameters (SpecError for an unknown name, a parameter
        it does not take, a value of the wrong type or range)."""
        if not isinstance(self.method, (str, Policy)):
            raise SpecError(f"method must be a method name such as 'vase-attnv' (see `vase methods`) or a Policy, "
                            f"got {_shown(self.method)}")
        if not isinstance(self.params, Mapping):
            raise SpecError(f"the method's parameters must be a mapping, got {_shown(self.params)}")
        try:
            return get_policy(self.method, **self.params)
        except SpecError:
            raise
        except (TypeError, ValueError) as exc:  # a policy's own range checks (sinks must be >= 0, ...)
            raise SpecError(str(exc)) from None

    def _sinks_used(self, policy: Policy) -> None:
        """A `sinks` the caller set is read: the method protects its sinks, attends them (Quest), or the quantized
        storage keeps them in full precision. Otherwise it would change nothing, silently."""
        sinks = self.params.get("sinks") if isinstance(self.params, Mapping) else None
        if not sinks or not policy.evicts or policy.protect_sinks or policy.selects or self.storage is not None:
            return
        raise SpecError(f"sinks ({sinks}) does nothing for {policy.name!r}: it does not protect sinks "
                        f"(protect_sinks=false); add protect_sinks=true (-p protect_sinks=true) to keep the first "
                        f"{sinks} tokens, or drop sinks")

    def _reserves(self, policy: Policy, budget: int, window: int) -> None:
        """The reserve rule: what a method reserves fits in what the budget leaves (else it would be clamped)."""
        if not policy.evicts:  # a method that keeps every token has no budget to reserve from
            return
        kept_old = budget - window
        if policy.n_large is not None and policy.n_large > kept_old:
            raise SpecError(f"n_large ({policy.n_large}) is larger than the budget leaves for old tokens (B - w = "
                            f"{budget} - {window} = {kept_old}): the value guard reserves slots among the old tokens "
                            f"each eviction keeps; lower n_large or raise the budget")
        guard = self.storage.guard if isinstance(self.storage, QuantSpec) else None
        if isinstance(guard, int) and not isinstance(guard, bool) and guard > budget:
            raise SpecError(f"quant_guard ({guard}) is larger than the budget ({budget}): it counts old tokens kept "
                            f"in full precision inside the budget; lower quant_guard (--quant-guard) or raise the "
                            f"budget")


def carried(request: Any, **given: Any) -> Request:
    """The `Request` a caller carries down (``request=``), as it is: nothing is validated again. `given`: the
    keywords that would build another request beside it (only those the caller set): SpecError, one line, when
    any is set, or when `request` is not a validated Request."""
    if not isinstance(request, Request):
        raise SpecError(f"request must be a vase.core.spec.Request (RequestSpec(...).validate()), got "
                        f"{type(request).__name__}")
    if given:
        raise SpecError(f"pass request= or {', '.join(sorted(given))}, not both: the request already holds the "
                        f"method, its parameters, the budget, the window and the storage")
    return request


def set_beside(method: Any, budget: Any, window: Any, default_method: str = "vase-attnv") -> dict[str, Any]:
    """Of a door's request keywords, those the caller set (not at the door's defaults: `default_method`, B 512,
    w 64): what `carried` refuses beside ``request=``."""
    return {k: v for k, v, default in (("method", method, default_method), ("budget", budget, 512),
                                       ("window", window, 64)) if not (type(v) is type(default) and v == default)}
