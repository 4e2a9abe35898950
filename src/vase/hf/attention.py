"""vase's attention functions, registered through transformers' public `AttentionInterface`.

For each stock kernel (sdpa, eager, flash_attention_2) we register `vase_<kernel>`, which

1. takes the `EvictionCache` layer that was just updated from the side channel `PENDING_LAYER`
   and makes one call on it, `attention_mask_for(query, mask_2d, kind)`: the layer records the
   post-RoPE queries (when its policy scores by attention) and returns the mask over what it
   physically stores (its own padding bookkeeping and causal order; transformers' 2-D padding
   mask has logical length and no longer lines up with stored slots after an eviction),
2. calls the stock kernel on what the cache holds.

With any other cache (or none) it behaves like the stock kernel with a causal + padding mask
(`vase.hf.masks`, the one mask builder). A local-attention layer of a hybrid model (`vase.hf.hybrid`: sliding
window, or Llama 4's chunked-local attention) is never evicted: it gets transformers' own sliding or
chunked mask (built by the stock mask function from its own cache layer) and the stock kernel, exactly
as without vase; kernel arguments such as gpt-oss's attention
sinks (`s_aux`) reach the stock kernel unchanged in every layer. This module does not import the cache.
Nothing is registered at import: `install(model)` does it (idempotent), and `EvictionCache(model)`
calls it.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import PreTrainedModel

from .hybrid import LOCAL
from .masks import causal_padding_mask, mask_kind
from .support import UnsupportedModelError, check_model_supported

PREFIX = "vase_"
#: the attention functions of the fixed-shape cache (`vase.caches.static`) carry this prefix
STATIC_PREFIX = "vase_static_"
KERNELS = ("sdpa", "eager", "flash_attention_2")


class PendingLayer(Protocol):
    """What the attention function needs from a cache layer (`vase.caches.eager.EvictionLayer`)."""

    layer_idx: int

    def serves(self, key: torch.Tensor) -> bool:
        """Whether `key` is what this layer's last `update` returned (a pending layer left by another
        cache or model with the same layer index is not this call's)."""
        ...

    def attention_mask_for(self, query: torch.Tensor, attention_mask: torch.Tensor | None,
                           kind: str) -> torch.Tensor | None: ...


#: The side channel from a cache to the attention function: the layer whose `update` ran last
#: and whose attention call is pending. A cache layer sets it in `update`; the attention function
#: of that layer takes it and asks it for the mask (`attention_mask_for`).
PENDING_LAYER: contextvars.ContextVar[PendingLayer | None] = contextvars.ContextVar("vase_pending_layer",
                                                                                   default=None)


def stock_kernel(kernel: str, module: torch.nn.Module) -> Callable:
    if kernel == "eager":
        # The model file's own eager function (some models add soft-capping etc.).
        model_module = sys.modules.get(type(module).__module__)
        return getattr(model_module, "eager_attention_forward")
    return AttentionInterface._global_mapping[kernel]


def _make_attention(kernel: str) -> Callable:
    kind = mask_kind(kernel)

    def vase_attention(module, query, key, value, attention_mask, **kwargs):
        layer = PENDING_LAYER.get()
        mask_2d = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
        if _is_local(module, kwargs):  # the model's own sliding/chunked mask (`_mask_function`); never vase's layer
            mask = attention_mask
        elif layer is not None and layer.layer_idx == getattr(module, "layer_idx", None) and layer.serves(key):
            PENDING_LAYER.set(None)
            mask = layer.attention_mask_for(query, mask_2d, kind)
        else:  # another cache (or none): the 2-D padding mask lines up with the keys
            mask = causal_padding_mask(mask_2d, query.shape[2], key.shape[2], kind, query.dtype, query.device)
        return stock_kernel(kernel, module)(module, query, key, value, mask, **kwargs)

    vase_attention.__name__ = f"vase_{kernel}"
    return vase_attention


def _is_local(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether `module` is a local-attention layer: sliding window (the kernel gets `sliding_window`, or the
    config names the layer's type) or chunked-local (Llama 4 passes no window to the kernel: the config's
    `layer_types` names it)."""
    if kwargs.get("sliding_window"):
        return True
    types = getattr(getattr(module, "config", None), "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    return bool(types) and isinstance(idx, int) and idx < len(types) and types[idx] in LOCAL


def _mask_function(kernel: str) -> Callable:
    """The mask function registered as `vase_<kernel>`: for full attention, the 2-D padding mask passed
    through untouched (the attention function builds the real mask from what the cache stores; it only
    needs the 2-D mask of the first forward to learn each row's left padding); for sliding-window and
    chunked-local attention, the stock kernel's own mask (transformers asks with `local_size`, sized from
    the sliding layer of the cache, which vase never evicts)."""
    stock = AttentionMaskInterface._global_mapping[kernel]

    def vase_mask(*, attention_mask=None, **kwargs):
        if kwargs.get("local_size") is not None:
            return stock(attention_mask=attention_mask, **kwargs)
        return attention_mask

    vase_mask.__name__ = f"vase_{kernel}_mask"
    return vase_mask


def register() -> None:
    """Register `vase_sdpa`, `vase_eager` and `vase_flash_attention_2` (idempotent)."""
    for kernel in KERNELS:
        if PREFIX + kernel not in AttentionInterface._global_mapping:
            AttentionInterface.register(PREFIX + kernel, _make_attention(kernel))
        if PREFIX + kernel not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(PREFIX + kernel, _mask_function(kernel))


def base_kernel(model: PreTrainedModel) -> str:
    """The stock kernel a model runs (with or without vase installed)."""
    impl = model.config._attn_implementation or "eager"
    for prefix in (STATIC_PREFIX, PREFIX):  # the static prefix also starts with PREFIX: test it first
        if impl.startswith(prefix):
            return impl[len(prefix):]
    return impl


def install(model: PreTrainedModel) -> None:
    """Switch `model` to vase's wrapper of the kernel it was loaded with (idempotent).

    Raises UnsupportedModelError for models vase cannot run.
    """
    check_model_supported(model)
    kernel = base_kernel(model)
    if kernel not in KERNELS:
        raise UnsupportedModelError(f"attention implementation {kernel!r} is not supported by vase: load the model "
                                    f"with attn_implementation in {', '.join(KERNELS)}")
    register()
    if model.config._attn_implementation != PREFIX + kernel:
        model.set_attn_implementation(PREFIX + kernel)


def uninstall(model: PreTrainedModel) -> None:
    """Put the model back on its stock kernel."""
    kernel = base_kernel(model)
    if model.config._attn_implementation != kernel:
        model.set_attn_implementation(kernel)
