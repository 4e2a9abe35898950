"""The fp8 storage (`vase.storage.fp8`, kind `fp8` of the storage registry, keyword `kv_dtype`): K/V stored as float8
with per-layer scales of 1.0 (vLLM's default), dequantized on read. References: transformers' DynamicCache fed
K/V rounded through float8 (nothing evicted), and a dense evicting cache whose storage rounds through float8
(evicting: the same kept sets). float32 models: fp8 rounding of float32 K/V is one cast."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import vase
from vase import cache_kwargs
from vase.caches.eager import EvictionCache, EvictionLayer
from vase.core.errors import SpecError
from vase.storage.fp8 import Fp8Bytes, Fp8Config, Fp8Storage
from vase.core.policies import get_policy
from vase.core.spec import RequestSpec
from vase.storage.dense import DenseStorage
from vase.storage.registry import StorageKind, byte_model, register_storage, unregister_storage, static_refusal, storage_kinds

B, W = 16, 4
PROMPT = torch.arange(5, 17)[None]
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, attn_implementation="sdpa",
                      eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def rounded(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.to(FP8[fmt]).to(x.dtype)


class RoundingCache(DynamicCache):
    """transformers' own cache, fed K/V rounded through float8 (no scale: 1.0)."""

    def __init__(self, fmt: str, **kw):
        super().__init__(**kw)
        self.fmt = fmt

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(rounded(key_states, self.fmt), rounded(value_states, self.fmt), layer_idx, *args,
                              **kwargs)


@dataclass(frozen=True)
class RefSpec:
    fmt: str
    KEYWORDS = {"fmt": "ref_fp8"}

    @classmethod
    def from_options(cls, options):
        return cls(options["ref_fp8"]) if "ref_fp8" in options else None

    def resolve(self, policy, budget, window, seed):
        return RefConfig(self.fmt)


@dataclass(frozen=True)
class RefConfig:
    fmt: str


class RefStorage(DenseStorage):
    """Dense buffers (the model's dtype) holding fp8-rounded K/V: the policies read the same numbers."""

    def __init__(self, fmt: str):
        super().__init__()
        self.fmt = fmt

    def write(self, key_states, value_states, start, end):
        super().write(rounded(key_states, self.fmt), rounded(value_states, self.fmt), start, end)


@pytest.fixture
def ref_kind():
    before = storage_kinds()
    register_storage(StorageKind(name="ref-fp8", spec=RefSpec, config=RefConfig,
                                 eager=lambda config, window, layer_idx: RefStorage(config.fmt)))
    yield
    unregister_storage("ref-fp8")
    assert storage_kinds() == before


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_nothing_evicted_equals_a_cache_of_fp8_rounded_kv(model, fmt):
    ours = EvictionCache(model, "full", budget=None, window=W, kv_dtype=fmt)
    assert isinstance(ours.layers[0].storage, Fp8Storage)
    gen = dict(max_new_tokens=30, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a = model.generate(PROMPT, **cache_kwargs(ours), **gen)
    ref = model.generate(PROMPT, **cache_kwargs(RoundingCache(fmt)), **gen)
    plain = model.generate(PROMPT, **cache_kwargs(DynamicCache()), **gen)
    assert torch.equal(a.sequences, ref.sequences)
    for x, y in zip(a.logits, ref.logits):
        assert torch.equal(x, y)
    assert max((x - y).abs().max().item() for x, y in zip(a.logits, plain.logits)) > 1e-4  # fp8 did round
    assert ours.layers[0].storage.k_codes.dtype == FP8[fmt]


@pytest.mark.parametrize("method", ["snapkv", "vase-attnv", "knorm", "evict-large-v"])
def test_evicting_fp8_keeps_what_a_dense_cache_of_fp8_rounded_kv_keeps(model, method, ref_kind, monkeypatch):
    kept: list = []
    compact = EvictionLayer._compact

    def record(layer, index, pad):
        compact(layer, index, pad)
        kept.append(layer.positions[0, :, :B].clone())

    monkeypatch.setattr(EvictionLayer, "_compact", record)
    runs = []
    for opt in ({"kv_dtype": "fp8"}, {"ref_fp8": "fp8"}):
        kept.clear()
        cache = EvictionCache(model, method, budget=B, window=W, seed=1, **opt)
        out = model.generate(PROMPT, **cache_kwargs(cache), max_new_tokens=50, do_sample=False)
        runs.append((out, list(kept), cache.stats()))
    (a, ka, sa), (b, kb, sb) = runs
    assert sa["evictions"] >= 8
    assert torch.equal(a, b) and len(ka) == len(kb)
    assert all(torch.equal(x, y) for x, y in zip(ka, kb))
    # one byte per element and two float32 scales per layer; the reference holds float32 (4 bytes)
    layers, heads, d = 2, 2, 16
    assert sa["kv_bytes"] == layers * (sa["stored_length"] * heads * 2 * d + 8)
    assert sb["kv_bytes"] == layers * sb["stored_length"] * heads * 2 * d * 4
    assert sa["kv_bytes_capacity"] == layers * (sa["capacity"] * heads * 2 * d + 8)
    bytes_model = byte_model(model, get_policy(method), B, W, {"kv_dtype": "fp8"})
    assert isinstance(bytes_model, Fp8Bytes)
    assert bytes_model.held(sa["stored_length"], 0, 0) == sa["kv_bytes"]


def test_fp8_doors_refusals_and_crop(model):
    req = RequestSpec.of("snapkv", 32, 8, kv_dtype="fp8_e5m2").validate()
    assert req.quant == Fp8Config("fp8_e5m2")
    assert RequestSpec.of("snapkv", 32, 8, kv_dtype="auto").validate().quant is None
    with pytest.raises(SpecError, match="kv_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        RequestSpec.of("snapkv", 32, 8, kv_dtype="int8").validate()
    with pytest.raises(SpecError, match="two storages"):
        RequestSpec.of("snapkv", 32, 8, kv_dtype="fp8", kv_bits=4).validate()
    with pytest.raises(SpecError, match="quest"):
        RequestSpec.of("quest", 32, 8, kv_dtype="fp8").validate()
    assert static_refusal(Fp8Config("fp8")) == "compile=True has no fixed-shape form of the fp8 storage: use " \
                                               "compile=False"
    # saturation: a value past e5m2's largest finite (57344) is stored as 57344, not inf (a cast alone gives inf)
    layer = EvictionCache(None, "snapkv", 32, 8, num_layers=1, kv_dtype="fp8_e5m2").layers[0]
    k = torch.full((1, 2, 3, 16), 1e6)
    layer.update(k, -k)
    layer.awaiting_attention = False
    keys, values = layer.storage.read(3)
    assert torch.equal(keys, torch.full_like(k, 57344.0)) and torch.equal(values, torch.full_like(k, -57344.0))
    # speculative decoding composes: prompt lookup over fp8 equals plain greedy over fp8
    outs = [model.generate(torch.tensor([[5, 6, 7, 8, 9, 10] * 2]),
                           **cache_kwargs(EvictionCache(model, "snapkv", budget=B, window=W, kv_dtype="fp8")),
                           max_new_tokens=40, do_sample=False, **spec)
            for spec in ({}, {"prompt_lookup_num_tokens": 3})]
    assert torch.equal(outs[0], outs[1])


def test_kv_rounding_keyword_reaches_the_stored_codes():
    """`kv_rounding="zero"` (vLLM's CPU kernel) passes the door as a storage keyword and truncates the stored codes;
    without an fp8 `kv_dtype`, or with a rounding that is not one of the two, it is refused in one line."""
    from vase.storage.fp8 import to_fp8
    req = RequestSpec.of("snapkv", 32, 8, kv_dtype="fp8", kv_rounding="zero").validate()
    assert req.quant == Fp8Config("fp8", rounding="zero")
    assert req.storage.options() == {"kv_dtype": "fp8", "kv_rounding": "zero"}
    with pytest.raises(SpecError, match="kv_rounding=zero rounds fp8 codes: add kv_dtype=fp8"):
        RequestSpec.of("snapkv", 32, 8, kv_rounding="zero").validate()
    with pytest.raises(SpecError, match="kv_rounding must be one of nearest, zero, got 'up'"):
        RequestSpec.of("snapkv", 32, 8, kv_dtype="fp8", kv_rounding="up").validate()
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 3, 16) * 3, torch.randn(1, 2, 3, 16) * 3
    codes = {}
    for rounding in ("nearest", "zero"):
        layer = EvictionCache(None, "snapkv", 32, 8, num_layers=1, kv_dtype="fp8", kv_rounding=rounding).layers[0]
        layer.update(k, v)
        layer.awaiting_attention = False
        codes[rounding] = layer.storage.read(3)[0]
        assert torch.equal(codes[rounding], to_fp8(k, torch.float8_e4m3fn, 1.0, rounding).float())
    assert not torch.equal(codes["nearest"], codes["zero"])


def test_vase_generate_takes_kv_dtype_and_refuses_compile(model):
    from tests.conftest import tiny_tokenizer, tiny_model

    m, tok = tiny_model(), tiny_tokenizer()
    kw = dict(method="snapkv", budget=12, window=4, max_new_tokens=20, greedy=True, chat_template=False,
              ignore_eos=True)
    out = vase.generate(m, tok, ["the quick brown fox"], kv_dtype="fp8", **kw)
    dense = vase.generate(m, tok, ["the quick brown fox"], **kw)
    assert out.stats["evictions"] == dense.stats["evictions"] > 0
    assert out.stats["kv_bytes"] - 2 * 8 == (dense.stats["kv_bytes"] - dense.stats["kv_bytes_kept"]) // 4
    with pytest.raises(Exception, match="no fixed-shape form of the fp8 storage"):
        vase.generate(m, tok, ["the quick brown fox"], kv_dtype="fp8", compile="eager", **kw)
