"""Multi-head latent attention (DeepSeek-V2/V3, tiny random models in float64): vase evicts the latent cache,
one kept set per layer shared by every head (`vase.hf.latent`, `vase.core.shared_heads`).

- With nothing evicted, vase's cache equals transformers' DynamicCache (logits and tokens).
- With eviction, the logits equal those of the model's own DynamicCache with every head masked to exactly the
  tokens vase's latent cache held, through 8+ evictions, for every method that can score MLA (the others are
  refused in one line); MoE routing agrees.
- The shared choice itself: the heads' scores averaged, the value guard on the heads' concatenated values, H2O's
  accumulator one per token; and, end to end, the first eviction keeps the tokens a hand computation of SnapKV's
  head-averaged window attention over the model's own up-projected keys and queries keeps.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

import vase
from vase.caches.eager import EvictionCache
from vase.caches.static import CompileUnsupportedError, check_compilable
from vase.core.errors import SpecError
from vase.core.policies import get_policy, window_attention
from vase.core.shared_heads import choose_shared, shared_magnitude
from vase.hf.compat import cache_kwargs
from vase.hf.hybrid import kv_bytes_per_layer_token
from vase.hf.support import config_problem

from .hybrid_models import MLA, hybrid_config, hybrid_model
from .test_cache import _ByteTokenizer, _stored_masks
from .test_hybrid import PAD, _decode, _decode_forced, _Only, _prompts, _reference_model, _replay_masked

#: every evicting method that can score MLA; curdkv, vase-dkv and quest are refused (test_refusals)
METHODS = ("snapkv", "snapkv-sample", "snapkv-v", "vase-attnv", "h2o", "tova", "rkv", "knorm", "evict-large-v",
           "random", "streamingllm")
REFUSED = ("curdkv", "vase-dkv", "quest")


def _routers(model, log: list):
    """Record every MoE router's (logits, chosen experts) per forward (DeepSeek's `...TopkRouter`)."""
    return [m.register_forward_hook(lambda m, i, out: log.append((out[0], out[-1])))
            for m in model.modules() if type(m).__name__.endswith("TopkRouter")]


@pytest.mark.parametrize("family,attn", [("deepseek-v3", "sdpa"), ("deepseek-v3", "eager"), ("deepseek-v2", "sdpa")])
def test_nothing_evicted_equals_dynamic_cache(family, attn):
    ids, mask = _prompts()
    if attn == "eager":  # transformers' own eager DeepSeek gives NaN logits for a left-padded row: the unpadded one
        ids, mask = ids[:1], mask[:1]
    stock = hybrid_model(family, attn)
    ref_logits, ref_tokens = _decode(stock, DynamicCache(config=stock.config), ids, mask, 30)
    model = hybrid_model(family, attn)
    cache = EvictionCache(model, "snapkv", budget=256, window=8)
    logits, tokens = _decode(model, cache, ids, mask, 30)
    assert model.config._attn_implementation == f"vase_{attn}" and cache.stats()["evictions"] == 0
    assert [t.tolist() for t in tokens] == [t.tolist() for t in ref_tokens]
    for a, b in zip(logits, ref_logits):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    layer = cache.layers[0]  # the latent, one "KV head" for every query head: [b, 1, L, rank] and [b, 1, L, rope]
    assert layer.keys.shape[1] == layer.values.shape[1] == 1
    assert (layer.keys.shape[3], layer.values.shape[3]) == (16, 8)


@pytest.mark.parametrize("family,method", [("deepseek-v3", m) for m in METHODS] + [("deepseek-v2", "vase-attnv"),
                                                                                   ("deepseek-v2", "h2o")])
def test_eviction_equals_dynamic_cache_with_the_kept_set_masked_in_every_head(family, method):
    model = hybrid_model(family)
    ids, mask = _prompts()
    steps, budget, window = 40, 12, 4
    layers = range(model.config.num_hidden_layers)

    # 1. decode with eviction, recording logits, routing and what each layer's latent cache held at each step
    cache = EvictionCache(model, method, budget, window, seed=[5, 6])
    held: list[dict[int, torch.Tensor]] = []
    routed: list = []
    handles = _routers(model, routed)
    original = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        out = original(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == layers[-1]:
            held.append(_stored_masks(_Only(cache.evicting_layers), cache.layers[layer_idx].seen))
        return out

    cache.update = update
    logits, tokens = _decode(model, cache, ids, mask, steps)
    for h in handles:
        h.remove()
    held[0] = {i: m & mask[:, None, :].bool() for i, m in held[0].items()}  # the prefill's padding, learnt after
    assert cache.stats()["evictions"] >= 8
    assert all(m.shape[1] == 1 for step in held for m in step.values())  # one kept set per layer for every head
    for layer in cache.evicting_layers:  # B tokens per layer after an eviction (and at most w more between)
        assert max(layer.real_lengths()) <= budget + window

    # 2. the same tokens through the model's own DynamicCache, every head of each layer masked to what vase held
    reference = _reference_model(family)
    ref_routed: list = []
    handles = _routers(reference, ref_routed)
    ref_logits, _, _ = _replay_masked(reference, held, 0, ids, mask, tokens)
    for h in handles:
        h.remove()
    for t, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"step {t}")
    assert len(routed) == len(ref_routed) == 2 * (steps + 1) and routed[0][0].abs().max() > 0  # 2 MoE layers
    real = mask.flatten().bool()
    for (la, ia), (lb, ib) in zip(routed, ref_routed):  # MoE: the same experts from the same router logits
        rows = real if la.shape[0] == real.numel() else slice(None)
        assert torch.equal(ia[rows], ib[rows])
        torch.testing.assert_close(la[rows], lb[rows], atol=1e-10, rtol=1e-10)

    # 3. the latent cache's bytes: kv_lora_rank + qk_rope_head_dim per token and layer
    per_token = kv_bytes_per_layer_token(model.config, 8)
    stored = sum(l.length - p for l in cache.evicting_layers for p in l.pad)
    assert per_token == (16 + 8) * 8 and sum(r["kv_bytes"] for r in cache.row_stats()) == stored * per_token

    # 4. vase.generate (its own decode loop, rows padded by its tokenizer) gives the same greedy tokens
    if method in ("vase-attnv", "h2o"):
        prompts = [ids[0].tolist(), ids[1, PAD:].tolist()]
        out = vase.generate(model, _ByteTokenizer(), prompts, method=method, budget=budget, window=window,
                            seed=[5, 6], max_new_tokens=steps, greedy=True, chat_template=False, ignore_eos=True)
        assert out.token_ids == torch.cat(tokens, dim=-1).tolist()


def test_first_eviction_keeps_the_head_averaged_window_attention_top_k():
    """SnapKV (no smoothing) on layer 0 at the first eviction, by hand from the model's own attention inputs:
    softmax(q k / sqrt(dk)) of each head's up-projected keys under the last w queries, mean over the window,
    mean over the heads, top B - w. A head-0-only or summed-logit score keeps other tokens here."""
    model = hybrid_model("deepseek-v3")
    torch.manual_seed(7)
    budget, window, prompt = 12, 4, 10
    ids = torch.randint(0, 90, (1, budget + window + 1))  # the 17th token's update evicts down to B
    captured = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            captured["q"], captured["k"] = query, key
        return AttentionInterface._global_mapping["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("vase_test_mla_record", recording)
    reference = hybrid_model("deepseek-v3", "vase_test_mla_record")
    with torch.no_grad():
        reference(input_ids=ids[:, : budget + window], past_key_values=DynamicCache(config=reference.config))
    q, k = captured["q"][:, :, -window:], captured["k"][:, :, : budget]  # the window, the candidates
    attn = (q @ k.transpose(-1, -2) / math.sqrt(k.shape[-1])).softmax(-1).mean(2)  # [1, h, n]: per head
    expected = set(attn.mean(1)[0].topk(budget - window).indices.tolist())
    assert expected != set(attn[0, 0].topk(budget - window).indices.tolist())  # the heads disagree here

    cache = EvictionCache(model, "snapkv", budget, window, smooth_kernel=1)
    with torch.no_grad():
        out = model(input_ids=ids[:, :prompt], **cache_kwargs(cache))
        for t in range(prompt, budget + window + 1):
            out = model(input_ids=ids[:, t:t + 1], **cache_kwargs(cache))
    layer = cache.layers[0]
    assert layer.evictions == 1
    assert set(layer.positions[0, 0, : budget - window].tolist()) == expected


def test_shared_choice_averages_head_scores_and_guards_concatenated_values():
    torch.manual_seed(0)
    b, h, n, w, dk, dv = 2, 4, 20, 4, 6, 5
    keys, values, queries = torch.randn(b, h, n, dk), torch.randn(b, h, n, dv), torch.randn(b, h, w, dk)
    budget = 12
    # scores: the heads' window attention averaged, top B - w
    kept = choose_shared(get_policy("snapkv"), keys, values, queries, budget, w)
    assert kept.shape == (b, 1, budget - w)
    expected = window_attention(keys, queries).mean(1, keepdim=True).topk(budget - w).indices
    assert torch.equal(kept.sort(-1).values, expected.sort(-1).values)
    # the value guard: one outlier coordinate in one head of token 13 puts it first in the reserve
    values[:, 2, 13, 1] = 50.0
    guarded = choose_shared(get_policy("snapkv-v", value_guard=0.25), keys, values, queries, budget, w)
    assert guarded[:, 0, 0].tolist() == [13, 13]
    magnitude = shared_magnitude(values)  # range over the heads' values concatenated
    cat = values.transpose(1, 2).reshape(b, n, h * dv)
    torch.testing.assert_close(magnitude[:, 0], cat.amax(-1) - cat.amin(-1))
    # H2O: one accumulator per token, the heads' mean window attention added at each eviction
    acc = torch.zeros(b, 1, n)
    choose_shared(get_policy("h2o"), keys, values, queries, budget, w, state={"accumulated": acc})
    choose_shared(get_policy("h2o"), keys, values, queries, budget, w, state={"accumulated": acc})
    torch.testing.assert_close(acc, 2 * window_attention(keys, queries, smooth_kernel=1).mean(1, keepdim=True))


@pytest.mark.parametrize("method", REFUSED)
def test_methods_that_cannot_score_mla_are_refused_in_one_line(method):
    with pytest.raises(SpecError, match=f"{method} cannot evict multi-head latent attention") as err:
        EvictionCache(hybrid_model("deepseek-v3"), method, 12, 4)
    assert "\n" not in str(err.value)


def test_storage_compile_and_other_mla_types_are_refused_in_one_line():
    model = hybrid_model("deepseek-v3")
    with pytest.raises(SpecError, match="not supported on multi-head latent attention"):
        EvictionCache(model, "snapkv", 12, 4, kv_bits=8)
    with pytest.raises(CompileUnsupportedError, match="multi-head latent attention"):
        check_compilable(EvictionCache(model, "snapkv", 12, 4), "sdpa")
    config = hybrid_config("deepseek-v3")
    assert config_problem(config) is None
    config.model_type = "deepseek_v32"  # a top-k indexer beside the latent: not run
    assert "deepseek_v32" in config_problem(config)
    assert all(config_problem(hybrid_config(f)) is None for f in MLA)


def test_models_page_rows_of_mla_families():
    """docs/models.md's MLA rows say what `vase.hf.support` and the vLLM plugin do (it evicts the latent cache of
    both types, compared in tests/test_vllm_mla.py)."""
    from pathlib import Path
    from types import SimpleNamespace as NS

    from vase.vllm.model_refusals import model_refusal

    from .test_hybrid import _table

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    rows = {r["model_type"]: r for r in _table(text, "| family | model_type |")}
    for family in MLA:
        cfg = hybrid_config(family)
        row = rows[cfg.model_type]
        assert config_problem(cfg) is None and row["transformers"] == "tested (tests/test_mla.py)"
        assert row["evicted"].startswith("every layer (the latent cache") and row["compile=True"] == "refused (MLA)"
        stand_in = NS(model="m", hf_config=cfg, hf_text_config=cfg, use_mla=True, is_hybrid=False,
                      has_inner_state=False, get_sliding_window=lambda: None)
        assert model_refusal(stand_in) is None
        assert row["vLLM CPU"].startswith("tested (tests/test_vllm_mla.py"), family


def test_teacher_forcing_equals_decoding():
    """`forced_log_probs` (several tokens per forward up to each eviction point, the eval's fidelity) on the latent
    cache: the log-probs of decoding the same tokens one at a time."""
    from vase.generation.generate import forced_log_probs

    model = hybrid_model("deepseek-v3")
    torch.manual_seed(1)
    ids = torch.randint(0, 90, (1, 10))
    cache = EvictionCache(model, "vase-attnv", 12, 4)
    logits, tokens = _decode(model, cache, ids, torch.ones_like(ids), 40)
    assert cache.stats()["evictions"] >= 8
    forced = forced_log_probs(model, ids[0], torch.cat(tokens, dim=-1)[0], method="vase-attnv", budget=12, window=4)
    torch.testing.assert_close(forced, torch.stack([l[0].float().log_softmax(-1) for l in logits[:-1]]),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_prompt_lookup_equals_plain_greedy(method, monkeypatch):
    """transformers' prompt lookup (drafts verified several at a time, evictions deferred across them,
    `vase.hf.verify`) on the latent cache: the tokens and kept sets of plain greedy decoding."""
    from .test_speculative import run

    model = hybrid_model("deepseek-v3")
    model.generation_config.eos_token_id = None
    tokens, kept, stats, forwards = run(model, method, monkeypatch)
    s_tokens, s_kept, s_stats, s_forwards = run(model, method, monkeypatch, prompt_lookup_num_tokens=3)
    assert stats["evictions"] >= 8 and s_forwards < forwards - 10  # drafts were accepted
    assert s_tokens == tokens and len(s_kept) == len(kept)
    assert all(a == b and torch.equal(p, q) for (a, p), (b, q) in zip(kept, s_kept))
