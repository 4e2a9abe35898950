"""The run store: nothing lost, nothing silent (deleted/moved/replaced files, write errors, atomic files)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

import pytest

from tests.helpers_tiny import tiny_model_and_tokenizer
from vase.eval.config import EvalConfig
from vase.eval.runner import RunConflictError, run_eval, write_run_config
from vase.eval.store import (
    SAMPLE_KEY,
    JsonlStore,
    StoreError,
    atomic_write_text,
    create_once,
    read_all,
    read_jsonl,
)
from vase.generation.generate import GenerationOutput


def rec(i: int, method: str = "full") -> dict:
    return {"method": method, "budget": None, "problem_id": f"p{i}", "sample": 0, "x": i}


def test_deleted_file_stops_the_next_append(tmp_path):
    path = tmp_path / "run" / "samples.rank0.jsonl"
    with pytest.raises(StoreError, match="deleted or moved"):
        with JsonlStore(path) as store:
            assert store.append(rec(0))
            shutil.rmtree(path.parent)
            store.append(rec(1))


def test_moved_folder_is_noticed_even_after_the_last_append(tmp_path):
    path = tmp_path / "run" / "samples.rank0.jsonl"
    with pytest.raises(StoreError, match="deleted or moved"):
        with JsonlStore(path) as store:
            store.append(rec(0))
            os.rename(path.parent, tmp_path / "elsewhere")
    assert read_jsonl(tmp_path / "elsewhere" / path.name) == [rec(0)]  # nothing written after the move


def test_replaced_file_is_noticed(tmp_path):
    path = tmp_path / "samples.rank0.jsonl"
    with JsonlStore(path) as store:
        store.append(rec(0))
        os.rename(path, tmp_path / "old.jsonl")  # the old file lives on, so the new one has another inode
        path.write_text("")
        with pytest.raises(StoreError, match="replaced by another file"):
            store.append(rec(1))
        os.replace(tmp_path / "old.jsonl", path)  # put it back: the store goes on
        assert store.append(rec(1))
    assert read_jsonl(path) == [rec(0), rec(1)]


def test_write_error_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "samples.rank0.jsonl"
    with JsonlStore(path) as store:
        store.append(rec(0))

        def full_disk(fd):
            raise OSError(errno.EFBIG, "File too large")

        monkeypatch.setattr(os, "fsync", full_disk)
        with pytest.raises(StoreError, match=f"cannot write to {path}: File too large"):
            store.append(rec(1))
        monkeypatch.undo()
        assert rec(1)["problem_id"] not in {k[2] for k in store.keys}  # not counted as stored


def test_record_missing_key_fields_is_named(tmp_path):
    (tmp_path / "samples.rank0.jsonl").write_text(json.dumps(rec(0)) + "\n" + json.dumps({"problem_id": "p1"}) + "\n")
    with pytest.raises(StoreError, match=r"record 2 lacks the field\(s\) 'method', 'budget', 'sample'"):
        read_all(tmp_path)


def test_atomic_write_and_create_once(tmp_path):
    path = tmp_path / "summary.csv"
    atomic_write_text(path, "a\n")
    atomic_write_text(path, "b\n")
    assert path.read_text() == "b\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.csv"]  # no temp left behind
    cfg = tmp_path / "config.json"
    assert create_once(cfg, "first") and not create_once(cfg, "second")
    assert cfg.read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "summary.csv"]


def test_files_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a", "x")
        create_once(tmp_path / "b", "x")
        with JsonlStore(tmp_path / "samples.rank0.jsonl") as s:
            s.append(rec(0))
    finally:
        os.umask(old)
    for name in ("a", "b", "samples.rank0.jsonl"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


def test_config_json_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(RunConflictError, match="not a vase run config"):
        write_run_config(tmp_path, {"identity": {}})


# ----------------------------------------------------------------------------- through the runner


def fake_generate(model, tokenizer, prompts, *, seed, **kw):
    return GenerationOutput(texts=["\\boxed{1}"] * len(prompts), token_ids=[[3, 4]] * len(prompts),
                            prompt_lengths=[5] * len(prompts), finished=[True] * len(prompts), seconds=0.01,
                            prefill_seconds=0.001, stats={})


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer()


def test_run_folder_deleted_mid_run_stops_with_an_error(tmp_path, tiny):
    model, tok = tiny
    cfg = EvalConfig(task="arith", limit=4, methods=["snapkv"], budgets=[24], window=8, batch_size=1,
                     model="tiny", output_dir=str(tmp_path), name="r")
    calls = []

    def deleting(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            shutil.rmtree(tmp_path / "r")
        return fake_generate(*a, **kw)

    with pytest.raises(StoreError, match="deleted or moved"):
        run_eval(cfg, model, tok, generate_fn=deleting, progress=False)
    assert len(calls) == 2  # stopped at the first append after the deletion
    # Rerunning redoes everything that was lost, exactly once.
    run_dir = run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)
    keys = [tuple(r[k] for k in SAMPLE_KEY) for r in read_all(run_dir)]
    assert len(keys) == len(set(keys)) == 4 * 2


def test_failed_summary_is_an_error_and_leaves_no_old_summary(tmp_path, tiny, monkeypatch):
    model, tok = tiny
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[24], window=8, model="tiny",
                     output_dir=str(tmp_path), name="r")
    run_dir = run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)
    assert (run_dir / "summary.csv").exists()

    import vase.eval.report as report

    def broken(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "summarize", broken)
    with pytest.raises(RuntimeError, match="writing the summary .* failed"):
        run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)
    assert not (run_dir / "summary.csv").exists() and not (run_dir / "summary.md").exists()


# ----------------------------------------------------------------------------- run identity


def test_resume_with_another_model_is_refused_naming_the_field(tmp_path, monkeypatch):
    from tests.helpers_tiny import tiny_model, tiny_tokenizer

    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    tok = tiny_tokenizer()
    tiny_model(len(tok), seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[24], window=8, model=str(model_dir),
                     output_dir=str(tmp_path / "runs"), device="cpu")
    run_dir = run_eval(cfg, generate_fn=fake_generate, progress=False)
    saved = json.loads((run_dir / "config.json").read_text())["identity"]
    assert saved["resolved_dtype"] == "float32" and saved["device"] == "cpu" and saved["attn_kernel"] == "sdpa"
    assert len(saved["model_sha256"]) == 64 and saved["torch"] and saved["transformers"]
    # Same folder, other weights: the same run name, refused naming the field.
    tiny_model(len(tok), seed=1).save_pretrained(model_dir)
    with pytest.raises(RunConflictError, match="model_sha256"):
        run_eval(cfg, generate_fn=fake_generate, progress=False)
    tiny_model(len(tok), seed=0).save_pretrained(model_dir)
    run_eval(cfg, generate_fn=fake_generate, progress=False)  # the original weights resume fine
    # The same command under another transformers: refused, naming it.
    import transformers

    monkeypatch.setattr(transformers, "__version__", "9.9.9")
    with pytest.raises(RunConflictError, match="transformers: '.*' -> '9.9.9'"):
        run_eval(cfg, generate_fn=fake_generate, progress=False)
    monkeypatch.undo()
    # A typed setting that differs names another run (a new folder), as before.
    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "cache"))
    other = run_eval(EvalConfig(**{**cfg.to_dict(), "dtype": "bfloat16"}), generate_fn=fake_generate, progress=False)
    assert other != run_dir
    assert json.loads((other / "config.json").read_text())["identity"]["resolved_dtype"] == "bfloat16"


def test_passed_model_objects_are_identified_by_their_weights(tmp_path, tiny):
    from tests.helpers_tiny import tiny_model

    model, tok = tiny
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[24], window=8, model="tiny",
                     output_dir=str(tmp_path))
    run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)
    run_eval(cfg, tiny_model(len(tok), seed=0), tok, generate_fn=fake_generate, progress=False)  # equal weights
    with pytest.raises(RunConflictError, match="model_sha256"):
        run_eval(cfg, tiny_model(len(tok), seed=3), tok, generate_fn=fake_generate, progress=False)
