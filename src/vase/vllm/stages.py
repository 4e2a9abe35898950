"""Pipeline parallelism: where a stage's evicted layers sit among the model's, and which layers it replays.

Every stage runs vase's scheduler output through its own runner, so it evicts its own layers at the steps
`vase.vllm.steps.plan_step` picks from the lengths alone, with its own query ring (its layers' queries). What a
stage cannot see are the other stages' layers, and one thing depends on them: a request's generator is drawn
layer after layer (hook 2 once per layer, then each layer's `select`), so a stage holding layers 12..23 must first
draw what layers 0..11 draw. It replays them (`VaseStepMixin._vase_evict`): for each layer of another stage it
runs the same policy call on its own first or last layer's K/V (the shapes every layer shares), keeps that layer's
policy state and discards the choice; nothing is written to the cache. This draws what the other stage draws as long
as a policy's draws depend on shapes only (true of every policy here: noise over the candidates, a projection per
head). A policy that draws nothing (no `stochastic` selection, no
drawn layer state) replays nothing.
"""

from __future__ import annotations

from typing import Any

from ..core.policies import Policy
from .config import VaseConfigError

_DROP = "or drop additional_config['vase']"


def stage_span(evicted: list[int], num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """(layers on earlier stages, layers on later stages) for the stage `rank` of `size` holding the evicted layers
    at global indices `evicted` of a `num_layers`-layer model; refuses a stage whose layers are not all evicted
    (sliding-window groups beside the evicted one: their layers would be missing from the replay count)."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, rank, size)
    if sorted(evicted) != list(range(start, end)):
        raise VaseConfigError(f"vase runs pipeline parallelism on models whose every layer is full attention, and "
                              f"stage {rank} of {size} holds layers {start}..{end - 1} but evicts {sorted(evicted)}: "
                              f"use pipeline_parallel_size=1 for this model {_DROP}")
    return start, num_layers - end


def draws(policy: Any) -> bool:
    """Whether `policy` draws from a request's generator (stochastic selection or a drawn per-layer state)."""
    inner = getattr(policy, "policy", policy)  # vase.vllm.heads.RankPolicy wraps the configured policy
    return bool(policy.stochastic) or type(inner).init_layer_state is not Policy.init_layer_state
