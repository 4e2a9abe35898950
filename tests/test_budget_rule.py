"""The budget rule (B > w + protected slots) has one owner, `Policy.check`: every door that takes a
(method, B, w) — the library cache, `vase generate`/`bench` (cli.checked_params), `vase eval`
(EvalConfig) and the vLLM config — accepts and refuses the same table, with the same message."""

from __future__ import annotations

import pytest

from vase.caches.eager import EvictionCache
from vase.core.spec import RequestSpec
from vase.cli import checked_params
from vase.eval.config import ConfigError, EvalConfig
from vase.core.policies import get_policy
from vase.vllm.config import VaseConfigError, VaseVllmConfig

# (method, params, B, w, accepted). snapkv protects no sinks, so B = 66, w = 64 is legal: `vase eval`
# refused it while it applied 4 sinks to every method (issue 17's drift).
TABLE = [
    ("snapkv", {}, 66, 64, True),
    ("snapkv", {}, 65, 64, True),
    ("snapkv", {}, 64, 64, False),
    ("snapkv", {"protect_sinks": True}, 68, 64, False),
    ("snapkv", {"protect_sinks": True}, 69, 64, True),
    ("vase-attnv", {}, 68, 64, False),
    ("vase-attnv", {}, 69, 64, True),
    ("vase-attnv", {"sinks": 0}, 65, 64, True),
    ("streamingllm", {}, 36, 32, False),
    ("streamingllm", {}, 37, 32, True),
    ("h2o", {}, 33, 32, None),  # None: whatever the policy says; the doors must agree
    ("rkv", {}, 20, 16, None),
]


def _policy_says(method: str, params: dict, budget: int, window: int) -> bool:
    try:
        get_policy(method, **params).check(budget, window)
    except ValueError:
        return False
    return True


def _door_accepts(door: str, method: str, params: dict, budget: int, window: int) -> bool:
    try:
        if door == "library":
            EvictionCache(None, method=method, budget=budget, window=window, num_layers=2, **params)
        elif door == "generate":
            checked_params([method], [f"{k}={v}" for k, v in params.items()], budgets=[budget], window=window)
        elif door == "eval":
            EvalConfig(methods=[method], method_params={method: params} if params else {}, budgets=[budget],
                       window=window)
        elif door == "vllm":
            VaseVllmConfig.from_dict({"method": method, "budget": budget, "window": window, **params})
    except (ValueError, ConfigError, VaseConfigError) as exc:
        assert "must be larger than window + protected sinks" in str(exc), f"{door}: {exc}"
        return False
    return True


@pytest.mark.parametrize("method,params,budget,window,accepted", TABLE)
@pytest.mark.parametrize("door", ["library", "generate", "eval", "vllm"])
def test_every_door_applies_the_policy_rule(door, method, params, budget, window, accepted):
    says = _policy_says(method, params, budget, window)
    if accepted is not None:
        assert says is accepted
    assert _door_accepts(door, method, params, budget, window) is says


def test_one_message_names_the_numbers_and_the_fix():
    with pytest.raises(ValueError) as info:
        RequestSpec(get_policy("vase-attnv"), 68, 64).validate()
    assert str(info.value) == ("budget (68) must be larger than window + protected sinks (64 + 4): "
                               "raise --budget or lower --window")


def test_quest_protects_its_sinks():
    quest = get_policy("quest")
    assert quest.protected_slots == quest.sinks
    with pytest.raises(ValueError, match=r"window \+ protected sinks \(16 \+ 4\)"):
        quest.check(20, 16)
    quest.check(21, 16)


def test_full_takes_any_budget():
    get_policy("full").check(1, 64)
