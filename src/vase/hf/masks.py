"""The one causal + padding mask builder of vase's attention functions, and the selection AND.

Three mask forms, one per kernel family (`mask_kind`):
    "bool":     [b, 1, q, L] bool, True = attend (sdpa)
    "additive": [b, 1, q, L] float, 0 or the dtype's minimum (eager)
    "flash":    [b, L] int, 1 = real slot (flash_attention_2 unpads it and applies causality)

The q new queries sit at the last q of the L key slots (query i sees slots 0 .. L - q + i).
None means "nothing to mask" in the kernel's own terms: a single query over real slots, or a
plain causal square that sdpa runs with is_causal (eager always needs the additive mask).
A selection method (Quest) ANDs a per-head [b, q_heads, q, L] bool mask in with `and_selection`.
Pure torch.
"""

from __future__ import annotations

import torch

KINDS = ("bool", "additive", "flash")


def mask_kind(kernel: str) -> str:
    """The mask form a stock kernel takes: 'flash', 'additive' (eager) or 'bool' (sdpa)."""
    if kernel.startswith("flash"):
        return "flash"
    return "additive" if kernel == "eager" else "bool"


def real_slots(pad: list[int] | torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """[b, length] bool: True from slot pad[r] on (row r's first pad[r] slots are left padding)."""
    pad = torch.as_tensor(pad, device=device)
    return torch.arange(length, device=device)[None, :] >= pad[:, None]


def causal_padding_mask(real: torch.Tensor | None, q_len: int, kv_len: int, kind: str, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor | None:
    """The mask for `q_len` queries over `kv_len` key slots, in the form `kind` (see the module docstring).

    real: [b, >= kv_len] bool/int, nonzero = real slot (its last kv_len columns are used), or
    None when every slot is real.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown mask kind {kind!r}: use one of {', '.join(KINDS)}")
    if real is not None:
        real = real[:, -kv_len:].bool()
        if bool(real.all()):
            real = None
    if kind == "flash":
        return None if real is None else real.int()
    if real is None and (q_len == 1 or (q_len == kv_len and kind == "bool")):
        return None
    slots = torch.arange(kv_len, device=device)
    causal = slots[None, :] <= (kv_len - q_len + torch.arange(q_len, device=device))[:, None]  # [q, L]
    mask = causal[None, None] if real is None else real[:, None, None, :] & causal[None, None]
    if kind == "additive":
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask


def and_selection(mask: torch.Tensor | None, selected: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """AND a selection `selected` (bool [b, q_heads, q, L], True = attend) into `mask` of form `kind`."""
    if kind == "flash":
        raise ValueError("selection methods (quest) need a per-head mask, which flash_attention_2 does not take: "
                         "load the model with attn_implementation='sdpa' or 'eager'")
    if mask is None:
        mask = selected
    elif mask.dtype == torch.bool:
        return mask & selected
    else:
        return mask.masked_fill(~selected, torch.finfo(dtype).min)
    if kind == "additive":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask
