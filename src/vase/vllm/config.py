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

from dataclasses import dataclass, field
from typing import Any

from ..core.errors import SpecError
from ..core.scalars import plain_items
from ..core.policies import Policy, get_policy
from ..core.spec import RequestSpec, split_storage

#: The key of vase's section in vLLM's `additional_config`.
CONFIG_KEY = "vase"
_OWN_KEYS = ("method", "budget", "window", "seed", "sort_kept")
#: The key in an unseeded child request's `SamplingParams.extra_args` (n > 1) with its index among the samples: set
#: by the plugin's front-end hook, read by the workers for the child's eviction seed (config seed + index).
CHILD_KEY = "vase_child"


class VaseConfigError(ValueError):
    """A vase section of `additional_config` that cannot run (one line, names the value and the fix)."""


@dataclass(frozen=True)
class VaseVllmConfig:
    """A validated vase configuration: the policy and its schedule parameters."""

    method: str
    budget: int
    window: int = 64
    seed: int = 0
    sort_kept: bool = False
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def policy(self) -> Policy:
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
        policy, params = req.policy, split_storage(options)[0]
        if not policy.evicts:
            raise VaseConfigError(f"vase config: method {policy.name!r} does not evict, so the plugin has nothing "
                                  f"to do: drop additional_config[\"vase\"] to run stock vLLM")
        return cls(method=policy.name, budget=budget, window=window, seed=seed, sort_kept=sort_kept,
                   params=params)

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> "VaseVllmConfig | None":
        """The vase config in vLLM's `additional_config`, or None when there is none (stock vLLM)."""
        if not isinstance(additional_config, dict) or additional_config.get(CONFIG_KEY) is None:
            return None
        return cls.from_dict(additional_config[CONFIG_KEY])


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
