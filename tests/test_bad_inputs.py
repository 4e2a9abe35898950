"""The bad-input table: every case a careful user tried against the CLI, the Python API, the run store
and the model cache, as one parametrised test.

Each case must end in one clear line that names the value or the fix (CLI: ``vase: error: ...`` on
stderr and a non-zero exit; API: the right exception type with a one-line message), never a
traceback without ``--debug``, and lose nothing (cases with a ``check`` verify what is on disk).
Everything fails before a model loads, or runs on tiny random models, so the table takes seconds.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import vase
from tests.conftest import run_main, tiny_model, tiny_tokenizer
from tests.helpers_tiny import tiny_model_and_tokenizer
from vase.caches.eager import EvictedStateError
from vase.cli import main
from vase.eval.config import ConfigError, EvalConfig
from vase.eval.store import StoreError
from vase.models import ModelLoadError, load_model, model_fingerprint
from vase.core.policies import UnknownMethodError, get_policy

# ----------------------------------------------------------------------------- the fixtures


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    """Files and models the cases point at (built once)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    w: dict[str, Any] = {"root": root}
    # A model directory without a chat template (the conftest tokenizer), one with (helpers_tiny).
    plain = root / "plain-model"
    tiny_model().save_pretrained(plain)
    tiny_tokenizer().save_pretrained(plain)
    chat = root / "chat-model"
    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(chat)
    tok.save_pretrained(chat)
    w["plain"], w["chat"] = str(plain), str(chat)
    from tests.hybrid_models import hybrid_model  # a linear-attention hybrid (3 gated-delta-net layers, 1 full)

    hybrid = root / "hybrid-model"
    hybrid_model("qwen3.5", dtype=torch.float32).save_pretrained(hybrid)
    tiny_tokenizer().save_pretrained(hybrid)
    w["hybrid"] = str(hybrid)
    (root / "no-config").mkdir()
    (root / "notes.txt").write_text("not a model\n")
    (root / "garbage.gguf").write_bytes(b"this is not a gguf file" * 50)
    w["truncated"] = str(_truncated_gguf(root / "truncated.gguf"))
    (root / "empty.txt").write_text("\n  \n")
    (root / "latin1.txt").write_bytes(b"first prompt\ncaf\xe9\n")
    (root / "latin1.jsonl").write_bytes(b'{"q": "1+1", "a": "2"}\n{"q": "caf\xe9", "a": "1"}\n')
    (root / "badjson.jsonl").write_text('{"q": "1+1", "a": "2"}\n{"q": oops}\n')
    configs = {
        "bad.yaml": "limit: [1\n", "list.yaml": "- 1\n- 2\n", "typo.yaml": "limt: 3\n", "c.txt": "limit: 3\n",
        "traversal.yaml": "name: ../../x\nbudgets: [128]\n", "slash.yaml": "name: a/b\nbudgets: [128]\n",
        "dots.yaml": "name: ..\nbudgets: [128]\n", "params.yaml": "budgets: [128]\nmethod_params:\n  snapkv: {}\n",
        "budgets.yaml": "budgets: abc\n", "limit.yaml": "limit: abc\nbudgets: [128]\n",
        "greedy.yaml": "greedy: maybe\nbudgets: [128]\n", "mp.yaml": "budgets: [128]\nmethod_params: [1]\n",
        "bad.toml": "limit = \n", "bad.json": "{limit: 3}",
    }
    for name, text in configs.items():
        (root / name).write_text(text)
    (root / "latin1.yaml").write_bytes(b"limit: 3\n# caf\xe9\n")
    (root / "kv-bits-top.yaml").write_text("kv_bits: 4\nbudgets: [128]\n")
    (root / "named.yaml").write_text("name: mine\n")
    (root / "long-question.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps(
        {"question": " ".join(["word"] * 3000), "answer": "1"}) + "\n")
    (root / "dup.yaml").write_text("limit: 3\nbudgets: [128]\nlimit: 5\n")
    (root / "dup-nested.yaml").write_text("methods: [snapkv]\nbudgets: [128]\nmethod_params:\n  snapkv: {n_large: 1, "
                                          "n_large: 2}\n")
    (root / "dup.json").write_text('{"limit": 3, "budgets": [128], "limit": 5}')
    more = {
        "budget-float.yaml": "budgets: [32.5]\n", "samples-bool.yaml": "samples: true\nbudgets: [128]\n",
        "window-float.yaml": "window: 8.9\nbudgets: [128]\n", "snapkv.yaml": "methods: [snapkv]\nbudgets: [128]\n",
        "n-large.yaml": "methods: [snapkv]\nbudgets: [128]\nmethod_params:\n  snapkv: {n_large: 1000}\n",
        "null-question.jsonl": '{"question": "1+1", "answer": "2"}\n{"question": null, "answer": "1"}\n',
        "good.jsonl": '{"question": "1+1", "answer": "2"}\n', "bad-config.json": '{"model_type": "no-such-arch"}',
    }
    for name, text in more.items():
        (root / name).write_text(text)
    (root / "long.txt").write_text(" ".join(["word"] * 3000) + "\n")
    return w


def _truncated_gguf(path: Path) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:-2000])
    return path


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(), tiny_tokenizer()


# ----------------------------------------------------------------------------- the table


@dataclass
class Case:
    """One bad input: a CLI argument list (``{name}`` filled from the world and ``tmp``), or an API call."""

    id: str
    expect: str | None  # None: no error (a warning-only case); else a regex the one message line must match (the value and/or the fix)
    argv: list[str] | None = None
    api: Callable[..., Any] | None = None  # api(ctx) -> anything; must raise `error`
    error: type[BaseException] | tuple = ()
    code: int = 1  # CLI exit code
    setup: Callable[[dict], None] | None = None  # prepares files under ctx["tmp"] (and may monkeypatch)
    check: Callable[[dict], None] | None = None  # afterwards: nothing lost
    stdin: bytes | None = None
    warn: str | None = None  # a regex for the one "vase: warning: ..." line (CLI) or the UserWarning (API)


def cli(id, expect, *argv, code=1, **kw) -> Case:
    return Case(id, expect, argv=list(argv), code=code, **kw)


def api(id, expect, fn, error, **kw) -> Case:
    return Case(id, expect, api=fn, error=error, **kw)


G = ["generate", "hi"]
E = ["eval", "--output-dir", "{tmp}/runs"]
EVAL_TINY = [*E, "--model", "{chat}", "--task", "arith", "--limit", "2", "--methods", "snapkv", "--budgets", "24",
             "--window", "8", "--max-new-tokens", "6", "--batch-size", "1", "--device", "cpu"]


def gen(ctx, prompts, **kw):
    model, tok = ctx["tiny"]
    return vase.generate(model, tok, prompts, **{"budget": 24, "window": 8, "max_new_tokens": 4,
                                                 "chat_template": False, **kw})


def cache(ctx, **kw):
    return vase.EvictionCache(ctx["tiny"][0], **{"method": "snapkv", "budget": 24, "window": 8, **kw})


def _second_generate(ctx):
    model, tok = ctx["tiny"]
    c = cache(ctx)
    enc = tok(["hello world"], return_tensors="pt")
    model.generate(**enc, **vase.cache_kwargs(c), max_new_tokens=20, do_sample=False)
    model.generate(**enc, **vase.cache_kwargs(c), max_new_tokens=20, do_sample=False)


def _check_inspect_hybrid(ctx):
    report = json.loads((ctx["tmp"] / "insp" / "inspect.json").read_text())
    assert [row["layer"] for row in report["values"]] == [3]  # the one full-attention layer, by its own index


def _check_randomness_hybrid(ctx):
    report = json.loads((ctx["tmp"] / "rand" / "randomness.json").read_text())
    assert report["config"]["attn_layers"] == [3]
    assert all(len(row["attn_err_per_layer"]) in (0, 1) for row in report["methods"])


def _write_run(path: Path, name: str, text: str) -> None:
    (path / name).mkdir(parents=True, exist_ok=True)
    (path / name / "config.json").write_text(text)


def _records(run_dir: Path) -> list[tuple]:
    from vase.eval.store import SAMPLE_KEY, rank_files, read_jsonl

    return [tuple(r[k] for k in SAMPLE_KEY) for p in rank_files(run_dir, "samples") for r in read_jsonl(p)]


def _interrupt_after(n: int):
    """Patch vase.generation.generate.generate to raise KeyboardInterrupt on call n + 1 (Ctrl-C mid-run)."""
    import vase.generation.generate as generation

    real, calls = generation.generate, []

    def patched(*a, **kw):
        calls.append(1)
        if len(calls) > n:
            raise KeyboardInterrupt
        return real(*a, **kw)

    return patched


def _setup_interrupt(ctx):
    import vase.generation.generate as generation

    ctx["monkeypatch"].setattr(generation, "generate", _interrupt_after(2))


def _check_interrupt(ctx):
    [run_dir] = (ctx["tmp"] / "runs").iterdir()
    assert len(_records(run_dir)) == 2  # the two finished samples are on disk
    ctx["monkeypatch"].undo()
    code, _, err = run_cli([a.format(**ctx) for a in EVAL_TINY], ctx)
    keys = _records(run_dir)
    assert code == 0, err
    assert len(keys) == len(set(keys)) == 2 * 2  # the rerun resumed: each record exactly once


def _setup_delete(ctx):
    import vase.generation.generate as generation

    real, calls = generation.generate, []

    def deleting(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            shutil.rmtree(ctx["tmp"] / "runs")
        return real(*a, **kw)

    ctx["monkeypatch"].setattr(generation, "generate", deleting)


def _setup_summary_fails(ctx):
    import vase.eval.report as report

    def broken(run_dir, **kw):
        raise OSError(28, "No space left on device")

    ctx["monkeypatch"].setattr(report, "summarize", broken)
    (ctx["tmp"] / "runs").mkdir()


def _check_no_summary(ctx):
    [run_dir] = (ctx["tmp"] / "runs").iterdir()
    assert not (run_dir / "summary.csv").exists() and len(_records(run_dir)) == 4


def _samples(ctx, lines: list[str]) -> None:
    run = ctx["tmp"] / "run"
    run.mkdir()
    (run / "samples.rank0.jsonl").write_text("".join(line + "\n" for line in lines))


GOOD = json.dumps({"method": "full", "budget": None, "problem_id": "p0", "sample": 0, "correct": True, "length": 3,
                   "failure": "ok", "answer": "1", "text": "x"})


def _store_locked(ctx):
    from vase.eval.store import JsonlStore

    p = ctx["tmp"] / "samples.rank0.jsonl"
    with JsonlStore(p):
        JsonlStore(p).open()


def _store_deleted(ctx):
    from vase.eval.store import JsonlStore

    p = ctx["tmp"] / "run" / "samples.rank0.jsonl"
    with JsonlStore(p) as s:
        s.append({"method": "full", "budget": None, "problem_id": "p0", "sample": 0})
        shutil.rmtree(p.parent)
        s.append({"method": "full", "budget": None, "problem_id": "p1", "sample": 0})


def _store_efbig(ctx):
    from vase.eval.store import JsonlStore

    p = ctx["tmp"] / "samples.rank0.jsonl"
    with JsonlStore(p) as s:
        s.append({"method": "full", "budget": None, "problem_id": "p0", "sample": 0})
        ctx["monkeypatch"].setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(27, "File too large")))
        s.append({"method": "full", "budget": None, "problem_id": "p1", "sample": 0})


def _check_store_kept_first(ctx):
    from vase.eval.store import read_jsonl

    ctx["monkeypatch"].undo()
    # p0 is safe; p1 may or may not have reached the disk (it was not confirmed), and the file still parses
    assert [r["problem_id"] for r in read_jsonl(ctx["tmp"] / "samples.rank0.jsonl")][:1] == ["p0"]


def _store_symlink(ctx, dangling: bool = False):
    from vase.eval.store import JsonlStore

    run = ctx["tmp"] / "run"
    run.mkdir()
    target = ctx["tmp"] / "precious.txt"
    if not dangling:
        target.write_text("a complete line\n")
    (run / "samples.rank0.jsonl").symlink_to(target)
    JsonlStore(run / "samples.rank0.jsonl").open()


def _check_target_intact(ctx):
    target = ctx["tmp"] / "precious.txt"
    assert target.read_text() == "a complete line\n"  # neither cut nor filled


def _store_folder(ctx):
    from vase.eval.store import JsonlStore

    (ctx["tmp"] / "samples.rank0.jsonl").mkdir()
    JsonlStore(ctx["tmp"] / "samples.rank0.jsonl").open()


def _store_complete_bad_line(ctx):
    from vase.eval.store import JsonlStore

    (ctx["tmp"] / "samples.rank0.jsonl").write_text(GOOD + "\nnot a record\n")
    JsonlStore(ctx["tmp"] / "samples.rank0.jsonl").open()


def _check_bad_line_kept(ctx):
    assert (ctx["tmp"] / "samples.rank0.jsonl").read_text() == GOOD + "\nnot a record\n"


def _store_emptied(ctx):
    from vase.eval.store import JsonlStore

    p = ctx["tmp"] / "samples.rank0.jsonl"
    with JsonlStore(p) as s:
        s.append({"method": "full", "budget": None, "problem_id": "p0", "sample": 0})
        p.write_bytes(b"")  # `: > samples.rank0.jsonl` from another shell
        s.append({"method": "full", "budget": None, "problem_id": "p1", "sample": 0})


def _full_disk(ctx, name: str = "samples.rank0.jsonl"):
    """os.write to ``name`` writes half a line once, then fails with ENOSPC (a disk that fills mid-record)."""
    real, calls = os.write, []

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            calls.append(1)
            if len(calls) == 1:
                return real(fd, bytes(data)[:len(data) // 2])
            raise OSError(28, "No space left on device")
        return real(fd, data)

    ctx["monkeypatch"].setattr(os, "write", write)


def _store_enospc(ctx):
    from vase.eval.store import JsonlStore

    p = ctx["tmp"] / "samples.rank0.jsonl"
    with JsonlStore(p) as s:
        s.append({"method": "full", "budget": None, "problem_id": "p0", "sample": 0})
        _full_disk(ctx)
        s.append({"method": "full", "budget": None, "problem_id": "p1", "sample": 0})


def _check_enospc(ctx):
    from vase.eval.store import read_jsonl

    ctx["monkeypatch"].undo()
    p = ctx["tmp"] / "samples.rank0.jsonl"
    assert p.read_bytes().endswith(b"\n")  # the half line was cut back off
    assert [r["problem_id"] for r in read_jsonl(p)] == ["p0"]


def _setup_run_full_disk(ctx):
    _full_disk(ctx)


def _check_run_full_disk(ctx):
    ctx["monkeypatch"].undo()
    [run_dir] = (ctx["tmp"] / "runs").iterdir()
    assert (run_dir / "samples.rank0.jsonl").read_bytes() == b""  # no half record left behind


def _setup_orphan_samples(ctx):
    (ctx["tmp"] / "named.yaml").write_text("name: r\nbudgets: [128]\nlimit: 2\n")
    run = ctx["tmp"] / "runs" / "r"
    run.mkdir(parents=True)
    (run / "samples.rank0.jsonl").write_text(GOOD + "\n")


def _check_orphan_kept(ctx):
    run = ctx["tmp"] / "runs" / "r"
    assert not (run / "config.json").exists() and (run / "samples.rank0.jsonl").read_text() == GOOD + "\n"


def _setup_emptied(ctx):
    import vase.generation.generate as generation

    real, calls = generation.generate, []

    def emptying(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            [run_dir] = (ctx["tmp"] / "runs").iterdir()
            (run_dir / "samples.rank0.jsonl").write_bytes(b"")
        return real(*a, **kw)

    ctx["monkeypatch"].setattr(generation, "generate", emptying)


def _setup_foreign_records(ctx):
    run = ctx["tmp"] / "run"
    run.mkdir()
    ident = {"methods": {"full": {}, "snapkv": {}}, "budgets": [24], "n_problems": 1, "samples": 1}
    (run / "config.json").write_text(json.dumps({"identity": ident}))
    other = json.loads(GOOD)
    lines = [GOOD, json.dumps({**other, "method": "h2o", "budget": 24}), json.dumps({**other, "sample": 6}),
             json.dumps({**other, "problem_index": 6, "problem_id": "p6"})]
    (run / "samples.rank0.jsonl").write_text("".join(line + "\n" for line in lines))


def _check_foreign_dropped(ctx):
    text = (ctx["tmp"] / "run" / "summary.csv").read_text()
    assert text.count("\nfull,") == 1 and "h2o" not in text


def _setup_bad_length(ctx):
    _samples(ctx, [json.dumps({**json.loads(GOOD), "length": "long"})])
    (ctx["tmp"] / "run" / "summary.csv").write_text("an old summary\n")


def _setup_bad_correct(ctx):
    _samples(ctx, [GOOD, json.dumps({**json.loads(GOOD), "problem_id": "p1", "correct": "no"})])
    (ctx["tmp"] / "run" / "summary.csv").write_text("an old summary\n")


def _dist_timeout_abc(ctx):
    from vase.eval.runner import dist_env

    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("VASE_DIST_TIMEOUT_S", "abc")):
        ctx["monkeypatch"].setenv(name, value)
    dist_env()


def _run_name_file(ctx):
    (ctx["tmp"] / "runs").mkdir()
    (ctx["tmp"] / "runs" / "mine").write_text("not a run\n")


def _changed_param(ctx):
    from vase.eval.runner import write_run_config

    method = {"method": "snapkv", "params": {"sinks": 4, "window_attention": "mean", "kernel": 7, "x": "y" * 200}}
    old = {"limit": 2, "methods": {"full": {"method": "full", "params": {}}, "snapkv": method}}
    new = json.loads(json.dumps(old))
    new["methods"]["snapkv"]["params"]["sinks"] = 2
    (ctx["tmp"] / "config.json").write_text(json.dumps({"identity": old}))
    write_run_config(ctx["tmp"], {"identity": new})


def _dangling(ctx, name: str = "out"):
    (ctx["tmp"] / name).symlink_to(ctx["tmp"] / "nowhere")


def _check_context(ctx, prompt: int, cap: int):
    from vase.generation.generate import check_context

    assert check_context(ctx["tiny"][0], [prompt], cap) is None  # grows as needed: nothing preallocated


def _crop(ctx):
    c = cache(ctx)
    gen_cache_fill(ctx, c)
    c.crop(-100)  # more than the last forward wrote


def gen_cache_fill(ctx, c):
    model, tok = ctx["tiny"]
    with torch.no_grad():
        model(**tok(["hello"], return_tensors="pt"), **vase.cache_kwargs(c), use_cache=True)


CASES: list[Case] = [
    # -- the CLI: arguments and flags (typer's usage errors exit 2) --------------------------------------------
    cli("unknown-command", r"No such command 'frobnicate'", "frobnicate", code=2),
    cli("budget-not-int", r"Invalid value for '--budget'", *G, "--budget", "abc", code=2),
    cli("window-not-int", r"Invalid value for '--window'", *G, "--window", "x", code=2),
    cli("max-new-tokens-float", r"Invalid value for '--max-new-tokens'", *G, "--max-new-tokens", "1.5", code=2),
    cli("threads-not-int", r"Invalid value for '--threads'", "--threads", "abc", "methods", code=2),
    cli("unknown-option", r"No such option: --budgit", *G, "--budgit", "3", code=2),
    cli("eval-samples-not-int", r"Invalid value for '--samples'", *E, "--samples", "two", code=2),
    # -- methods and parameters (checked before any model loads) -----------------------------------------------
    cli("unknown-method", r"unknown method 'snapk'\. Did you mean snapkv", *G, "--method", "snapk"),
    cli("numeric-method", r"unknown method '123'", *G, "--method", "123"),
    cli("compare-unknown", r"unknown method 'fulll'", *G, "--compare", "fulll"),
    cli("param-no-equals", r"--param takes KEY=VALUE, got 'rank'", *G, "-p", "rank"),
    cli("param-no-key", r"--param takes KEY=VALUE, got '=3'", *G, "-p", "=3"),
    cli("param-unknown", r"takes no parameter 'rank'; it takes", *G, "--method", "snapkv", "-p", "rank=3"),
    cli("param-yaml-list", r"--param 'sinks=\[1': the value is not a valid YAML scalar", *G, "-p", "sinks=[1"),
    cli("param-yaml-brace", r"--param 'sinks=\{a': the value is not a valid YAML scalar", *G, "-p", "sinks={{a"),
    cli("param-bool-maybe", r"parameter sample must be true or false, got 'maybe'", *G, "-p", "sample=maybe"),
    cli("param-bool-int", r"parameter protect_sinks must be true or false, got 2", *G, "-p", "protect_sinks=2"),
    cli("param-int-float", r"parameter n_large must be an integer \(or unset\), got 1.5", *G, "-p", "n_large=1.5"),
    cli("param-int-str", r"parameter sinks must be an integer, got 'abc'", *G, "-p", "sinks=abc"),
    cli("param-int-bool", r"parameter sinks must be an integer, got True", *G, "-p", "sinks=true"),
    cli("param-negative", r"sinks must be >= 0, got -1", *G, "-p", "sinks=-1"),
    cli("param-n-large-negative", r"n_large must be >= 0, got -3", *G, "-p", "n_large=-3"),
    cli("param-guard-range", r"value_guard is a fraction of the budget in \[0, 1\), got 1.5", *G, "-p",
        "value_guard=1.5"),
    cli("param-guard-str", r"parameter value_guard must be a number, got 'abc'", *G, "-p", "value_guard=abc"),
    cli("param-guard-nan", r"parameter value_guard must be a finite number, got nan", *G, "-p", "value_guard=.nan"),
    cli("param-metric", r"unknown value metric 'max': use one of range, l2, var", *G, "-p", "metric=max"),
    cli("param-metric-int", r"parameter metric must be a string, got 3", *G, "-p", "metric=3"),
    cli("param-temperature", r"temperature must be > 0, got 0", *G, "--method", "snapkv", "-p", "temperature=0"),
    cli("param-kernel-even", r"smooth_kernel must be an odd number", *G, "--method", "snapkv", "-p",
        "smooth_kernel=4"),
    cli("param-rkv-lambda", r"rkv_lambda must be in \[0, 1\], got 2", *G, "--method", "rkv", "-p", "rkv_lambda=2"),
    cli("param-rank-zero", r"rank must be >= 1, got 0", *G, "--method", "vase-dkv", "-p", "rank=0"),
    cli("param-rank-float", r"parameter rank must be an integer, got 2.5", *G, "--method", "vase-dkv", "-p",
        "rank=2.5"),
    # -- budget, window, sampling (before any model loads) ------------------------------------------------------
    cli("budget-below-window", r"budget \(20\) must be larger than window \+ protected sinks \(64 \+ 4\)", *G,
        "--budget", "20"),
    cli("budget-equals-window", r"budget \(64\) must be larger than window", *G, "--budget", "64", "--method",
        "snapkv"),
    cli("budget-zero", r"budget must be a positive number of tokens, got 0", *G, "--budget", "0"),
    cli("window-zero", r"window must be a positive number of tokens, got 0", *G, "--window", "0"),
    cli("window-negative", r"window must be a positive number of tokens, got -5", *G, "--window", "-5"),
    cli("compare-budget", r"budget \(66\) must be larger than window \+ protected sinks \(64 \+ 4\)", *G, "--method",
        "snapkv", "--budget", "66", "--compare", "vase-attnv"),
    cli("top-k-zero", r"top_k must be >= 1 \(or None for no top-k\), got 0", *G, "--top-k", "0"),
    cli("top-k-negative", r"top_k must be >= 1 .*got -1", *G, "--top-k", "-1"),
    cli("top-p-zero", r"top_p must be in \(0, 1\], got 0", *G, "--top-p", "0"),
    cli("top-p-big", r"top_p must be in \(0, 1\], got 1.5", *G, "--top-p", "1.5"),
    cli("temperature-zero", r"temperature must be > 0 \(or greedy=True for argmax\), got 0", *G, "--temperature",
        "0"),
    cli("temperature-negative", r"temperature must be > 0 .*got -1", *G, "--temperature", "-1"),
    cli("max-new-tokens-zero", r"max_new_tokens must be >= 1, got 0", *G, "--max-new-tokens", "0"),
    cli("batch-size-zero", r"--batch-size must be >= 1", *G, "--batch-size", "0"),
    cli("engine-unknown", r"unknown --engine 'foo': use transformers or vllm", *G, "--engine", "foo"),
    cli("bench-budget", r"budget \(20\) must be larger than window", "bench", "--budgets", "20", "--window", "64"),
    cli("bench-budgets-list", r"expected a comma-separated list of ints, got '12x'", "bench", "--budgets", "12x"),
    cli("bench-warmup-tokens", r"--warmup-tokens.*greater than or equal to 2", "bench", "--warmup-tokens", "1",
        code=2),
    cli("inspect-budget", r"budget \(10\) must be larger than window", "inspect", "hi", "--budget", "10"),
    cli("randomness-budget", r"budget \(18\) must be larger than window \+ protected sinks \(16 \+ 4\)", "analyze",
        "randomness", "--budget", "18", "--window", "16"),
    # -- prompts ----------------------------------------------------------------------------------------------------
    cli("no-prompt", r"give a PROMPT, or --file F", "generate"),
    cli("prompt-and-file", r"give a PROMPT or --file, not both", *G, "--file", "{root}/empty.txt"),
    cli("prompt-file-missing", r"no such prompt file: /nonexistent/prompts.txt", "generate", "--file",
        "/nonexistent/prompts.txt"),
    cli("prompt-file-dir", r"--file .*no-config is a folder, not a prompt file", "generate", "--file", "{root}/no-config"),
    cli("prompt-file-empty", r"no prompts found in .*empty.txt \(one prompt per line\)", "generate", "--file", "{root}/empty.txt"),
    cli("prompt-file-dev-null", r"no prompts found in /dev/null \(one prompt per line\)", "generate", "-f", "/dev/null"),
    cli("prompt-file-latin1", r"latin1.txt: line 2 is not UTF-8 text .*save the file as UTF-8", "generate", "--file",
        "{root}/latin1.txt"),
    cli("stdin-latin1", r"the prompts on stdin are not UTF-8 text", "generate", "-", stdin=b"ok\ncaf\xe9\n"),
    cli("stdin-empty", r"no prompts found", "generate", "-", stdin=b"\n\n"),
    cli("empty-prompt-no-chat", r"an empty prompt with --no-chat gives the model nothing", "generate", "",
        "--no-chat"),
    cli("empty-prompt-no-template", r"prompt 0 \(''\) encodes to no tokens", "generate", "", "--model", "{plain}",
        "--budget", "24", "--window", "8"),
    # -- models (one line, the path and the fix) ------------------------------------------------------------------
    cli("model-missing", r"no such file or directory: /nonexistent/model", *G, "--model", "/nonexistent/model"),
    cli("model-not-gguf", r"notes.txt is a file but not a .gguf file", *G, "--model", "{root}/notes.txt"),
    cli("model-no-config", r"is not a transformers model directory: no config.json", *G, "--model",
        "{root}/no-config"),
    cli("model-garbage-gguf", r"could not read the GGUF file .*garbage.gguf", *G, "--model", "{root}/garbage.gguf"),
    cli("model-truncated-gguf", r"truncated.gguf.*looks truncated or damaged: download it again", *G, "--model",
        "{truncated}"),
    cli("dtype-unknown", r"unknown dtype 'float64': use 'auto', 'float32'", *G, "--model", "{plain}", "--dtype",
        "float64"),
    cli("device-unknown", r"unknown device 'tpu': use 'cpu', 'cuda' or 'auto'", *G, "--device", "tpu"),
    cli("device-no-cuda", r"device 'cuda' was asked for but CUDA is not available", *G, "--device", "cuda"),
    cli("attn-unknown", r"unknown attn_implementation 'flash'", *G, "--attn", "flash"),
    cli("attn-flash-cpu", r"flash_attention_2.*(flash-attn package|CUDA device)", *G, "--attn", "flash_attention_2"),
    # -- vase eval: settings ----------------------------------------------------------------------------------------
    cli("eval-unknown-method", r"unknown method 'snapk'", *E, "--methods", "snapk"),
    cli("eval-budgets-list", r"expected a comma-separated list of ints, got '12x'", *E, "--budgets", "12x"),
    cli("eval-budget-window", r"budget \(20\) must be larger than window \+ protected sinks \(64 \+ 4\)", *E, "--budgets", "20"),
    cli("eval-budget-twice", r"budgets lists a budget twice: \[128, 128\]", *E, "--budgets", "128,128"),
    cli("eval-method-twice", r"methods lists a method twice", *E, "--methods", "snapkv,snapkv", "--budgets", "128"),
    cli("eval-samples-zero", r"samples must be >= 1, got 0", *E, "--samples", "0"),
    cli("eval-limit-zero", r"limit must be >= 1 \(or unset", *E, "--limit", "0"),
    cli("eval-max-new-zero", r"max_new_tokens must be >= 1, got 0", *E, "--max-new-tokens", "0"),
    cli("eval-temperature", r"temperature must be > 0 \(or set greedy\), got 0", *E, "--temperature", "0"),
    cli("eval-top-p", r"top_p must be in \(0, 1\], got 2", *E, "--top-p", "2"),
    cli("eval-batch-zero", r"batch_size must be >= 1, got 0", *E, "--batch-size", "0"),
    cli("eval-dtype", r"dtype must be one of auto, float32.*got 'float64'", *E, "--dtype", "float64"),
    cli("eval-attn", r"attn_implementation must be one of sdpa, eager, flash_attention_2, got 'flash'", *E,
        "--attn", "flash"),
    cli("eval-param-type", r"method 'vase-attnv': bad parameters .*parameter sample must be true or false, got "
        r"'maybe'", *E, "--methods", "vase-attnv", "--budgets", "128", "-p", "sample=maybe"),
    cli("eval-param-yaml", r"--param 'n_large=\[1': the value is not a valid YAML scalar", *E, "-p", "n_large=[1"),
    cli("eval-unknown-task", r"unknown task 'nope': choose one of", *E, "--task", "nope", "--budgets", "128"),
    cli("eval-task-file-missing", r"task file not found: /nonexistent.jsonl", *E, "--task-file", "/nonexistent.jsonl",
        "--budgets", "128"),
    cli("eval-task-file-latin1", r"latin1.jsonl: line 2 is not UTF-8 text .*save the file as UTF-8", *E,
        "--task-file", "{root}/latin1.jsonl", "--question-field", "q", "--answer-field", "a", "--budgets", "128"),
    cli("eval-task-file-json", r"badjson.jsonl: line 2 is not valid JSON", *E, "--task-file", "{root}/badjson.jsonl",
        "--question-field", "q", "--answer-field", "a", "--budgets", "128"),
    cli("eval-device-cuda", r"device 'cuda' was asked for but CUDA is not available", *E, "--budgets", "128",
        "--device", "cuda"),
    cli("eval-output-dir-file", r"--output-dir .*notes.txt is a file, not a folder", "eval", "--output-dir", "{root}/notes.txt",
        "--budgets", "128"),
    cli("eval-fidelity-vllm", r"fidelity \(teacher forcing\) runs on the transformers engine only", *E, "--budgets",
        "128", "--fidelity", "--engine", "vllm"),
    # -- vase eval: config files --------------------------------------------------------------------------------------
    cli("config-missing", r"config file not found: /nonexistent.yaml", *E, "-c", "/nonexistent.yaml"),
    cli("config-bad-yaml", r"cannot read config file .*bad.yaml", *E, "-c", "{root}/bad.yaml"),
    cli("config-bad-toml", r"cannot read config file .*bad.toml", *E, "-c", "{root}/bad.toml"),
    cli("config-bad-json", r"cannot read config file .*bad.json", *E, "-c", "{root}/bad.json"),
    cli("config-list", r"must hold a table of settings, got list", *E, "-c", "{root}/list.yaml"),
    cli("config-suffix", r"must end in .toml, .yaml, .yml or .json", *E, "-c", "{root}/c.txt"),
    cli("config-typo", r"unknown setting 'limt' \(did you mean 'limit'\?\)", *E, "-c", "{root}/typo.yaml"),
    cli("config-latin1", r"latin1.yaml: line 2 is not UTF-8 text", *E, "-c", "{root}/latin1.yaml"),
    cli("config-name-traversal", r"name must be one folder name .*got '../../x'", *E, "-c",
        "{root}/traversal.yaml"),
    cli("config-name-slash", r"name must be one folder name .*got 'a/b'", *E, "-c", "{root}/slash.yaml"),
    cli("config-name-dots", r"name must be one folder name .*got '..'", *E, "-c", "{root}/dots.yaml"),
    cli("config-method-params", r"method_params names 'snapkv', which is not in methods", *E, "-c",
        "{root}/params.yaml"),
    cli("config-budgets-str", r"budgets must be integers, got 'abc'", *E, "-c", "{root}/budgets.yaml"),
    cli("config-limit-str", r"limit must be int, got 'abc'", *E, "-c", "{root}/limit.yaml"),
    cli("config-greedy-str", r"greedy must be bool, got 'maybe'", *E, "-c", "{root}/greedy.yaml"),
    cli("config-method-params-list", r"method_params must map a method label to its parameters", *E, "-c",
        "{root}/mp.yaml"),
    # -- vase eval: the run folder --------------------------------------------------------------------------------------
    cli("run-config-list", r"config.json is not a vase run config \(a JSON list", *E, "-c", "{tmp}/named.yaml",
        setup=lambda ctx: ((ctx["tmp"] / "named.yaml").write_text("name: r\nbudgets: [128]\nlimit: 2\n"),
                           _write_run(ctx["tmp"] / "runs", "r", "[1, 2]"))),
    cli("run-other-settings", r"already holds a run with different settings .*never overwritten", *E, "-c",
        "{tmp}/named.yaml",
        setup=lambda ctx: ((ctx["tmp"] / "named.yaml").write_text("name: r\nbudgets: [128]\nlimit: 2\n"),
                           _write_run(ctx["tmp"] / "runs", "r", json.dumps({"identity": {"limit": 3}}))),
        check=lambda ctx: json.loads((ctx["tmp"] / "runs" / "r" / "config.json").read_text()) == {
            "identity": {"limit": 3}}),
    cli("run-interrupted", r"^vase: interrupted; every finished sample is saved: run the same command again to "
        r"resume$", *EVAL_TINY, code=130, setup=_setup_interrupt, check=_check_interrupt),
    cli("run-folder-deleted", r"samples.rank0.jsonl was deleted or moved while this run was writing to it", *EVAL_TINY,
        setup=_setup_delete),
    cli("run-summary-fails", r"writing the summary of .* failed \(OSError: .*No space left on device\); the results "
        r"are safe", *EVAL_TINY, setup=_setup_summary_fails, check=_check_no_summary),
    # -- vase summarize -------------------------------------------------------------------------------------------------
    cli("summarize-missing", r"no such run folder: /nonexistent/run", "summarize", "/nonexistent/run"),
    cli("summarize-empty", r"holds no samples.rank\*.jsonl records yet", "summarize", "{root}/no-config"),
    cli("summarize-missing-fields", r"record 2 lacks the field\(s\) 'method', 'budget', 'sample'", "summarize",
        "{tmp}/run", setup=lambda ctx: _samples(ctx, [GOOD, '{"problem_id": "p1"}'])),
    cli("summarize-corrupt-line", r"line 2 is not a valid record .*the file is corrupt: remove that line", "summarize",
        "{tmp}/run", setup=lambda ctx: _samples(ctx, [GOOD, "{oops", GOOD])),
    cli("summarize-not-object", r"line 1 is not a valid record \(not a JSON object\)", "summarize", "{tmp}/run",
        setup=lambda ctx: _samples(ctx, ["[1, 2]", GOOD])),
    # -- silent before (issue 16): each now one line, or one warning when the value is legal but ignored ------------
    cli("eval-param-config-methods", r"method 'snapkv': bad parameters .*sample must be true or false", *E, "-c",
        "{root}/snapkv.yaml", "-p", "sample=maybe", "--model", "/nonexistent/model"),
    cli("eval-param-default-method", r"vase-attnv: n_large \(1000\) is larger than the budget leaves for old tokens \(B - w = 128 - 64 = 64\)", *E,
        "--budgets", "128", "-p", "n_large=1000", "--model", "/nonexistent/model"),
    cli("eval-param-no-method-takes", r"--param rank: no method of this run takes it \(snapkv\)", *E, "--methods",
        "snapkv", "--budgets", "128", "-p", "rank=3"),
    cli("eval-param-some-methods", r"no such file or directory: /nonexistent/model", *E, "--methods",
        "snapkv,vase-dkv", "--budgets", "128", "-p", "rank=3", "--model", "/nonexistent/model",
        warn=r"--param rank applies to vase-dkv only \(snapkv take no 'rank'\)"),
    cli("eval-budgets-empty", r"--budgets is empty \(''\): give a comma-separated list", *E, "--budgets", ""),
    cli("eval-methods-empty", r"--methods is empty \(''\)", *E, "--methods", ""),
    cli("bench-methods-empty", r"--methods is empty", "bench", "--methods", " , "),
    cli("config-budget-float", r"budgets must be a whole number, got 32.5", *E, "-c", "{root}/budget-float.yaml"),
    cli("config-samples-bool", r"samples must be an integer, got True", *E, "-c", "{root}/samples-bool.yaml"),
    cli("config-window-float", r"window must be a whole number, got 8.9", *E, "-c", "{root}/window-float.yaml"),
    cli("config-n-large-budget", r"snapkv: n_large \(1000\) is larger than the budget leaves for old tokens \(B - w = 128 - 64 = 64\)", *E, "-c",
        "{root}/n-large.yaml"),
    cli("summarize-foreign-records", None, "summarize", "{tmp}/run", code=0, setup=_setup_foreign_records,
        check=_check_foreign_dropped, warn=r"left out 3 samples record\(s\) that are not part of this run"),
    cli("task-file-null-question", r"null-question.jsonl: row 2: question field 'question' is null", *E,
        "--task-file", "{root}/null-question.jsonl", "--budgets", "128"),
    cli("eval-task-and-task-file", r"give --task or --task-file, not both", *E, "--task", "gsm8k", "--task-file",
        "{root}/good.jsonl"),
    cli("generate-n-large-budget", r"n_large \(1000\) is larger than the budget leaves for old tokens \(B - w = 100 - 64 = 36\)", *G, "--budget", "100",
        "-p", "n_large=1000"),
    cli("generate-quant-guard-budget", r"quant_guard \(1000\) is larger than the budget \(100\)", *G, "--budget",
        "100", "--kv-bits", "4", "--quant-guard", "1000"),
    cli("generate-greedy-temperature", r"no such file or directory: /nonexistent/model", *G, "--greedy",
        "--temperature", "0.3", "--top-k", "5", "-m", "/nonexistent/model",
        warn=r"--temperature/--top-k is ignored with --greedy"),
    cli("bench-requests-transformers", r"no such file or directory: /nonexistent/model", "bench", "--requests", "4",
        "--regimes", "tight", "-m", "/nonexistent/model",
        warn=r"--requests, --regimes are ignored on the transformers engine"),
    cli("generate-full-param", r"no such file or directory: /nonexistent/model", *G, "--method", "full", "-p",
        "n_large=5", "-m", "/nonexistent/model", warn=r"--param n_large is ignored by 'full': it keeps every token"),
    cli("report-inspect-missing", r"holds no samples.rank\*.jsonl records", "report", "{root}/no-config",
        "--inspect", "/nonexistent/insp", warn=r"--inspect /nonexistent/insp: no such folder; ignored"),
    cli("threads-zero", r"--threads must be >= 1, got 0", "--threads", "0", "methods"),
    cli("threads-negative", r"--threads must be >= 1, got -2", "--threads", "-2", "methods"),
    cli("threads-huge", r"--threads 100000 is more than this machine can use: at most \d+ \(4 per CPU core",
        "--threads", "100000", "methods"),  # issue 40: torch took it and the process died (SIGSEGV)
    cli("threads-past-int64", r"--threads 99999999999999999999 is more than this machine can use", "--threads",
        "99999999999999999999", "methods"),  # was "Overflow when unpacking long long"
    cli("prompt-past-context", r"prompt 0 is \d+ tokens, longer than the model's context \(2048 tokens", "generate",
        "--file", "{root}/long.txt", "--model", "{plain}", "--budget", "24", "--window", "8", "--no-chat"),
    api("prompt-and-cap-past-context", None, lambda c: _check_context(c, 100, 2000), (),
        warn=r"prompt \(100 tokens\) \+ max_new_tokens \(2000\) passes the model's context \(2048 tokens\)"),
    cli("sweep-compression-huge", r"--compressions 1000: every run is too short for it", "analyze", "sweep",
        "--compressions", "1000", "--tasks", "arith", "--limit", "1", "--methods", "snapkv", "--window", "8",
        "--max-new-tokens", "12", "--model", "{chat}", "--out", "{tmp}/sweep",
        setup=lambda c: c["monkeypatch"].setattr("vase.cli.err_console.print", lambda *a, **k: None)),  # progress
    # -- unclear before (issue 16): one line naming the file, flag or value and the fix ----------------------------
    cli("summarize-length-str", r"samples.rank0.jsonl: line 1: 'length' is \"long\", not a number", "summarize",
        "{tmp}/run", setup=_setup_bad_length,  # a bad record: nothing is written, the last summary stays (issue 40)
        check=lambda c: (c["tmp"] / "run" / "summary.csv").read_text() == "an old summary\n"),
    cli("summarize-correct-str", r"samples.rank0.jsonl: line 2: 'correct' is \"no\", not true or false", "summarize",
        "{tmp}/run", setup=_setup_bad_correct,
        check=lambda c: (c["tmp"] / "run" / "summary.csv").read_text() == "an old summary\n"),
    api("run-param-changed", r"\(methods.snapkv.params.sinks: 4 -> 2\)\. It is never overwritten", _changed_param,
        ConfigError),
    cli("budget-huge", r"budget 99999999999999999999 is too large \(at most 2147483647\)", *G, "--budget",
        "99999999999999999999"),
    cli("seed-huge", r"--seed 99999999999999999999 is too large", *G, "--seed", "99999999999999999999"),
    cli("eval-budget-huge", r"budget 99999999999999999999 is too large", *E, "--budgets", "99999999999999999999"),
    api("max-new-tokens-huge", None, lambda c: _check_context(c, 5, 99999999999), (),
        warn=r"max_new_tokens \(99999999999\) passes the model's context .*lower --max-new-tokens to 2043"),
    cli("world-size-abc", r"WORLD_SIZE='abc' is not an integer: unset it", *E, "--budgets", "128",
        setup=lambda c: c["monkeypatch"].setenv("WORLD_SIZE", "abc")),
    cli("random-init-bad-config", r"--random-init .*bad-config.json: cannot build a model from it", "bench",
        "--random-init", "{root}/bad-config.json", "--budgets", "128", "--lengths", "4"),
    cli("layers-without-random-init", r"--layers cuts a --random-init shape: add --random-init NAME, or drop "
        r"--layers", "bench", "--layers", "2", "--budgets", "128", "--lengths", "4"),
    cli("layers-on-vllm", r"--layers is for the transformers engine's bench only: drop it with --engine vllm", "bench", "--engine", "vllm", "--layers", "2", "--lengths", "4"),
    cli("random-init-on-vllm", r"--random-init is for the transformers engine's bench only: drop it with --engine vllm", "bench", "--engine", "vllm", "--random-init", "gemma3-270m", "--lengths", "4"),
    cli("bench-vllm-transformers-flags", r"--batch-sizes, --warmup, --warmup-tokens, --no-dynamic are for the transformers engine's bench only: drop them with --engine vllm", "bench", "--engine", "vllm", "--batch-sizes", "2", "--warmup", "0", "--warmup-tokens", "4", "--no-dynamic"),
    cli("layers-past-depth", r"--layers 100: qwen3-0.6b has 28 decoder layers: give 1..28, got 100", "bench",
        "--random-init", "qwen3-0.6b", "--layers", "100", "--lengths", "4", "--budgets", "128"),  # was IndexError
    cli("layers-no-full-attention", r"--layers 2: the first 2 of qwen3.5-0.8b's layers hold no full-attention layer "
        r"\(the first is layer 3\), so nothing would be evicted: give at least 4", "bench", "--random-init",
        "qwen3.5-0.8b", "--layers", "2", "--lengths", "4", "--budgets", "128"),
    cli("random-init-gpt-oss-sdpa", r"--attn sdpa: gpt-oss-20b does not run with it .*add --attn eager", "bench",
        "--random-init", "gpt-oss-20b", "--layers", "2", "--lengths", "4", "--budgets", "128"),
    cli("layers-zero", r"Invalid value for .--layers.: Input should be greater than or equal to 1", "bench",
        "--random-init", "tiny", "--layers", "0", "--lengths", "4", code=2),
    cli("model-empty", r"--model is empty \(''\)", *G, "-m", ""),
    cli("eval-model-empty", r"--model is empty", *E, "-m", " "),
    api("api-model-empty", r"the model is empty \(''\)", lambda c: load_model(""), ModelLoadError),
    cli("vllm-kv-bits", r"quantized K/V storage \(kv_bits\) runs on the transformers engine only, not on vllm: drop "
        r"--kv-bits", *G, "--engine", "vllm", "--kv-bits", "4"),
    cli("task-file-folder", r"task file .*no-config is a folder, not a JSONL file", *E, "--task-file",
        "{root}/no-config", "--budgets", "128"),
    cli("config-folder", r"config file .*no-config is a folder", *E, "-c", "{root}/no-config"),
    cli("summarize-file", r"notes.txt is a file, not a run folder", "summarize", "{root}/notes.txt"),
    cli("report-file", r"notes.txt is a file, not a run folder", "report", "{root}/notes.txt"),
    cli("data-dir-file", r"--data-dir .*notes.txt is a file, not a folder", *E, "--task", "gsm8k", "--data-dir",
        "{root}/notes.txt", "--budgets", "128"),
    cli("eval-output-dir-dangling", r"--output-dir .*out is a symbolic link to nothing", "eval", "--output-dir",
        "{tmp}/out", "--budgets", "128", setup=_dangling),
    cli("bench-out-file", r"--out .*notes.txt is a file, not a folder", "bench", "--out", "{root}/notes.txt"),
    cli("inspect-out-dangling", r"--out .*out is a symbolic link to nothing", "inspect", "hi", "--out", "{tmp}/out",
        setup=_dangling),
    cli("sweep-unknown-task", r"--tasks: unknown task 'nosuch': choose from retrieval, ", "analyze", "sweep", "--tasks",
        "nosuch"),
    # -- tracebacks before (issue 40): a linear-attention hybrid is supported by the analyses ------------------------
    cli("inspect-hybrid", None, "inspect", "hi", "--model", "{hybrid}", "--budget", "24", "--window", "8",
        "--max-new-tokens", "12", "--out", "{tmp}/insp", code=0, check=_check_inspect_hybrid),
    cli("randomness-hybrid", None, "analyze", "randomness", "--model", "{hybrid}", "--limit", "1", "--budget", "24",
        "--window", "8", "--seeds", "2", "--max-new-tokens", "24", "--loop-tokens", "0", "--out", "{tmp}/rand",
        code=0, check=_check_randomness_hybrid,
        setup=lambda c: c["monkeypatch"].setattr("vase.cli.err_console.print", lambda *a, **k: None)),  # progress
    # -- silent before (issue 40): each now one line -----------------------------------------------------------------
    api("cache-sinks-unprotected", r"^sinks \(8\) does nothing for 'h2o': it does not protect sinks .*add "
        r"protect_sinks=true", lambda c: cache(c, method="h2o", sinks=8), ValueError),
    cli("generate-sinks-unprotected", r"sinks \(100\) does nothing for 'tova'", *G, "--method", "tova", "-p",
        "sinks=100", "-m", "/nonexistent/model"),
    cli("eval-sinks-unprotected", r"snapkv: sinks \(2\) does nothing for 'snapkv'", *E, "--methods", "snapkv",
        "--budgets", "128", "-p", "sinks=2", "-m", "/nonexistent/model"),
    cli("param-twice", r"--param sinks is given twice \(-p sinks=2 and -p sinks=3\): give it once", *G, "-p",
        "sinks=2", "-p", "sinks=3", "-m", "/nonexistent/model"),
    cli("config-key-twice-yaml", r"dup.yaml: the key 'limit' is given twice \(line 3\)", *E, "-c",
        "{root}/dup.yaml", "-m", "/nonexistent/model"),
    cli("config-key-twice-nested", r"dup-nested.yaml: the key 'n_large' is given twice", *E, "-c",
        "{root}/dup-nested.yaml", "-m", "/nonexistent/model"),
    cli("config-key-twice-json", r"dup.json: the key 'limit' is given twice", *E, "-c", "{root}/dup.json", "-m", "/nonexistent/model"),
    cli("question-field-without-file", r"question_field \(--question-field\) is not read by 'arith', a task "
        r"generated in vase", *E, "--question-field", "q", "-m", "/nonexistent/model"),
    cli("data-dir-on-arith", r"data_dir \(--data-dir\) is not read by 'arith'", *E, "--data-dir", "{root}", "-m", "/nonexistent/model"),
    cli("data-dir-with-task-file", r"data_dir \(--data-dir\) is not read with a task file", *E, "--task-file",
        "{root}/good.jsonl", "--data-dir", "{root}", "-m", "/nonexistent/model"),
    cli("randomness-loop-tokens-negative", r"--loop-tokens must be >= 0, got -1", "analyze", "randomness",
        "--loop-tokens", "-1", "-m", "/nonexistent/model"),
    cli("randomness-seeds-huge", r"--seeds must be in 1..256 .*got 99999999999", "analyze", "randomness", "--seeds",
        "99999999999", "-m", "/nonexistent/model"),
    cli("report-config-not-json", r"run/config.json is not valid JSON at line 1, column 2: it holds the run's "
        r"settings", "report", "{tmp}/run", setup=lambda c: (_samples(c, [GOOD]), _write_run(c["tmp"], "run", "{oops"))),
    cli("summarize-config-not-object", r"run/config.json holds list, not the run's settings", "summarize", "{tmp}/run",
        setup=lambda c: (_samples(c, [GOOD]), _write_run(c["tmp"], "run", "[1]"))),
    cli("sweep-out-empty", r"--out '.' is the current folder: give a folder of its own", "analyze", "sweep", "--out",
        "", "-m", "/nonexistent/model"),
    api("cache-max-length-negative", r"^max_length must be a positive number of tokens, got -1$",
        lambda c: cache(c, method="full", budget=None, max_length=-1), ValueError),
    api("cache-max-length-float", r"^max_length must be an integer, got 2.5", lambda c: cache(c, max_length=2.5),
        TypeError),
    # -- unclear before (issue 40): the line names the flag, variable, file, row or setting ------------------------
    cli("seed-most-negative", r"--seed -9223372036854775808 is too small \(at least -9223372036854775807\)", *G,
        "--seed=-9223372036854775808"),
    api("api-seed-most-negative", r"seed -9223372036854775808 is too small", lambda c: cache(c, seed=-(2**63)),
        ValueError),
    cli("config-kv-bits-top", r"'kv_bits' is a method's setting, not the run's: put it under method_params", *E, "-c",
        "{root}/kv-bits-top.yaml"),
    cli("regimes-empty", r"--regimes is empty \(''\): give a comma-separated list, e.g. --regimes ample,tight", "bench",
        "--engine", "vllm", "--regimes", ""),
    api("dist-timeout-abc", r"VASE_DIST_TIMEOUT_S='abc' is not a positive number of seconds", _dist_timeout_abc,
        ValueError),
    cli("eval-question-too-long", r"problem 'long-question-0001' \(row 2 of .*long-question.jsonl\) is \d+ tokens, "
        r"longer than the model's context", *E, "--model", "{chat}", "--task-file", "{root}/long-question.jsonl",
        "--methods", "snapkv", "--budgets", "24", "--window", "8", "--max-new-tokens", "4", "--batch-size", "1",
        "--device", "cpu"),
    cli("eval-run-name-is-a-file", r"the run folder .*runs/mine is a file: give the run another name", *E, "-c",
        "{root}/named.yaml", "--model", "{chat}", "--methods", "snapkv", "--budgets", "24", "--window", "8",
        "--limit", "1", "--max-new-tokens", "4", "--device", "cpu", setup=_run_name_file),
    api("compiled-full-kv-bits", r"method 'full' with kv_bits=4 has no compiled form: .*drop kv_bits",
        lambda c: vase.CompiledEvictionCache(c["tiny"][0], "full", None, 8, kv_bits=4), ValueError),
    cli("sweep-retrieval-tokens-zero", r"--retrieval-tokens must be >= 1, got 0", "analyze", "sweep",
        "--retrieval-tokens", "0", "-m", "/nonexistent/model"),  # was reported as max_new_tokens
    cli("sweep-compressions-twice", r"--compressions lists 2 twice: give each once", "analyze", "sweep",
        "--compressions", "2,2", "-m", "/nonexistent/model"),
    # -- the Python API: types at the door -------------------------------------------------------------------------------
    api("cache-budget-str", r"^budget must be an integer, got 'abc' \(str\)$", lambda c: cache(c, budget="abc"),
        TypeError),
    api("cache-budget-float", r"^budget must be an integer, got 40.5 \(float\)$", lambda c: cache(c, budget=40.5),
        TypeError),
    api("cache-budget-bool", r"^budget must be an integer, got True", lambda c: cache(c, budget=True), TypeError),
    api("cache-method-int", r"^method must be a method name .* got 123 \(int\)$", lambda c: cache(c, method=123),
        TypeError),
    api("cache-method-none", r"^method must be a method name .* got None", lambda c: cache(c, method=None), TypeError),
    api("cache-window-zero", r"window must be a positive number of tokens, got 0", lambda c: cache(c, window=0),
        ValueError),
    api("cache-window-str", r"window must be an integer, got '8'", lambda c: cache(c, window="8"), TypeError),
    api("cache-budget-small", r"budget \(12\) must be larger than window \+ protected sinks \(12 \+ 0\)",
        lambda c: cache(c, budget=12, window=12), ValueError),
    api("cache-unknown-method", r"unknown method 'snapk'", lambda c: cache(c, method="snapk"),
        UnknownMethodError),
    api("cache-unknown-param", r"takes no parameter 'rank'", lambda c: cache(c, rank=3), UnknownMethodError),
    api("cache-param-type", r"parameter sample must be true or false, got 'yes'", lambda c: cache(c, sample="yes"),
        (TypeError, ValueError)),
    api("cache-second-generate", r"already holds a generation .*one-shot.*cache.reset\(\)", _second_generate,
        EvictedStateError),
    api("cache-crop", r"cannot be cropped: evicted tokens cannot be restored", _crop, EvictedStateError),
    api("generate-prompts-none", r"^prompts must be a string or a list of strings, got None", lambda c: gen(c, None),
        TypeError),
    api("generate-prompts-int", r"prompts must be a string or a list of strings, got 5", lambda c: gen(c, 5),
        TypeError),
    api("generate-prompts-empty", r"prompts is empty", lambda c: gen(c, []), ValueError),
    api("generate-prompt-item", r"prompts\[1\] must be a string, got None", lambda c: gen(c, ["a", None]),
        TypeError),
    api("generate-top-k-negative", r"top_k must be >= 1 .*got -1", lambda c: gen(c, "a", top_k=-1), ValueError),
    api("generate-top-k-float", r"top_k must be an integer, got 2.5", lambda c: gen(c, "a", top_k=2.5), TypeError),
    api("generate-top-p", r"top_p must be in \(0, 1\], got 0", lambda c: gen(c, "a", top_p=0), ValueError),
    api("generate-temperature-str", r"temperature must be a finite number, got 'hot'",
        lambda c: gen(c, "a", temperature="hot"), TypeError),
    api("generate-max-new-zero", r"max_new_tokens must be >= 1, got 0", lambda c: gen(c, "a", max_new_tokens=0),
        ValueError),
    api("generate-seed-count", r"seed lists 2 seeds for 1 prompts", lambda c: gen(c, "a", seed=[1, 2]), ValueError),
    api("generate-seed-str", r"seed must be an integer, got 'x'", lambda c: gen(c, "a", seed="x"), TypeError),
    api("generate-greedy-str", r"greedy must be True or False, got 'yes'", lambda c: gen(c, "a", greedy="yes"),
        TypeError),
    api("generate-empty-prompt", r"prompt 1 \(''\) encodes to no tokens", lambda c: gen(c, ["abc", ""]), ValueError),
    api("generate-budget-float", r"budget must be an integer, got 40.5", lambda c: gen(c, "a", budget=40.5),
        TypeError),
    api("generate-param", r"parameter n_large must be an integer \(or unset\), got 1.5",
        lambda c: gen(c, "a", n_large=1.5), (TypeError, ValueError)),
    api("policy-param-bool", r"parameter sinks must be an integer, got True",
        lambda c: get_policy("vase-attnv", sinks=True), (TypeError, ValueError)),
    # -- the eval config, the store and the model cache from Python -------------------------------------------------------
    api("api-config-name-traversal", r"name must be one folder name", lambda c: EvalConfig(
        name="../../x", budgets=[128]), ConfigError),
    api("config-budgets", r"budgets must be integers", lambda c: EvalConfig(budgets=["abc"]),
        ConfigError),
    api("store-locked", r"is being written by another process", _store_locked, StoreError),
    api("store-deleted", r"was deleted or moved while this run was writing to it", _store_deleted,
        StoreError),
    api("store-file-too-large", r"cannot write to .*samples.rank0.jsonl: File too large", _store_efbig,
        StoreError, check=_check_store_kept_first),
    # -- nothing lost: the store never follows a link, never cuts a complete line, notices an emptied file ----------
    api("store-symlink", r"samples.rank0.jsonl is a symbolic link: .*remove the link", _store_symlink, StoreError,
        check=_check_target_intact),
    api("store-dangling-symlink", r"samples.rank0.jsonl is a symbolic link", lambda c: _store_symlink(c, True),
        StoreError, check=lambda c: not (c["tmp"] / "precious.txt").exists()),
    api("store-folder", r"samples.rank0.jsonl is a folder, not a results file", _store_folder, StoreError),
    api("store-complete-bad-line", r"samples.rank0.jsonl: line 2 is not a valid record", _store_complete_bad_line,
        StoreError, check=_check_bad_line_kept),
    api("store-emptied", r"samples.rank0.jsonl was emptied or truncated while this run was writing", _store_emptied,
        StoreError),
    api("store-enospc", r"^cannot write to .*samples.rank0.jsonl: No space left on device; every earlier record is "
        r"saved", _store_enospc, StoreError, check=_check_enospc),
    cli("run-disk-full", r"cannot write to .*samples.rank0.jsonl: No space left on device; .*rerun the same command",
        *EVAL_TINY, setup=_setup_run_full_disk, check=_check_run_full_disk),
    cli("run-samples-no-config", r"runs/r holds samples.rank0.jsonl but no config.json", *E, "-c", "{tmp}/named.yaml",
        setup=_setup_orphan_samples, check=_check_orphan_kept),
    cli("run-samples-emptied", r"samples.rank0.jsonl was emptied or truncated while this run was writing",
        *EVAL_TINY, setup=_setup_emptied),
    api("load-missing", r"no such file or directory: /nonexistent", lambda c: load_model("/nonexistent"),
        ModelLoadError),
    api("load-dtype", r"unknown dtype 'int8'", lambda c: load_model(c["plain"], dtype="int8"),
        ModelLoadError),
    api("fingerprint-missing", r"no such file or directory: /nonexistent",
        lambda c: model_fingerprint("/nonexistent"), ModelLoadError),
]


# ----------------------------------------------------------------------------- the test


def run_cli(argv: list[str], ctx: dict, stdin: bytes | None = None) -> tuple[int, str, str]:
    capsys, monkeypatch = ctx["capsys"], ctx["monkeypatch"]
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    return run_main(argv, capsys)


def test_the_table_has_every_case():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 95


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, world, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in the repository (e.g. runs/)
    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "cache"))
    ctx = {**world, "tmp": tmp_path, "tiny": tiny, "capsys": capsys, "monkeypatch": monkeypatch}
    if case.setup is not None:
        case.setup(ctx)
    if case.argv is not None:
        argv = [a.format(**ctx) for a in case.argv]
        code, out, err = run_cli(argv, ctx, case.stdin)
        lines = err.strip().splitlines()
        warned = [line for line in lines if line.startswith("vase: warning: ")]
        lines = [line for line in lines if not line.startswith("vase: warning: ")]
        assert code == case.code, (code, err)
        assert "Traceback" not in out + err
        if case.warn is None:
            assert not warned, warned
        else:
            assert len(warned) == 1 and re.search(case.warn, warned[0]), err  # one warning, naming the flag
        if case.expect is None:  # a legal value: the command runs, with its warning
            assert not lines, err
        else:
            assert len(lines) == 1, err  # one line, nothing else on stderr
            assert lines[0].startswith(("vase: error: ", "vase: interrupted")), lines[0]
            assert re.search(case.expect, lines[0]), lines[0]
            assert "results:" not in out  # never reports a result it did not produce
    elif case.expect is None:  # a legal call that must warn once
        with pytest.warns(UserWarning) as record:
            case.api(ctx)
        messages = [str(w.message) for w in record]
        assert len(messages) == 1 and re.search(case.warn, messages[0]), messages
        assert len(messages[0].strip().splitlines()) == 1
    else:
        with pytest.raises(case.error) as info:
            case.api(ctx)
        message = str(info.value)
        assert len(message.strip().splitlines()) == 1, message
        assert re.search(case.expect, message), message
    if case.check is not None:
        assert case.check(ctx) is not False


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        main(["generate", "hi", "--top-k", "0", "--debug"])


def test_reset_makes_a_filled_cache_reusable(tiny):
    """The documented way to reuse a cache: reset() gives exactly what a fresh cache gives."""
    model, tok = tiny
    enc = tok(["hello world, hello"], return_tensors="pt")
    kw = dict(max_new_tokens=40, do_sample=False)
    c = vase.EvictionCache(model, method="vase-attnv", budget=24, window=8, seed=3)
    first = model.generate(**enc, **vase.cache_kwargs(c), **kw)
    assert c.stats()["evictions"] > 0
    with pytest.raises(EvictedStateError, match="one-shot"):
        model.generate(**enc, **vase.cache_kwargs(c), **kw)
    c.reset()
    again = model.generate(**enc, **vase.cache_kwargs(c), **kw)
    fresh = model.generate(**enc, **vase.cache_kwargs(vase.EvictionCache(model, method="vase-attnv", budget=24, window=8, seed=3)),
                           **kw)
    assert torch.equal(again, first) and torch.equal(fresh, first)
