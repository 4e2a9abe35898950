"""`vase.engines`: one protocol, two implementations, one vLLM engine builder, one teacher-forcing loop.

No vLLM engine is started here: the vLLM builder is checked by catching the arguments it would start
an engine with (the eval's engine and the bench's), and `tests/test_vllm_eval.py` runs it for real.
"""

from __future__ import annotations

import importlib.util
import inspect
from contextlib import contextmanager

import pytest
import torch

import vase
from vase.engines import Engine, TransformersEngine, VllmEngine, engine_args, kv_bytes_per_token
from vase.core.capabilities import EngineInfo, engine_class, engine_info, register_engine
from vase.core.errors import SpecError
from vase.core.spec import RequestSpec
from vase.generation.generate import eos_ids, forced_log_probs

from .conftest import F64, tiny_model, tiny_tokenizer

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here (pip install -e '.[vllm]')")

#: tiny_model: 2 layers, 2 KV heads, head_dim 16
TINY_BPT_F64 = 2 * 2 * 2 * 16 * 8


def _protocol_members() -> list[str]:
    return [n for n in dir(Engine) if not n.startswith("_")] + list(Engine.__annotations__)


def _params(fn) -> list[tuple]:
    """(name, kind, default) of each parameter: what a caller of the protocol relies on."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


# ----------------------------------------------------------------------------- the protocol


@pytest.mark.parametrize("impl", [TransformersEngine, VllmEngine])
def test_both_engines_satisfy_the_protocol(impl):
    for name in _protocol_members():
        assert inspect.getattr_static(impl, name, None) is not None, f"{impl.__name__} lacks {name}"
    for method in ("generate", "forced_log_probs", "start", "close"):
        assert _params(getattr(impl, method)) == _params(getattr(Engine, method)), (impl.__name__, method)
    for prop in ("tokenizer", "bytes_per_token"):
        assert isinstance(inspect.getattr_static(impl, prop), property), (impl.__name__, prop)
    assert impl.name in ("transformers", "vllm")
    assert engine_class(impl.name) is impl and engine_info(impl.name).forcing == (impl is TransformersEngine)
    assert not hasattr(impl, "supports_forcing")  # the registry's `forcing` is the one flag


# ----------------------------------------------------------------------------- a new engine from outside


class ToyEngine:
    """A third engine defined here, outside the package: it loads its own model (vase's tiny checkpoint) and
    generates with vase.generate; it records its calls so the test sees that the doors went through it."""

    name = "toy"
    calls: list = []

    def __init__(self, model=None, *, dtype="auto", device="auto", seed=0):
        self.model_name, self.dtype, self.seed = model, dtype, seed
        self.model = self._tokenizer = None

    @property
    def tokenizer(self):
        self.start()
        return self._tokenizer

    @property
    def bytes_per_token(self) -> int:
        self.start()
        return kv_bytes_per_token(self.model)

    def start(self) -> None:
        if self.model is None:
            from vase.models import load_model

            self.model, self._tokenizer = load_model(self.model_name, dtype="float32", device="cpu")

    def generate(self, prompts, *, method="vase-attnv", budget=512, window=64, max_new_tokens=2048,
                 temperature=0.6, top_p=0.95, top_k=None, greedy=False, seed=None, chat_template=True, request=None,
                 **params):
        self.start()
        if request is None:  # the keyword door: build (and validate) the request here, once
            request = RequestSpec.of(method, budget, window, **params).validate()
            params = {}
        ToyEngine.calls.append(("generate", list(prompts), request.method, request.budget))
        return vase.generate(self.model, self._tokenizer, prompts, request=request, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, seed=seed,
                             chat_template=chat_template, **params)

    def forced_log_probs(self, prompt_ids, target_ids, *, method="full", budget=512, window=64, seed=None,
                         max_chunk=None, on_chunk=None, request=None, **params):
        raise NotImplementedError("the toy engine does not teacher-force")

    def close(self) -> None:
        ToyEngine.calls.append(("close",))


@pytest.fixture
def toy_engine(monkeypatch):
    """ToyEngine registered through the public API for one test (the registry restored after)."""
    from vase.core import capabilities as registry

    # the one table is mutated in place (modules hold it by name: `from ... import ENGINES`); "toy" removed after
    info = EngineInfo("toy", ToyEngine, forcing=False, internal_batching=False, loads_model=True, storage=True,
                      compile=False, attn=False, streaming=False)
    register_engine(info)
    with pytest.raises(SpecError, match="already registered"):
        register_engine(info)
    ToyEngine.calls = []
    yield ToyEngine
    registry.ENGINES.pop("toy", None)


def test_a_toy_engine_registered_from_outside_runs_through_generate_and_eval(toy_engine, model_dir, capsys,
                                                                             tmp_path):
    """docs/architecture.md's recipe: one class implementing Engine + one registry entry, and `vase generate
    --engine toy` and eval's runner use it (no other file edited); its flags are read (no --attn, no fidelity)."""
    from vase.eval.config import ConfigError, EvalConfig
    from vase.eval.runner import run_eval

    from .conftest import run_main

    for impl in (ToyEngine,):
        for name in ("generate", "forced_log_probs", "start", "close"):
            assert _params(getattr(impl, name)) == _params(getattr(Engine, name)), name
    code, out, err = run_main(["generate", "--engine", "toy", "--model", model_dir, "--method", "snapkv",
                               "--budget", "24", "--window", "8", "--max-new-tokens", "12", "--greedy", "--no-chat",
                               "hello there"], capsys)
    assert code == 0, err
    assert toy_engine.calls == [("generate", ["hello there"], "snapkv", 24)]
    assert "snapkv" in out and "tokens" in out
    code, _, err = run_main(["generate", "--engine", "toy", "--model", model_dir, "--attn", "eager", "hi"], capsys)
    assert code != 0 and "not on toy" in err

    toy_engine.calls = []
    cfg = EvalConfig(task="arith", limit=2, model=model_dir, engine="toy", methods=["full", "snapkv"], budgets=[24],
                     window=8, samples=1, max_new_tokens=8, greedy=True, output_dir=str(tmp_path))
    run_dir = run_eval(cfg, progress=False, summarize=False)
    assert (run_dir / "samples.rank0.jsonl").is_file()
    # one batch of both problems per method (vase's batches: the toy does not schedule them itself)
    assert [(c[2], len(c[1])) for c in toy_engine.calls if c[0] == "generate"] == [("full", 2), ("snapkv", 2)]
    assert toy_engine.calls[-1] == ("close",)
    with pytest.raises(ConfigError, match="fidelity"):
        EvalConfig(task="arith", model=model_dir, engine="toy", fidelity=True, output_dir=str(tmp_path))


def test_the_transformers_engine_is_vase_generate_and_forced_log_probs():
    model, tok = tiny_model(dtype=F64), tiny_tokenizer()
    engine = TransformersEngine(model, tok)
    prompts = ["Tell me a story", "abc", "Count to ten, slowly"]
    settings = dict(method="vase-attnv", budget=24, window=8, max_new_tokens=40, temperature=0.6, top_p=0.95,
                    top_k=None, greedy=False, seed=[11, 12, 13], chat_template=True)
    got = engine.generate(prompts, **settings)
    want = vase.generate(model, tok, prompts, **settings)
    assert got.token_ids == want.token_ids and got.texts == want.texts
    assert got.finished == want.finished and got.prompt_lengths == want.prompt_lengths
    assert got.stats["rows"] == want.stats["rows"] and any(r["evictions"] for r in got.stats["rows"])

    prompt, target = list(range(5, 17)), [(7 * i) % 90 for i in range(50)]
    kw = dict(method="snapkv", budget=24, window=8, seed=3)
    assert torch.equal(engine.forced_log_probs(prompt, target, **kw), forced_log_probs(model, prompt, target, **kw))
    chunked = engine.forced_log_probs(prompt, target, method="full", max_chunk=8)
    assert torch.equal(chunked, forced_log_probs(model, prompt, target, method="full", max_chunk=8))
    assert engine.bytes_per_token == TINY_BPT_F64 and engine.tokenizer is tok


def test_the_transformers_engine_passes_only_what_a_stand_in_was_asked_for():
    calls = []

    def gen(model, tokenizer, prompts, **kw):
        calls.append(("gen", model, tokenizer, list(prompts), kw))

    def forced(model, prompt_ids, target_ids, *, method, budget, window, seed):  # no max_chunk, no on_chunk
        calls.append(("forced", method))
        return torch.zeros(len(target_ids), 3)

    engine = TransformersEngine("M", "T", generate_fn=gen, forced_fn=forced)
    engine.generate(["p"], method="snapkv", budget=9, n_large=2)
    assert calls[0][:4] == ("gen", "M", "T", ["p"]) and calls[0][4]["n_large"] == 2 and calls[0][4]["budget"] == 9
    assert engine.forced_log_probs([1], [2, 3], method="snapkv").shape == (2, 3)
    with pytest.raises(TypeError):  # the runner's noise floor asks for chunking; a stand-in without it says so
        engine.forced_log_probs([1], [2, 3], max_chunk=4)


def test_kv_bytes_per_token_from_a_model_or_a_config_and_dtype():
    model = tiny_model(dtype=F64)
    assert kv_bytes_per_token(model) == TINY_BPT_F64
    assert kv_bytes_per_token(model.config, torch.float64) == TINY_BPT_F64
    assert kv_bytes_per_token(model.config, "float32") == TINY_BPT_F64 // 2
    assert kv_bytes_per_token(model.config, "bfloat16") == kv_bytes_per_token(model.config, "torch.float16") \
        == TINY_BPT_F64 // 4
    from vase.eval.runner import kv_bytes_per_token as runners

    assert runners is kv_bytes_per_token  # one count: the runner re-exports it


def test_eos_ids_from_a_model_or_another_engines_generation_config():
    tok = tiny_tokenizer()
    model = tiny_model()
    model.generation_config.eos_token_id = [3, 95]
    assert eos_ids(model, tok) == [3, 95]
    assert eos_ids(None, tok, generation_eos=[7, 3]) == [3, 7, 95] and eos_ids(None, tok) == [95]

    from vase.engines.vllm import llm_eos_ids

    class Cfg:
        def try_get_generation_config(self):
            return {"eos_token_id": 7}

    class Llm:
        class llm_engine:
            model_config = Cfg()

    assert llm_eos_ids(Llm(), tok) == [7, 95]


# ----------------------------------------------------------------------------- the loop the studies observe


def _observed(model, prompt, target, **kw):
    chunks = []

    @contextmanager
    def observe(cache, start, n):
        layer0 = cache.layers[0]
        seen, evictions = layer0.seen, layer0.evictions
        yield
        chunks.append((start, n, seen, layer0.seen, layer0.evictions - evictions))

    return forced_log_probs(model, prompt, target, on_chunk=observe, **kw), chunks


@pytest.mark.parametrize("method", ["snapkv", "vase-attnv"])
def test_forced_log_probs_on_chunk_observes_exactly_the_chunks(method):
    model = tiny_model(dtype=F64)
    torch.manual_seed(1)
    P, T, B, w = 12, 70, 24, 8
    prompt, target = torch.randint(0, 90, (P,)).tolist(), torch.randint(0, 90, (T,)).tolist()
    lp, chunks = _observed(model, prompt, target, method=method, budget=B, window=w, seed=3)
    assert torch.equal(lp, forced_log_probs(model, prompt, target, method=method, budget=B, window=w, seed=3))
    # the prompt is no chunk; the first chunk fills the cache to max(P, B) + w, then each evicts and feeds w
    first = B + w - P
    starts = [0] + list(range(first, T - 1, w))
    assert [(s, n) for s, n, *_ in chunks] == [(s, min(e, T - 1) - s) for s, e in zip(starts, starts[1:] + [T - 1])]
    for start, n, seen_before, seen_after, evicted in chunks:
        assert seen_before == P + start and seen_after == seen_before + n  # entered before, left after its forward
        assert evicted == (start > 0)  # every chunk after the first evicts once, at its start
    assert len(chunks) == len(range(first, T - 1, w)) + 1


def test_on_chunk_follows_max_chunk_and_a_single_target_feeds_no_chunk():
    model = tiny_model(dtype=F64)
    prompt, target = list(range(3, 15)), [(5 * i) % 90 for i in range(23)]
    lp, chunks = _observed(model, prompt, target, method="full", max_chunk=5)
    assert [(s, n) for s, n, *_ in chunks] == [(0, 5), (5, 5), (10, 5), (15, 5), (20, 2)]
    assert all(ev == 0 for *_, ev in chunks) and lp.shape == (23, 96)
    lp, chunks = _observed(model, prompt, target[:1], method="full")
    assert chunks == [] and lp.shape == (1, 96)


# ----------------------------------------------------------------------------- the one vLLM builder


def test_engine_args_on_a_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    section = {"vase": {"method": "snapkv", "budget": 48}}
    args = engine_args("m", dtype="float32", max_model_len=80, seed=5, section=section, in_process=True,
                       kv_cache_memory_bytes=123, block_size=32, max_num_seqs=4)
    assert args == {"model": "m", "dtype": "float32", "max_model_len": 80, "seed": 5, "enforce_eager": True,
                    "distributed_executor_backend": "uni", "kv_cache_memory_bytes": 123, "block_size": 32,
                    "additional_config": section, "max_num_seqs": 4}
    bare = engine_args("m", dtype="float32", max_model_len=80, seed=5, section=None, in_process=False,
                       enforce_eager=False)
    assert bare == {"model": "m", "dtype": "float32", "max_model_len": 80, "seed": 5, "enforce_eager": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_args("m", dtype="bfloat16", max_model_len=8, seed=0, section=None, in_process=True) == {
        "model": "m", "dtype": "bfloat16", "max_model_len": 8, "seed": 0, "enforce_eager": False}


class _Started(Exception):
    """Raised by the stand-in engine starters with the arguments they were given."""


def _catch(monkeypatch, name):
    def starter(args, *rest, **kw):
        raise _Started(args)

    monkeypatch.setattr(f"vase.engines.vllm.{name}", starter)


def test_vase_section_lives_in_the_plugin_config():
    from vase.vllm.config import VaseConfigError, additional_config, vase_section

    assert vase_section("full", 48) is None and vase_section(" Full ", 48, 8) is None
    assert vase_section("snapkv", 48, 8, {"smooth_kernel": 7}) == additional_config("snapkv", 48, 8, smooth_kernel=7)
    with pytest.raises(VaseConfigError):
        vase_section("snapkv", 8, 8)  # B must exceed w


@needs_vllm
def test_the_eval_engine_and_the_bench_start_vllm_through_the_one_builder(monkeypatch, model_dir, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vase.vllm.config import vase_section

    _catch(monkeypatch, "start_llm")
    engine = VllmEngine(model_dir, dtype="float32", seed=4)
    with pytest.raises(NotImplementedError, match="cannot teacher-force"):
        engine.forced_log_probs([1], [2, 3])
    assert engine.bytes_per_token == TINY_BPT_F64 // 2
    with pytest.raises(_Started) as got:
        engine.generate(["hello"], method="snapkv", budget=48, window=8, max_new_tokens=16, seed=[1])
    section = vase_section("snapkv", 48, 8)
    (args,) = got.value.args
    pool = 64 * 2**20  # the CPU pool's floor: one short request
    assert args == engine_args(model_dir, dtype="float32", max_model_len=args["max_model_len"], seed=4,
                               section=section, in_process=True, kv_cache_memory_bytes=pool)
    assert args["max_model_len"] > 16

    from transformers import Qwen3Config

    from vase.bench import vllm_bench

    bench_dir = str(tmp_path)  # the bench draws prompt ids from 100 .. vocab - 100: a config with a wider vocabulary
    config = tiny_model().config.to_dict()
    config["vocab_size"] = 512
    Qwen3Config(**config).save_pretrained(bench_dir)
    _catch(monkeypatch, "start_engine")
    with pytest.raises(_Started) as got:
        vllm_bench.run_vllm_bench(bench_dir, ["snapkv"], [48], n_requests=2, new_tokens=16, prompt_len=8, window=8,
                                  pool_requests=2, block_size=16, log=lambda *a: None)
    (args,) = got.value.args
    kv = vllm_bench.pool_bytes(2, 8, 16, 16, TINY_BPT_F64 // 2)
    assert args == engine_args(bench_dir, dtype="float32", max_model_len=24, seed=0, section=None, in_process=True,
                               kv_cache_memory_bytes=kv, block_size=16, max_num_seqs=2,
                               enable_prefix_caching=False, disable_log_stats=False,
                               max_num_batched_tokens=2 * (8 + 16))  # no chunked prefill: see vllm_bench._one

