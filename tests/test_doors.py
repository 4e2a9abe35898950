"""One request spec for every door (issue 28): one table of (method, params, B, w, storage) through every door that
takes a request, each accepting and refusing what `RequestSpec.validate()` accepts and refuses, with its message.

Doors: `EvictionCache`, `CompiledEvictionCache`, `vase.generate` (eager and compiled), `EvalConfig`,
`vase.vllm.additional_config`, the plugin's parsing of `additional_config`, and the CLI's `generate` (both
engines), `bench`, `inspect`, `eval` and `serve`. The CLI doors point at a model that does not exist, so an
accepted request ends at the model load ("no such file or directory"), never in a slow run; the vLLM ones never
start vLLM. Each door may put its context before the message (``snapkv: ...``, ``vase config: ...``).
"""

from __future__ import annotations

from typing import Any

import importlib.util

import pytest

import vase
import vase.vllm
from tests.conftest import tiny_model, tiny_tokenizer
from vase.caches.eager import EvictionCache
from vase.cli import main
from vase.core.errors import SpecError
from vase.eval.config import ConfigError, EvalConfig
from vase.core.spec import RequestSpec

# (method, params, B, w, storage keywords): the storage is spelled one way, `kv_bits` (-p kv_bits=4 on every CLI door)
TABLE: list[tuple[str, dict, int, int, dict]] = [
    ("snapkv", {}, 512, 64, {}),
    ("snapkv", {"n_large": 448}, 512, 64, {}),  # exactly what B - w leaves
    ("snapkv", {"n_large": 449}, 512, 64, {}),  # one more: refused, not clamped
    ("snapkv", {"n_large": 600}, 512, 64, {}),  # the example
    ("vase-attnv", {}, 68, 64, {}),  # the budget rule: B > w + protected sinks
    ("vase-attnv", {}, 69, 64, {}),
    ("snapkv", {}, 2**31, 64, {}),  # past what torch holds
    ("snapkv", {}, 512, 0, {}),
    ("snapkv", {"sample": "maybe"}, 512, 64, {}),
    ("nosuch", {}, 512, 64, {}),
    ("snapkv", {}, 512, 64, {"kv_bits": 4}),
    ("snapkv", {}, 512, 64, {"kv_bits": 4, "quant_guard": 512}),
    ("snapkv", {}, 512, 64, {"kv_bits": 4, "quant_guard": 600}),
    ("snapkv", {}, 512, 64, {"kv_bits": 3}),
    ("snapkv", {}, 512, 64, {"quant_guard": 8}),  # a guard without kv_bits
    ("quest", {}, 512, 64, {"kv_bits": 4}),
]
IDS = [f"{m}-{p}-B{b}-w{w}-{s}".replace(" ", "") for m, p, b, w, s in TABLE]
MISSING = "/nonexistent/model"
#: what an accepted request meets next at a CLI door pointed at MISSING
PAST_THE_SPEC = "no such file or directory: /nonexistent/model"


def spec_says(method: str, params: dict, budget: int, window: int, storage: dict, engine: str | None = None
              ) -> str | None:
    """The spec's verdict: None (accepted) or its one-line message."""
    try:
        RequestSpec.of(method, budget, window, **params, **storage).validate(engine)
    except SpecError as exc:
        assert "\n" not in str(exc)
        return str(exc)
    return None


class Reached(Exception):
    """Raised where an accepted request goes past the door (instead of running)."""


def _p(params: dict, storage: dict) -> list[str]:
    out: list[str] = []
    for k, v in {**params, **storage}.items():
        out += ["-p", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return out


def _cli(argv: list[str], capsys) -> str | None:
    """Run the CLI; the one error line (without 'vase: error: '), or None when it exits 0."""
    capsys.readouterr()
    try:
        main(argv)
        return None
    except SystemExit as exc:
        err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith(("vase: warning", "vase serve: "))]
        assert exc.code != 0 and len(err) == 1, err
        assert err[0].startswith("vase: error: "), err
        return err[0].removeprefix("vase: error: ")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(), tiny_tokenizer()


def door_verdict(door: str, row: tuple, tiny, capsys, monkeypatch, tmp_path) -> tuple[bool, str]:
    """(accepted, the refusal's message or '')."""
    method, params, budget, window, storage = row
    model, tok = tiny
    common = ["--method", method, "--window", str(window), *_p(params, storage)]
    try:
        if door == "cache":
            EvictionCache(None, method, budget, window, num_layers=1, **params, **storage)
        elif door == "compiled-cache":
            vase.CompiledEvictionCache(model, method, budget, window, **params, **storage)
        elif door == "generate":
            vase.generate(model, tok, "hi", method=method, budget=budget, window=window, max_new_tokens=1,
                          chat_template=False, **params, **storage)
        elif door == "generate-compiled":
            def reached(*a, **k):
                raise Reached
            monkeypatch.setattr("vase.generation.compiled.compile_cache", reached)
            vase.generate(model, tok, "hi", method=method, budget=budget, window=window, max_new_tokens=1,
                          chat_template=False, compile=True, **params, **storage)
        elif door == "eval-config":
            EvalConfig(methods=[method], method_params={method: {**params, **storage}} if params or storage else {},
                       budgets=[budget], window=window)
        elif door == "vllm-additional-config":
            vase.vllm.additional_config(method, budget, window, **params, **storage)
        elif door == "vllm-plugin":
            vase.vllm.VaseVllmConfig.from_additional_config(
                {"vase": {"method": method, "budget": budget, "window": window, **params, **storage}})
        elif door == "cli-generate":
            msg = _cli(["generate", "hi", "--budget", str(budget), *common, "-m", MISSING], capsys)
            return msg == PAST_THE_SPEC, msg or ""
        elif door == "cli-generate-vllm":
            monkeypatch.setattr("vase.engines.vllm.VllmEngine.start", lambda self: (_ for _ in ()).throw(Reached()))
            msg = _cli(["generate", "hi", "--engine", "vllm", "--budget", str(budget), *common, "-m", MISSING], capsys)
            return msg is not None and msg.startswith("Reached"), msg or ""
        elif door == "cli-bench":
            msg = _cli(["bench", "--methods", method, "--budgets", str(budget), "--window", str(window), "--lengths",
                        "4", *_p(params, storage), "-m", MISSING, "--out", str(tmp_path / "b")], capsys)
            return msg == PAST_THE_SPEC, msg or ""
        elif door == "cli-inspect":
            msg = _cli(["inspect", "hi", "--budget", str(budget), *common, "-m", MISSING, "--out",
                        str(tmp_path / "i")], capsys)
            return msg == PAST_THE_SPEC, msg or ""
        elif door == "cli-eval":
            msg = _cli(["eval", "--methods", method, "--budgets", str(budget), "--window", str(window),
                        *_p(params, storage), "-m", MISSING, "--output-dir", str(tmp_path / "e")], capsys)
            return msg == PAST_THE_SPEC, msg or ""
        elif door == "cli-serve":
            import vase.vllm.serve as sv

            monkeypatch.setattr(sv, "run_serve", lambda argv, ready_timeout=300: (_ for _ in ()).throw(Reached()))
            monkeypatch.setattr(sv, "require_vllm", lambda: None)
            monkeypatch.setattr("vase.models.model_dir", lambda model: str(tmp_path))
            (tmp_path / "config.json").write_text("{}")
            msg = _cli(["serve", "--budget", str(budget), *common], capsys)
            return msg is not None and msg.startswith("Reached"), msg or ""
        else:
            raise AssertionError(door)
    except Reached:
        return True, ""
    except (SpecError, ConfigError, ValueError, TypeError) as exc:
        return False, str(exc)
    return True, ""


VLLM_DOORS = {"vllm-additional-config", "vllm-plugin", "cli-generate-vllm", "cli-serve"}
DOORS = ["cache", "compiled-cache", "generate", "generate-compiled", "eval-config", "vllm-additional-config",
         "vllm-plugin", "cli-generate", "cli-generate-vllm", "cli-bench", "cli-inspect", "cli-eval", "cli-serve"]


@pytest.mark.parametrize("row", TABLE, ids=IDS)
@pytest.mark.parametrize("door", DOORS)
def test_every_door_says_what_the_spec_says(door, row, tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "cache"))
    method, params, budget, window, storage = row
    expected = spec_says(*row, engine="vllm" if door in VLLM_DOORS else None)
    if door in VLLM_DOORS and expected is None and method != "full" and not vase.core.policies.get_policy(method).evicts:
        pytest.skip("the plugin has nothing to do for a method that does not evict")
    if door == "cli-generate-vllm" and expected is None and importlib.util.find_spec("vllm") is None:
        pytest.skip("an accepted request goes on to need vLLM, which this environment lacks")
    accepted, message = door_verdict(door, row, tiny, capsys, monkeypatch, tmp_path)
    if expected is None:
        assert accepted, f"{door} refused what the spec accepts: {message}"
    else:
        assert not accepted, f"{door} accepted what the spec refuses: {expected}"
        assert expected in message, f"{door}: {message!r} does not carry the spec's {expected!r}"


def test_the_table_covers_each_rule():
    verdicts = [spec_says(*row) for row in TABLE]
    for fragment in ("n_large (449) is larger than the budget leaves for old tokens (B - w = 512 - 64 = 448)",
                     "budget (68) must be larger than window + protected sinks (64 + 4)",
                     "budget 2147483648 is too large (at most 2147483647)",
                     "window must be a positive number of tokens, got 0",
                     "parameter sample must be true or false, got 'maybe'",
                     "unknown method 'nosuch'",
                     "quant_guard (600) is larger than the budget (512)",
                     "kv_bits must be 16 (no quantization) or one of 8, 4, 2; got 3",
                     "pass kv_bits=8, 4 or 2",
                     "quest selects from a full cache"):
        assert sum(fragment in (v or "") for v in verdicts) == 1, fragment
    assert verdicts.count(None) == 5
    assert "runs on the transformers engine only, not on vllm" in spec_says("snapkv", {}, 512, 64, {"kv_bits": 4},
                                                                             engine="vllm")
