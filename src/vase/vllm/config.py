"""The vase configuration of a vLLM engine, read from `additional_config["vase"]`.

    LLM(model, additional_config={"vase": {"method": "vase-attnv", "budget": 512, "window": 64}})
    vllm serve MODEL --additional-config '{"vase": {"method": "snapkv", "budget": 512}}'

Keys: `method` (a vase method name), `budget` (B, tokens kept per layer and KV head after an
eviction), `window` (w, default 64), `seed` (seeds requests without `SamplingParams.seed`,
default 0), `sort_kept` (default false); every other key is a parameter of the method (see
`vase methods`), e.g. `n_large` or `sinks`. No vllm import here: the serving, eval and bench
code build and check configs without vLLM installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.capabilities import refuse_unsupported
from ..core.errors import SpecError
from ..core.scalars import plain_items
from ..core.policies import Policy, get_policy
from ..core.spec import Request, RequestSpec, split_storage

#: The key of vase's section in vLLM's `additional_config`.
CONFIG_KEY = "vase"
_OWN_KEYS = ("method", "budget", "window", "seed", "sort_kept")
#: The key in an unseeded child request's `SamplingParams.extra_args` (n > 1) with its index among the samples: set
#: by the plugin's front-end hook, read by the workers for the child's eviction seed (config seed + index).
CHILD_KEY = "vase_child"


class VaseConfigError(ValueError):
    """A vase section of `additional_config` that cannot run (one line, names the value and the fix)."""


#: The configs this process validated, by their section (canonical JSON): the plugin, the scheduler and each runner
#: read the engine's section again, and get the config validated once instead of a second validation.
_VALIDATED: dict[str, "VaseVllmConfig"] = {}
_VALIDATED_MAX = 64


def _key(section: Any) -> str | None:
    try:
        return json.dumps(section, sort_keys=True)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class VaseVllmConfig:
    """A validated vase configuration: the policy and its schedule parameters, and the validated `Request` it was
    built from (`request`; None only for a config built by hand, whose `policy` is then built on each read)."""

    method: str
    budget: int
    window: int = 64
    seed: int = 0
    sort_kept: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    request: Request | None = field(default=None, compare=False, repr=False)

    @property
    def policy(self) -> Policy:
        if self.request is not None:
            return self.request.policy
        return get_policy(self.method, **self.params)

    def to_dict(self) -> dict[str, Any]:
        """The `additional_config["vase"]` section that rebuilds this config."""
        return {"method": self.method, "budget": self.budget, "window": self.window, "seed": self.seed,
                "sort_kept": self.sort_kept, **self.params}

    @classmethod
    def from_dict(cls, section: Any) -> "VaseVllmConfig":
        """Validate `additional_config["vase"]`; raises VaseConfigError naming the bad value and the fix."""
        if not isinstance(section, dict):
            raise VaseConfigError(f'additional_config["vase"] must be a mapping like {{"method": "vase-attnv", '
                                  f'"budget": 512}}, got {section!r}')
        if "method" not in section or "budget" not in section:
            raise VaseConfigError(f'additional_config["vase"] needs "method" and "budget", got keys '
                                  f'{sorted(section)}')
        method = section["method"]
        budget, window = section["budget"], section.get("window", 64)
        seed, sort_kept = section.get("seed", 0), section.get("sort_kept", False)
        if not isinstance(sort_kept, bool):
            raise VaseConfigError(f'additional_config["vase"]["sort_kept"] must be true or false, got {sort_kept!r}')
        if isinstance(seed, (list, tuple)):  # the spec takes one seed per row; the engine seeds requests with one
            raise VaseConfigError(f'additional_config["vase"]["seed"] must be one integer, got {seed!r}')
        options = {k: v for k, v in section.items() if k not in _OWN_KEYS}
        try:  # the one request check (types, method, budget rule, reserves), and what vLLM can store
            req = RequestSpec.of(method, budget, window, seed=seed, **options).validate(engine="vllm")
        except SpecError as exc:
            raise VaseConfigError(f"vase config: {exc}") from None
        return cls._of(req, seed, sort_kept, _key(section))

    @classmethod
    def from_request(cls, request: Request, *, seed: int | None = None, sort_kept: bool = False) -> "VaseVllmConfig":
        """The config of an already validated `Request` (nothing is validated again; what vLLM cannot store, and a
        method that does not evict, are refused). `seed`: the config's seed (None: the request's, one integer)."""
        if not isinstance(request, Request):
            raise VaseConfigError(f"request must be a vase.core.spec.Request (RequestSpec(...).validate()), got "
                                  f"{type(request).__name__}")
        seed = request.seed if seed is None else seed
        if isinstance(seed, (list, tuple)):
            raise VaseConfigError(f"the vase config's seed must be one integer, got {seed!r}")
        if not isinstance(sort_kept, bool):
            raise VaseConfigError(f"sort_kept must be true or false, got {sort_kept!r}")
        if request.storage is not None:
            try:
                refuse_unsupported("vllm", storage=True)
            except SpecError as exc:
                raise VaseConfigError(f"vase config: {exc}") from None
        return cls._of(request, seed, sort_kept, None)

    @classmethod
    def _of(cls, req: Request, seed: Any, sort_kept: bool, given: str | None) -> "VaseVllmConfig":
        """The config of a validated request, remembered under its section (and the section as given)."""
        policy = req.policy
        if not policy.evicts:
            raise VaseConfigError(f"vase config: method {policy.name!r} does not evict, so the plugin has nothing "
                                  f"to do: drop additional_config[\"vase\"] to run stock vLLM")
        cfg = cls(method=policy.name, budget=req.budget, window=req.window, seed=seed, sort_kept=sort_kept,
                  params=dict(req.params), request=replace(req, seed=seed))
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        for key in {given, _key(cfg.to_dict())} - {None}:
            _VALIDATED[key] = cfg
        return cfg

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> "VaseVllmConfig | None":
        """The vase config in vLLM's `additional_config`, or None when there is none (stock vLLM). A section this
        process validated already (`additional_config`, `from_request`, an earlier read) is not validated again."""
        if not isinstance(additional_config, dict) or additional_config.get(CONFIG_KEY) is None:
            return None
        section = additional_config[CONFIG_KEY]
        known = _VALIDATED.get(_key(section) or "")
        return known if known is not None else cls.from_dict(section)


def additional_config(method: str, budget: int, window: int = 64, *, seed: int = 0, sort_kept: bool = False,
                      **params: Any) -> dict[str, Any]:
    """The `additional_config` dict for `vllm.LLM(...)` (validated): {"vase": {...}}.

        LLM(model, additional_config=vase.vllm.additional_config("vase-attnv", 512, 64))
    """
    cfg = VaseVllmConfig.from_dict(plain_items({"method": method, "budget": budget, "window": window, "seed": seed,
                                                "sort_kept": sort_kept, **params}))  # np.int64(512) is 512
    return {CONFIG_KEY: cfg.to_dict()}


def vase_section(method: str, budget: int, window: int = 64, params: dict[str, Any] | None = None
                 ) -> dict[str, Any] | None:
    """vLLM's ``additional_config`` for a method, ``{"vase": {...}}`` (validated: raises VaseConfigError);
    None for ``full`` (stock vLLM, no vase section)."""
    if method.strip().lower() == "full":
        return None
    return additional_config(method, budget, window, **(params or {}))


def request_config(request: Request) -> VaseVllmConfig | None:
    """The engine's config of a validated `Request` (`VaseVllmConfig.from_request`, section seed 0: the engine seeds
    each request itself), or None for ``full`` (stock vLLM, no vase section). Nothing is validated again."""
    if request.method == "full":
        return None
    return VaseVllmConfig.from_request(request, seed=0)
