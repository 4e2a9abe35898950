"""Value-magnitude statistics: measured, never assumed (small models lack the paper's heavy tail)."""

from __future__ import annotations

import torch

from ..core.policies import value_magnitude


def value_statistics(values: list[torch.Tensor], metric: str = "range", outlier_ratio: float = 5.0,
                     top: int = 5, layer_ids: list[int] | None = None) -> list[dict]:
    """Per layer: how far the largest value magnitudes stand above the per-head median.

    values: one tensor per layer, [batch, kv_heads, n, head_dim] (e.g. a full cache's values).
    Returns one dict per layer with the max/median ratio, the share of tokens above
    `outlier_ratio` x median, and the `top` token positions (of row 0) with the largest ratio.
    layer_ids: the model's index of each tensor's layer (default 0, 1, ...; a hybrid's full-attention layers).
    """
    rows = []
    for layer, v in enumerate(values):
        mag = value_magnitude(v, metric)  # [b, h, n]
        ratio = mag / mag.median(dim=-1, keepdim=True).values.clamp(min=1e-12)
        flat = ratio[0].amax(0)  # per position: the most extreme head of row 0
        k = min(top, flat.numel())
        rows.append({
            "layer": layer if layer_ids is None else layer_ids[layer],
            "max_over_median": float(ratio.max()),
            "share_over_threshold": float((ratio > outlier_ratio).float().mean()),
            "top_positions": flat.topk(k).indices.tolist(),
            "top_ratios": [round(float(x), 2) for x in flat.topk(k).values],
        })
    return rows
