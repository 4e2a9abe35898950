"""Scores shared by several policies: windowed attention (SnapKV, R-KV, VaSE-AttnV, H2O, TOVA),
key redundancy (R-KV), and `AttentionScored`, the base of the policies scored by attention.
Layouts as in `base.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Policy


def window_attention(keys: torch.Tensor, queries: torch.Tensor, temperature: float = 1.0,
                     smooth_kernel: int = 5) -> torch.Tensor:
    """Attention mass each candidate gets from the query window (docs/methods.md, "The windowed attention score").

    keys [b, kv_heads, n, d], queries [b, q_heads, w, d] -> [b, kv_heads, n] float32:
    softmax over the candidates (float32), mean over the window, average pool along the
    candidates (kernel `smooth_kernel`, zero padding, edges divided by the full kernel),
    mean over the query heads of each KV group.
    """
    b, h_kv, n, d = keys.shape
    h_q, w = queries.shape[1], queries.shape[2]
    group = h_q // h_kv
    # Scale the (few) queries rather than the (many) logits.
    q = queries.float().reshape(b, h_kv, group * w, d) / (math.sqrt(d) * temperature)
    logits = torch.matmul(q, keys.float().transpose(-1, -2))
    attn = logits.softmax(-1).view(b, h_kv, group, w, n).mean(3)  # [b, h_kv, group, n]
    if smooth_kernel > 1:
        attn = F.avg_pool1d(attn.reshape(-1, 1, n), smooth_kernel, stride=1, padding=smooth_kernel // 2,
                            count_include_pad=True).view(b, h_kv, group, -1)[..., :n]
    return attn.mean(2)


def key_redundancy(keys: torch.Tensor) -> torch.Tensor:
    """R-KV's redundancy: softmax over candidates of the mean cosine similarity to the others.

    keys [b, kv_heads, n, d] -> [b, kv_heads, n] float32 (the diagonal counts as 0 in the mean, which runs
    over all n). Computed in O(n * d) memory, never the [n, n] similarity matrix: with unit keys u_i,
    sum_{j != i} u_i . u_j = u_i . (sum_j u_j) - u_i . u_i (the last term is 1, or 0 for a zero key).
    In float64, so the cancellation costs nothing and the row sum's order (which depends on the batch
    shape) cannot move a float32 score.
    """
    n = keys.shape[2]
    # One float64 copy (never the caller's keys), normalised in place as F.normalize does: k / max(||k||, 1e-12).
    u = keys.to(torch.float64, copy=True)
    u.div_(torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_(min=1e-12))
    total = u.sum(-2, keepdim=True)  # [b, h, 1, d]
    others = torch.matmul(u, total.transpose(-1, -2)).squeeze(-1) - u.square().sum(-1)  # [b, h, n]
    return (others / n).softmax(-1).float()


@dataclass(frozen=True)
class AttentionScored(Policy):
    """A policy scored by the attention of the query window (docs/methods.md, "The windowed attention score")."""

    temperature: float = 1.0
    smooth_kernel: int = 5
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.smooth_kernel < 1 or self.smooth_kernel % 2 == 0:
            raise ValueError(f"smooth_kernel must be an odd number >= 1 (1 = no smoothing), got {self.smooth_kernel}")

    def score(self, keys, values, queries, generator=None, **extra):
        return window_attention(keys, queries, self.temperature, self.smooth_kernel)
