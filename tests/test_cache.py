"""The evicting cache against transformers' DynamicCache, a masked full-cache reference, and its invariants."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import vase
from vase.hf.attention import UnsupportedModelError
from vase.caches.eager import EvictedStateError, EvictionCache
from vase.hf.compat import cache_kwargs
from vase.generation.generate import encode_prompts

from .conftest import F64, tiny_model

EVICTING = ["streamingllm", "random", "knorm", "snapkv", "rkv", "h2o", "tova", "curdkv", "vase-dkv",
            "vase-attnv", "evict-large-v", "snapkv-sample", "snapkv-v"]


def greedy_ids(model, ids, n, cache=None):
    kwargs = cache_kwargs(cache) if cache is not None else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None, **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_large_budget_is_token_identical_to_dynamic_cache(arch, attn):
    # float64: vase's attention path (its own mask) and transformers' may use other kernels
    torch.manual_seed(1)
    ids = torch.randint(0, 90, (1, 12))
    reference = greedy_ids(tiny_model(arch, attn, dtype=F64), ids, 40)
    model = tiny_model(arch, attn, dtype=F64)
    cache = EvictionCache(model, "vase-attnv", budget=128, window=16)
    assert greedy_ids(model, ids, 40, cache) == reference
    assert cache.stats()["evictions"] == 0
    # and through vase's own decode loop
    out = vase.generate(model, _ByteTokenizer(), [ids[0].tolist()], method="snapkv", budget=128, window=16,
                        max_new_tokens=40, greedy=True, chat_template=False, ignore_eos=True)
    assert out.token_ids[0] == reference


class _ByteTokenizer:
    """Hands pre-tokenised prompts straight through `encode_prompts`."""

    pad_token = eos_token = "<pad>"
    eos_token_id = None
    chat_template = None
    padding_side = "left"

    def __call__(self, texts, return_tensors, padding, add_special_tokens, padding_side="left"):
        width = max(len(t) for t in texts)
        ids = torch.tensor([[0] * (width - len(t)) + list(t) for t in texts])
        mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in texts])
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


# -- equivalence with a full cache whose evicted tokens are masked out per KV head --------------------------

_REFERENCE_MASKS: dict[int, torch.Tensor] = {}


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """sdpa over the full cache where each KV head sees only the slots in _REFERENCE_MASKS[layer] [b, h_kv, L]."""
    keep = _REFERENCE_MASKS[module.layer_idx][:, :, : key.shape[2]]
    group = query.shape[1] // key.shape[1]
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
    mask = keep.repeat_interleave(group, dim=1)[:, :, None, :] & causal
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _stored_masks(cache: EvictionCache, total: int) -> dict[int, torch.Tensor]:
    """Per layer: which sequence indices each row and KV head holds now, [b, h_kv, total] bool."""
    masks = {}
    for i, layer in enumerate(cache.layers):
        pos = layer.positions[:, :, : layer.length]
        held = torch.zeros(*pos.shape[:2], total + 1, dtype=torch.bool)
        held.scatter_(2, torch.where(pos >= 0, pos, total), True)
        masks[i] = held[:, :, :total]
    return masks


@pytest.mark.parametrize("method", ["snapkv", "vase-attnv", "vase-dkv", "h2o", "rkv", "streamingllm"])
def test_eviction_equals_full_cache_with_evicted_tokens_masked(method):
    model = tiny_model("qwen3", "sdpa", dtype=F64)  # float64: the two attention paths agree to ~1e-15
    torch.manual_seed(2)
    prompts = torch.randint(0, 90, (2, 10))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # row 1 is left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    steps, budget, window = 45, 20, 6

    # 1. decode with eviction, recording logits and what each layer held at each step
    cache = EvictionCache(model, method, budget, window, seed=[5, 6])
    logits, held, tokens = [], [], []
    with torch.no_grad():
        out = model(input_ids=prompts, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        logits.append(out.logits[:, -1])
        held.append(_stored_masks(cache, prompts.shape[1]))
        pos = positions[:, -1:]
        for _ in range(steps):
            tok = logits[-1].argmax(-1, keepdim=True)
            tokens.append(tok)
            pos = pos + 1
            out = model(input_ids=tok, position_ids=pos, **cache_kwargs(cache))
            logits.append(out.logits[:, -1])
            held.append(_stored_masks(cache, prompts.shape[1] + len(tokens)))
    assert cache.stats()["evictions"] >= 3

    # 2. the same tokens through a full DynamicCache, each KV head masked to what the evicting cache held
    AttentionInterface.register("vase_test_reference", _masked_reference_attention)
    AttentionMaskInterface.register("vase_test_reference", lambda **kw: None)
    reference_model = tiny_model("qwen3", "sdpa", dtype=F64)
    reference_model.set_attn_implementation("vase_test_reference")
    full = DynamicCache()
    with torch.no_grad():
        _REFERENCE_MASKS.clear()
        _REFERENCE_MASKS.update({i: m & mask[:, None, :].bool() for i, m in held[0].items()})
        out = reference_model(input_ids=prompts, position_ids=positions, **cache_kwargs(full))
        torch.testing.assert_close(out.logits[:, -1], logits[0], atol=1e-10, rtol=1e-10)
        pos = positions[:, -1:]
        for t, tok in enumerate(tokens, start=1):
            pos = pos + 1
            _REFERENCE_MASKS.clear()
            _REFERENCE_MASKS.update(held[t])
            out = reference_model(input_ids=tok, position_ids=pos, **cache_kwargs(full))
            torch.testing.assert_close(out.logits[:, -1], logits[t], atol=1e-10, rtol=1e-10)


# -- invariants at every step -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", EVICTING)
def test_invariants_hold_at_every_step(method):
    model = tiny_model("qwen3", "sdpa")
    budget, window = 24, 8
    cache = EvictionCache(model, method, budget, window, seed=0)
    policy = cache.policy
    torch.manual_seed(3)
    prompt = torch.randint(0, 90, (2, 9))
    with torch.no_grad():
        out = model(input_ids=prompt, **cache_kwargs(cache))
        pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        pos = torch.full((2, 1), prompt.shape[1] - 1)
        evictions_before = 0
        for step in range(70):
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            pos = pos + 1
            out = model(input_ids=tok, position_ids=pos, **cache_kwargs(cache))
            seen = prompt.shape[1] + step + 1
            for layer, ptrs in zip(cache.layers, pointers):
                assert (layer.keys.data_ptr(), layer.values.data_ptr()) == ptrs  # no re-allocation
                assert layer.length <= budget + window
                stored = layer.positions[:, :, : layer.length]
                for row in stored.reshape(-1, layer.length):
                    real = row[row >= 0].tolist()
                    assert len(real) == len(set(real))  # original positions unique
                    assert set(range(seen - window, seen)) <= set(real)  # recent window kept
                    if policy.protect_sinks:
                        assert set(range(policy.sinks)) <= set(real)
            evictions = cache.stats()["evictions"]
            if evictions > evictions_before:  # this step evicted: B kept + the new token
                assert cache.layers[0].length == budget + 1
                evictions_before = evictions
    assert cache.stats()["evictions"] == (9 + 70 - (budget + window)) // window + 1
    stats = cache.stats()
    assert stats["kv_bytes"] < stats["kv_bytes_full"]
    assert stats["tokens_evicted"] > 0


def test_long_prompt_is_cut_to_budget_at_first_eviction():
    model = tiny_model()
    cache = EvictionCache(model, "snapkv", budget=16, window=4)
    prompt = torch.randint(0, 90, (1, 30))
    with torch.no_grad():
        out = model(input_ids=prompt, **cache_kwargs(cache))
        lengths = []
        for step in range(6):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), position_ids=torch.tensor([[30 + step]]),
                        **cache_kwargs(cache))
            lengths.append(cache.layers[0].length)
    assert cache.layers[0].capacity == 30 + 4
    assert lengths == [31, 32, 33, 34, 17, 18]  # grows to P + w, then the first eviction brings it to B


# -- padded batches -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["snapkv", "vase-attnv", "vase-dkv", "curdkv", "h2o", "rkv", "random"])
@pytest.mark.parametrize("greedy", [True, False])
def test_padded_batch_rows_match_rows_alone(method, greedy, tokenizer):
    """Padding never reaches the policy and rows are independent: each row's tokens equal the row decoded alone.

    float64: a batch of 3 and a batch of 1 run other BLAS kernels on some CPUs (AVX-512, AMX), whose float32
    rounding flips near-tied argmaxes and sampled picks; in float64 only a real leak changes a token.
    """
    model = tiny_model("qwen3", "sdpa", dtype=F64)
    # 30, 2 and 45 tokens: row 0 (P > B) first evicts while row 2 is longer, so its candidates start after
    # 15 padding slots; rows 0 and 2 then evict together, row 1 alone.
    prompts = ["What is 12 plus 30, times two?", "Hi", "A much longer prompt, with more tokens in it."]
    kwargs = dict(method=method, budget=24, window=8, max_new_tokens=50, greedy=greedy, chat_template=False,
                  temperature=1.0, top_p=0.9)
    batch = vase.generate(model, tokenizer, prompts, seed=[11, 12, 13], **kwargs)
    assert batch.stats["evictions"] > 0
    for r, prompt in enumerate(prompts):
        alone = vase.generate(model, tokenizer, [prompt], seed=[11 + r], **kwargs)
        assert alone.token_ids[0] == batch.token_ids[r], f"row {r}"


def test_dropping_finished_rows_keeps_the_others_exact(tokenizer):
    model = tiny_model(dtype=F64)  # float64: the batch of 2 and the row alone prefill with other kernels
    eos = tokenizer.eos_token_id
    ids, mask = encode_prompts(tokenizer, ["abc", "defgh"], chat_template=False)
    cache = EvictionCache(model, "snapkv", budget=16, window=4)
    alone = EvictionCache(model, "snapkv", budget=16, window=4)
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache))
        solo = model(input_ids=ids[1:], position_ids=pos[1:], **cache_kwargs(alone))
        cache.batch_select_indices(torch.tensor([1]))
        nxt, p = solo.logits[:, -1:].argmax(-1), pos[1:, -1:]
        for _ in range(30):
            p = p + 1
            a = model(input_ids=nxt, position_ids=p, **cache_kwargs(cache)).logits[:, -1]
            b = model(input_ids=nxt, position_ids=p, **cache_kwargs(alone)).logits[:, -1]
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
            nxt = b.argmax(-1, keepdim=True)
    assert cache.layers[0].pad == [0] and eos is not None


# -- bad input ----------------------------------------------------------------------------------------------

def test_bad_configuration_errors_name_what_to_change(qwen3):
    with pytest.raises(ValueError, match="budget .* must be larger than window"):
        EvictionCache(qwen3, "vase-attnv", budget=68, window=64)
    with pytest.raises(ValueError, match="window must be a positive"):
        EvictionCache(qwen3, "snapkv", budget=100, window=0)
    with pytest.raises(vase.UnknownMethodError, match="Did you mean vase-attnv"):
        EvictionCache(qwen3, "vase-atnv", budget=100)
    with pytest.raises(vase.UnknownMethodError, match="takes no parameter 'rank'.*it takes"):
        EvictionCache(qwen3, "snapkv", budget=100, rank=3)


def test_unsupported_models_are_refused_by_name():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                           use_sliding_window=True, sliding_window=8, max_window_layers=0))
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM.*sliding"):
        EvictionCache(sliding, "snapkv", budget=100)

    class LegacyModel(torch.nn.Module):
        _supports_attention_backend = False

    with pytest.raises(UnsupportedModelError, match="LegacyModel.*attention interface"):
        EvictionCache(LegacyModel(), "snapkv", budget=100)


def test_beam_search_and_crop_raise(qwen3):
    ids = torch.randint(0, 90, (1, 5))
    cache = EvictionCache(qwen3, "snapkv", budget=32, window=8)
    with pytest.raises(EvictedStateError, match="beam search"):
        qwen3.generate(ids, **cache_kwargs(cache), num_beams=2, max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache = EvictionCache(qwen3, "snapkv", budget=32, window=8)
    with torch.no_grad():
        qwen3(input_ids=ids, **cache_kwargs(cache))
    with pytest.raises(EvictedStateError, match="cannot be cropped"):
        cache.crop(-5)  # the whole prompt: the first token of a forward is never a draft


def test_importing_vase_changes_nothing_global():
    import subprocess
    import sys

    code = ("from transformers import AttentionInterface; import vase; "
            "assert not any(k.startswith('vase_') for k in AttentionInterface._global_mapping)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_other_caches_still_work_with_vase_attention(tokenizer):
    """After a vase cache installed its attention function, a DynamicCache run is unchanged (with padding).

    float64: vase's attention function may build the mask itself and so run another sdpa kernel."""
    qwen3 = tiny_model(dtype=F64)
    ids, mask = encode_prompts(tokenizer, ["abc", "defghij"], chat_template=False)
    reference = tiny_model(dtype=F64).generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id)
    EvictionCache(qwen3, "snapkv", budget=32, window=8)
    assert qwen3.config._attn_implementation == "vase_sdpa"
    out = qwen3.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(out, reference)


def test_per_row_stats_follow_each_rows_schedule(tokenizer):
    """Per-sequence stats, including rows that finished early and left the batch."""
    model = tiny_model()
    prompts = ["a", "a much longer prompt here"]
    out = vase.generate(model, tokenizer, prompts, method="snapkv", budget=20, window=5, max_new_tokens=40,
                        greedy=True, chat_template=False, ignore_eos=True)
    for r, prompt in enumerate(prompts):
        alone = vase.generate(model, tokenizer, [prompt], method="snapkv", budget=20, window=5,
                              max_new_tokens=40, greedy=True, chat_template=False, ignore_eos=True)
        row = out.stats["rows"][r]
        assert row == alone.stats["rows"][0]
        assert row["evictions"] == alone.stats["evictions"] > 0
        assert row["kv_bytes"] == alone.stats["kv_bytes"] and row["kv_bytes_full"] == alone.stats["kv_bytes_full"]


# -- the policy state hooks, driven generically -------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402
from typing import ClassVar  # noqa: E402

from vase.core.policies import Policy  # noqa: E402


@dataclass(frozen=True)
class _StatefulProbe(Policy):
    """Declares one per-slot and one per-layer state and records what the cache hands it."""

    name = "probe"
    slot_state = ("mark",)
    calls: ClassVar[list] = []

    def init_layer_state(self, batch, kv_heads, head_dim, generators, device):
        draws = torch.stack([torch.rand(3, generator=g) for g in generators])  # [batch, 3]
        self.calls.append(("init", draws.clone()))
        return {"token": draws}

    def score(self, keys, values, queries, generator=None, mark=None, token=None, **extra):
        self.calls.append(("select", token.clone()))
        mark.copy_(keys[..., 0].float())  # in place: each candidate's slot remembers its own key
        return keys[..., 1].float()


def test_policy_state_hooks_are_kept_aligned_and_per_row():
    """Slot state moves with its slot through compaction and comes back from `select` (rows evicting alone
    included); layer state is drawn once per layer and row, from that row's generator, before its first eviction."""
    model = tiny_model()
    _StatefulProbe.calls.clear()
    B, w = 12, 4
    torch.manual_seed(7)
    prompts = torch.randint(0, 90, (2, 15))
    mask = torch.ones_like(prompts)
    mask[0, :10] = 0  # rows of 5 and 15 prompt tokens evict at different steps
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = EvictionCache(model, _StatefulProbe(), B, w, seed=[21, 22])
    with torch.no_grad():
        out = model(input_ids=prompts, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        pos = positions[:, -1:]
        for _ in range(30):
            pos = pos + 1
            out = model(input_ids=out.logits[:, -1:].argmax(-1), position_ids=pos, **cache_kwargs(cache))
    layer = cache.layers[0]
    assert min(layer.row_evictions) >= 4
    for layer in cache.layers:
        stored = slice(None, layer.length)
        mark, key0 = layer.slot_state["mark"][:, :, stored], layer.keys[:, :, stored, 0]
        # A slot that was a candidate at its row's last eviction holds its own key; newer slots hold 0.
        for r in range(2):
            real = slice(layer.pad[r], None)
            n = (mark[r, :, real] != 0).sum(-1)
            assert (n == B - w).all()  # the kept candidates; the w recent and the new ones were never scored
            torch.testing.assert_close(mark[r, :, real][:, : B - w], key0[r, :, real][:, : B - w].float())
    inits = [c[1] for c in _StatefulProbe.calls if c[0] == "init"]
    assert [x.shape[0] for x in inits] == [1, 1, 1, 1]  # per layer and row, each row at its own first eviction
    for r, seed in enumerate([21, 22]):  # layer i's state of row r: the i-th draw of row r's own generator
        g = torch.Generator().manual_seed(seed)
        for layer in cache.layers:
            assert torch.equal(layer.layer_state["token"][r], torch.rand(3, generator=g))
    selects = [token for kind, token in _StatefulProbe.calls if kind == "select"]
    assert len(selects) == sum(sum(layer.row_evictions) for layer in cache.layers)  # rows evict alone here
    assert all(any(torch.equal(t[0], x[0]) for x in inits) for t in selects)  # each select got its row's state


# -- the one mask builder -----------------------------------------------------------------------------------

from vase.hf.masks import and_selection, causal_padding_mask, mask_kind, real_slots  # noqa: E402


@pytest.mark.parametrize("q_len", [1, 3, 7])
@pytest.mark.parametrize("pad", [[0, 0], [2, 0], [0, 5]])
def test_mask_builder_matches_elementwise_definition(q_len, pad):
    L = 7
    real = real_slots(pad, L, torch.device("cpu"))
    # reference: query i (at slot L - q + i) sees slot j iff j <= L - q + i and j is real
    ref = torch.tensor([[[[j <= L - q_len + i and j >= pad[r] for j in range(L)] for i in range(q_len)]]
                        for r in range(2)])
    as_bool = causal_padding_mask(real, q_len, L, "bool", torch.float32, torch.device("cpu"))
    additive = causal_padding_mask(real, q_len, L, "additive", torch.float32, torch.device("cpu"))
    flash = causal_padding_mask(real, q_len, L, "flash", torch.float32, torch.device("cpu"))
    if not any(pad) and (q_len == 1 or q_len == L):
        assert as_bool is None  # sdpa: a single query, or its own is_causal
    else:
        assert torch.equal(as_bool.expand_as(ref), ref)
    if not any(pad) and q_len == 1:
        assert additive is None
    else:
        assert torch.equal((additive == 0).expand_as(ref), ref)
        assert (additive[additive != 0] == torch.finfo(torch.float32).min).all()
    assert (flash is None) if not any(pad) else torch.equal(flash, real.int())
    # a selection ANDs in per head
    selected = torch.rand(2, 4, q_len, L) > 0.5
    both = and_selection(causal_padding_mask(real, q_len, L, "bool", torch.float32, torch.device("cpu")),
                         selected, "bool", torch.float32)
    if as_bool is not None:
        assert torch.equal(both, ref & selected)
    with pytest.raises(ValueError, match="flash_attention_2"):
        and_selection(flash, selected, "flash", torch.float32)
    assert [mask_kind(k) for k in ("sdpa", "eager", "flash_attention_2")] == ["bool", "additive", "flash"]


def test_attention_module_does_not_import_the_cache():
    import subprocess
    import sys

    code = "import sys, vase.hf.attention; assert 'vase.caches.eager' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cache_keyword_is_the_one_this_transformers_takes():
    """vase.hf.compat picks `cache=` (5.24+) or `past_key_values=` (5.16-5.23): the model's forward must name it."""
    import inspect

    from transformers import Qwen3ForCausalLM

    from vase.hf.compat import CACHE_KWARG, TRANSFORMERS_VERSION, _release

    assert CACHE_KWARG in inspect.signature(Qwen3ForCausalLM.forward).parameters
    assert (5, 16, 1) <= TRANSFORMERS_VERSION < (6,)
    assert _release("5.24.0.dev0") == (5, 24, 0) and _release("5.19.1rc1") == (5, 19, 1)
