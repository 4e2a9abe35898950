"""Query capture through one mechanism for the CPU and the GPU attention implementations, on FlashAttention-shaped inputs.

`capture.capturing(cls)` wraps vLLM's implementation class; the kernel call (`cls.forward`) is
replaced by a recorder here, so everything but the kernel runs: the class swap on a live
instance, the planned copies from a CUDA-graph-padded query [padded_tokens, q_heads, head_dim],
the ring's time order across steps, and no recording without metadata (profiling) or without a
plan (warm-up, graph capture).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vase.vllm.capture import CapturePlan, QueryRing, capturing, install
from vase.vllm.offsets import capture_rows

W, HQ, D = 4, 2, 8


def test_capture_rows_takes_the_last_w_scheduled_tokens_of_each_request():
    starts, computed, scheduled, slots = (np.array(a) for a in ([0, 6, 7], [0, 40, 3], [6, 1, 2], [5, 0, 2]))
    src, slot, pos = capture_rows(starts, computed, scheduled, slots, W)
    assert src.tolist() == [2, 3, 4, 5, 6, 7, 8]  # request 0: its last 4 of 6 prefill tokens
    assert slot.tolist() == [5, 5, 5, 5, 0, 2, 2]
    assert pos.tolist() == [2 % W, 3 % W, 4 % W, 5 % W, 40 % W, 3 % W, 4 % W]  # logical position mod w


def _impl_classes():
    classes = {}
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    classes["CPU_ATTN"] = CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    classes["FLASH_ATTN"] = FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    classes["TRITON_ATTN"] = TritonAttentionImpl
    return classes


@pytest.fixture(scope="module")
def impl_classes():
    pytest.importorskip("vllm")
    return _impl_classes()


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN"])
def test_capturing_impl_records_then_calls_the_kernel(backend, impl_classes, monkeypatch):
    cls = impl_classes[backend]
    kernel_calls = []

    def kernel(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        kernel_calls.append(query.shape[0])
        return output

    monkeypatch.setattr(cls, "forward", kernel)  # the one line not run here: the kernel itself
    impl = object.__new__(cls)  # vLLM builds it; its state is kept by the class swap
    impl.marker = "state"
    ring = QueryRing(["model.layers.0.self_attn.attn"], HQ, D, W, torch.float32, torch.device("cpu"))
    install(impl, ring)
    assert isinstance(impl, cls) and type(impl) is capturing(cls) and impl.marker == "state"
    assert capturing(capturing(cls)) is capturing(cls)
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    meta = SimpleNamespace(num_actual_tokens=0)
    a, b = ring.acquire(), ring.acquire()
    history = {a: [], b: []}
    # step 1: request a prefills 6 tokens, request b 3 tokens; step 2..4: both decode (one token each)
    steps = [([0, 0], [6, 3]), ([6, 3], [1, 1]), ([7, 4], [1, 1]), ([8, 5], [1, 1])]
    g = torch.Generator().manual_seed(0)
    for computed, scheduled in steps:
        computed, scheduled = np.array(computed), np.array(scheduled)
        starts = np.concatenate([[0], np.cumsum(scheduled)])
        total = int(scheduled.sum())
        padded = total + 5  # CUDA graph padding: rows past num_actual_tokens are junk
        query = torch.randn(padded, HQ, D, generator=g)
        meta.num_actual_tokens = total
        src, slot, pos = (torch.from_numpy(x) for x in capture_rows(starts[:-1], computed, scheduled,
                                                                     np.array([a, b]), W))
        ring.plan = CapturePlan(src=src, slot=slot, pos=pos)
        impl.forward(layer, query, query, query, None, meta, torch.empty(padded, HQ * D))
        for r, req in enumerate((a, b)):
            history[req].extend(query[starts[r]:starts[r + 1]])
    assert kernel_calls == [14, 7, 7, 7]
    for req, seen in ((a, 9), (b, 6)):
        expected = torch.stack(history[req][-W:], dim=1).unsqueeze(0)  # [1, q_heads, w, d], time order
        assert torch.equal(ring.window_of(0, req, seen), expected)
    before = ring.rings[0].clone()
    impl.forward(layer, torch.randn(3, HQ, D), None, None, None, None, torch.empty(3, HQ * D))  # profiling run
    ring.plan = None
    impl.forward(layer, torch.randn(3, HQ, D), None, None, None, meta, torch.empty(3, HQ * D))  # warm-up
    assert torch.equal(ring.rings[0], before) and kernel_calls == [14, 7, 7, 7, 3, 3]


def test_the_cpu_runner_installs_the_one_mechanism(impl_classes, monkeypatch):
    """vase's CPU runner swaps its attention layers to `capturing(CPUAttentionBackendImpl)` (no class of its own)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from vase.vllm import worker

    cls = impl_classes["CPU_ATTN"]
    monkeypatch.setattr(CPUModelRunner, "load_model", lambda self, *args, **kwargs: None)  # vLLM's model load
    checked = []
    monkeypatch.setattr(worker, "check_attention_layer", lambda name, *args, **kwargs: checked.append(name))
    impl = object.__new__(cls)
    runner = object.__new__(worker.VaseCPUModelRunner)
    runner.model_config = SimpleNamespace(dtype=torch.float32)
    runner._vase_attention_impls = lambda: iter([("model.layers.0.self_attn.attn", impl)])
    runner.load_model()
    assert type(impl) is capturing(cls) and checked == ["model.layers.0.self_attn.attn"]
    assert not any(isinstance(v, type) and issubclass(v, cls) for v in vars(worker).values() if v is not cls)
