"""`vase eval --engine vllm`: the runner's store, seeds, stats, resume and report with generation through vLLM.

One small run on the embedded model for the module (2 problems x 2 samples, full + vase-attnv at B=48,
w=8, 40 new tokens: every vase-attnv sequence evicts). The config checks need neither vLLM nor a model.
"""

from __future__ import annotations

import csv
import json

import pytest

from vase.eval.config import ConfigError, EvalConfig
from vase.eval.identity import identity, run_name
from vase.engines.vllm import vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed here (pip install -e '.[vllm]')")

BUDGET, WINDOW, NEW = 48, 8, 40


def _config(tmp, **over) -> EvalConfig:
    base = dict(task="arith", limit=2, samples=2, methods=["vase-attnv"], budgets=[BUDGET], window=WINDOW,
                max_new_tokens=NEW, engine="vllm", dtype="float32", output_dir=str(tmp))
    return EvalConfig(**{**base, **over})


# ----------------------------------------------------------------------------- config (no vLLM)


def test_fidelity_is_refused_with_vllm(tmp_path):
    with pytest.raises(ConfigError, match="transformers engine only"):
        _config(tmp_path, fidelity=True)


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="engine must be one of transformers, vllm"):
        _config(tmp_path, engine="tgi")


def test_engine_is_part_of_the_identity(tmp_path):
    v, t = _config(tmp_path), _config(tmp_path, engine="transformers")
    assert identity(v)["engine"] == "vllm" and identity(t)["engine"] == "transformers"
    assert run_name(v) != run_name(t)  # the same command on another engine never lands in the same run


@pytest.mark.skipif(vllm_available(), reason="checks the message shown where vLLM is not installed")
def test_without_vllm_eval_stops_before_making_a_run_folder(tmp_path):
    from vase.eval.runner import run_eval

    with pytest.raises(RuntimeError, match="needs vLLM: pip install"):
        run_eval(_config(tmp_path), progress=False)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- one run through vLLM


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not vllm_available():
        pytest.skip("vLLM is not installed here")
    from vase.eval.runner import run_eval

    tmp = tmp_path_factory.mktemp("vllm-eval")
    cfg = _config(tmp)
    run_dir = run_eval(cfg, progress=False)
    records = [json.loads(line) for line in (run_dir / "samples.rank0.jsonl").read_text().splitlines()]
    return {"cfg": cfg, "dir": run_dir, "records": records}


@needs_vllm
def test_every_sample_is_stored_with_the_shared_seeds(run):
    from vase.eval.runner import sample_seed

    recs = run["records"]
    keys = sorted((r["method"], r["problem_index"], r["sample"]) for r in recs)
    assert keys == sorted((m, i, s) for m in ("full", "vase-attnv") for i in range(2) for s in range(2))
    for r in recs:
        assert r["seed"] == sample_seed(0, r["problem_index"], r["sample"])
        assert 1 <= r["length"] <= NEW and r["finished"] == (r["length"] < NEW) or r["finished"]
        assert r["failure"] in ("ok", "truncated", "garbage", "phrase_loop")
        assert (r["failure"] == "truncated") == (not r["finished"])
        assert r["text"] and r["tokens_per_s"] > 0


@needs_vllm
def test_prompts_are_the_transformers_engines_tokens(run):
    from transformers import AutoTokenizer

    from vase.eval.prompts import build_user_message
    from vase.eval.tasks import load_task
    from vase.generation.generate import encode_prompts
    from vase.models import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir())
    problems = load_task("arith", limit=2, seed=0)
    for r in run["records"]:
        ids, _ = encode_prompts(tok, [build_user_message(problems[r["problem_index"]])], True)
        assert r["prompt_length"] == ids.shape[1]


@needs_vllm
def test_cache_stats_follow_the_plugins_schedule(run):
    from vase.core import schedule

    bpt = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32
    for r in run["records"]:
        P, n = r["prompt_length"], r["length"]
        written = n if r["finished"] else n - 1  # the token sampled at the cap is never written
        assert r["kv_bytes_full"] == (P + written) * bpt
        if r["method"] == "full":
            assert r["evictions"] == 0 and r["kv_bytes"] == r["kv_bytes_full"]
        else:
            assert r["evictions"] == schedule.num_evictions(P, BUDGET, WINDOW, written)
            assert r["kv_bytes"] == schedule.physical_length(P, BUDGET, WINDOW, written) * bpt
            if n == NEW:  # 40 tokens after a prompt longer than B: several evictions, B + a partial window held
                assert r["evictions"] >= 3
                assert BUDGET * bpt < r["kv_bytes"] <= (BUDGET + WINDOW) * bpt < r["kv_bytes_full"]


@needs_vllm
def test_summary_and_identity(run):
    meta = json.loads((run["dir"] / "config.json").read_text())
    assert meta["identity"]["engine"] == "vllm"
    rows = list(csv.DictReader((run["dir"] / "summary.csv").open()))
    assert {r["method"] for r in rows} == {"full", "vase-attnv"}


@needs_vllm
def test_rerun_resumes_without_generating(run):
    from vase.eval.runner import run_eval

    samples = run["dir"] / "samples.rank0.jsonl"
    before = samples.read_bytes()
    assert run_eval(run["cfg"], progress=False) == run["dir"]
    assert samples.read_bytes() == before
    last = json.loads((run["dir"] / "starts.jsonl").read_text().splitlines()[-1])
    assert last["samples_done"] == last["samples_total"] == 8


#: Fields that depend on the machine's speed or on which rank ran the sample, not on what was generated.
TIMING = {"seconds", "prefill_seconds", "tokens_per_s", "rank", "batch_rows"}


@needs_vllm
def test_two_ranks_each_with_its_own_engine_store_what_one_rank_stores(tmp_path):
    """Data parallelism for evaluation: under torchrun (RANK / WORLD_SIZE) every rank starts its own vLLM engine
    and takes problems i % WORLD_SIZE == RANK; the stored samples equal the one-rank run's (the seeds are the
    sample's, not the rank's). On the tiny random Llama: the sharding does not depend on the weights, and two
    SmolLM engines cost 30 s more here."""
    import os
    import socket
    import subprocess
    import sys

    from tests.vllm_tiny import save_tiny_llama
    from vase.eval.runner import run_eval

    model = save_tiny_llama(str(tmp_path / "tiny"))
    cfg = dict(task="arith", limit=2, samples=2, methods=["vase-attnv"], budgets=[BUDGET], window=WINDOW,
               max_new_tokens=NEW, engine="vllm", dtype="float32", model=model)
    one_dir = run_eval(EvalConfig(**cfg, output_dir=str(tmp_path / "one")), progress=False)
    one = [json.loads(line) for line in (one_dir / "samples.rank0.jsonl").read_text().splitlines()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import json, sys\n"
              "from vase.eval.config import EvalConfig\n"
              "from vase.eval.runner import run_eval\n"
              "if __name__ == '__main__':\n"
              "    run_eval(EvalConfig(**json.loads(sys.argv[1])), progress=False)\n")
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", script, json.dumps({**cfg, "output_dir": str(tmp_path)})],
                                      env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    run_dir = tmp_path / one_dir.name  # the same settings name the same run
    by_rank = [[json.loads(line) for line in (run_dir / f"samples.rank{r}.jsonl").read_text().splitlines()]
               for r in range(2)]
    assert [{r["problem_index"] for r in rows} for rows in by_rank] == [{0}, {1}]
    assert {r["method"] for r in one} == {"full", "vase-attnv"} and len(one) == 8

    def stable(records):
        return sorted((json.dumps({k: v for k, v in r.items() if k not in TIMING}, sort_keys=True)
                       for r in records))

    assert stable(by_rank[0] + by_rank[1]) == stable(one)


@needs_vllm
def test_resuming_with_the_other_engine_is_refused(run):
    from vase.eval.runner import RunConflictError, run_eval

    other = _config(run["dir"].parent, engine="transformers", name=run["dir"].name)
    with pytest.raises(RunConflictError, match="engine"):
        run_eval(other, progress=False)


@needs_vllm
def test_greedy_full_agrees_with_the_transformers_engine(tmp_path):
    """Stock vLLM and vase's decode loop, both float32 and greedy, on the same prompt tokens: they agree
    token for token until a near-tie, where float32 rounding in two different kernels may pick either."""
    import torch

    import vase
    from vase.engines.vllm import VllmEngine
    from vase.models import load_model

    cfg = _config(tmp_path, greedy=True)
    prompt = "What is 12 + 30? Answer briefly."
    engine = VllmEngine(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
    try:
        out_v = engine.generate([prompt], method="full", budget=BUDGET, window=WINDOW, max_new_tokens=24,
                                temperature=0.6, top_p=0.95, top_k=None, greedy=True, seed=[0], chat_template=True)
    finally:
        engine.close()
    model, tok = load_model(dtype="float32")
    out_t = vase.generate(model, tok, [prompt], method="full", budget=BUDGET, window=WINDOW, max_new_tokens=24,
                          greedy=True, seed=0)
    assert out_v.prompt_lengths == out_t.prompt_lengths
    a, b = out_v.token_ids[0], out_t.token_ids[0]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        assert len(a) == len(b)
        return
    assert k >= 4, (a, b)
    from vase.generation.generate import encode_prompts

    ids, _ = encode_prompts(tok, [prompt], True)
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor([b[:k]])], dim=1)).logits[0, -1]
    top = logits.topk(2)
    assert {a[k], b[k]} == set(top.indices.tolist())  # the two engines picked the model's top two
    assert float(top.values[0] - top.values[1]) < 0.05, (k, top)  # ... and they were a near-tie


def test_the_vllm_version_is_part_of_the_runtime_identity(tmp_path, monkeypatch):
    """A run on another vLLM is refused on resume like one on another torch (its kernels make the tokens)."""
    import vase.engines.vllm as engine  # where eval.config reads the version
    from vase.eval.identity import runtime_identity

    monkeypatch.setattr("vase.models.model_fingerprint", lambda model: "sha")
    v, t = _config(tmp_path), _config(tmp_path, engine="transformers")
    assert runtime_identity(v)["vllm"] == engine.vllm_version()
    assert "vllm" not in runtime_identity(t)
    if vllm_available():
        assert engine.vllm_version().startswith("0.32")
    monkeypatch.setattr(engine, "vllm_version", lambda: "0.33.1")
    assert runtime_identity(v)["vllm"] == "0.33.1"
