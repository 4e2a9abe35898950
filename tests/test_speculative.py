"""Speculative decoding on an evicting cache (transformers' prompt lookup and assisted generation): the same tokens
and the same kept sets at every eviction as plain greedy decoding with the same cache settings (`vase.hf.verify`).

float64 models, so another CPU's rounding cannot flip a token; B = 16, w = 4, 70 new tokens: 16 evictions."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vase import cache_kwargs
from vase.caches.eager import EvictedStateError, EvictionCache, EvictionLayer

B, W, NEW = 16, 4, 70
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 2])  # repetitive (prompt lookup finds drafts); P + 3 drafts <= B


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, attn_implementation="sdpa",
                      eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@pytest.fixture(scope="module")
def models():
    model, draft = tiny_llama(0), tiny_llama(0)  # the draft: same weights, its own full cache (accepts often)
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return model, draft


def run(model, method: str, monkeypatch, **spec):
    """Tokens, the kept slots' positions after every compaction ([kv_heads, B] per layer), stats, forwards."""
    kept, forwards = [], [0]
    compact = EvictionLayer._compact

    def record(layer, index, pad):
        compact(layer, index, pad)
        kept.append((layer.layer_idx, layer.positions[0, :, :B].clone()))

    monkeypatch.setattr(EvictionLayer, "_compact", record)
    hook = model.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        cache = EvictionCache(model, method, budget=B, window=W, seed=3)
        out = model.generate(PROMPT, **cache_kwargs(cache), max_new_tokens=NEW, do_sample=False, **spec)
    finally:
        hook.remove()
        monkeypatch.setattr(EvictionLayer, "_compact", compact)
    return out[0, PROMPT.shape[1]:].tolist(), kept, cache.stats(), forwards[0]


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
@pytest.mark.parametrize("method", ["snapkv", "h2o", "knorm", "vase-attnv", "vase-dkv"])
def test_speculative_equals_plain_greedy(models, method, mode, monkeypatch):
    model, draft = models
    tokens, kept, stats, forwards = run(model, method, monkeypatch)
    spec = {"prompt_lookup_num_tokens": 3} if mode == "prompt_lookup" else {"assistant_model": draft}
    s_tokens, s_kept, s_stats, s_forwards = run(model, method, monkeypatch, **spec)
    assert forwards == NEW and s_forwards < NEW - 10  # drafts were accepted: fewer forwards of the target
    assert stats["evictions"] >= 8 and len(kept) == 2 * stats["evictions"]
    assert s_tokens == tokens
    assert len(s_kept) == len(kept)
    for (layer, pos), (s_layer, s_pos) in zip(kept, s_kept):
        assert s_layer == layer and torch.equal(s_pos, pos)
    for key in ("evictions", "tokens_evicted", "stored_length", "seen_length", "kv_bytes", "kv_bytes_full"):
        assert s_stats[key] == stats[key], key


def test_crop_takes_back_only_the_last_forward(models):
    model, _ = models
    cache = EvictionCache(model, "snapkv", budget=B, window=W)
    ids = torch.arange(5, 17)[None]
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
        model(input_ids=torch.tensor([[20, 21, 22]]), **cache_kwargs(cache))
    cache.crop(-2)  # two drafts of the last forward
    assert cache.get_seq_length() == 13
    with pytest.raises(EvictedStateError, match="cannot be cropped"):
        cache.crop(-1)  # the last forward is settled: nothing more to take back
    quant = EvictionCache(model, "snapkv", budget=B, window=W, kv_bits=4)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(quant))
    with pytest.raises(EvictedStateError, match="cannot be cropped"):
        quant.crop(-1)  # packed codes are shared by tokens: no crop
