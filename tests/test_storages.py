"""The storage registry (`vase.storage.registry`): a storage is its own module plus one `register_storage` call.

A toy storage registered here (K/V rounded to bfloat16 and counted at 2 bytes an element; no compiled
form) runs through the request spec, `EvictionCache`, `vase.generate`, the compiled step's refusal and
the byte model, with nothing else in vase changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import vase
from tests.conftest import F64, tiny_model, tiny_tokenizer
from vase.caches.eager import EvictionCache
from vase.core.errors import SpecError
from vase.core.policies import get_policy
from vase.storage.quantized import QuantBytes, QuantSpec, QuantStorage
from vase.core.spec import RequestSpec, split_storage
from vase.storage.dense import DenseStorage
from vase.storage.registry import (StorageKind, byte_model, eager_storage, kind_of, register_storage, spec_from_options,
                                   static_refusal, storage_keywords, storage_kinds, unregister_storage)


# -- the toy storage's own module (what a new storage writes) -------------------------------------------------------
@dataclass(frozen=True)
class ToyConfig:
    fmt: str


@dataclass(frozen=True)
class ToySpec:
    fmt: str = "bf16"
    KEYWORDS: ClassVar[dict[str, str]] = {"fmt": "toy_format"}

    @classmethod
    def from_options(cls, options):
        return cls(options["toy_format"]) if "toy_format" in options else None

    def resolve(self, policy, budget, window, seed):
        if self.fmt != "bf16":
            raise ValueError(f"toy_format must be 'bf16', got {self.fmt!r}")
        return ToyConfig(self.fmt)


class ToyStorage(DenseStorage):
    """Dense buffers holding bfloat16-rounded K/V, counted at 2 bytes an element."""

    def write(self, key_states, value_states, start, end):
        super().write(key_states.bfloat16().to(key_states.dtype), value_states.bfloat16().to(value_states.dtype),
                      start, end)

    def held_bytes(self, slots, row):
        return super().held_bytes(slots, row) * 2 // self.keys.element_size()


@dataclass(frozen=True)
class ToyBytes:
    per_token: int

    def held(self, length, steps, capacity):
        return length * self.per_token


@pytest.fixture
def toy():
    before = storage_kinds()
    kind = register_storage(StorageKind(
        name="toy", spec=ToySpec, config=ToyConfig,
        eager=lambda config, window, layer_idx: ToyStorage(),
        byte_model=lambda model, policy, budget, window, spec: ToyBytes(2 * 2 * 2 * 16 * 2)))
    yield kind
    unregister_storage("toy")
    assert storage_kinds() == before


def test_the_built_in_kinds_build_what_the_cache_held_before():
    assert [k.name for k in storage_kinds()][:2] == ["dense", "quantized"]
    assert type(eager_storage(None, 8, 0)) is DenseStorage
    cfg = QuantSpec(bits=4).resolve(get_policy("snapkv"), 32, 8, 0)
    assert type(eager_storage(cfg, 8, 0)) is QuantStorage
    assert kind_of(QuantSpec(bits=4)).name == kind_of(cfg).name == "quantized"
    assert isinstance(byte_model(tiny_model(), get_policy("snapkv"), 32, 8, {"kv_bits": 4, "n_large": 2}), QuantBytes)
    assert byte_model(tiny_model(), get_policy("snapkv"), 32, 8, {"n_large": 2}) is None  # dense: bytes per token
    assert static_refusal(None) is None


def test_a_registered_storage_runs_through_the_spec_the_cache_generate_and_the_byte_model(toy):
    assert "toy_format" in storage_keywords()
    assert split_storage({"n_large": 4, "toy_format": "bf16"}) == ({"n_large": 4}, {"toy_format": "bf16"})
    req = RequestSpec.of("snapkv", 32, 8, toy_format="bf16", n_large=4).validate()
    assert req.storage == ToySpec("bf16") and req.quant == ToyConfig("bf16")
    with pytest.raises(SpecError, match="toy_format must be 'bf16'"):
        RequestSpec.of("snapkv", 32, 8, toy_format="fp4").validate()
    with pytest.raises(SpecError, match="two storages"):
        RequestSpec.of("snapkv", 32, 8, toy_format="bf16", kv_bits=4).validate()

    cache = EvictionCache(None, "snapkv", 32, 8, num_layers=1, toy_format="bf16")
    layer = cache.layers[0]
    assert type(layer.storage) is ToyStorage
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    layer.update(k, v)
    assert torch.equal(layer.keys[:, :, :5], k.bfloat16().float()) and not torch.equal(layer.keys[:, :, :5], k)

    model, tok = tiny_model(dtype=F64), tiny_tokenizer()
    kw = dict(method="snapkv", budget=12, window=4, max_new_tokens=20, greedy=True, chat_template=False,
              ignore_eos=True)
    dense = vase.generate(model, tok, ["the quick brown fox"], **kw)
    ours = vase.generate(model, tok, ["the quick brown fox"], toy_format="bf16", **kw)
    assert ours.stats["evictions"] == dense.stats["evictions"] > 0
    assert ours.stats["kv_bytes"] * 4 == dense.stats["kv_bytes"] - dense.stats["kv_bytes_kept"]  # 2 bytes, not 8

    assert static_refusal(ToyConfig("bf16")) == "compile=True has no fixed-shape form of the toy storage: use " \
                                                "compile=False"
    with pytest.raises(Exception, match="no fixed-shape form of the toy storage"):
        vase.generate(model, tok, ["the quick brown fox"], toy_format="bf16", compile="eager", **kw)
    assert byte_model(model, get_policy("snapkv"), 12, 4, {"toy_format": "bf16", "n_large": 2}) == ToyBytes(256)
    assert spec_from_options({"toy_format": "bf16"}) == ToySpec("bf16")
