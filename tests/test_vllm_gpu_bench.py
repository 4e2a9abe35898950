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
    assert seen["engine_kwargs"] == {}  # the stock baseline runs at vLLM's own defaults
    assert seen["vase_kwargs"] == {"compilation_config": {"cudagraph_mode": "PIECEWISE"}, "async_scheduling": False}
    assert seen["in_process"] is False and seen["regimes"] == ["ample", "tight"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _script().main(["--model", "some/model", "--out", str(tmp_path)])
    assert seen["engine_kwargs"] == {} and seen["vase_kwargs"] is None  # on CPU nothing is added


def test_stock_runs_at_its_defaults_and_again_at_vases_settings(monkeypatch):
    """Each regime: `full` with vLLM's defaults (the user's VLLM_USE_V2_MODEL_RUNNER, here unset), then
    `full@vase-settings` with the plugin's engine options and the V1 runner, then the vase rows; the variable is
    put back after each engine (the plugin sets it process-wide)."""
    import os

    import vase.bench.vllm_bench as vb

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    calls = []

    def fake_engine(path, *, method, engine_kwargs, **kw):
        calls.append((method, engine_kwargs, os.environ.get("VLLM_USE_V2_MODEL_RUNNER")))
        if method not in vb.STOCK_METHODS:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # what the plugin does
        raise RuntimeError("not run")

    monkeypatch.setattr(vb, "_one_engine", fake_engine)
    mode = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}, "async_scheduling": False}
    vb.run_vllm_bench(None, ["snapkv"], [64], n_requests=4, new_tokens=8, prompt_len=8, window=8,
                      regimes=["ample", "tight"], engine_kwargs={"seed": 1}, vase_kwargs=mode, skip_errors=True,
                      log=lambda m: None)
    stock_default = ("full", {"seed": 1}, None)
    stock_vase = (vb.STOCK_AT_VASE, {"seed": 1, **mode}, "0")
    assert calls == [stock_default, stock_vase, ("snapkv", {"seed": 1, **mode}, None)] * 2
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
