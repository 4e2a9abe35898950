"""Hybrid-attention and MoE models (Gemma 3, gpt-oss, Qwen3-Next, Qwen3.5, Qwen3-MoE, Llama 4), float64.

The pattern of tests/test_cache.py's masked full-cache reference, extended: vase evicts the
full-attention layers; a reference model runs transformers' own DynamicCache (its sliding and
linear-attention layers untouched) and masks each full-attention layer's KV heads to exactly what
vase's cache held at that step. Logits agree to 1e-10, the tokens of `vase.generate` equal the
reference's, and the sliding windows and recurrent states end bit-for-bit alike.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

import vase
from vase.caches.eager import EvictionCache
from vase.hf.compat import cache_kwargs
from vase.hf.hybrid import bounded_bytes, kv_bytes_per_layer_token, layer_types, recurrent_state_bytes
from vase.caches.static import CompileUnsupportedError

from .hybrid_models import FAMILIES, hybrid_model
from .test_cache import _ByteTokenizer, _stored_masks

HYBRID = ("gemma3", "gpt-oss", "qwen3-next", "qwen3.5", "llama4")
MOE = ("gpt-oss", "qwen3-next", "qwen3-moe")

# -- the reference: the model's own cache, each full-attention KV head masked to what vase held -------------

_HELD: dict[int, torch.Tensor] = {}  # full-attention layer index -> [b, h_kv, L] bool, what vase's cache held


def _reference_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None,
                         **kwargs):
    """Attention written out in the input's precision: scores, the model's soft-cap if any, the mask, gpt-oss's
    sink column (`s_aux`) in the softmax and dropped after it. Full-attention layers see only the slots in
    _HELD (and causality); sliding layers get transformers' own (eager) sliding mask unchanged."""
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ k.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    held = _HELD.get(module.layer_idx)
    if held is None:
        if attention_mask is not None:
            scores = scores + attention_mask
    else:
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
        keep = held[:, :, :kv_len].repeat_interleave(group, dim=1)[:, :, None, :] & causal
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    if s_aux is not None:
        sink = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ v).transpose(1, 2).contiguous(), None


def _reference_mask(*, attention_mask=None, **kwargs):
    """transformers' own eager mask for sliding and chunked layers (asked with local_size); full layers mask in the
    kernel."""
    if kwargs.get("local_size") is None:
        return None
    return AttentionMaskInterface._global_mapping["eager"](attention_mask=attention_mask, **kwargs)


def _reference_model(family: str):
    AttentionInterface.register("vase_test_hybrid_ref", _reference_attention)
    AttentionMaskInterface.register("vase_test_hybrid_ref", _reference_mask)
    model = hybrid_model(family)
    model.set_attn_implementation("vase_test_hybrid_ref")
    return model


def _routers(model, log: list):
    """Record every MoE router's (logits, chosen experts) per forward."""
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            handles.append(module.register_forward_hook(lambda m, i, out: log.append((out[0], out[-1]))))
    return handles


PAD = 7  # row 1's left padding: 4 real tokens


def _prompts():
    torch.manual_seed(3)
    ids = torch.randint(0, 90, (2, 11))
    mask = torch.ones_like(ids)
    # row 1 is left-padded (with id 0, as _ByteTokenizer pads), its padding still inside the sliding window (8)
    ids[1, :PAD], mask[1, :PAD] = 0, 0
    return ids, mask


def _decode(model, cache, ids, mask, steps, routers=None):
    """Greedy decode as `vase.generate` does (the growing 2-D mask at every step); returns logits [steps+1] and
    the tokens, and, when `cache` is vase's, what each full-attention layer held before each forward's attention."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, tokens = [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        logits.append(out.logits[:, -1])
        pos = positions[:, -1:]
        for _ in range(steps):
            tok = logits[-1].argmax(-1, keepdim=True)
            tokens.append(tok)
            pos, mask = pos + 1, torch.cat([mask, torch.ones_like(tok)], dim=-1)
            out = model(input_ids=tok, attention_mask=mask, position_ids=pos, **cache_kwargs(cache))
            logits.append(out.logits[:, -1])
    return logits, tokens


@pytest.mark.parametrize("family,method", [(f, "snapkv") for f in FAMILIES] + [("gemma3", "vase-attnv"),
                                                                               ("qwen3-next", "vase-attnv"),
                                                                               ("gpt-oss", "h2o"),
                                                                               ("llama4", "vase-attnv")])
def test_eviction_equals_the_models_own_cache_with_evicted_tokens_masked(family, method):
    model = hybrid_model(family)
    ids, mask = _prompts()
    steps, budget, window = 40, 12, 4
    full_layers = [i for i, t in enumerate(layer_types(model.config)) if t == "full_attention"]

    # 1. decode with eviction, recording logits, routing and what each full-attention layer held at each step
    cache = EvictionCache(model, method, budget, window, seed=[5, 6])
    held: list[dict[int, torch.Tensor]] = []
    routed: list = []
    handles = _routers(model, routed)
    original = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):  # what the attention of this forward sees
        out = original(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == full_layers[-1]:
            seen = cache.layers[layer_idx].seen
            held.append({i: m for i, m in zip(full_layers, _stored_masks(
                _Only(cache.evicting_layers), seen).values())})
        return out

    cache.update = update
    logits, tokens = _decode(model, cache, ids, mask, steps)
    for h in handles:
        h.remove()
    held[0] = {i: m & mask[:, None, :].bool() for i, m in held[0].items()}  # the prefill's padding is learnt after its update
    assert cache.stats()["evictions"] >= 5
    assert [type(l).__name__ for l in cache.kept_layers] == [
        type(l).__name__ for l in DynamicCache(config=model.config).layers if not _is_full(l)]

    # 2. the same tokens through the model's own DynamicCache, each full-attention KV head masked to what vase held
    reference = _reference_model(family)
    ref_routed: list = []
    handles = _routers(reference, ref_routed)
    ref_logits, ref_tokens, full = _replay_masked(reference, held, full_layers[0], ids, mask, tokens)
    for h in handles:
        h.remove()
    for t, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"step {t}")
    assert len(routed) == len(ref_routed) > 0 or family not in MOE
    real = mask.flatten().bool()  # padding positions' own (unused) outputs depend on how a kernel fills them
    for (la, ia), (lb, ib) in zip(routed, ref_routed):  # MoE: the same experts chosen from the same logits
        rows = real if la.shape[0] == real.numel() else slice(None)
        assert torch.equal(ia[rows], ib[rows])
        torch.testing.assert_close(la[rows], lb[rows], atol=1e-10, rtol=1e-10)

    # 3. eviction never touched a sliding or recurrent layer: they end as the model's own cache ends
    for i, (ours, theirs) in enumerate(zip(cache.layers, full.layers)):
        if i in full_layers:
            continue
        if isinstance(ours, LinearAttentionCacheLayerMixin):
            for a, b in zip([*ours.conv_states.values(), *ours.recurrent_states.values()],
                            [*theirs.conv_states.values(), *theirs.recurrent_states.values()]):
                torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        else:
            assert ours.keys.shape == theirs.keys.shape == (2, 2, 7, 16)  # window 8 - 1 tokens, as transformers keeps
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(ours.values, theirs.values, atol=1e-10, rtol=1e-10)

    # 4. vase.generate (its own decode loop, rows padded by its tokenizer) gives the same greedy tokens
    prompts = [ids[0].tolist(), ids[1, PAD:].tolist()]
    out = vase.generate(model, _ByteTokenizer(), prompts, method=method, budget=budget, window=window, seed=[5, 6],
                        max_new_tokens=steps, greedy=True, chat_template=False, ignore_eos=True)
    expected = torch.cat(tokens, dim=-1).tolist()
    assert out.token_ids == expected


class _Only:
    """`_stored_masks` over a list of layers."""

    def __init__(self, layers):
        self.layers = layers


def _is_full(layer) -> bool:
    return type(layer).__name__ == "DynamicLayer"


def _decode_forced(model, cache, ids, mask, tokens):
    """`_decode` feeding the given tokens (the reference follows vase's trajectory)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        logits.append(out.logits[:, -1])
        pos = positions[:, -1:]
        for tok in tokens:
            pos, mask = pos + 1, torch.cat([mask, torch.ones_like(tok)], dim=-1)
            out = model(input_ids=tok, attention_mask=mask, position_ids=pos, **cache_kwargs(cache))
            logits.append(out.logits[:, -1])
    return logits, tokens


def test_gpt_oss_with_nothing_evicted_equals_its_own_eager_attention():
    """vase's attention path on gpt-oss (sinks, sliding layers, MoE) with a budget nothing passes: the model's
    own eager attention over its DynamicCache, to rounding, batch 2 with padding."""
    ids, mask = _prompts()
    stock = hybrid_model("gpt-oss")
    ref_logits, ref_tokens = _decode(stock, DynamicCache(config=stock.config), ids, mask, 30)
    model = hybrid_model("gpt-oss")
    cache = EvictionCache(model, "snapkv", budget=256, window=8)
    logits, tokens = _decode(model, cache, ids, mask, 30)
    assert model.config._attn_implementation == "vase_eager" and cache.stats()["evictions"] == 0
    assert [t.tolist() for t in tokens] == [t.tolist() for t in ref_tokens]
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # the sinks matter: without them the logits move
    with torch.no_grad():
        for layer in stock.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    moved, _ = _decode(stock, DynamicCache(config=stock.config), ids, mask, 1)
    assert (moved[0] - ref_logits[0]).abs().max() > 1e-3


def test_llama4_with_nothing_evicted_equals_its_own_cache():
    """Llama 4 (chunked-local RoPE layers, chunk 8, beside global NoPE layers with temperature tuning) with a
    budget nothing passes: the model's own sdpa over its DynamicCache, to rounding, batch 2 with padding, 40
    steps (6 chunks crossed)."""
    ids, mask = _prompts()
    stock = hybrid_model("llama4")
    ref_logits, ref_tokens = _decode(stock, DynamicCache(config=stock.config), ids, mask, 40)
    model = hybrid_model("llama4")
    cache = EvictionCache(model, "snapkv", budget=256, window=8)
    logits, tokens = _decode(model, cache, ids, mask, 40)
    assert model.config._attn_implementation == "vase_sdpa" and cache.stats()["evictions"] == 0
    assert [t.tolist() for t in tokens] == [t.tolist() for t in ref_tokens]
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # the chunks and the temperature tuning matter: full attention on every layer, or no tuning, moves the logits
    for change in ("no chunks", "no tuning"):
        other = hybrid_model("llama4")
        if change == "no chunks":
            other.config.layer_types = ["full_attention"] * 4
        for layer in other.model.layers if change == "no tuning" else []:
            layer.self_attn.attn_temperature_tuning = False
        moved, _ = _decode(other, DynamicCache(config=other.config), ids, mask, 8)
        assert max((a - b).abs().max() for a, b in zip(moved, ref_logits)) > 1e-3, change


def test_llama4_evicts_only_its_global_layers():
    """vase evicts Llama 4's NoPE (global, full-attention) layers and leaves each chunked-local layer to
    transformers' own sliding layer with the chunk as window: after 40 steps through 5+ evictions the chunked
    layers hold the last chunk - 1 = 7 tokens, equal to the model's own DynamicCache's on the same tokens."""
    from vase.hf.hybrid import CHUNKED

    model = hybrid_model("llama4")
    cfg = model.config
    ids, mask = _prompts()
    cache = EvictionCache(model, "snapkv", budget=12, window=4)
    _, tokens = _decode(model, cache, ids, mask, 40)
    nope = [i for i, rope in enumerate(cfg.no_rope_layers) if not rope]
    assert nope == [1, 3] and [l.layer_idx for l in cache.evicting_layers] == nope
    assert all(l.evictions >= 5 and l.length <= 12 + 4 for l in cache.evicting_layers)
    assert cache.layer_types == layer_types(cfg) == [CHUNKED, "full_attention"] * 2
    full = DynamicCache(config=cfg)
    _decode_forced(hybrid_model("llama4"), full, ids, mask, tokens)
    for i in (0, 2):
        ours, theirs = cache.layers[i], full.layers[i]
        assert ours.sliding_window == theirs.sliding_window == cfg.attention_chunk_size == 8
        assert ours.keys.shape == (2, 2, 7, 16)
        if i == 0:  # below the first evicting layer: its K/V depend on the tokens alone (layer 2's see the eviction)
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(ours.values, theirs.values, atol=1e-12, rtol=1e-12)
    per_token = 2 * 2 * 16 * 8
    seen = cache.evicting_layers[0].seen
    # 2 rows x 2 chunked layers x 7 tokens (bounded_bytes: one row)
    assert cache.stats()["kv_bytes_kept"] == 2 * 2 * 7 * per_token == 2 * bounded_bytes(cfg, 8, seen)


# -- honest accounting ----------------------------------------------------------------------------------------

def test_bytes_count_every_layer_type_by_hand():
    """Gemma 3 tiny: 3 sliding layers (window 8) and 1 full; Qwen3.5 tiny: 3 linear-attention layers and 1 full.
    K/V per token per attention layer = 2 x 2 KV heads x 16 x 8 bytes = 512."""
    per_token = 2 * 2 * 16 * 8
    gemma = hybrid_model("gemma3")
    assert kv_bytes_per_layer_token(gemma.config, 8) == per_token
    ids = torch.randint(0, 90, (1, 20))
    cache = EvictionCache(gemma, "snapkv", budget=12, window=4)
    with torch.no_grad():
        gemma(input_ids=ids, **cache_kwargs(cache))
    s = cache.stats()
    # full layer: 20 prompt tokens stored (P > B + w, first eviction comes with the next token); sliding: 7 each
    assert s["kv_bytes_kept"] == 3 * 7 * per_token == bounded_bytes(gemma.config, 8, 20)
    assert s["kv_bytes"] == 20 * per_token + 3 * 7 * per_token
    assert s["kv_bytes_full"] == 20 * per_token + 3 * 7 * per_token
    assert bounded_bytes(gemma.config, 8, 5) == 3 * 5 * per_token  # shorter than the window: every token

    qwen = hybrid_model("qwen3.5")
    # conv state (2 x 2 x 8 + 4 x 8) x kernel 4 = 256 float64, recurrent state 4 x 8 x 8 = 256 float32 per layer
    state = 256 * 8 + 256 * 4
    assert recurrent_state_bytes(qwen.config, 8) == state
    cache = EvictionCache(qwen, "snapkv", budget=12, window=4)
    with torch.no_grad():
        qwen(input_ids=ids, **cache_kwargs(cache))
    s = cache.stats()
    assert s["kv_bytes_kept"] == 3 * state == bounded_bytes(qwen.config, 8, 20)
    assert s["kv_bytes"] == 20 * per_token + 3 * state
    out = vase.generate(qwen, _ByteTokenizer(), [ids[0].tolist()], method="snapkv", budget=12, window=4,
                        max_new_tokens=30, greedy=True, chat_template=False, ignore_eos=True)
    row = out.stats["rows"][0]
    # 20 + 29 = 49 tokens fed; P = 20 > B + w: cut to B = 12 at token 21, then back to 12 at every B + w = 16:
    # 12 + (49 - 12) % 4 = 13 stored
    assert out.stats["stored_length"] == 13
    assert row["kv_bytes"] == 13 * per_token + 3 * state
    assert row["kv_bytes_full"] == 49 * per_token + 3 * state


def test_engine_bytes_per_token_counts_the_growing_layers():
    from vase.engines import kv_bytes_per_token

    gemma = hybrid_model("gemma3")
    assert kv_bytes_per_token(gemma) == 1 * 512  # one full-attention layer grows; the sliding ones are bounded
    assert kv_bytes_per_token(hybrid_model("qwen3-next")) == 512
    assert kv_bytes_per_token(hybrid_model("gpt-oss")) == 2 * 512


def _replay_masked(reference, held: list[dict], first_layer: int, ids, mask, tokens):
    """The reference model's forced decode of `tokens` over a DynamicCache whose attention sees, at each step, only
    what vase's cache held then (`held`: one {layer index: [b, h, L] bool} per forward, set when `first_layer` is
    written; `_reference_attention` applies it). Returns `_decode_forced`'s (logits, tokens) and the cache."""
    full = DynamicCache(config=reference.config)
    step = iter(held)
    update = full.update

    def masked_update(key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == first_layer:
            _HELD.clear()
            _HELD.update(next(step))
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    full.update = masked_update
    try:
        return (*_decode_forced(reference, full, ids, mask, tokens), full)
    finally:
        _HELD.clear()


# -- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,kind", [("gemma3", "sliding_attention"), ("qwen3.5", "linear_attention")])
def test_compiled_decode_refuses_hybrid_models_naming_the_layer_type(family, kind):
    model = hybrid_model(family)
    with pytest.raises(CompileUnsupportedError, match=f"no static form for {kind} layers"):
        vase.generate(model, _ByteTokenizer(), [[1, 2, 3]], method="snapkv", budget=12, window=4,
                      max_new_tokens=4, greedy=True, chat_template=False, compile=True)
    with pytest.raises(CompileUnsupportedError, match=f"no static form for {kind} layers"):
        vase.CompiledEvictionCache(model, "snapkv", budget=12, window=4)


def test_layer_mixes_vase_cannot_evict_are_refused_in_one_line():
    from transformers import Gemma3TextConfig

    from vase.hf.support import UnsupportedModelError, config_problem

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=2, sliding_window=8)
    assert config_problem(Gemma3TextConfig(**base, layer_types=["sliding_attention", "full_attention"])) is None
    problem = config_problem(Gemma3TextConfig(**base, layer_types=["sliding_attention"] * 2))
    assert "every layer uses sliding-window attention" in problem and "\n" not in problem
    problem = config_problem(Gemma3TextConfig(**base, layer_types=["chunked_attention", "full_attention"]))
    assert "chunked_attention" in problem
    shared = Gemma3TextConfig(**base, layer_types=["sliding_attention", "full_attention"])
    shared.num_kv_shared_layers = 1
    assert "num_kv_shared_layers=1" in config_problem(shared)
    assert issubclass(UnsupportedModelError, ValueError)


@pytest.mark.parametrize("family", ["gemma3", "qwen3.5"])
def test_dropping_a_finished_row_keeps_the_others_exact(family):
    """A row leaving the batch leaves every layer type: evicting, sliding and recurrent (`batch_select_indices`)."""
    model = hybrid_model(family)
    ids, mask = _prompts()
    cache = EvictionCache(model, "snapkv", budget=12, window=4)
    alone = EvictionCache(model, "snapkv", budget=12, window=4)
    # the gated delta rule runs its state in float32 (transformers' kernels): a batch of 2 and a row alone round
    # apart by ~1e-8 there; a leak of the other row would move the logits by far more
    tol = 1e-6 if family == "qwen3.5" else 1e-10
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache))
        solo = model(input_ids=ids[1:, PAD:], position_ids=pos[1:, PAD:], **cache_kwargs(alone))
        cache.batch_select_indices(torch.tensor([1]))
        nxt, p, m = solo.logits[:, -1:].argmax(-1), pos[1:, -1:], mask[1:]
        for _ in range(30):
            p, m = p + 1, torch.cat([m, torch.ones_like(nxt)], dim=-1)
            a = model(input_ids=nxt, attention_mask=m, position_ids=p, **cache_kwargs(cache)).logits[:, -1]
            b = model(input_ids=nxt, position_ids=p, **cache_kwargs(alone)).logits[:, -1]
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
            nxt = b.argmax(-1, keepdim=True)
    assert cache.stats()["evictions"] >= 5


# -- vLLM: Qwen3.5 refused by the plugin in one line (stand-ins of vLLM's ModelConfig); Llama 4 taken -------------------

@pytest.mark.parametrize("family, fragment", [
    ("qwen3.5", "(qwen3_5_text) has recurrent (linear-attention or Mamba) layers"),
])
def test_vllm_plugin_refuses_hybrid_families_in_one_line(family, fragment):
    from types import SimpleNamespace as NS

    from vase.vllm.config import VaseConfigError
    from vase.vllm.model_refusals import check_model_layers, model_refusal

    from .hybrid_models import hybrid_config

    hf = hybrid_config(family)
    model = NS(model="m", hf_config=hf, hf_text_config=hf, use_mla=False, is_hybrid=False, has_inner_state=False,
               get_sliding_window=lambda: None)
    with pytest.raises(VaseConfigError) as info:
        check_model_layers(model)
    line = str(info.value)
    assert fragment in line and "--engine transformers" in line and "\n" not in line
    plain = NS(model="m", hf_config=hybrid_config("qwen3-moe"), hf_text_config=hybrid_config("qwen3-moe"),
               use_mla=False, is_hybrid=False, has_inner_state=False, get_sliding_window=lambda: None)
    assert model_refusal(plain) is None  # MoE with full attention: the plugin evicts it as any dense model
    llama4 = hybrid_config("llama4")  # chunked-local beside full attention: evicted (tests/test_vllm_hybrid.py)
    assert model_refusal(NS(model="m", hf_config=llama4, hf_text_config=llama4, use_mla=False, is_hybrid=False,
                            has_inner_state=False, get_sliding_window=lambda: None)) is None
    for sliding in ("gemma3", "gpt-oss", "qwen3-next"):  # sliding-window or recurrent groups: evicted in the full group
        cfg = hybrid_config(sliding)
        assert model_refusal(NS(**{**vars(plain), "hf_config": cfg, "hf_text_config": cfg})) is None, sliding
    every = hybrid_config("gemma3")
    every.layer_types = ["sliding_attention"] * 4
    line = model_refusal(NS(**{**vars(plain), "hf_config": every, "hf_text_config": every}))
    assert "sliding-window attention in every layer" in line and "\n" not in line
    mla = NS(**{**vars(plain), "use_mla": True})  # an MLA model type the plugin was not run on (vase.vllm.latent)
    assert "multi-head latent attention in a way vase has not been run on" in model_refusal(mla)


# -- docs/models.md in step with support.py, the plugin's refusals and the bench shapes ------------------------

def _table(text: str, header: str) -> list[dict[str, str]]:
    lines = text[text.index(header):].splitlines()
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(names, [c.strip() for c in line.strip("|").split("|")])))
    return rows


def _vllm_stand_in(hf):
    from types import SimpleNamespace as NS

    return NS(model="m", hf_config=hf, hf_text_config=hf, use_mla=False, is_hybrid=False, has_inner_state=False,
              get_sliding_window=lambda: None)


def test_models_page_is_in_step_with_support():
    from pathlib import Path

    from vase.hf.support import config_problem
    from vase.vllm.model_refusals import model_refusal

    from .hybrid_models import hybrid_config

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    rows = {r["model_type"]: r for r in _table(text, "| family | model_type |")}
    by_type = {hybrid_config(f).model_type: f for f in FAMILIES}
    assert set(by_type) <= set(rows), f"families missing from docs/models.md: {set(by_type) - set(rows)}"
    for model_type, family in by_type.items():
        row, cfg = rows[model_type], hybrid_config(family)
        assert row["transformers"].startswith("tested") == (config_problem(cfg) is None), model_type
        refused = model_refusal(_vllm_stand_in(cfg)) is not None
        assert (row["vLLM CPU"] == "refused") == refused, model_type
        if not refused:
            assert row["vLLM CPU"].startswith("tested (tests/"), model_type
        kept = sorted({t for t in layer_types(cfg) if t != "full_attention"})
        if kept:
            assert row["compile=True"] == f"refused ({', '.join(kept)})", model_type
            assert row["evicted"] == "full-attention layers", model_type
        else:
            assert row["evicted"] == "every layer" and not row["compile=True"].startswith("refused"), model_type


def test_bench_shapes_of_hybrid_families():
    from pathlib import Path

    from vase.bench.shapes import resolve_shape
    from vase.engines import kv_bytes_per_token
    from vase.hf.support import config_problem

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    rows = _table(text, "| shape | full-attention layers |")
    assert {r["shape"] for r in rows} == {"qwen3.5-0.8b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "gpt-oss-20b",
                                          "gemma3-1b", "gemma3-270m"}
    for row in rows:
        cfg = resolve_shape(row["shape"])
        types = layer_types(cfg)
        assert config_problem(cfg) is None
        assert row["full-attention layers"] == f"{types.count('full_attention')} of {len(types)}"
        assert int(row["K/V per token (growing)"].replace(",", "")) == kv_bytes_per_token(cfg, "bfloat16")
        bounded = int(row["bounded bytes at 4,096 tokens"].split()[0].replace(",", ""))
        assert bounded == bounded_bytes(cfg, 2, 4096), row["shape"]


def test_time_averaged_bounded_bytes_sum_every_step():
    """`bounded_bytes_mean` (the eval's kv_bytes_time_mean of a hybrid model) is the plain mean over the steps."""
    from vase.hf.hybrid import bounded_bytes_mean

    from .hybrid_models import hybrid_config

    for family in ("gemma3", "gpt-oss", "qwen3.5", "llama4"):
        cfg = hybrid_config(family)
        for prompt, seen in [(3, 3), (3, 20), (5, 7), (10, 40), (2, 6)]:
            steps = range(prompt + 1, seen + 1)
            plain = (sum(bounded_bytes(cfg, 8, t) for t in steps) / len(steps)) if len(steps) else \
                bounded_bytes(cfg, 8, prompt)
            assert bounded_bytes_mean(cfg, 8, prompt, seen) == pytest.approx(plain, rel=1e-12), (family, prompt, seen)


def test_eval_kv_columns_count_every_layer_type(tmp_path):
    """An eval run on a Gemma 3 tiny model: each record's K/V columns are the full-attention layer's bytes plus
    the sliding layers' (3 x min(7, length) tokens), for `full` and for the evicting method."""
    from transformers import AutoModelForCausalLM

    from tests.helpers_tiny import tiny_tokenizer
    from vase.eval.config import EvalConfig
    from vase.eval.runner import run_eval
    from vase.eval.store import rank_files, read_jsonl

    from .hybrid_models import hybrid_config

    tok = tiny_tokenizer()
    cfg = hybrid_config("gemma3")
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = len(tok), 1, 0, None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.float64).eval()
    config = EvalConfig(task="arith", limit=1, methods=["snapkv"], budgets=[24], window=8, samples=1,
                        max_new_tokens=24, batch_size=1, model="tiny-gemma3", output_dir=str(tmp_path))
    run_dir = run_eval(config, model, tok, progress=False)
    records = [r for p in rank_files(run_dir, "samples") for r in read_jsonl(p)]
    assert {r["method"] for r in records} == {"full", "snapkv"}
    per_token = 2 * 2 * 16 * 8  # one full-attention layer, 2 KV heads of 16, float64
    for r in records:
        seen = r["prompt_length"] + r["length"] - (0 if r["finished"] else 1)
        sliding = 3 * min(7, seen) * per_token
        assert r["kv_bytes_full"] == seen * per_token + sliding
        steps = range(r["prompt_length"] + 1, seen + 1)
        if r["method"] == "full":
            assert r["kv_bytes"] == r["kv_bytes_full"]
            mean = sum(t * per_token + 3 * min(7, t) * per_token for t in steps) / len(steps)
            assert r["kv_bytes_time_mean"] == pytest.approx(mean, rel=1e-12)
        else:
            assert r["evictions"] > 0 and r["kv_bytes"] < r["kv_bytes_full"]
            assert (r["kv_bytes"] - sliding) % per_token == 0 and r["kv_bytes"] - sliding <= (24 + 8) * per_token
    # a generate_fn without per-row stats: the runner derives them from the schedule and the config, the same
    def without_rows(*args, **kwargs):
        out = vase.generate(*args, **kwargs)
        out.stats.pop("rows")
        return out

    derived_dir = run_eval(EvalConfig(**{**config.to_dict(), "output_dir": str(tmp_path / "derived")}), model, tok,
                           generate_fn=without_rows, progress=False)
    derived = {r["method"]: r for p in rank_files(derived_dir, "samples") for r in read_jsonl(p)}
    for r in records:
        for k in ("kv_bytes", "kv_bytes_peak", "kv_bytes_full", "kv_bytes_time_mean"):
            assert derived[r["method"]][k] == r[k], (r["method"], k)


@pytest.mark.parametrize("family", HYBRID)
def test_teacher_forcing_equals_decoding_on_hybrid_models(family):
    """`forced_log_probs` feeds chunks up to the next eviction (several tokens per forward through the sliding and
    linear-attention layers too): the log-probs of decoding the same tokens one at a time (float32 output; the
    gated delta rule's chunked and recurrent forms round apart by ~1e-6)."""
    from vase.generation.generate import forced_log_probs

    model = hybrid_model(family)
    torch.manual_seed(1)
    ids = torch.randint(0, 90, (1, 10))
    logits, tokens = _decode(model, EvictionCache(model, "snapkv", 12, 4), ids, torch.ones_like(ids), 30)
    targets = torch.cat(tokens, dim=-1)[0]
    forced = forced_log_probs(model, ids[0], targets, method="snapkv", budget=12, window=4)
    expected = torch.stack([l[0].float().log_softmax(-1) for l in logits[:-1]])
    torch.testing.assert_close(forced, expected, atol=1e-5, rtol=0)


def test_quantized_storage_on_a_hybrid_model_counts_its_evicting_layers(tmp_path):
    """kv_bits on Gemma 3: only the full-attention layer is quantized (`QuantBytes` counts 1 layer, not 4); the
    eval's K/V columns derived from `QuantBytes` (no per-row stats) add the sliding layers' bytes
    (tests/test_eval_kv_columns.py: equal to the cache's own)."""
    from tests.helpers_tiny import tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from vase.core import schedule
    from vase.eval.config import EvalConfig
    from vase.eval.runner import run_eval
    from vase.eval.store import rank_files, read_jsonl
    from vase.core.policies import get_policy
    from vase.storage.quantized import QuantBytes

    from .hybrid_models import hybrid_config

    tok = tiny_tokenizer()
    cfg = hybrid_config("gemma3")
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = len(tok), 1, 0, None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.float64).eval()
    quant = QuantBytes.for_model(model, get_policy("snapkv"), 24, 8, {"kv_bits": 4})
    assert quant.layers == 1

    def without_rows(*args, **kwargs):
        out = vase.generate(*args, **kwargs)
        out.stats.pop("rows")
        return out

    config = EvalConfig(task="arith", limit=1, methods=["snapkv"], budgets=[24], window=8, samples=1,
                        max_new_tokens=24, batch_size=1, model="tiny-gemma3", output_dir=str(tmp_path),
                        method_params={"snapkv": {"kv_bits": 4}})
    run_dir = run_eval(config, model, tok, generate_fn=without_rows, progress=False)
    r = {r["method"]: r for p in rank_files(run_dir, "samples") for r in read_jsonl(p)}["snapkv"]
    P, seen = r["prompt_length"], r["prompt_length"] + r["length"] - (0 if r["finished"] else 1)
    s = schedule.sequence_stats(P, 24, 8, seen - P)
    sliding = 3 * min(7, seen) * 2 * 2 * 16 * 8
    assert r["evictions"] > 0
    # the peak (at the first eviction, nothing exact evicted yet) is known; the bytes held after an eviction
    # are not (which exact entries survived is the policy's choice): left empty
    assert r["kv_bytes_peak"] == quant.held(s.peak, s.peak - P, schedule.first_limit(P, 24, 8)) + sliding
    assert r["kv_bytes"] is None and r["kv_bytes_time_mean"] is None


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])  # float64 throughout (the linear layers' state is float32)
def test_generate_rows_that_finish_early_leave_the_others_exact(family):
    """`vase.generate`: row 0 stops on an EOS after a few tokens and leaves the batch (and every layer type of the
    cache, and the running padding mask); row 1 goes on exactly as when it is decoded alone."""
    model = hybrid_model(family)
    ids, _ = _prompts()
    prompts = [ids[0].tolist(), ids[1, PAD:].tolist()]
    kwargs = dict(method="snapkv", budget=12, window=4, max_new_tokens=40, greedy=True, chat_template=False)
    free = vase.generate(model, _ByteTokenizer(), prompts, seed=[5, 6], ignore_eos=True, **kwargs)
    row1 = free.token_ids[1]
    eos = next(t for t in free.token_ids[0][3:] if t not in row1)  # ends row 0 early, never row 1
    model.generation_config.eos_token_id = eos
    batch = vase.generate(model, _ByteTokenizer(), prompts, seed=[5, 6], **kwargs)
    alone = vase.generate(model, _ByteTokenizer(), prompts[1:], seed=[6], **kwargs)
    assert batch.finished[0] and len(batch.token_ids[0]) < 40
    assert batch.token_ids[1] == alone.token_ids[0] == row1
    assert batch.stats["evictions"] >= 5


def test_a_pending_layer_left_by_another_cache_is_not_taken_by_this_forward():
    """A layer whose `update` ran without its attention call (another cache, another model) stays pending in the
    side channel; a later forward's layer with the same index (a sliding layer here, or another cache's full
    layer) must not take it: it would record queries into the other cache's ring and mask with its slots."""
    import vase
    from tests.conftest import tiny_model
    from vase.hf.attention import PENDING_LAYER

    torch.manual_seed(0)
    ids = torch.randint(3, 60, (1, 12))
    model = hybrid_model("gpt-oss")  # layer 0 sliding, layer 1 full
    clean = model(input_ids=ids, **vase.cache_kwargs(vase.EvictionCache(model, "snapkv", 12, 4))).logits
    other = tiny_model(layers=2, dtype=torch.float64)
    for idx in (0, 1):  # a stale pending layer with the sliding layer's index, then with the full layer's
        stale = vase.EvictionCache(other, "snapkv", 12, 4)
        k = torch.zeros(1, 2, 5, 8, dtype=torch.float64)  # a head size the gpt-oss model does not have
        stale.layers[idx].update(k, k)
        assert PENDING_LAYER.get() is stale.layers[idx]
        logits = model(input_ids=ids, **vase.cache_kwargs(vase.EvictionCache(model, "snapkv", 12, 4))).logits
        torch.testing.assert_close(logits, clean, rtol=0, atol=0)
        PENDING_LAYER.set(None)
