"""benchmarks/gpu_vllm_bench.py on a (mocked) GPU: a real model id goes to vLLM as is, and every engine gets the
settings the GPU worker needs. The toy-size CPU run of the whole script is tests/test_vllm_bench.py."""

import importlib.util as iu
from pathlib import Path

import torch


def _script():
    spec = iu.spec_from_file_location("gpu_vllm_bench", Path(__file__).parents[1] / "benchmarks" / "gpu_vllm_bench.py")
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_gpu_engines_get_piecewise_graphs_and_no_async_scheduling(monkeypatch, tmp_path):
    import vase.bench.vllm_bench as vb

    seen = {}

    def fake_run(model, methods, budgets, **kwargs):
        seen.update(model=model, methods=methods, budgets=budgets, **kwargs)
        return []  # no configuration finished: the script says so and exits 1

    monkeypatch.setattr(vb, "run_vllm_bench", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc = _script().main(["--model", "Qwen/Qwen3-4B", "--budgets", "2048,1024", "--out", str(tmp_path)])
    assert rc == 1
    assert seen["model"] == "Qwen/Qwen3-4B" and seen["budgets"] == [2048, 1024]
    assert seen["engine_kwargs"] == {"compilation_config": {"cudagraph_mode": "PIECEWISE"}, "async_scheduling": False}
    assert seen["in_process"] is False and seen["regimes"] == ["ample", "tight"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _script().main(["--model", "some/model", "--out", str(tmp_path)])
    assert seen["engine_kwargs"] == {}  # on CPU nothing is added
