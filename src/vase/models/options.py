"""The load options (device, dtype, attention kernel), checked before anything is read."""

from __future__ import annotations

import importlib.util

import torch

from .errors import ModelLoadError

__all__ = ["resolve_device", "resolve_dtype", "check_attn_implementation", "accelerate_available"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a device; ModelLoadError otherwise."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"unknown device {name!r}: use 'cpu', 'cuda' or 'auto'") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} was asked for but CUDA is not available: use 'cpu' or 'auto'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A dtype name (``"auto"``: bfloat16 on CUDA, float32 elsewhere) or a ``torch.dtype`` as a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
    return _DTYPES[name]


def check_attn_implementation(attn_implementation: str, device: torch.device) -> None:
    """A known attention kernel that this install and device can run; ModelLoadError otherwise."""
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        raise ModelLoadError(
            f"unknown attn_implementation {attn_implementation!r}: use one of {', '.join(_ATTN_IMPLEMENTATIONS)}"
        )
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ModelLoadError(
                "attn_implementation='flash_attention_2' needs the flash-attn package: "
                "`pip install flash-attn`, or use attn_implementation='sdpa'"
            )
        if device.type != "cuda":
            raise ModelLoadError("attn_implementation='flash_attention_2' needs a CUDA device; use 'sdpa' on CPU")


def accelerate_available() -> bool:
    """Whether accelerate is installed (it enables device_map loads and the newer GGUF loader)."""
    return importlib.util.find_spec("accelerate") is not None
