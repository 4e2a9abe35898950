"""Quest (Tang et al., 2024): query-aware page selection over a full cache (selection, not eviction).

Nothing is evicted. Keys are grouped in pages of `page_size` consecutive tokens, each page
summarised by its elementwise minimum and maximum key. At every decode step, each KV head
scores every page by an upper bound on `q . k` over the page,

    bound(q, page) = sum_c max(q_c * kmin_c, q_c * kmax_c)
                   = relu(q) . kmax + min(q, 0) . kmin          (two matmuls),

and attends only to: the first `sinks` tokens, the `window` most recent tokens, and the
top `(budget - sinks - window) // page_size` pages by the bound among the pages holding any
other token. When the visible context is at most `budget` tokens, everything is attended.
So each query attends to at most `budget` tokens, the same sparsity as an eviction cache
holding `budget` tokens.

GQA (Quest's reference targets multi-head models; **choice made here**): the KV heads of a
group share one selection; a page's score is the *sum* over the group's query heads of the
per-head bounds. This is an upper bound on the sum of the group's `q . k`, i.e. on the
group's total pre-softmax attention logit to the page's best key, so a page any head of the
group needs strongly ranks high.

The prefill is dense (as in Quest); selection applies to every query after it. Pure tensor
code, no transformers import. Layouts:
    keys:    [batch, kv_heads, L, head_dim]   post-RoPE keys of the stored slots, in order
    queries: [batch, q_heads, q, head_dim]    post-RoPE; query i sits at slot q_start + i
    masks:   bool [batch, kv_heads, q, L]     True = attended (causal order included)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page elementwise min and max of the keys.

    keys [b, h, L, d] -> (kmin, kmax), each [b, h, ceil(L / page_size), d] float32; the last
    page may be partial and is summarised over the tokens it holds.
    """
    b, h, L, d = keys.shape
    n_pages = -(-L // page_size)
    k = keys.float()
    full = (L // page_size) * page_size
    kmin = k[:, :, :full].reshape(b, h, -1, page_size, d).amin(3)
    kmax = k[:, :, :full].reshape(b, h, -1, page_size, d).amax(3)
    if full < L:  # the partial last page
        kmin = torch.cat([kmin, k[:, :, full:].amin(2, keepdim=True)], dim=2)
        kmax = torch.cat([kmax, k[:, :, full:].amax(2, keepdim=True)], dim=2)
    assert kmin.shape[2] == n_pages
    return kmin, kmax


def page_scores(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound on q . k per page, summed over each KV head's query group.

    queries [b, h_q, q, d], kmin/kmax [b, h_kv, P, d] -> [b, h_kv, q, P] float32.
    """
    b, h_q, q, d = queries.shape
    h_kv = kmin.shape[1]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    group = h_q // h_kv
    qf = queries.float().reshape(b, h_kv, group * q, d)
    bound = qf.clamp(min=0) @ kmax.transpose(-1, -2) + qf.clamp(max=0) @ kmin.transpose(-1, -2)
    return bound.view(b, h_kv, group, q, -1).sum(2)


def quest_mask(keys: torch.Tensor, queries: torch.Tensor, q_start: int, budget: int, window: int, sinks: int,
               page_size: int) -> torch.Tensor:
    """Which stored slots each query attends under Quest: bool [b, kv_heads, q, L].

    keys [b, h_kv, L, d] (all stored slots), queries [b, h_q, q, d]; query i sits at slot
    `q_start + i` and sees slots `0 .. q_start + i`. Each query attends to the sinks, its
    `window` most recent slots and the top pages by `page_scores` among the pages that hold
    any other visible slot, `(budget - sinks - window) // page_size` of them; to every
    visible slot when at most `budget` are visible. With `window >= page_size`, a chunk of
    queries gets exactly the masks that one query at a time would (the pages they score
    differently, being still incomplete, lie inside the always-attended window).
    """
    b, h_kv, L, _ = keys.shape
    q = queries.shape[2]
    if q_start < 0 or q_start + q > L:
        raise ValueError(f"queries at slots {q_start}..{q_start + q - 1} do not fit in {L} stored slots")
    device = keys.device
    slots = torch.arange(L, device=device)
    t = q_start + torch.arange(q, device=device)  # the slot of each query
    visible = slots[None, :] <= t[:, None]  # [q, L]
    n_visible = t + 1
    always = (slots[None, :] < sinks) | (slots[None, :] >= (n_visible - window)[:, None])
    kmin, kmax = page_bounds(keys, page_size)
    n_pages = kmin.shape[2]
    first = torch.arange(n_pages, device=device) * page_size  # first slot of each page
    # A page competes when it holds a visible slot that is neither a sink nor in the window.
    candidate = (first[None, :] < (n_visible - window)[:, None]) & (first[None, :] + page_size > sinks)  # [q, P]
    n_select = min(max((budget - sinks - window) // page_size, 0), n_pages)
    chosen = torch.zeros(b, h_kv, q, n_pages, dtype=torch.bool, device=device)
    if n_select > 0:
        scores = page_scores(queries, kmin, kmax).masked_fill(~candidate, float("-inf"))
        top = scores.topk(n_select, dim=-1).indices
        chosen.scatter_(-1, top, True)
        chosen &= candidate  # fewer candidates than slots: the -inf picks are not pages
    attend = chosen[..., slots // page_size] | always  # [b, h_kv, q, L]
    attend |= (n_visible <= budget)[:, None]  # short contexts: everything
    return attend & visible


@dataclass(frozen=True)
class Quest(Policy):
    """Query-aware page selection over the full cache (Tang et al., 2024); see the module docstring.

    page_size:    tokens per page (16 in Quest).
    sinks:        first tokens always attended (4).
    dense_layers: the first layers attend densely (Quest's paper leaves early layers, which are far
                  less sparse, dense; 0 here so every layer keeps the stated sparsity).
    The recent window is the cache's `window`; the budget `B` caps the attended tokens per query.
    """

    page_size: int = 16
    dense_layers: int = 0

    name = "quest"
    summary = "Selection, no eviction: attend sinks, window and the top 16-token pages by a q.k upper bound."
    evicts = False
    selects: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 token, got {self.page_size}")
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")
        if self.sample or self.guarded or self.protect_sinks:
            raise ValueError("quest selects pages and evicts nothing: the eviction modifiers (sample, value_guard, "
                             "n_large, protect_sinks) do not apply; its parameters are page_size, sinks, dense_layers")

    def check(self, budget: int, window: int) -> None:
        """Reject a budget/window this selection cannot honour, with the fix."""
        if budget <= window + self.sinks:
            raise ValueError(f"quest: budget ({budget}) must be larger than window + sinks ({window} + {self.sinks}): "
                             "raise --budget or lower --window")
        if window < self.page_size:
            raise ValueError(f"quest: window ({window}) must be at least page_size ({self.page_size}) so the "
                             "incomplete last page is always attended: raise --window or lower -p page_size")

    def attend_mask(self, keys: torch.Tensor, queries: torch.Tensor, q_start: int, budget: int,
                    window: int) -> torch.Tensor:
        """bool [b, kv_heads, q, L]: what each query attends (see `quest_mask`)."""
        return quest_mask(keys, queries, q_start, budget, window, self.sinks, self.page_size)

    def score(self, keys, values, queries, generator=None, **extra):
        raise RuntimeError("quest selects per step and never evicts")
