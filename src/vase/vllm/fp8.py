"""vLLM's fp8 KV cache (`kv_cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2) as the eviction policies read it.

vLLM 0.32 allocates an fp8 cache as uint8 (`vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE`) and its CPU
kernel (`cpu_attn_reshape_and_cache`) stores each element as the float8 code of `x / k_scale` (`v_scale` for
values; per layer, `layer._k_scale_float`, 1.0 unless the checkpoint calibrates them), truncated toward zero
and saturated; "fp8" is e4m3 (`float8_e4m3fn`, largest 448). A compaction moves those bytes as they are
(`vase.vllm.paged.evict_paged` gathers and scatters the raw codes); the scores read keys and values, so
`Fp8Codec` turns the gathered codes into the model's dtype, `code * scale`, exactly as
`vase.storage.fp8.from_fp8` reads the transformers engine's fp8 storage. Queries are never quantised.

No vLLM import: the tests hand in stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..storage.fp8 import FORMATS, from_fp8

#: vLLM `kv_cache_dtype` values the plugin evicts under ("auto": the model's dtype, nothing to decode)
FP8_CACHE_DTYPES: tuple[str, ...] = tuple(FORMATS)

#: fp8 formats the codec reads whose eviction has not been compared end to end with the transformers engine (the
#: CPU kernel stores fp8 only on AVX-512/AMX machines; only e4m3 was run there): refused, with this reason
UNCOMPARED_FP8: dict[str, str] = {
    "fp8_e5m2": "kv_cache_dtype='fp8_e5m2' is decoded by vase but its eviction was never compared end to end with "
                "the transformers engine (only e4m3 was): use kv_cache_dtype='fp8' (e4m3) or 'auto'",
}
#: the fp8 formats the plugin evicts under
EVICTED_FP8: tuple[str, ...] = tuple(d for d in FP8_CACHE_DTYPES if d not in UNCOMPARED_FP8)


def evicts_under(cache_dtype: Any) -> bool:
    """Whether the plugin evicts under vLLM's `cache_dtype`: the model's dtype ('auto') or a compared fp8 format."""
    return cache_dtype in ("auto", None) or str(cache_dtype) in EVICTED_FP8


def is_fp8(cache_dtype: Any) -> bool:
    """Whether vLLM's resolved `cache_dtype` (a string) is one of the fp8 formats the plugin evicts under."""
    return str(cache_dtype) in FP8_CACHE_DTYPES


def storage_dtype(cache_dtype: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype vLLM allocates a layer's KV tensor in: uint8 for fp8, else the model's."""
    return torch.uint8 if is_fp8(cache_dtype) else model_dtype


@dataclass(frozen=True)
class Fp8Codec:
    """How one layer's stored fp8 codes read as keys and values: the float8 format, the layer's scales and the
    model dtype the policy reads."""

    format: torch.dtype  # torch.float8_e4m3fn or torch.float8_e5m2
    k_scale: float
    v_scale: float
    dtype: torch.dtype

    def keys(self, codes: torch.Tensor) -> torch.Tensor:
        """Gathered key codes [..., d] (uint8) as keys in `dtype`: `code * k_scale`."""
        return from_fp8(codes.view(self.format), self.dtype, self.k_scale)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """Gathered value codes [..., d] (uint8) as values in `dtype`: `code * v_scale`."""
        return from_fp8(codes.view(self.format), self.dtype, self.v_scale)


def layer_codec(layer: Any, cache_dtype: Any, model_dtype: torch.dtype) -> Fp8Codec | None:
    """The codec of one vLLM attention layer (its `_k_scale_float` / `_v_scale_float`, read at each eviction:
    a checkpoint's calibrated scales are loaded after the layer is built); None for an unquantised cache."""
    if not is_fp8(cache_dtype):
        return None
    return Fp8Codec(FORMATS[str(cache_dtype)], float(layer._k_scale_float), float(layer._v_scale_float), model_dtype)
