"""The evaluation runner: resume after a kill, torn lines, multi-process merge, fidelity, config.

Everything runs on a tiny random Qwen3 (tests/helpers_tiny.py) with budget 24 and window 8, so
eviction really happens within the 24 new tokens (prompts are ~170 characters = tokens). The model is
float64: a resumed unit decodes its samples in another batch than the clean run did, and another CPU's
float32 kernels round a batch of 1 and a batch of 2 differently (a flipped token, not a lost record).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vase
from tests.helpers_tiny import tiny_model_and_tokenizer
from vase.eval.config import ConfigError, EvalConfig
from vase.eval.config_files import load_config
from vase.eval.identity import identity, identity_hash, run_name
from vase.eval.report import summarize
from vase.eval.runner import (
    VOLATILE_FIELDS,
    RunConflictError,
    kv_bytes_per_token,
    row_cache_stats,
    run_eval,
    sample_seed,
)
from vase.eval.store import (
    FIDELITY_KEY,
    SAMPLE_KEY,
    JsonlStore,
    StoreError,
    rank_files,
    read_all,
    read_jsonl,
    record_key,
)
from vase.generation.generate import GenerationOutput

REPO = Path(__file__).resolve().parents[1]
BASE = dict(task="arith", limit=3, methods=["snapkv", "vase-attnv"], budgets=[24], window=8, samples=2,
            max_new_tokens=24, batch_size=2, model="tiny")
N_UNITS = 3 * 3  # problems x (full + 2 methods)
N_SAMPLES = N_UNITS * 2


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer(dtype=torch.float64)


class Counting:
    """A generate_fn that counts calls and rows, then calls the real one."""

    def __init__(self, fn=vase.generate):
        self.fn, self.calls, self.rows = fn, 0, 0

    def __call__(self, model, tokenizer, prompts, **kw):
        self.calls += 1
        self.rows += len(prompts)
        return self.fn(model, tokenizer, prompts, **kw)


def stable(records):
    """Records without timing / work-split fields, as a key -> record map."""
    return {record_key(r, SAMPLE_KEY): {k: v for k, v in r.items() if k not in VOLATILE_FIELDS} for r in records}


def raw_keys(run_dir: Path) -> list[tuple]:
    """Every key in every rank file, duplicates included."""
    return [record_key(r, SAMPLE_KEY) for p in rank_files(run_dir, "samples") for r in read_jsonl(p)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny):
    """A clean one-process run of BASE."""
    model, tok = tiny
    gen = Counting()
    out = tmp_path_factory.mktemp("ref")
    run_dir = run_eval(EvalConfig(**BASE, output_dir=str(out)), model, tok, generate_fn=gen, progress=False)
    assert gen.calls == N_UNITS and gen.rows == N_SAMPLES
    return run_dir, read_all(run_dir)


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from tests.helpers_tiny import tiny_model_and_tokenizer
    from vase.eval import store as store_mod
    from vase.eval.config import EvalConfig
    from vase.eval.runner import run_eval

    args = json.loads(sys.argv[1])
    kill_after = args.pop("kill_after", None)
    if kill_after is not None:  # die like a SIGKILL mid-write after `kill_after` sample records
        real_append, count = store_mod.JsonlStore.append, [0]
        def append(self, record):
            if self.path.name.startswith("samples.") and count[0] == kill_after:
                with open(self.path, "ab") as f:
                    f.write(json.dumps(record)[:40].encode())
                os._exit(137)
            count[0] += 1
            return real_append(self, record)
        store_mod.JsonlStore.append = append
    model, tok = tiny_model_and_tokenizer(dtype=torch.float64)  # as the `tiny` fixture
    print(run_eval(EvalConfig(**args), model, tok, progress=False))
""")


def spawn(args: dict, env: dict | None = None) -> subprocess.Popen:
    e = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or k not in env:
            e.pop(k, None)
    return subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(args)], cwd=REPO, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ----------------------------------------------------------------------------- resume


def test_resume_after_kill_loses_and_repeats_nothing(tmp_path, tiny, reference):
    ref_dir, ref_records = reference
    killed_after = 5  # two whole units, then the first sample of the third; the second is torn
    proc = spawn({**BASE, "output_dir": str(tmp_path), "kill_after": killed_after})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 137, err
    run_dir = tmp_path / ref_dir.name  # the same settings give the same run name
    path = run_dir / "samples.rank0.jsonl"
    assert not path.read_bytes().endswith(b"\n")  # the kill left a torn line
    assert len(read_jsonl(path)) == killed_after

    model, tok = tiny
    gen = Counting()
    assert run_eval(EvalConfig(**BASE, output_dir=str(tmp_path)), model, tok, generate_fn=gen,
                    progress=False) == run_dir
    assert gen.rows == N_SAMPLES - killed_after  # nothing finished was generated again
    assert gen.calls == N_UNITS - 2  # the two whole units were skipped, the torn one finished alone
    keys = raw_keys(run_dir)
    assert len(keys) == len(set(keys)) == N_SAMPLES  # no duplicates, nothing lost
    assert stable(read_all(run_dir)) == stable(ref_records)  # and identical to a clean run
    assert path.read_bytes().endswith(b"\n")

    # A third start has nothing left to do.
    gen = Counting()
    run_eval(EvalConfig(**BASE, output_dir=str(tmp_path)), model, tok, generate_fn=gen, progress=False)
    assert gen.calls == 0 and len(raw_keys(run_dir)) == N_SAMPLES
    starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]
    assert [s["samples_done"] for s in starts] == [0, killed_after, N_SAMPLES]


def test_two_process_run_equals_one_process_run(tmp_path, reference):
    ref_dir, ref_records = reference
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [spawn({**BASE, "output_dir": str(tmp_path)},
                   {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)}) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    run_dir = tmp_path / ref_dir.name
    files = rank_files(run_dir, "samples")
    assert [f.name for f in files] == ["samples.rank0.jsonl", "samples.rank1.jsonl"]
    by_rank = [{r["problem_index"] for r in read_jsonl(f)} for f in files]
    assert by_rank == [{0, 2}, {1}]
    assert stable(read_all(run_dir)) == stable(ref_records)
    # Rank 0 wrote the summary after the barrier: it matches the one-process summary but for speed.
    ref_csv = (ref_dir / "summary.csv").read_text().splitlines()
    got_csv = (run_dir / "summary.csv").read_text().splitlines()
    col = ref_csv[0].split(",").index("batch_tokens_per_s")

    def drop(lines):
        return [",".join(v for i, v in enumerate(line.split(",")) if i != col) for line in lines]

    assert drop(got_csv) == drop(ref_csv)


def test_records_have_the_documented_schema(reference):
    _, records = reference
    for r in records:
        assert {"problem_id", "sample", "method", "budget", "seed", "answer", "correct", "length", "finished",
                "failure", "text", "seconds", "tokens_per_s", "kv_bytes", "kv_bytes_full", "evictions"} <= set(r)
        assert r["seed"] == sample_seed(0, r["problem_index"], r["sample"])  # the same for every method
        assert (r["budget"] is None) == (r["method"] == "full")
        assert len(r["token_ids"]) == r["length"]  # every completion keeps its ids (first divergence)
        if r["method"] == "full":
            assert r["evictions"] == 0 and r["kv_bytes"] == r["kv_bytes_full"]
        elif r["prompt_length"] + r["length"] > r["prompt_length"] + 8 + 1:  # past max(P, B) + w
            assert r["evictions"] >= 1 and r["kv_bytes"] < r["kv_bytes_full"]
    assert sum(r["evictions"] >= 2 for r in records) >= len(records) // 3  # eviction really ran


def test_row_cache_stats_match_the_cache(tiny):
    model, tok = tiny
    bpt = kv_bytes_per_token(model)
    for prompt, method, budget, n in [("hi", "snapkv", 24, 40), ("hi", "snapkv", 24, 17),
                                      ("x" * 40, "vase-attnv", 24, 23), ("hi", "full", 24, 30)]:
        out = vase.generate(model, tok, [prompt], method=method, budget=budget, window=8, max_new_tokens=n, seed=3)
        est = row_cache_stats(out.prompt_lengths[0], len(out.token_ids[0]), out.finished[0], budget=budget,
                              window=8, evicts=method != "full", bytes_per_token=bpt)
        assert {k: est[k] for k in ("kv_bytes", "kv_bytes_full", "evictions")} == \
            {k: out.stats[k] for k in ("kv_bytes", "kv_bytes_full", "evictions")}, (prompt, method, n)
    # Rows that stop on EOS: every generated token was fed.
    model2, _ = tiny_model_and_tokenizer(dtype=torch.float64)
    model2.generation_config.eos_token_id = list(range(1, 80))
    out = vase.generate(model2, tok, ["x" * 30], method="snapkv", budget=24, window=8, max_new_tokens=50, seed=1)
    assert out.finished[0]
    est = row_cache_stats(out.prompt_lengths[0], len(out.token_ids[0]), True, budget=24, window=8, evicts=True,
                          bytes_per_token=bpt)
    assert est["kv_bytes_full"] == out.stats["kv_bytes_full"] and est["kv_bytes"] == out.stats["kv_bytes"]


# ----------------------------------------------------------------------------- store


def test_torn_last_line_is_tolerated_and_cut(tmp_path):
    path = tmp_path / "samples.rank0.jsonl"
    recs = [{"method": "full", "budget": None, "problem_id": f"p{i}", "sample": 0, "x": i} for i in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"method": "snapkv", "bud')
    assert read_jsonl(path) == recs  # reading never changes the file
    assert path.read_text().endswith("bud")
    with JsonlStore(path, SAMPLE_KEY) as store:
        assert len(store) == store.n_read == 2 and ("full", None, "p1", 0) in store
        assert path.read_text().endswith("\n")  # cut before appending
        assert store.append({"method": "snapkv", "budget": 24, "problem_id": "p0", "sample": 0})
        assert not store.append({"method": "snapkv", "budget": 24, "problem_id": "p0", "sample": 0})
    assert len(read_jsonl(path)) == 3
    # A complete (newline-ended) line that does not parse is never torn: an error naming file and line.
    path.write_text(path.read_text() + "{not json}\n")
    with pytest.raises(StoreError, match="line 4"):
        read_jsonl(path)
    path.write_text(path.read_text() + json.dumps(recs[0]) + "\n")
    with pytest.raises(StoreError, match="line 4"):
        read_jsonl(path)


def test_store_lock_and_merge(tmp_path):
    a = {"method": "full", "budget": None, "problem_id": "p0", "sample": 0, "v": "rank0"}
    b = {"method": "full", "budget": None, "problem_id": "p1", "sample": 0, "v": "rank1"}
    with JsonlStore(tmp_path / "samples.rank0.jsonl") as s0:
        with pytest.raises(StoreError, match="another process"):
            JsonlStore(tmp_path / "samples.rank0.jsonl").open()
        s0.append(a)
    with JsonlStore(tmp_path / "samples.rank1.jsonl") as s1:
        s1.append(b)
        s1.append({**a, "v": "dup"})
    (tmp_path / "samples.rank10.jsonl").write_text("")
    merged = read_all(tmp_path)
    assert merged == [a, b]  # deduplicated on the key, lower rank first
    f = {"method": "snapkv", "budget": 24, "problem_id": "p0", "kl_mean": 0.1}
    with JsonlStore(tmp_path / "fidelity.rank0.jsonl", FIDELITY_KEY) as s:
        s.append(f)
    assert read_all(tmp_path, "fidelity") == [f]


# ----------------------------------------------------------------------------- fidelity


def test_fidelity_full_is_exactly_zero_and_resumes(tmp_path, tiny):
    model, tok = tiny
    cfg = EvalConfig(task="arith", limit=2, methods=["full", "snapkv"], budgets=[24, 400], window=8, samples=1,
                     max_new_tokens=24, fidelity=True, model="tiny", output_dir=str(tmp_path))
    calls = []

    def forced(*a, **kw):
        calls.append(kw["request"].method)  # every forcing carries its request, full's reference and noise floor too
        return vase.forced_log_probs(*a, **kw)

    run_dir = run_eval(cfg, model, tok, progress=False, forced_fn=forced)
    fid = {(r["method"], r["budget"], r["problem_id"]): r for r in read_all(run_dir, "fidelity")}
    assert len(fid) == 2 * 3
    samples = {(r["problem_id"]): r for r in read_all(run_dir) if r["method"] == "full"}
    for (method, budget, pid), r in fid.items():
        assert r["n_tokens"] == samples[pid]["length"] > 0
        if method == "full":
            assert r["kl_mean"] == 0.0 and r["top1_agree"] == 1.0 and r["dnll_mean"] == 0.0
            assert 0.0 <= r["noise_kl_mean"] < 1e-6  # full vs full fed in chunks of w: rounding only
        elif budget == 400:  # never evicts: the same distributions up to rounding
            assert r["kl_mean"] < 1e-6 and r["top1_agree"] == 1.0
            assert r["n_tokens_evicted"] == 0 and "kl_mean_evicted" not in r
        else:
            assert r["kl_mean"] > 0
            # Only the targets after the first eviction: the earlier ones (full's own) no longer dilute it.
            assert r["n_tokens_evicted"] == r["n_tokens"] - r["first_evicted"] > 0
            assert r["kl_mean_evicted"] >= r["kl_mean"]
    assert calls.count("full") == 4 and calls.count("snapkv") == 4  # full: reference + noise floor
    rows = {(r["method"], r["budget"]): r for r in summarize(run_dir, print_table=False)}
    assert rows[("full", None)]["kl_all"] == 0.0 and rows[("full", None)]["noise_kl"] < 1e-6
    assert rows[("snapkv", 24)]["kl_evicted"] > 0
    assert (run_dir / "fidelity_kl_vs_budget.png").stat().st_size > 0

    before = (run_dir / "fidelity.rank0.jsonl").read_bytes()
    calls.clear()
    gen = Counting()
    run_eval(cfg, model, tok, generate_fn=gen, progress=False, forced_fn=forced)
    assert calls == [] and gen.calls == 0
    assert (run_dir / "fidelity.rank0.jsonl").read_bytes() == before


# ----------------------------------------------------------------------------- config


def test_config_toml_yaml_and_overrides(tmp_path):
    toml = tmp_path / "eval.toml"
    toml.write_text(textwrap.dedent("""
        task = "arith"
        limit = 4
        methods = ["snapkv", "vase_attnv"]
        budgets = [96, 128]
        max-new-tokens = 100
        [method_params.snapkv]
        smooth_kernel = 3
    """))
    yaml = tmp_path / "eval.yaml"
    yaml.write_text(textwrap.dedent("""
        eval:
          task: arith
          limit: 4
          methods: [snapkv, vase-attnv]
          budgets: [96, 128]
          max_new_tokens: 100
          method_params: {snapkv: {smooth_kernel: 3}}
    """))
    a, b = load_config(toml), load_config(yaml)
    assert a == b and a.methods == ["snapkv", "vase-attnv"] and a.max_new_tokens == 100
    assert run_name(a) == run_name(b)
    c = load_config(toml, {"limit": 2, "budgets": "96", "samples": None, "method_params": {"snapkv": {"n_large": 2}}})
    assert c.limit == 2 and c.budgets == [96] and c.samples == 1  # flags win; an unset flag does not
    assert c.method_params == {"snapkv": {"smooth_kernel": 3, "n_large": 2}}
    with pytest.raises(ConfigError, match="max_new_tokenz"):
        load_config(toml, {"max_new_tokenz": 3})


def test_config_validation():
    with pytest.raises(ConfigError, match="Did you mean snapkv"):
        EvalConfig(methods=["snapkvv"], budgets=[128])
    with pytest.raises(ConfigError, match="takes no parameter"):
        EvalConfig(methods=["snapkv"], budgets=[128], method_params={"snapkv": {"bogus": 1}})
    with pytest.raises(ConfigError, match="larger than window"):
        EvalConfig(methods=["vase-attnv"], budgets=[68], window=64)  # its 4 protected sinks need B > 68
    EvalConfig(methods=["vase-attnv"], budgets=[69], window=64)
    EvalConfig(methods=["snapkv"], budgets=[66], window=64)  # snapkv protects no sinks (was refused: issue 17)
    with pytest.raises(ConfigError, match="samples"):
        EvalConfig(samples=0)
    with pytest.raises(ConfigError, match="not in methods"):
        EvalConfig(methods=["snapkv"], method_params={"rkv": {}})
    # A label naming its method: two settings of one method side by side.
    cfg = EvalConfig(methods=["snapkv", "v16"], budgets=[128], method_params={"v16": {"method": "snapkv-v",
                                                                                       "n_large": 16}})
    specs = cfg.method_specs()
    assert list(specs) == ["full", "snapkv", "v16"] and specs["v16"].policy.n_large == 16


def test_run_name_is_deterministic_and_covers_results():
    cfg = EvalConfig(task="arith", limit=6, methods=["snapkv", "vase-attnv"], budgets=[96, 128], samples=1)
    name = run_name(cfg)
    assert name.startswith("arith-n6-s1-") and len(name.rsplit("-", 1)[1]) == 8
    assert run_name(EvalConfig(task="arith", limit=6, methods=["vase-attnv", "snapkv"], budgets=[128, 96],
                               samples=1, batch_size=3, fidelity=True, device="cpu")) == name
    for change in ({"max_new_tokens": 100}, {"seed": 1}, {"temperature": 0.7}, {"window": 32},
                   {"method_params": {"snapkv": {"smooth_kernel": 3}}}, {"model": "other"}, {"limit": 5}):
        other = EvalConfig(**{**dict(task="arith", limit=6, methods=["snapkv", "vase-attnv"], budgets=[96, 128],
                                     samples=1), **change})
        assert run_name(other) != name, change
    ident = identity(cfg)
    assert ident["methods"]["vase-attnv"]["params"]["value_guard"] == 0.25  # full parameters, defaults too
    assert len(identity_hash(ident)) == 64


#: Every EvalConfig setting, by how a change of it alone is kept apart from the run made before it (issue 40: a
#: kv_bits=4 run reused the dense run's folder). A new setting must be placed here, so its effect is decided.
_NAMED = {"task": "arith-5", "limit": 5, "seed": 1, "methods": ["snapkv", "rkv"], "budgets": [96],
          "window": 32, "samples": 2, "max_new_tokens": 100, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
          "greedy": True, "chat_template": False, "numeric_fallback": True, "end_marker": "END", "model": "other",
          "dtype": "float32", "engine": "vllm", "method_params": {"snapkv": {"smooth_kernel": 3}}}
_DATA = ("data_dir", "task_file", "question_field", "answer_field")  # the problems they load: the data digest
_RUNTIME = {"device": "device", "attn_implementation": "attn_kernel"}  # refused on resume (RUNTIME_FIELDS)
_NO_RESULT = ("batch_size", "fidelity", "output_dir", "name")  # the same samples: the same run


def test_every_setting_that_changes_results_names_a_new_run(tmp_path):
    from dataclasses import fields

    from vase.eval.identity import RUNTIME_FIELDS
    from vase.storage.registry import storage_keywords

    placed = set(_NAMED) | set(_DATA) | set(_RUNTIME) | set(_NO_RESULT)
    assert {f.name for f in fields(EvalConfig)} == placed  # a new setting is placed in one of the tables above
    base = dict(task="arith", limit=6, methods=["snapkv"], budgets=[128], samples=1)
    name = run_name(EvalConfig(**base))
    for key, value in _NAMED.items():
        assert run_name(EvalConfig(**{**base, key: value})) != name, key
    for key in _NO_RESULT:
        value = {"batch_size": 3, "fidelity": True, "output_dir": str(tmp_path)}.get(key)
        if value is not None:
            assert run_name(EvalConfig(**{**base, key: value})) == name, key
    assert set(_RUNTIME.values()) <= set(RUNTIME_FIELDS)
    # The problems: another field of the same file, or another file, is other data.
    rows = [{"q": f"{i} + 1?", "a": str(i + 1), "p": f"{i} + 2?", "b": str(i + 2)} for i in range(3)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "u.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    file_base = dict(base, task=None, task_file=str(tmp_path / "t.jsonl"), question_field="q", answer_field="a")
    file_name = run_name(EvalConfig(**file_base))
    for key, value in (("task_file", str(tmp_path / "u.jsonl")), ("question_field", "p"), ("answer_field", "b")):
        assert run_name(EvalConfig(**{**file_base, key: value})) != file_name, key
    # The storage: kv_bits (the CLI's --kv-bits is -p kv_bits, which lands here) and every other storage
    # keyword changed alone.
    dense = run_name(EvalConfig(**base))
    q4 = dict(base, method_params={"snapkv": {"kv_bits": 4}})
    assert run_name(EvalConfig(**q4)) != dense
    other = {"kv_bits": 8, "quant_guard": 8, "quant_group": 16, "quant_select": "random", "flush_every": 8,
             "quant_key_scale": True}
    assert set(other) | {"kv_dtype", "kv_rounding"} == set(storage_keywords())
    for key, value in other.items():
        changed = dict(base, method_params={"snapkv": {"kv_bits": 4, key: value}})
        assert run_name(EvalConfig(**changed)) != run_name(EvalConfig(**q4)), key
    # fp8 storage (refused beside kv_bits): a run of its own, and each format one
    fp8 = {f: run_name(EvalConfig(**dict(base, method_params={"snapkv": {"kv_dtype": f}})))
           for f in ("fp8", "fp8_e5m2")}
    truncated = run_name(EvalConfig(**dict(base, method_params={"snapkv": {"kv_dtype": "fp8", "kv_rounding": "zero"}})))
    assert len({dense, *fp8.values(), truncated}) == 4


def test_a_quantized_run_never_resumes_the_dense_one(tmp_path, tiny):
    model, tok = tiny
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[24], window=8, model="tiny",
                     output_dir=str(tmp_path))
    dense = run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)
    q4 = EvalConfig(**{**cfg.to_dict(), "method_params": {"snapkv": {"kv_bits": 4}}})
    assert run_eval(q4, model, tok, generate_fn=fake_generate, progress=False) != dense
    with pytest.raises(RunConflictError, match="storage"):  # the same folder by name: refused, naming the storage
        run_eval(EvalConfig(**{**q4.to_dict(), "name": dense.name}), model, tok, generate_fn=fake_generate,
                 progress=False)


def fake_generate(model, tokenizer, prompts, *, seed, max_new_tokens, **kw):
    """Instant stand-in: answers 7 on even seeds, gets cut off on odd ones."""
    texts = ["so \\boxed{7}" if s % 2 == 0 else "x" * 50 for s in seed]
    return GenerationOutput(texts=texts, token_ids=[list(range(3, 3 + len(t) // 5)) for t in texts],
                            prompt_lengths=[10] * len(prompts), finished=[s % 2 == 0 for s in seed],
                            seconds=0.01, prefill_seconds=0.001, stats={})


def test_run_dir_with_other_settings_is_never_overwritten(tmp_path, tiny):
    model, tok = tiny
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[24], window=8, name="mine",
                     model="tiny", output_dir=str(tmp_path))
    run_dir = run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)
    assert run_dir == tmp_path / "mine"
    saved = (run_dir / "config.json").read_text()
    meta = json.loads(saved)
    snapkv = meta["methods"]["snapkv"]
    assert snapkv["repr"].startswith("SnapKV(") and "smooth_kernel" in snapkv["params"]
    with pytest.raises(RunConflictError, match="max_new_tokens"):
        run_eval(EvalConfig(**{**cfg.to_dict(), "max_new_tokens": 7}), model, tok, generate_fn=fake_generate,
                 progress=False)
    assert (run_dir / "config.json").read_text() == saved
    # Settings that do not change results resume the same run.
    run_eval(EvalConfig(**{**cfg.to_dict(), "batch_size": 1}), model, tok, generate_fn=fake_generate, progress=False)
    assert (run_dir / "config.json").read_text() == saved
