"""vase's attention functions, registered through transformers' public `AttentionInterface`.

For each stock kernel (sdpa, eager, flash_attention_2) we register `vase_<kernel>`, which

1. hands the post-RoPE queries of the layer to the `EvictionCache` that was just updated
   (only when its policy scores by attention),
2. builds the mask from what the cache physically stores (its own padding bookkeeping and
   causal order; transformers' 2-D padding mask has logical length and no longer lines up
   with stored slots after an eviction),
3. calls the stock kernel on what the cache holds.

With any other cache (or none) it behaves like the stock kernel with a causal + padding mask.
Nothing is registered at import: `install(model)` does it (idempotent), and `EvictionCache(model)`
calls it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import PreTrainedModel

from .cache import PENDING_LAYER
from .support import UnsupportedModelError, check_model_supported

PREFIX = "vase_"
KERNELS = ("sdpa", "eager", "flash_attention_2")


def _stock_kernel(kernel: str, module: torch.nn.Module) -> Callable:
    if kernel == "eager":
        # The model file's own eager function (some models add soft-capping etc.).
        model_module = sys.modules.get(type(module).__module__)
        return getattr(model_module, "eager_attention_forward")
    return AttentionInterface._global_mapping[kernel]


def _mask_from_2d(mask_2d: torch.Tensor | None, q_len: int, kv_len: int, additive: bool,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Causal + padding mask [b, 1, q, kv] from a 2-D padding mask (no eviction happened)."""
    if mask_2d is None or mask_2d.dim() != 2:
        if q_len == 1 or (q_len == kv_len and not additive):
            return None
        mask_2d = torch.ones(1, kv_len, dtype=torch.bool, device=device)
    mask_2d = mask_2d[:, -kv_len:].bool()
    if q_len == 1 and bool(mask_2d.all()):
        return None
    slots = torch.arange(kv_len, device=mask_2d.device)
    causal = slots[None, :] <= (kv_len - q_len + torch.arange(q_len, device=mask_2d.device))[:, None]
    mask = mask_2d[:, None, None, :] & causal[None, None]
    if additive:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask


def _and_mask(mask: torch.Tensor | None, selected: torch.Tensor, kernel: str, dtype: torch.dtype) -> torch.Tensor:
    """AND a selection `selected` (bool [b, q_heads, q, L]) into the cache's mask (None, bool or additive)."""
    if kernel.startswith("flash"):
        raise ValueError("selection methods (quest) need a per-head mask, which flash_attention_2 does not take: "
                         "load the model with attn_implementation='sdpa' or 'eager'")
    if mask is None:
        mask = selected
    elif mask.dtype == torch.bool:
        return mask & selected
    else:
        return mask.masked_fill(~selected, torch.finfo(dtype).min)
    if kernel == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask


def _make_attention(kernel: str) -> Callable:
    def vase_attention(module, query, key, value, attention_mask, **kwargs):
        layer = PENDING_LAYER.get()
        q_len, kv_len = query.shape[2], key.shape[2]
        additive = kernel == "eager"
        if layer is not None and layer.layer_idx == getattr(module, "layer_idx", None):
            PENDING_LAYER.set(None)
            layer.awaiting_attention = False
            if layer.pad is None:
                layer.observe_padding(attention_mask if isinstance(attention_mask, torch.Tensor) else None)
            if layer.cfg.policy.needs_queries:
                layer.record_queries(query)
            if kernel.startswith("flash"):
                # Flash kernels take a 2-D [b, L] mask of real slots and unpad it themselves.
                mask = None
                if any(layer.pad):
                    slots = torch.arange(layer.length, device=query.device)
                    mask = (slots[None, :] >= torch.tensor(layer.pad, device=query.device)[:, None]).int()
            else:
                mask = layer.cache.attention_mask(layer, q_len, query.dtype, additive)
            selected = layer.selection_mask(query)  # Quest: per-step page selection, else None
            if selected is not None:
                mask = _and_mask(mask, selected, kernel, query.dtype)
        elif kernel.startswith("flash"):
            mask = attention_mask
        else:
            mask = _mask_from_2d(attention_mask if isinstance(attention_mask, torch.Tensor) else None,
                                 q_len, kv_len, additive, query.dtype, query.device)
        return _stock_kernel(kernel, module)(module, query, key, value, mask, **kwargs)

    vase_attention.__name__ = f"vase_{kernel}"
    return vase_attention


def _passthrough_mask(*, attention_mask=None, **kwargs):
    """Mask "creation" for vase kernels: hand the 2-D padding mask through untouched.

    The attention function builds the real mask from what the cache stores; it only needs
    the 2-D mask of the first forward to learn each row's left padding.
    """
    return attention_mask


def register() -> None:
    """Register `vase_sdpa`, `vase_eager` and `vase_flash_attention_2` (idempotent)."""
    for kernel in KERNELS:
        if PREFIX + kernel not in AttentionInterface._global_mapping:
            AttentionInterface.register(PREFIX + kernel, _make_attention(kernel))
        if PREFIX + kernel not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(PREFIX + kernel, _passthrough_mask)


def base_kernel(model: PreTrainedModel) -> str:
    """The stock kernel a model runs (with or without vase installed)."""
    impl = model.config._attn_implementation or "eager"
    return impl[len(PREFIX):] if impl.startswith(PREFIX) else impl


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
