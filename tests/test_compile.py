"""The compiled decode step (`vase.caches.static`, `vase.generation.compiled`): same kept sets and logits as the eager
cache through several evictions, no recompilation and no graph break at an eviction.

Tiny float64 models on CPU; the compiled runs teacher-force the same tokens as the eager ones, so
any difference is the step's. Kept sets (sequence positions stored per row and KV head): exactly
equal. Logits: within 1e-9 with aot_eager (the eager kernels), 1e-5 with inductor (transformers
computes the RoPE angles in float32 and inductor fuses that differently: 1e-7 seen).
Every evicting method and quantized storage configuration runs dynamo's full-graph capture with the `aot_eager`
backend (AOT's functionalization, then the eager kernels); the inductor backend (the one users get) runs vase-attnv
and h2o. The tests of the machinery around the step (the flush schedule, recompilation, a batch of one,
`vase.generate(compile=...)`) capture with the `eager` backend: the same graph without the AOT pass (measured here:
a quantized step compiles in about half the time).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from vase.caches.eager import EvictionCache
from vase.hf.compat import cache_kwargs
from vase.generation.compiled import CompiledSteps, teacher_forced
from vase.core.policies import POLICIES
from vase.caches.static import CompileUnsupportedError, StaticEvictionCache, activate, check_compilable

B, W, P, STEPS = 16, 4, 10, 30  # first eviction after 10 steps, then one every 4: 5 evictions per row
EVICTING = [name for name, cls in POLICIES.items() if cls.evicts and not getattr(cls, "selects", False)]


@pytest.fixture(scope="module")
def model():
    return tiny_model().double()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(batch: int = 2, pad: int = 3):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 90, (batch, P), generator=gen)
    mask = torch.ones(batch, P, dtype=torch.long)
    if batch > 1:
        mask[1, :pad] = 0  # row 1 is left-padded: it evicts on its own schedule
    feed = torch.randint(0, 90, (batch, STEPS), generator=gen)
    return ids, mask, feed


class Counter:
    """A torch.compile backend that counts the graphs dynamo hands it, then runs each as it is."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def run(model, method, compiled=None, batch=2, steps=STEPS, prompt=None, on_step=None, **storage):
    """Prefill, then teacher-force `steps` tokens; returns (logits [steps, b, vocab], kept per layer, evictions)."""
    ids, mask, feed = prompt or _inputs(batch)
    feed = feed.repeat(1, -(-steps // feed.shape[1]))[:, :steps]
    return teacher_forced(model, method, ids, mask, feed, B, W, steps=compiled, on_step=on_step, **storage)


def _assert_same(model, method, backend, batch=2, atol=None, **storage):
    le, ke, ee = run(model, method, batch=batch, **storage)
    lc, kc, ec = run(model, method, CompiledSteps(backend=backend), batch=batch, **storage)
    assert ee == ec and ee >= 5, (ee, ec)
    assert ke == kc, f"{method}: kept sets differ"
    torch.testing.assert_close(lc, le, rtol=0, atol=atol or (1e-5 if backend == "inductor" else 1e-9))


@pytest.mark.parametrize("method", EVICTING)
def test_compiled_step_keeps_what_eager_keeps_every_method(model, method):
    _assert_same(model, method, "aot_eager")


@pytest.mark.parametrize("method", ["vase-attnv", "h2o"])
def test_inductor_step_keeps_what_eager_keeps(model, method):
    _assert_same(model, method, "inductor")


# Quantized storage (vase.storage.static.StaticQuant): the stores' flush every `flush_every` tokens runs inside the
# step; these cover the flush falling on and off eviction steps, the reserve (quant_guard), the key scale and 2 bits.
QUANT = [("vase-attnv", {"kv_bits": 4}), ("snapkv", {"kv_bits": 2, "quant_guard": 3, "flush_every": 3}),
         ("h2o", {"kv_bits": 8, "quant_key_scale": True, "flush_every": 5}),
         ("vase-dkv", {"kv_bits": 4, "quant_guard": 0, "flush_every": 1})]


@pytest.mark.parametrize("method,storage", QUANT)
def test_compiled_quantized_step_keeps_what_eager_keeps(model, method, storage):
    _assert_same(model, method, "aot_eager", **storage)


def test_inductor_quantized_step_keeps_what_eager_keeps(model):
    _assert_same(model, "vase-attnv", "inductor", kv_bits=4)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_planes_are_the_dequantized_values_in_plane_order(bits):
    """`StaticQuant.attend` reads the codes as `planes`: the very values `dequantize` gives (times the key scale),
    bit for bit, in `plane_order`."""
    from vase.storage.packing import dequantize, quantize
    from vase.storage.static import plane_order, planes

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, 64, generator=gen) * 3
    key_scale = (torch.rand(2, 3, 1, 64, generator=gen) + 0.5).half()
    p = quantize(x, bits, 16)
    order = plane_order(64, bits, x.device)
    assert sorted(order.tolist()) == list(range(64))
    assert torch.equal(planes(p), dequantize(p).index_select(-1, order))
    assert torch.equal(planes(p, key_scale), (dequantize(p) * key_scale.float()).index_select(-1, order))


@pytest.mark.parametrize("cap", [20, 576])
def test_tag_widening_is_exact(cap):
    """The quantized stores' slot tags (`slot_dtype`) widened to int64 inside an inductor graph, as `renumber` and
    `attend` do: the same indices as eager. Fails on AVX2 code (ATEN_CPU_CAPABILITY=avx2, `make test-avx2`)
    when the tags are int8 or int32: torch 2.13's vectorized widening gives out-of-range indices there."""
    from vase.storage.quantized import slot_dtype

    def lookup(tags: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        wide = tags.long()
        return table.gather(-1, torch.where(wide >= 0, wide, cap))

    tags = torch.randint(-1, cap, (2, 2, cap), generator=torch.Generator().manual_seed(cap)).to(slot_dtype(cap))
    table = torch.arange(cap + 1).expand(2, 2, cap + 1).contiguous()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lookup, backend="inductor", fullgraph=True)(tags, table), lookup(tags, table))


def test_quantized_flush_runs_at_the_eager_steps_only(model, monkeypatch):
    """The flush is a graph variant the host picks (`StaticQuant.flush_due`): it runs at exactly the steps where the
    eager storage flushes (its counter back to 0), and the stores' fill (full-precision and packed entries per
    head) matches the eager storage's after every step (a flush at every step would quantize early)."""
    from vase.generation.compiled import StaticStepper
    from vase.generation.decoding import prefill

    storage = {"kv_bits": 4, "flush_every": 3}
    ids, mask, feed = _inputs(2)
    cache = EvictionCache(model, "vase-attnv", B, W, seed=[7, 8], **storage)
    eager = []
    with torch.inference_mode():
        positions, _, _ = prefill(model, ids, mask, cache)
        nxt = positions[:, -1:] + 1
        for t in range(STEPS):
            model(input_ids=feed[:, t:t + 1], position_ids=nxt, **cache_kwargs(cache), use_cache=True)
            nxt = nxt + 1
            st = cache.layers[0].storage
            eager.append((st.unflushed == 0, st.fn.tolist(), st.qn.tolist()))

    ran = []
    variant = StaticStepper.variant
    monkeypatch.setattr(StaticStepper, "variant", lambda self, ev, fl: ran.append(fl) or variant(self, ev, fl))
    compiled = []

    def on_step(t, stepper):
        st = stepper.cache.layers[0].store
        compiled.append((ran[-1], st.fn.tolist(), st.qn.tolist()))

    run(model, "vase-attnv", CompiledSteps(backend="eager"), on_step=on_step, **storage)
    assert len(ran) == STEPS  # static from the first step (the prompt fits B)
    flushes = [t for t, (flushed, _, _) in enumerate(eager) if flushed]
    assert [t for t, (flushed, _, _) in enumerate(compiled) if flushed] == flushes
    assert 5 <= len(flushes) < STEPS, flushes
    assert compiled == eager


def test_batch_of_one_and_long_prompt(model):
    """A prompt longer than B: the first eviction runs eagerly, then the static steps."""
    gen = torch.Generator().manual_seed(1)
    long = (torch.randint(0, 90, (1, B + 6), generator=gen), torch.ones(1, B + 6, dtype=torch.long),
            torch.randint(0, 90, (1, 24), generator=gen))
    le, ke, _ = run(model, "vase-attnv", prompt=long, steps=24)
    lc, kc, _ = run(model, "vase-attnv", CompiledSteps(backend="eager"), prompt=long, steps=24)
    assert ke == kc
    torch.testing.assert_close(lc, le, rtol=0, atol=1e-9)


@pytest.mark.parametrize("storage", [{}, {"kv_bits": 4, "flush_every": 3}], ids=["dense", "4-bit"])
def test_no_recompilation_over_evictions(model, storage, monkeypatch):
    """One graph per step variant that ran (plain, evicting; with quantized storage also the flush variant of
    each), compiled when it first runs; 3 more evictions (and flushes) compile nothing."""
    from vase.generation.compiled import StaticStepper

    backend = Counter()
    steps = CompiledSteps(backend=backend)
    seen, variants = {}, set()
    variant = StaticStepper.variant
    monkeypatch.setattr(StaticStepper, "variant", lambda self, ev, fl: variants.add((ev, fl)) or variant(self, ev, fl))

    def on_step(t, stepper):
        if stepper is not None:
            seen[t] = (backend.graphs, stepper.cache.stats()["evictions"], len(variants))

    run(model, "vase-attnv", steps, batch=1, steps=STEPS, on_step=on_step, **storage)
    # batch 1, P = 10: evictions before the feeds of steps 10, 14, 18, 22, 26
    warm = seen[10]
    expected = {(False, False), (True, False)} | ({(False, True), (True, True)} if storage else set())
    assert variants == expected  # flush_every 3 against an eviction every 4 steps: every combination occurs
    assert warm[0] == warm[2] and warm[0] >= 2, warm  # one graph per variant run so far
    assert seen[STEPS - 1][1] - warm[1] >= 3  # at least three more evictions ...
    assert seen[STEPS - 1][0] == len(variants)  # ... and no graph beyond one per variant
    # A second generation with a new cache of the same configuration reuses the graphs.
    run(model, "vase-attnv", steps, batch=1, steps=12, **storage)
    assert backend.graphs == len(variants)


def test_no_graph_break_at_an_eviction(model):
    """dynamo's explain over the evicting step: one graph, no break."""
    from vase.generation.compiled import _evicting_step

    ids, mask, feed = _inputs(1)
    cache = EvictionCache(model, "vase-attnv", B, W, seed=[0])
    with torch.inference_mode():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True)
        static = StaticEvictionCache.from_eager(cache, model.config.num_attention_heads)
        static.layers[0].host_length = [B + W] * 1  # pretend full so the step evicts
        for layer in static.layers:
            layer.length.fill_(B + W)
        activate(model, static)
        try:
            static.prepare([0])
            static.evicting = True
            explained = torch._dynamo.explain(_evicting_step)(model, static, feed[:, :1], pos[:, -1:] + 1)
        finally:
            static.evicting = False
            activate(model, None)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_refusals_are_one_clear_line(model):
    with pytest.raises(CompileUnsupportedError, match="quant_select"):
        check_compilable(EvictionCache(model, "vase-attnv", B, W, kv_bits=4, quant_select="random"), "sdpa")
    with pytest.raises(CompileUnsupportedError, match="quest"):
        check_compilable(EvictionCache(model, "quest", 32, W), "sdpa")
    from vase.generation.compiled import compile_cache

    with pytest.raises(CompileUnsupportedError, match="drop kv_bits for 'full'"):
        compile_cache(model, EvictionCache(model, "full", window=W, kv_bits=8), 1, 40)
    with pytest.raises(CompileUnsupportedError, match="flash_attention_2"):
        check_compilable(EvictionCache(model, "vase-attnv", B, W), "flash_attention_2")


@pytest.mark.parametrize("method,storage", [("vase-attnv", {}), ("full", {}), ("vase-attnv", {"kv_bits": 4})])
def test_generate_compile_gives_the_eager_tokens(model, method, storage):
    """vase.generate(compile=...) end to end: padded batch, greedy, same tokens, evictions and bytes as eager."""
    from tests.conftest import tiny_tokenizer
    from vase.generation.generate import generate

    tok = tiny_tokenizer()
    kw = dict(method=method, budget=B, window=W, max_new_tokens=36, greedy=True, ignore_eos=True, chat_template=False,
              **storage)
    eager = generate(model, tok, ["hello there, general", "hi"], **kw)
    compiled = generate(model, tok, ["hello there, general", "hi"], compile="eager", **kw)
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats["evictions"] == eager.stats["evictions"]
    if method != "full":  # per row: evictions, K/V bytes held now, at peak, in full (StaticCache keeps none)
        assert compiled.stats["rows"] == eager.stats["rows"]
        assert eager.stats["evictions"] >= 5
    assert model.config._attn_implementation.startswith("vase_") or method == "full"


def test_generate_compile_refuses_the_random_reserve_in_one_line(model):
    from tests.conftest import tiny_tokenizer
    from vase.generation.generate import generate

    with pytest.raises(CompileUnsupportedError, match="quant_select"):
        generate(model, tiny_tokenizer(), ["hi"], budget=B, window=W, max_new_tokens=4, compile=True, kv_bits=4,
                 quant_select="random")
