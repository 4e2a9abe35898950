"""Which original positions each layer and KV head kept, as a map and a picture."""

from __future__ import annotations

from pathlib import Path

import torch


def kept_map(cache, row: int = 0) -> torch.Tensor:
    """Bool [layers, kv_heads, seen]: True where the cache still holds that sequence position.

    `cache` is a `vase.EvictionCache` after a run; positions are sequence indices (padding included). A hybrid
    model's layers here are its evicting (full-attention) ones.
    """
    layers = [layer for layer in cache.evicting_layers if layer.is_initialized]
    seen = layers[0].seen
    out = torch.zeros(len(layers), layers[0].keys.shape[1], seen + 1, dtype=torch.bool)
    for i, layer in enumerate(layers):
        pos = layer.positions[row, :, : layer.length].cpu()
        out[i].scatter_(1, torch.where(pos >= 0, pos, seen), True)
    return out[..., :seen]


def plot_kept_map(kept: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Save `kept` [layers, kv_heads, seen] as a PNG heat map (one row per layer and head)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads, seen = kept.shape
    fig, ax = plt.subplots(figsize=(10, max(2.0, 0.12 * layers * heads)))
    ax.imshow(kept.reshape(layers * heads, seen).float().numpy(), aspect="auto", interpolation="nearest",
              cmap="Greys")
    ax.set_xlabel("sequence position")
    ax.set_ylabel("layer x KV head")
    ax.set_title(title or f"kept tokens ({kept.float().mean():.0%} of {seen})")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
