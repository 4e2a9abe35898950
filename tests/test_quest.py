"""Quest: page selection over the full cache (selection at equal sparsity, no eviction)."""

from __future__ import annotations

import pytest
import torch

import vase
from vase.caches.eager import EvictionCache
from vase.hf.compat import cache_kwargs
from vase.generation.generate import forced_log_probs
from vase.core.policies import get_policy
from vase.core.policies.quest import page_bounds, page_scores, prefix_bounds, quest_mask

from .conftest import tiny_model


def _reference_mask(keys, queries, q_start, budget, window, sinks, page_size):
    """Quest, one query, KV head and page at a time, straight from the definition: with more than
    `budget` slots visible, the sinks, the window and `budget - sinks - window` candidate slots
    taken page by page (pages counted from slot `sinks`, each scored on its candidate slots) in
    the order of the bound, earlier page first on ties, the last page taken cut to its first slots."""
    b, h_kv, L, d = keys.shape
    h_q, q = queries.shape[1], queries.shape[2]
    group = h_q // h_kv
    out = torch.zeros(b, h_kv, q, L, dtype=torch.bool)
    for r in range(b):
        for h in range(h_kv):
            for i in range(q):
                n = q_start + i + 1
                if n <= budget:
                    out[r, h, i, :n] = True
                    continue
                candidates = range(sinks, n - window)
                scored = []
                for p in range(-(-L // page_size)):
                    page = [s for s in range(sinks + p * page_size, sinks + (p + 1) * page_size) if s in candidates]
                    if not page:
                        continue
                    kmin, kmax = keys[r, h, page].amin(0), keys[r, h, page].amax(0)
                    bound = 0.0
                    for g in range(group):  # GQA: the group's bounds summed
                        qv = queries[r, h * group + g, i]
                        bound += float(torch.maximum(qv * kmin, qv * kmax).sum())
                    scored.append((-bound, p, page))
                taken = []
                for _, _, page in sorted(scored, key=lambda x: (x[0], x[1])):
                    taken += page[:budget - sinks - window - len(taken)]
                for s in range(n):
                    out[r, h, i, s] = s < sinks or s >= n - window or s in taken
    return out


@pytest.mark.parametrize("h_q,h_kv", [(2, 2), (4, 2), (6, 1)])
def test_selected_pages_are_the_top_ones_by_the_bound(h_q, h_kv):
    torch.manual_seed(0)
    b, L, d, q = 2, 83, 8, 5
    keys, queries = torch.randn(b, h_kv, L, d), torch.randn(b, h_q, q, d)
    for budget, window, sinks, page in [(40, 8, 4, 8), (60, 16, 2, 16), (30, 10, 0, 4), (83, 8, 4, 8)]:
        got = quest_mask(keys, queries, L - q, budget, window, sinks, page)
        want = _reference_mask(keys, queries, L - q, budget, window, sinks, page)
        assert torch.equal(got, want), (budget, window, sinks, page)
        attended = got.sum(-1)
        assert int(attended.max()) <= budget  # the sparsity it promises


def test_each_query_attends_exactly_the_budget_whatever_the_page_size():
    """min(visible, B) tokens per query, also when B - sinks - w is no multiple of the page size."""
    torch.manual_seed(7)
    keys, queries = torch.randn(1, 2, 120, 8), torch.randn(1, 4, 50, 8)
    for budget, window, sinks, page in [(37, 16, 4, 16), (32, 16, 4, 16), (61, 8, 3, 7), (45, 16, 0, 16)]:
        mask = quest_mask(keys, queries, 70, budget, window, sinks, page)
        visible = 71 + torch.arange(50)
        assert torch.equal(mask.sum(-1), visible.clamp(max=budget).expand(1, 2, 50)), (budget, window, sinks, page)
        assert mask[..., :sinks].all() and all(mask[0, :, i, 71 + i - window:71 + i].all() for i in range(50))


def test_sinks_and_window_are_not_page_candidates():
    """The page the window starts in scores high only through its window slots: it must not win."""
    d, L, page, window, sinks = 4, 64, 8, 12, 0
    keys = torch.zeros(1, 1, L, d)
    keys[0, 0, 8:16, 1] = 1.0  # page 1: a moderate match everywhere
    keys[0, 0, 52:56, 0] = 9.0  # page 6 (slots 48..55): strong, but 52.. lie in the window of 12
    queries = torch.zeros(1, 1, 1, d)
    queries[0, 0, 0, 0], queries[0, 0, 0, 1] = 1.0, 0.5
    mask = quest_mask(keys, queries, L - 1, budget=window + 8, window=window, sinks=sinks, page_size=page)[0, 0, 0]
    assert mask[8:16].all() and not mask[48:52].any() and int(mask.sum()) == window + 8
    # Sinks do not share a page with candidates: pages start at slot `sinks`.
    keys = torch.zeros(1, 1, L, d)
    keys[0, 0, 0:4, 0] = 9.0  # the sinks point where the query looks
    keys[0, 0, 20:28, 0] = 1.0  # candidates at slots 20..27 = page 2 when counted from slot 4
    mask = quest_mask(keys, queries, L - 1, budget=4 + 16 + 8, window=16, sinks=4, page_size=8)[0, 0, 0]
    assert mask[:4].all() and mask[20:28].all() and not mask[4:20].any()


def test_a_budget_below_one_page_of_candidates_still_selects():
    """B' = 32 with 4 sinks, w = 16 and 16-token pages (arith at 16x): 12 candidate tokens, not none."""
    d, L = 4, 90
    keys = torch.zeros(1, 1, L, d)
    keys[0, 0, 36:52, 0] = 1.0  # page 2 counted from slot 4 (slots 36..51)
    queries = torch.zeros(1, 1, 1, d)
    queries[0, 0, 0, 0] = 1.0
    mask = quest_mask(keys, queries, L - 1, budget=32, window=16, sinks=4, page_size=16)[0, 0, 0]
    assert int(mask.sum()) == 32 and mask[36:48].all() and not mask[48:52].any()


def test_bound_is_an_upper_bound_and_uses_partial_last_page():
    torch.manual_seed(1)
    keys, q = torch.randn(1, 1, 37, 6), torch.randn(1, 1, 1, 6)
    kmin, kmax = page_bounds(keys, 8)
    assert kmin.shape == (1, 1, 5, 6)  # ceil(37 / 8)
    assert torch.equal(kmax[0, 0, 4], keys[0, 0, 32:].amax(0))
    assert torch.equal(kmin[0, 0, 1], keys[0, 0, 8:16].amin(0))
    run_min, run_max = prefix_bounds(keys, 8)
    assert torch.equal(run_max[0, 0, 13], keys[0, 0, 8:14].amax(0)) and torch.equal(run_min[0, 0, 8], keys[0, 0, 8])
    bounds = page_scores(q, kmin, kmax)[0, 0, 0]
    dots = (keys[0, 0] @ q[0, 0, 0])
    for p in range(5):
        assert float(dots[p * 8:(p + 1) * 8].max()) <= float(bounds[p]) + 1e-5


def test_gqa_page_needed_by_one_head_of_the_group_is_selected():
    """Group of 2 query heads: head 1 points hard at page 3, head 0 mildly prefers page 1."""
    d, L = 4, 64
    keys = torch.zeros(1, 1, L, d)
    keys[0, 0, 16:24, 0] = 1.0  # page 1 (page size 8)
    keys[0, 0, 24:32, 1] = 1.0  # page 3
    queries = torch.zeros(1, 2, 1, d)
    queries[0, 0, 0, 0] = 1.0
    queries[0, 1, 0, 1] = 10.0
    mask = quest_mask(keys, queries, L - 1, budget=16 + 8, window=16, sinks=0, page_size=8)
    assert mask[0, 0, 0, 24:32].all() and not mask[0, 0, 0, 16:24].any()


def test_a_chunk_of_queries_gets_the_masks_of_one_query_at_a_time():
    """What teacher forcing (one chunk) sees equals what decoding (one token, growing cache) sees."""
    torch.manual_seed(2)
    keys, queries = torch.randn(1, 2, 90, 8), torch.randn(1, 4, 30, 8)
    for budget, window, page in [(44, 16, 8), (41, 6, 16)]:  # also a window shorter than a page
        chunk = quest_mask(keys, queries, 60, budget=budget, window=window, sinks=4, page_size=page)
        for i in range(30):
            n = 61 + i
            alone = quest_mask(keys[:, :, :n], queries[:, :, i:i + 1], n - 1, budget=budget, window=window, sinks=4,
                               page_size=page)
            assert torch.equal(chunk[:, :, i:i + 1, :n], alone), (budget, i)
            assert not chunk[:, :, i, n:].any()


def _decode_logits(model, prompt, steps, **cache_kw):
    cache = EvictionCache(model, **cache_kw)
    out = model(input_ids=prompt, **cache_kwargs(cache))
    logits, tokens = [out.logits[0, -1]], []
    for _ in range(steps):
        tok = logits[-1].argmax(-1).view(1, 1)
        tokens.append(int(tok))
        out = model(input_ids=tok, **cache_kwargs(cache))
        logits.append(out.logits[0, -1])
    return torch.stack(logits), tokens, cache


@torch.no_grad()
def test_budget_above_context_equals_full_exactly():
    model = tiny_model("qwen3", "sdpa")
    torch.manual_seed(3)
    prompt = torch.randint(0, 90, (1, 20))
    full, tokens, _ = _decode_logits(model, prompt, 40, method="full", budget=100, window=16)
    quest, tokens_q, cache = _decode_logits(model, prompt, 40, method="quest", budget=100, window=16)
    assert torch.equal(full, quest) and tokens == tokens_q
    assert cache.stats()["evictions"] == 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_decoding_matches_attention_masked_to_the_reference_selection(attn):
    """Every decode step of a 2-layer GQA model: the layer attends exactly the reference's selection."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    budget, window, page, steps = 36, 16, 8, 40
    model = tiny_model("qwen3", attn)
    torch.manual_seed(4)
    prompt = torch.randint(0, 90, (1, 30))
    got, tokens, _ = _decode_logits(model, prompt, steps, method="quest", budget=budget, window=window,
                                    page_size=page)
    full = forced_log_probs(model, prompt[0], tokens, method="full")
    assert (got[:-1].log_softmax(-1) - full).abs().max() > 1e-3  # the selection really restricts attention

    def reference(module, query, key, value, attention_mask, **kw):
        L, q = key.shape[2], query.shape[2]
        if q > 1:  # dense prefill
            return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kw)
        sel = _reference_mask(key, query, L - 1, budget, window, 4, page)
        sel = sel.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        return sdpa_attention_forward(module, query, key, value, sel, **kw)

    AttentionInterface.register("quest_test_reference", reference)
    ref_model = tiny_model("qwen3", "sdpa")
    ref_model.set_attn_implementation("quest_test_reference")
    from transformers import DynamicCache

    cache = DynamicCache()
    out = ref_model(input_ids=prompt, **cache_kwargs(cache))
    want = [out.logits[0, -1]]
    for tok in tokens:
        out = ref_model(input_ids=torch.tensor([[tok]]), **cache_kwargs(cache))
        want.append(out.logits[0, -1])
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_teacher_forcing_selects_as_decoding_does():
    model = tiny_model("qwen3", "sdpa")
    torch.manual_seed(5)
    prompt = torch.randint(0, 90, (1, 25))
    kw = dict(method="quest", budget=40, window=16, page_size=8)
    logits, tokens, _ = _decode_logits(model, prompt, 50, **kw)
    forced = forced_log_probs(model, prompt[0], tokens, **kw)
    torch.testing.assert_close(forced, logits[:-1].float().log_softmax(-1), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_padded_batch_rows_match_rows_alone(tokenizer):
    model = tiny_model("qwen3", "sdpa")
    prompts = ["What is 12 plus 30?", "Hi", "A much longer prompt, with more tokens in it."]
    kwargs = dict(method="quest", budget=40, window=16, max_new_tokens=40, greedy=True, chat_template=False,
                  page_size=8)
    batch = vase.generate(model, tokenizer, prompts, seed=[1, 2, 3], **kwargs)
    assert batch.stats["evictions"] == 0
    for r, prompt in enumerate(prompts):
        alone = vase.generate(model, tokenizer, [prompt], seed=[1 + r], **kwargs)
        assert alone.token_ids[0] == batch.token_ids[r], f"row {r}"


def test_registered_with_parameters_and_clear_errors():
    policy = get_policy("quest")
    assert policy.params()["page_size"] == 16 and policy.sinks == 4 and not policy.evicts
    assert get_policy("quest", page_size=32).page_size == 32
    model = tiny_model("qwen3", "sdpa")
    EvictionCache(model, "quest", budget=64, window=8)  # a window shorter than a page is fine
    with pytest.raises(ValueError, match="budget"):
        EvictionCache(model, "quest", budget=20, window=16)
    with pytest.raises(ValueError, match="page_size must be"):
        get_policy("quest", page_size=0)
    for modifier in ({"sample": True}, {"value_guard": 0.25}, {"n_large": 8}, {"protect_sinks": True}):
        with pytest.raises(ValueError, match="modifiers"):
            get_policy("quest", **modifier)


def test_bench_reports_quest_as_selection_not_eviction():
    from vase.bench import run_bench

    model = tiny_model("qwen3", "sdpa")
    rows = run_bench(model, ["quest"], [40], [60], [1], prompt_length=20, window=16, warmup=0, repeats=1,
                     include_dynamic=False, page_size=8)
    quest = next(r for r in rows if r["method"] == "quest")
    full = next(r for r in rows if r["method"] == "full")
    assert quest["evictions"] == 0 and quest["eviction_fired"] is None and quest["budget"] == 40
    assert quest["kv_bytes"] == full["kv_bytes"]  # no memory saved: the whole cache stays
    assert "selection" in quest["flag"]


@torch.no_grad()
def test_dense_layers_attend_everything_and_the_rest_select():
    model = tiny_model("qwen3", "sdpa")
    torch.manual_seed(6)
    prompt = torch.randint(0, 90, (1, 60))
    kw = dict(budget=36, window=16, page_size=8)
    tokens = [5]
    cache = EvictionCache(model, "quest", dense_layers=1, **kw)
    model(input_ids=prompt, **cache_kwargs(cache))
    query = torch.randn(1, 4, 1, 16)
    model(input_ids=torch.tensor([[tokens[0]]]), **cache_kwargs(cache))
    assert cache.layers[0].selection_mask(query) is None  # layer 0 dense
    mask = cache.layers[1].selection_mask(query)
    assert mask is not None and int(mask.sum(-1).max()) <= 36
    with pytest.raises(ValueError, match="dense_layers"):
        get_policy("quest", dense_layers=-1)
