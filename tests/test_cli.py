"""The `vase` command on a tiny local model: errors, streaming, --compare, stdin prompts."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import vase
from vase.cli import main
from vase.eval.paired import first_divergence


def run_cli(args, capsys, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as exit_info:
        main(args)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--budget", "abc"], "Invalid value for '--budget'"),
    (["generate", "hi", "--method", "snapk"], "Did you mean snapkv"),
    (["generate", "hi", "-p", "rank"], "--param takes KEY=VALUE"),
    (["generate", "hi", "--method", "snapkv", "-p", "rank=3"], "takes no parameter 'rank'"),
    (["generate"], "give a PROMPT"),
    (["generate", "--file", "/nonexistent/prompts.txt"], "no such prompt file"),
    (["frobnicate"], "No such command"),
])
def test_argument_errors_give_one_line_and_nonzero_exit(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("vase: error:")
    assert "Traceback" not in err + out


def test_bad_budget_for_window_is_one_line_before_generation(model_dir, capsys):
    code, _, err = run_cli(["generate", "hi", "--model", model_dir, "--budget", "20", "--window", "64"], capsys)
    assert code == 1 and "must be larger than window" in err and len(err.strip().splitlines()) == 1


def test_help_on_each_subcommand(capsys):
    for sub in ([], ["generate"], ["methods"], ["eval"], ["summarize"], ["bench"]):
        code, out, _ = run_cli([*sub, "--help"], capsys)
        assert code == 0 and "Usage" in out


def test_methods_lists_every_method_with_parameters(capsys):
    code, out, _ = run_cli(["methods"], capsys)
    assert code == 0
    for name in vase.method_names():
        assert name in out
    assert "n_large" in out and "rkv_lambda" in out


def test_generate_streams_and_summarises(model_dir, capsys):
    code, out, _ = run_cli(["generate", "abc", "--model", model_dir, "--budget", "24", "--window", "8",
                            "--max-new-tokens", "40", "--greedy", "--no-chat"], capsys)
    assert code == 0
    assert "vase-attnv:" in out and "tok/s" in out and "evictions" in out and "KV held" in out


def test_compare_reports_the_first_divergence(model_dir, capsys):
    from vase.models import load_model

    model, tok = load_model(model_dir)
    kwargs = dict(budget=24, window=8, max_new_tokens=60, greedy=True, chat_template=False, seed=[0])
    a = vase.generate(model, tok, ["hello there"], method="snapkv", **kwargs)
    b = vase.generate(model, tok, ["hello there"], method="full", **kwargs)
    expected = first_divergence(a.token_ids[0], b.token_ids[0])
    assert expected is not None  # eviction changed the output of this tiny model
    code, out, _ = run_cli(["generate", "hello there", "--model", model_dir, "--method", "snapkv", "--compare",
                            "full", "--budget", "24", "--window", "8", "--max-new-tokens", "60", "--greedy",
                            "--no-chat"], capsys)
    assert code == 0 and f"snapkv and full diverge at token {expected} " in out

    code, out, _ = run_cli(["generate", "hello there", "--model", model_dir, "--method", "snapkv", "--compare",
                            "full", "--budget", "400", "--window", "8", "--max-new-tokens", "30", "--greedy",
                            "--no-chat"], capsys)
    assert code == 0 and "snapkv and full produced identical tokens" in out


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_prompts_from_stdin_are_batched(model_dir, capsys, monkeypatch):
    code, out, _ = run_cli(["generate", "-", "--model", model_dir, "--budget", "24", "--window", "8",
                            "--max-new-tokens", "12", "--greedy", "--no-chat", "--batch-size", "2"],
                           capsys, stdin="first prompt\n\nsecond one\nthird\n", monkeypatch=monkeypatch)
    assert code == 0
    assert "prompt 1" in out and "prompt 2" in out and "prompt 3" in out
    assert out.count("vase-attnv:") == 2  # two batches: [1, 2] and [3]


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "vase.cli", "methods"], capture_output=True, text=True)
    assert result.returncode == 0 and "vase-attnv" in result.stdout


def test_ctrl_c_during_eval_says_how_to_resume(tmp_path):
    """A real SIGINT to `vase eval`: one line saying the same command resumes, exit 130, samples kept."""
    import os
    import signal
    import time
    from pathlib import Path

    from tests.helpers_tiny import tiny_model_and_tokenizer
    from vase.eval.store import read_all

    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    argv = [sys.executable, "-m", "vase.cli", "--threads", "1", "eval", "--model", str(tmp_path / "model"), "--task",
            "arith", "--limit", "400", "--methods", "snapkv", "--budgets", "24", "--window", "8", "--max-new-tokens",
            "40", "--batch-size", "1", "--device", "cpu", "--output-dir", str(tmp_path / "runs")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    # Earlier tests in the same pytest process may leave SIGINT ignored or blocked (children inherit both, and
    # Python then installs no KeyboardInterrupt handler): give the child what a terminal's Ctrl-C meets.
    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # wait for the first finished sample
        files = list((tmp_path / "runs").glob("*/samples.rank0.jsonl"))
        if files and files[0].stat().st_size > 0:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == ("vase: interrupted; every finished sample is saved: run the same "
                                            "command again to resume")
    assert "Traceback" not in err
    [run_dir] = (tmp_path / "runs").iterdir()
    # What finished is there, and the run really was cut short (800 samples: far more than can finish between
    # the first saved sample and the signal, even on an idle machine).
    assert 0 < len(read_all(run_dir)) < 400 * 2


# ----------------------------------------------------------------------------- a CLI that answers at once

#: Commands that must finish without importing transformers or vLLM: help, listings, and every refusal that
#: needs no model (issue 16). Each runs in a fresh interpreter, which then lists what it imported.
NO_MODEL_COMMANDS = [
    ["--help"], ["methods"], ["eval", "--help"], ["generate", "--help"], ["bench", "--help"], ["serve", "--help"],
    ["analyze", "sweep", "--help"], ["summarize", "--help"],
    ["generate", "hi", "-p", "sinks=abc"], ["generate", "hi", "--budget", "20"], ["generate", "hi", "--kv-bits", "5"],
    ["generate", "hi", "--budget", "99999999999999999999"], ["--threads", "0", "methods"],
    ["eval", "--budgets", "20"], ["eval", "--methods", "snapk"], ["eval", "-c", "/nonexistent.yaml"],
    ["eval", "--budgets", ""], ["summarize", "/nonexistent"], ["report", "/nonexistent"],
    ["bench", "--budgets", "20"], ["inspect", "hi", "--budget", "10"],
    ["analyze", "randomness", "--budget", "18", "--window", "16"], ["analyze", "sweep", "--tasks", "nosuch"],
    ["serve", "--budget", "8"],
]

_LIST_IMPORTS = """
import json, sys
from vase.cli import main
for args in json.loads(sys.argv[1]):  # one interpreter for all: imports only accumulate, so none may be heavy
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "vllm"))
    print(json.dumps({"args": args, "code": code, "heavy": heavy[:5]}), flush=True)
"""


def test_no_model_commands_import_neither_transformers_nor_vllm():
    import json

    proc = subprocess.run([sys.executable, "-c", _LIST_IMPORTS, json.dumps(NO_MODEL_COMMANDS)], capture_output=True,
                          text=True, timeout=300)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"args"')]
    assert [r["args"] for r in results] == NO_MODEL_COMMANDS, proc.stderr[-500:]
    for r in results:
        assert r["heavy"] == [], r  # the first command that imported transformers or vLLM
        help_like = "--help" in r["args"] or r["args"] == ["methods"]
        assert (r["code"] == 0) == help_like, r
