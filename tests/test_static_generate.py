"""transformers' own `model.generate` with the compiled evicting step (`vase.caches.compiled`).

Tiny float64 model on CPU, a batch of 2 with one row left-padded, B = 16, w = 4, 40 new tokens
(every row evicts 8 times). The reference is `model.generate` over the eager `EvictionCache`:
greedy tokens equal, kept sets (sequence positions per row, layer and KV head) equal, raw logits
within 1e-9 (dynamo's `eager` backend: the captured graph run as it is) or 1e-5 (inductor, which fuses
transformers' float32 RoPE angles differently), at every one of the 40 steps, most of them after an eviction.
What is checked here is the driving (transformers' generate loop, the cache it is handed): full-graph capture
with the `eager` backend, without AOT's functionalization, which tests/test_compile.py runs for every method and
storage (`aot_eager`).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from vase.caches.eager import EvictionCache
from vase.hf.compat import cache_kwargs, generate_kwargs
from vase.caches.static import CompileUnsupportedError
from vase.caches.compiled import CompiledEvictionCache

B, W, P, NEW = 16, 4, 10, 40


@pytest.fixture(scope="module")
def model():
    m = tiny_model().double()
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _prompt(batch: int = 2, length: int = P):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0  # row 1 is left-padded: it evicts on its own schedule
    return ids, mask


def _kept(cache) -> list:
    """Per layer, row and KV head: the sorted sequence positions the cache holds."""
    if hasattr(cache, "kept_positions"):
        return [cache.kept_positions(i) for i in range(len(cache.layers))]
    out = []
    for l in cache.layers:
        pos = l.positions.cpu()
        out.append([[sorted(pos[r, k, l.pad[r]:l.length].tolist()) for k in range(pos.shape[1])]
                    for r in range(pos.shape[0])])
    return out


def _generate(model, method, *, compiled: str | None, sample: bool = False, batch: int = 2, new: int = NEW,
              stats: dict | None = None, **storage):
    ids, mask = _prompt(batch)
    opts = dict(max_new_tokens=new, min_new_tokens=new, return_dict_in_generate=True, output_logits=True,
                do_sample=sample, **({"temperature": 0.6, "top_p": 0.95} if sample else {}))
    if compiled is None:
        cache = EvictionCache(model, method, B, W, seed=[7, 8][:batch], **storage)
        kwargs = cache_kwargs(cache)
    else:
        cache = CompiledEvictionCache(model, method, B, W, seed=[7, 8][:batch], backend=compiled, **storage)
        kwargs = generate_kwargs(cache)
    torch.manual_seed(0)  # transformers samples from the global generator
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs, **opts)
    if stats is not None:
        stats.update(cache.stats(), rows=cache.row_stats())
    return out.sequences, torch.stack(out.logits), _kept(cache), cache.stats()["evictions"]


@pytest.mark.parametrize("method", ["vase-attnv", "snapkv", "h2o", "vase-dkv", "tova"])
def test_compiled_generate_keeps_and_generates_what_eager_generate_does(model, method):
    ids_e, logits_e, kept_e, ev_e = _generate(model, method, compiled=None)
    ids_c, logits_c, kept_c, ev_c = _generate(model, method, compiled="eager")
    assert ev_e == ev_c >= 8, (ev_e, ev_c)
    assert kept_c == kept_e, f"{method}: kept sets differ"
    torch.testing.assert_close(logits_c, logits_e, rtol=0, atol=1e-9)
    assert torch.equal(ids_c, ids_e)


@pytest.mark.parametrize("method,storage", [("vase-attnv", {"kv_bits": 4}),
                                            ("snapkv", {"kv_bits": 2, "quant_guard": 3, "flush_every": 3})])
def test_compiled_generate_with_quantized_storage(model, method, storage):
    """kv_bits: the fixed-shape quantized store keeps, generates and holds (bytes) what the eager one does."""
    se, sc = {}, {}
    ids_e, logits_e, kept_e, ev_e = _generate(model, method, compiled=None, stats=se, **storage)
    ids_c, logits_c, kept_c, ev_c = _generate(model, method, compiled="eager", stats=sc, **storage)
    assert ev_e == ev_c >= 8, (ev_e, ev_c)
    assert kept_c == kept_e, f"{method}: kept sets differ"
    torch.testing.assert_close(logits_c, logits_e, rtol=0, atol=1e-9)
    assert torch.equal(ids_c, ids_e)
    assert sc["kv_bytes"] == se["kv_bytes"] and sc["rows"] == se["rows"], (sc, se)
    dense = {}
    _generate(model, method, compiled=None, stats=dense)
    assert se["kv_bytes"] < dense["kv_bytes"]


def test_sampled_generate_with_inductor(model):
    """Sampled tokens (transformers' sampler, same global seed) and the policy's own draws replayed in the step."""
    ids_e, logits_e, kept_e, ev_e = _generate(model, "vase-attnv", compiled=None, sample=True)
    ids_c, logits_c, kept_c, ev_c = _generate(model, "vase-attnv", compiled="inductor", sample=True)
    assert ev_e == ev_c >= 8
    assert kept_c == kept_e
    torch.testing.assert_close(logits_c, logits_e, rtol=0, atol=1e-5)
    assert torch.equal(ids_c, ids_e)


def test_two_graphs_no_break_and_a_second_generate_reuses_them(model):
    """One plain and one evicting graph after warm-up; 8 evictions and a second call compile nothing more."""
    from torch._dynamo.utils import counters

    _, _, _, evictions = _generate(model, "vase-attnv", compiled="eager", batch=1)
    assert evictions >= 3
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    _generate(model, "vase-attnv", compiled="eager", batch=1, new=24)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_eager_vase_runs_again_after_a_compiled_generate(model):
    """The model is left on the static attention function; the next vase cache puts it back."""
    _generate(model, "snapkv", compiled="eager", new=8)
    assert model.config._attn_implementation.startswith("vase_static_")
    ids_e, logits_e, _, _ = _generate(model, "snapkv", compiled=None, new=24)
    assert model.config._attn_implementation == "vase_sdpa"
    assert ids_e.shape == (2, P + 24)


def test_refusals_are_one_line(model):
    with pytest.raises(CompileUnsupportedError, match="quest"):
        CompiledEvictionCache(model, "quest", 32, W)
    with pytest.raises(CompileUnsupportedError, match="quant_select"):
        CompiledEvictionCache(model, "vase-attnv", B, W, kv_bits=4, quant_select="random")
    ids, mask = _prompt(1, length=B + 5)
    with pytest.raises(CompileUnsupportedError, match="fit the budget"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                       **generate_kwargs(CompiledEvictionCache(model, "vase-attnv", B, W, backend="eager")))
    ids, mask = _prompt(1)
    with pytest.raises(CompileUnsupportedError, match="beam search"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, num_beams=2,
                       **generate_kwargs(CompiledEvictionCache(model, "vase-attnv", B, W, backend="eager")))


def test_several_samples_per_prompt(model):
    """num_return_sequences expands the inputs before the prefill: each copy is a row with its own generator."""
    ids, mask = _prompt(1)
    cache = CompiledEvictionCache(model, "vase-attnv", B, W, seed=[3, 4], backend="eager")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=True,
                         num_return_sequences=2, **generate_kwargs(cache))
    assert out.shape == (2, P + 30)
    assert cache.stats()["evictions"] >= 5
