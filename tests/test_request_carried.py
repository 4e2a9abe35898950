"""One Request, validated once at the door, carried down (issue 43): each door validates its request exactly once
(`RequestSpec.validate`, counted here), and nothing below it (vase.generate given ``request=``, the engines, the
batches of `vase generate`, the eval runner, the vLLM plugin's readers of its section) validates it again. A
validation added back anywhere below a door makes a count here go up."""

from __future__ import annotations

import json

import pytest
import torch

import vase
from tests.conftest import run_main, tiny_model, tiny_tokenizer
from vase.core.errors import SpecError
from vase.core.spec import Request, RequestSpec
from vase.engines import TransformersEngine
from vase.eval.config import EvalConfig
from vase.eval.runner import run_eval
from vase.generation.generate import forced_log_probs
from vase.vllm.config import VaseVllmConfig, additional_config, request_config

KW = dict(max_new_tokens=12, chat_template=False, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return tiny_model(dtype=torch.float64), tiny_tokenizer()


def test_vase_generate_validates_once_at_its_door_and_not_at_all_with_a_request(tiny, validations):
    model, tok = tiny
    by_keywords = vase.generate(model, tok, ["abcdefghijklmnop", "xy"], method="snapkv", budget=12, window=4, seed=3, **KW)
    assert len(validations) == 1  # the door
    request = RequestSpec.of("snapkv", 12, 4, seed=3).validate()
    validations.clear()
    carried = vase.generate(model, tok, ["abcdefghijklmnop", "xy"], request=request, **KW)
    assert len(validations) == 0  # carried down as it is
    assert carried.token_ids == by_keywords.token_ids and carried.stats["evictions"] == by_keywords.stats["evictions"] > 0
    assert carried.stats["method"] == "snapkv" and carried.stats["budget"] == 12


def test_forced_log_probs_and_the_engine_carry_the_request(tiny, validations):
    model, tok = tiny
    ref = forced_log_probs(model, list(range(5, 25)), list(range(30, 45)), method="snapkv", budget=12, window=4, seed=2)
    assert len(validations) == 1
    request = RequestSpec.of("snapkv", 12, 4).validate()
    validations.clear()
    engine = TransformersEngine(model, tok)
    got = engine.forced_log_probs(list(range(5, 25)), list(range(30, 45)), request=request, seed=2)
    out = engine.generate(["abcdefghijklmnop"], request=request, seed=[4], **KW)
    assert len(validations) == 0
    assert torch.equal(got, ref) and out.stats["evictions"] > 0


def test_a_request_and_its_keywords_are_not_both_given(tiny):
    model, tok = tiny
    request = RequestSpec.of("snapkv", 12, 4).validate()
    with pytest.raises(SpecError, match=r"pass request= or budget, not both"):
        vase.generate(model, tok, ["ab"], request=request, budget=16, **KW)
    with pytest.raises(SpecError, match=r"pass request= or n_large, not both"):
        TransformersEngine(model, tok).generate(["ab"], request=request, n_large=2, **KW)
    with pytest.raises(SpecError, match=r"request must be a vase.core.spec.Request"):
        vase.generate(model, tok, ["ab"], request=RequestSpec.of("snapkv", 12, 4), **KW)


def test_vase_generate_cli_validates_once_per_method_whatever_the_batches(tiny, validations, tmp_path, capsys):
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    prompts = tmp_path / "p.txt"
    prompts.write_text("abc\nde\nfgh\n")
    code, out, err = run_main(["generate", "--file", str(prompts), "--model", str(tmp_path / "m"), "--method", "snapkv",
                               "--compare", "streamingllm", "--budget", "12", "--window", "4", "--max-new-tokens", "3",
                               "--batch-size", "2", "--no-chat"], capsys)
    assert code == 0, err
    assert "snapkv" in out and "streamingllm" in out
    # 2 batches x 2 methods = 4 generate calls, 2 validations: one per method, at the CLI's door
    assert sorted(str(s.method) for s in validations) == ["snapkv", "streamingllm"]


def test_the_vllm_config_is_validated_once_and_read_by_the_plugin_without_validating(validations):
    section = additional_config("snapkv", 24, 8, n_large=4)
    assert len(validations) == 1
    for _ in range(3):  # the plugin's start check, the scheduler, a runner: the same process reads the same section
        cfg = VaseVllmConfig.from_additional_config(section)
    assert len(validations) == 1
    assert cfg.to_dict() == section["vase"] and isinstance(cfg.request, Request) and cfg.policy.n_large == 4
    request = RequestSpec.of("h2o", 32, 8).validate()
    validations.clear()
    built = request_config(request)
    again = VaseVllmConfig.from_additional_config({"vase": built.to_dict()})
    assert len(validations) == 0 and again is built and built.request.policy is request.policy
    assert request_config(RequestSpec.of("full", None, 8).validate()) is None  # stock vLLM


def test_the_eval_validates_at_its_config_and_the_runner_carries_the_requests(tiny, validations, tmp_path):
    model, tok = tiny
    config = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[12, 16], window=4, max_new_tokens=4,
                        batch_size=2, model="tiny", output_dir=str(tmp_path))
    assert len(validations) == 5  # full and snapkv at each budget, and full at its placeholder: the config's door
    validations.clear()
    seen: list[Request] = []

    def gen(model, tokenizer, prompts, **kw):
        seen.append(kw["request"])
        return vase.generate(model, tokenizer, prompts, **kw)

    run_eval(config, model, tok, generate_fn=gen, progress=False, summarize=False)
    assert len(validations) == 0
    assert sorted((r.method, r.budget) for r in seen if r.method != "full") == [("snapkv", 12), ("snapkv", 16)]
    assert [r for r in seen if r.method == "full"] == [config.request("full", None)]


def test_vase_bench_validates_each_configuration_once_whatever_the_runs(validations, tmp_path, capsys, monkeypatch):
    """`vase bench` (transformers engine): each method at each budget validated once at the CLI's door, full once at
    run_bench's; the warm-up and timed runs (2 lengths x 2 repeats) carry them."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["bench", "--random-init", "tiny", "--methods", "snapkv,streamingllm", "--budgets", "24",
                               "--window", "8", "--lengths", "32,40", "--repeats", "2", "--prompt-length", "8",
                               "--no-dynamic", "--bandwidth", "0", "--out", str(tmp_path / "b")], capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())["rows"]
    assert {(r["method"], r["new_tokens"]) for r in rows} == {(m, n) for m in ("full", "snapkv", "streamingllm")
                                                              for n in (32, 40)}
    assert all(r["evictions"] > 0 for r in rows if r["method"] != "full")
    assert sorted(str(s.method) for s in validations) == ["full", "snapkv", "streamingllm"]


def test_vase_bench_on_vllm_validates_at_its_door_and_each_engine_gets_the_section(validations, tmp_path, capsys,
                                                                                   monkeypatch):
    """`vase bench --engine vllm`: each (method, budget) validated once at the CLI's door; every engine of every
    regime and round starts with that request's section (no engine starts here: `_one_engine` records)."""
    pytest.importorskip("vllm", reason="vase bench --engine vllm refuses at its door without vLLM installed")
    from vase.bench import vllm_bench

    started: list = []
    monkeypatch.setattr(vllm_bench, "_one_engine", lambda path, **kw: started.append((kw["method"], kw["section"])))
    monkeypatch.chdir(tmp_path)
    run_main(["bench", "--engine", "vllm", "--methods", "snapkv,h2o", "--budgets", "24,32", "--window", "8",
              "--lengths", "16", "--repeats", "2", "--regimes", "ample,tight", "--out", str(tmp_path / "v")], capsys)
    assert sorted((str(s.method), s.budget) for s in validations) == [("h2o", 24), ("h2o", 32), ("snapkv", 24),
                                                                      ("snapkv", 32)]
    vase_rows = [(m, sec["vase"]["budget"]) for m, sec in started if sec is not None]
    assert sorted(vase_rows) == sorted([(m, b) for m in ("h2o", "snapkv") for b in (24, 32)] * 4)  # 2 regimes x 2
    assert [m for m, sec in started if sec is None] == ["full"] * 4


def test_the_eval_fidelity_pass_carries_every_request_and_validates_nothing(tiny, validations, tmp_path):
    """The fidelity pass forces full's reference, full's noise floor (in chunks of w) and each method through the
    requests the config validated: none is built from keywords, none validated again."""
    model, tok = tiny
    config = EvalConfig(task="arith", limit=1, methods=["snapkv"], budgets=[12, 16], window=4, max_new_tokens=20,
                        batch_size=1, model="tiny", fidelity=True, output_dir=str(tmp_path))
    validations.clear()
    forced: list[tuple[str, int, int | None]] = []

    def forced_fn(*a, **kw):
        forced.append((kw["request"].method, kw["request"].budget, kw.get("max_chunk")))
        return vase.forced_log_probs(*a, **kw)

    run_eval(config, model, tok, forced_fn=forced_fn, progress=False, summarize=False)
    assert len(validations) == 0
    placeholder = config.request("full", None).budget
    assert sorted(forced, key=str) == sorted([("full", 16, 4), ("full", placeholder, None), ("snapkv", 12, None),
                                              ("snapkv", 16, None)], key=str)


def test_vase_inspect_validates_once_at_its_door(tiny, validations, tmp_path, capsys):
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    code, out, err = run_main(["inspect", "abcdefghijklmnopqrstuvwxyz", "--model", str(tmp_path / "m"), "--method",
                               "snapkv", "--budget", "12", "--window", "4", "--max-new-tokens", "12", "--greedy",
                               "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "o" / "inspect.json").read_text())["stats"]["evictions"] > 0
    assert [(str(s.method), s.budget) for s in validations] == [("snapkv", 12)]


def test_the_randomness_study_validates_each_request_once_whatever_the_prompts_and_seeds(validations, tmp_path):
    """Each request of the study (full, each arm, the control at each of its budgets) is validated once at its door;
    the trajectories, the traced runs of every seed, the controls and the free generations carry them."""
    from vase.analysis.randomness import Arm, run_randomness, study_requests

    model, tok = tiny_model("qwen3", "sdpa"), tiny_tokenizer()
    arms = (Arm("snapkv", "snapkv"), Arm("snapkv-sample", "snapkv-sample"))
    study = dict(arms=arms, budget=24, window=8, seeds=2, max_new_tokens=48, loop_tokens=20, chat_template=False)
    report = run_randomness(model, tok, ["Tell me a story", "Count to ten"], tmp_path, **study)
    assert report["problems"] and report["controls"]
    assert sorted((str(s.method), s.budget) for s in validations) == sorted(
        [("full", 24), ("snapkv", 24), ("snapkv-sample", 24)] + [("snapkv", 24 + o) for o in (-6, -2, 2, 6)])
    requests = study_requests(arms, None, 2, 24, 8)
    validations.clear()
    again = run_randomness(model, tok, ["Tell me a story", "Count to ten"], tmp_path / "again", requests=requests,
                           **study)
    assert len(validations) == 0
    assert again["methods"] == report["methods"]


def test_the_sweep_validates_each_method_at_each_budget_once(validations, tmp_path):
    """Two tasks of the same problem (the same trajectory: each task's row 0 samples with the same seed) run every
    method at the same budgets: each request is validated on its first ask and carried by the second task's runs
    (full's by both trajectories and every reference)."""
    from vase.analysis.sweep import run_sweep

    model, tok = tiny_model("qwen3", "sdpa"), tiny_tokenizer()
    report = run_sweep(model, tok, tmp_path, tasks={"a": ["Tell me a story about a cat"], "b": ["Tell me a story about a cat"]},
                       methods=["snapkv", "quest"], compressions=[2, 3], window=4, max_new_tokens=40,
                       chat_template=False)
    assert len(report["rows"]) == 2 * 2 * 2 and {r["problems"] for r in report["rows"]} == {1}  # every cell ran
    keys = [(str(s.method), s.budget, s.window, tuple(sorted(s.params.items()))) for s in validations]
    assert len(keys) == len(set(keys)) == 1 + 2 * 2  # full, then each method at each compression's budget, once
