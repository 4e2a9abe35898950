"""The defects and audit classes of issue 28, one test each: what used to be checked against the wrong values,
clamped silently, computed several ways, or answered with a line that names the wrong flag (or a traceback).

Every CLI case here fails before a model loads or vLLM starts (a model path that does not exist, or the engine's
start replaced by a marker), so the file runs in seconds.
"""

from __future__ import annotations

import json
import re
import sys

import importlib.util

import pytest

import vase
import vase.vllm
from tests.conftest import run_main, tiny_model, tiny_tokenizer
from vase.caches.eager import EvictionCache

MISSING = "/nonexistent/model"


HAS_VLLM = importlib.util.find_spec("vllm") is not None

class Reached(Exception):
    """Raised where a request goes past its checks (instead of starting vLLM or a server)."""


def _raise_reached(*args, **kwargs):
    raise Reached("reached")


def cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """Exit code and stderr's lines (warnings and vase serve's progress lines left out)."""
    code, _, err = run_main(argv, capsys)
    err = err.strip().splitlines()
    return code, [ln for ln in err if not ln.startswith(("vase: warning", "vase serve: "))]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "cache"))


# ----------------------------------------------------------------------------- defects


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (the vLLM doors check once vLLM is importable)")
def test_generate_on_vllm_checks_the_users_budget_window_and_method(capsys, monkeypatch):
    """`vase generate --engine vllm` validated eval's default budgets [512] and method vase-attnv instead."""
    monkeypatch.setattr("vase.engines.vllm.VllmEngine.start", _raise_reached)
    code, err = cli(["generate", "--engine", "vllm", "--budget", "4096", "--window", "512", "--method", "snapkv",
                     "hi"], capsys)
    assert err == ["vase: error: Reached: reached (a bug in vase? rerun with --debug for the traceback)"], err
    # and the user's own budget is the one refused, naming the user's numbers
    code, err = cli(["generate", "--engine", "vllm", "--budget", "516", "--window", "512", "hi"], capsys)
    assert code == 1 and err == ["vase: error: budget (516) must be larger than window + protected sinks (512 + 4): "
                                 "raise --budget or lower --window"], err


@pytest.mark.parametrize("n_large", [600, 449])  # past B, and past B - w = 448 (clamped by reserve_size before)
def test_the_reserve_rule_is_the_librarys(n_large, capsys, monkeypatch):
    """n_large and quant_guard beyond what the budget leaves were refused by the CLI and eval only; the cache,
    vase.vllm.additional_config, the plugin's parsing and `vase serve` clamped them silently."""
    want = f"n_large ({n_large}) is larger than the budget leaves for old tokens (B - w = 512 - 64 = 448)"
    with pytest.raises(ValueError, match=re.escape(want)):
        EvictionCache(None, "snapkv", 512, 64, num_layers=1, n_large=n_large)
    with pytest.raises(ValueError, match=re.escape(want)):
        vase.vllm.additional_config("snapkv", 512, 64, n_large=n_large)
    with pytest.raises(ValueError, match=re.escape(want)):
        vase.vllm.VaseVllmConfig.from_additional_config({"vase": {"method": "snapkv", "budget": 512,
                                                                  "n_large": n_large}})
    import vase.vllm.serve as sv

    monkeypatch.setattr(sv, "run_serve", _raise_reached)
    monkeypatch.setattr(sv, "exec_serve", _raise_reached)
    code, err = cli(["serve", "--method", "snapkv", "--budget", "512", "-p", f"n_large={n_large}"], capsys)
    assert code == 1 and len(err) == 1 and want in err[0], err
    EvictionCache(None, "snapkv", 512, 64, num_layers=1, n_large=448)  # exactly what is left: fine


def test_quant_guard_past_the_budget_is_refused_by_the_cache():
    with pytest.raises(ValueError, match=re.escape("quant_guard (600) is larger than the budget (512)")):
        EvictionCache(None, "snapkv", 512, 64, num_layers=1, kv_bits=4, quant_guard=600)
    EvictionCache(None, "snapkv", 512, 64, num_layers=1, kv_bits=4, quant_guard=512)
    EvictionCache(None, "full", 512, 64, num_layers=1, kv_bits=4, quant_guard=600)  # full keeps every old token


def test_full_gets_one_placeholder_budget():
    """The budget of `full` was computed four ways (max(512, w + 8), 512, w + 1, prompt + new tokens)."""
    from pathlib import Path

    from vase.core.schedule import placeholder_budget

    cache = EvictionCache(None, "full", None, 16, num_layers=1)
    assert cache.cfg.budget == placeholder_budget(16)
    with pytest.raises(ValueError, match="method 'snapkv' needs a budget"):
        EvictionCache(None, "snapkv", None, 16, num_layers=1)
    src = Path(vase.__file__).parent
    formulas = [f"{p.relative_to(src)}: {line.strip()}" for p in src.rglob("*.py") for line in p.read_text().splitlines()
                if re.search(r"max\(512, (c\.)?window \+ 8\)|budget or max\(window \+ 1|budget if budget is not None "
                             r"else prompt_length", line)]
    assert formulas == []


def test_quest_check_says_what_it_does():
    """Quest.check promised a page/window check and only called super(): the page/window rule it promised is not
    needed (pages are scored on the tokens before the window, so any window is exact: test_quest's chunk test runs
    a window shorter than a page), so Quest keeps the contract's check and the budget rule is its only rule."""
    from vase.core.policies import Quest, get_policy

    assert "check" not in vars(Quest)
    quest = get_policy("quest")
    quest.check(quest.sinks + 8 + 1, 8)  # a window (8) shorter than a page (16): accepted, as it runs exactly
    with pytest.raises(ValueError, match=r"window \+ protected sinks \(8 \+ 4\)"):
        quest.check(12, 8)


def test_kv_bits_is_one_rule_with_one_message(capsys):
    """kv_bits was spelled --kv-bits (generate, bench) and -p kv_bits= (eval), checked three times, three messages."""
    want = "kv_bits must be 16 (no quantization) or one of 8, 4, 2; got 3"
    with pytest.raises(ValueError) as api:
        EvictionCache(None, "snapkv", 512, 64, num_layers=1, kv_bits=3)
    assert str(api.value) == want
    for argv in (["generate", "hi", "--kv-bits", "3"], ["generate", "hi", "-p", "kv_bits=3"],
                 ["bench", "--kv-bits", "3"], ["bench", "-p", "kv_bits=3"],
                 ["eval", "--methods", "snapkv", "--budgets", "128", "-p", "kv_bits=3"],
                 ["eval", "--methods", "snapkv", "--budgets", "128", "--kv-bits", "3"]):
        code, err = cli([*argv, "-m", MISSING], capsys)
        assert code == 1 and len(err) == 1 and err[0].endswith(want), (argv, err)


# ----------------------------------------------------------------------------- audit classes


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (the vLLM doors check once vLLM is importable)")
def test_serve_checks_what_generate_checks_without_starting_vllm(capsys, monkeypatch):
    import vase.vllm.serve as sv

    monkeypatch.setattr(sv, "run_serve", _raise_reached)
    monkeypatch.setattr(sv, "exec_serve", _raise_reached)
    for argv, want in ((["--budget", "99999999999"], "budget 99999999999 is too large (at most 2147483647)"),
                       (["--kv-bits", "4"], "quantized K/V storage (kv_bits) runs on the transformers engine only, not on vllm"),
                       (["-p", "kv_bits=4"], "runs on the transformers engine only, not on vllm"),
                       (["--method", "snapkv", "--budget", "512", "-p", "sample=maybe"],
                        "parameter sample must be true or false, got 'maybe'")):
        code, err = cli(["serve", *argv], capsys)
        assert code != 0 and len(err) == 1 and want in err[0], (argv, err)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (the vLLM doors check once vLLM is importable)")
def test_serve_start_up_failures_are_one_line(tmp_path):
    import socket

    from vase.vllm.serve import ServeError, run_serve

    fake = tmp_path / "fake_vllm.py"  # 40 lines of log and a traceback, as vLLM prints when its engine fails
    fake.write_text("import sys\nfor i in range(40): print('INFO starting', i)\n"
                    "def f(): raise ValueError('No available memory for the cache blocks: raise "
                    "--kv-cache-memory-bytes')\n"
                    "try: f()\nexcept ValueError: import traceback; traceback.print_exc()\n"
                    "print('RuntimeError: Engine core initialization failed. See root cause above.', file=sys.stderr)\n"
                    "sys.exit(1)\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(ServeError) as info:
        run_serve([sys.executable, str(fake), "--port", str(free)], log_path=str(tmp_path / "log"))
    assert str(info.value) == (f"vLLM stopped before it answered (exit status 1): ValueError: No available memory for "
                               f"the cache blocks: raise --kv-cache-memory-bytes (full log: {tmp_path / 'log'})")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServeError, match=rf"cannot listen on 127.0.0.1:{port} .*give another --port"):
            run_serve([sys.executable, str(fake), "--port", str(port)], log_path=str(tmp_path / "log2"))
    assert not (tmp_path / "log2").exists()  # refused before anything started


def test_inspect_runs_generates_checks(capsys, tmp_path):
    code, err = cli(["inspect", "hi", "--max-new-tokens", "99999999999", "-m", MISSING], capsys)
    assert code == 1 and err == ["vase: error: --max-new-tokens 99999999999 is too large (at most 2147483647)"], err
    from vase.analysis.inspect import inspect_generation

    model, tok = tiny_model(), tiny_tokenizer()
    long = " ".join(["word"] * 2100)  # past the tiny model's 2048-token context
    with pytest.raises(ValueError, match=r"prompt 0 is \d+ tokens, longer than the model's context \(2048 tokens"):
        inspect_generation(model, tok, long, tmp_path / "out", budget=24, window=8, max_new_tokens=4,
                           chat_template=False)
    assert not (tmp_path / "out").exists()  # refused before the folder is made
    with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
        inspect_generation(model, tok, "hi", tmp_path / "out", budget=24, window=8, max_new_tokens="4")


def test_the_python_api_refuses_what_the_cli_refuses():
    model, tok = tiny_model(), tiny_tokenizer()
    with pytest.raises(TypeError, match=r"^ignore_eos must be True or False, got 'no' \(str\)$"):
        vase.generate(model, tok, "hi", budget=24, window=8, max_new_tokens=2, ignore_eos="no")
    with pytest.raises(TypeError, match=r"^seed must be an integer, got '5' \(str\)$"):
        vase.generate(model, tok, "hi", budget=24, window=8, max_new_tokens=2, seed="5")
    with pytest.raises(TypeError, match="sort_kept must be True or False"):
        EvictionCache(None, "snapkv", 24, 8, num_layers=1, sort_kept="yes")
    with pytest.raises(TypeError, match=r"cache_kwargs takes a cache .* got \{'a': 1\} \(dict\)"):
        vase.cache_kwargs({"a": 1})


def test_flags_the_engine_ignores_are_refused(capsys):
    for argv, want in (
        (["generate", "hi", "--engine", "vllm", "--attn", "eager"],
         "an attention kernel choice (--attn) runs on the transformers engine only, not on vllm"),
        (["bench", "--engine", "vllm", "--kv-bits", "4"],
         "quantized K/V storage (kv_bits) runs on the transformers engine only, not on vllm"),
        (["bench", "--engine", "vllm", "--compile"],
         "a compiled decode step (compile) runs on the transformers engine only, not on vllm: drop --compile"),
        (["eval", "--engine", "vllm", "--attn", "eager", "--budgets", "128"],
         "an attention kernel choice (--attn) runs on the transformers engine only, not on vllm"),
    ):
        code, err = cli([*argv, "-m", MISSING] if argv[0] != "eval" else argv, capsys)
        assert code == 1 and len(err) == 1 and want in err[0], (argv, err)


def test_messages_name_the_right_flag(capsys, tmp_path):
    from vase.engines.vllm import check_fits

    with pytest.raises(ValueError, match=r"^prompt 1 is 30 tokens, longer than the model's context \(20 tokens"):
        check_fits([[1] * 5, [1] * 30], 4, 20)
    with pytest.raises(ValueError, match=r"passes the model's context \(20 tokens\), .*lower --max-new-tokens to 15"):
        check_fits([[1] * 5], 16, 20)
    code, err = cli(["analyze", "randomness", "--limit", "0", "-m", MISSING], capsys)
    assert err == ["vase: error: --limit must be >= 1 (problems to study), got 0"], err
    code, err = cli(["bench", "--random-init", "smollm2-135m", "--attn", "flash_attention_2", "--lengths", "4"],
                    capsys)
    assert code == 1 and len(err) == 1 and err[0].startswith("vase: error: --attn flash_attention_2: "), err
    (tmp_path / "c.yaml").write_text("output_dir: 5\nbudgets: [128]\n")
    code, err = cli(["eval", "-c", str(tmp_path / "c.yaml")], capsys)
    assert err == ["vase: error: output_dir must be a folder path, got 5: write it as text (in quotes)"], err


# ----------------------------------------------------------------------------- issue 40: a model vLLM cannot load


def _model_vllm_cannot_import(tmp_path, monkeypatch) -> str:
    """A tiny model folder whose architecture vLLM's registry maps to a module that imports a missing package
    (as Qwen3.5's does with torchvision absent)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    folder = tmp_path / "needs-pkg"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["VaseNeedsPkgForCausalLM"]}))
    (tmp_path / "vase_needs_pkg_model.py").write_text("import vase_no_such_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ModelRegistry.models, "VaseNeedsPkgForCausalLM",
                        _LazyRegisteredModel(module_name="vase_needs_pkg_model", class_name="Model"))
    return str(folder)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_generate_on_vllm_names_the_missing_package(capsys, monkeypatch, tmp_path):
    """vLLM printed its 55-line traceback and "1 validation error for ModelConfig"; the cause is one line."""
    folder = _model_vllm_cannot_import(tmp_path, monkeypatch)
    monkeypatch.setattr("vllm.LLM", _raise_reached)  # past the check, vLLM would start here
    code, err = cli(["generate", "--engine", "vllm", "--model", folder, "--budget", "24", "--window", "8",
                     "--max-new-tokens", "4", "hi"], capsys)
    err = [ln for ln in err if ln.startswith("vase:")]
    assert code == 1 and err == [f"vase: error: vLLM cannot load {folder} (VaseNeedsPkgForCausalLM): its model code "
                                 f"(vase_needs_pkg_model) needs the package 'vase_no_such_package_xyz', which is not "
                                 f"installed: pip install vase_no_such_package_xyz, or run it with --engine "
                                 f"transformers"], err


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_serve_names_the_missing_package_before_vllm_starts(tmp_path, monkeypatch):
    import socket

    import vase.vllm.serve as sv

    folder = _model_vllm_cannot_import(tmp_path, monkeypatch)
    monkeypatch.setattr(sv.subprocess, "Popen", _raise_reached)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(sv.ServeError, match=r"needs the package 'vase_no_such_package_xyz', which is not installed"):
        sv.run_serve([sys.executable, "-m", "vllm", "--model", folder, "--port", str(free)],
                     log_path=str(tmp_path / "log"))


def test_serve_failure_line_reads_through_vllms_log_prefix():
    """The traceback vLLM logs (each line behind its `(pid) ERROR date [file]` prefix) ends in the missing package;
    a pydantic ValidationError says its reason."""
    from vase.vllm.serve import failure_line

    pre = "(APIServer pid=7) ERROR 12-04 18:23:45 [registry.py:1120] "
    log = "\n".join([f"{pre}Traceback (most recent call last):", f"{pre}  File \"x.py\", line 1, in <module>",
                     f"{pre}ModuleNotFoundError: No module named 'torchvision'", f"{pre}",
                     "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
                     "  Value error, Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected. [type=value_error]"])
    assert failure_line(log) == "ModuleNotFoundError: No module named 'torchvision'"
    no_import = "\n".join(log.splitlines()[4:])
    assert failure_line(no_import) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                                       "ModelConfig: Model architectures ['Qwen3_5ForCausalLM'] failed to be "
                                       "inspected. [type=value_error]")


def test_max_length_is_the_full_caches_first_allocation():
    """max_length=5 'generated 40 tokens': it sizes the full cache's first allocation (honoured below), it does not
    cap generation (max_new_tokens does); -1 was accepted and ignored, and is refused (tests/test_bad_inputs.py)."""
    model, tok = tiny_model(), tiny_tokenizer()
    ids = tok(["hello world"], return_tensors="pt").input_ids
    for max_length, capacity in ((64, 64), (None, ids.shape[1]), (1, ids.shape[1])):
        cache = EvictionCache(model, "full", None, 8, max_length=max_length)
        model(input_ids=ids, **vase.cache_kwargs(cache), use_cache=True)
        assert cache.layers[0].capacity == capacity, (max_length, cache.layers[0].capacity)


def test_numpy_scalars_are_the_numbers_they_hold():
    """np.int64(32) was refused as "must be an integer, got np.int64(32)": numpy code passes them everywhere. The same
    request in numpy scalars gives the same tokens, and the saved identity stays JSON."""
    import numpy as np

    from vase.eval.config import EvalConfig
    from vase.eval.identity import identity, identity_hash

    model, tok = tiny_model(), tiny_tokenizer()
    plain = dict(method="snapkv", budget=24, window=8, max_new_tokens=12, temperature=0.5, top_p=0.9, greedy=False,
                 seed=[1, 2], chat_template=False, n_large=2, sample=True)
    numpy = dict(method="snapkv", budget=np.int64(24), window=np.int32(8), max_new_tokens=np.int64(12),
                 temperature=np.float32(0.5), top_p=np.float64(0.9), greedy=np.bool_(False),
                 seed=[np.int64(1), np.int64(2)], chat_template=np.bool_(False), n_large=np.int64(2),
                 sample=np.bool_(True))
    a = vase.generate(model, tok, ["hello there", "a b c"], **plain)
    b = vase.generate(model, tok, ["hello there", "a b c"], **numpy)
    c = vase.generate(model, tok, ["hello there", "a b c"], **{**numpy, "seed": np.arange(1, 3)})
    assert a.token_ids == b.token_ids == c.token_ids
    cache = EvictionCache(model, "snapkv", np.int64(24), np.int64(8), seed=np.int64(3), kv_bits=np.int64(4))
    assert type(cache.cfg.budget) is int and cache.quant.bits == 4
    cfg = dict(methods=["snapkv"], budgets=[128], limit=3, temperature=0.5, method_params={"snapkv": {"n_large": 3}})
    np_cfg = dict(methods=["snapkv"], budgets=[np.int64(128)], limit=np.int64(3), temperature=np.float32(0.5),
                  method_params={"snapkv": {"n_large": np.int64(3)}})
    assert identity_hash(identity(EvalConfig(**np_cfg))) == identity_hash(identity(EvalConfig(**cfg)))
    assert vase.vllm.additional_config("snapkv", np.int64(128), np.int64(64)) == \
        vase.vllm.additional_config("snapkv", 128, 64)
