"""Quest (Tang et al., 2024): query-aware page selection over a full cache (selection, not eviction).

Nothing is evicted. The slots after the first `sinks` are grouped in pages of `page_size`
consecutive tokens, each page summarised by its elementwise minimum and maximum key. At every
decode step, each KV head scores every page by an upper bound on `q . k` over the page,

    bound(q, page) = sum_c max(q_c * kmin_c, q_c * kmax_c)
                   = relu(q) . kmax + min(q, 0) . kmin          (two matmuls),

and attends exactly `budget` tokens: the first `sinks` tokens, the `window` most recent tokens,
and `budget - sinks - window` of the tokens between them (the candidates), taken page by page
in the order of the bound. Pages are sized to the target (**choice made here**; Quest rounds the
budget down to whole pages): the last page taken is cut to its earliest candidate tokens, so the
count is exactly `budget` whatever the page size. Sinks and window never count as candidates:
pages start after the sinks, and the page the window starts in is scored on its tokens before
the window only. When the visible context is at most `budget` tokens, everything is attended.
So a query attends `min(visible, budget)` tokens: give `budget` the mean number of tokens an
evicting cache attends per step (`B + (w + 1) / 2` in its steady state) for equal sparsity.

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

import torch

from .base import Policy


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page elementwise min and max of the keys.

    keys [b, h, L, d] -> (kmin, kmax), each [b, h, ceil(L / page_size), d] float32; the last
    page may be partial and is summarised over the tokens it holds.
    """
    kmin, kmax = prefix_bounds(keys, page_size)
    last = torch.arange(0, keys.shape[2], page_size, device=keys.device).add(page_size - 1).clamp(max=keys.shape[2] - 1)
    return kmin[:, :, last], kmax[:, :, last]


def prefix_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running min and max of the keys from the start of each slot's page up to the slot.

    keys [b, h, L, d] -> (kmin, kmax), each [b, h, L, d] float32: entry s summarises slots
    `page_size * (s // page_size) .. s`, i.e. the part of s's page that is at or before s.
    """
    b, h, L, d = keys.shape
    n_pages = -(-L // page_size)
    k = keys.float()
    if n_pages * page_size > L:  # pad the partial last page; the padding lies after every real slot
        k = torch.cat([k, k.new_zeros(b, h, n_pages * page_size - L, d)], dim=2)
    k = k.view(b, h, n_pages, page_size, d)
    kmin = k.cummin(3).values.view(b, h, -1, d)[:, :, :L]
    kmax = k.cummax(3).values.view(b, h, -1, d)[:, :, :L]
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


def _own_page_scores(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The bound of query i against its own summary i: queries [b, h_q, q, d], kmin/kmax
    [b, h_kv, q, d] -> [b, h_kv, q] float32 (summed over each KV head's query group)."""
    b, h_q, q, d = queries.shape
    h_kv = kmin.shape[1]
    qf = queries.float().view(b, h_kv, h_q // h_kv, q, d)
    bound = (qf.clamp(min=0) * kmax[:, :, None]).sum(-1) + (qf.clamp(max=0) * kmin[:, :, None]).sum(-1)
    return bound.sum(2)


def quest_mask(keys: torch.Tensor, queries: torch.Tensor, q_start: int, budget: int, window: int, sinks: int,
               page_size: int) -> torch.Tensor:
    """Which stored slots each query attends under Quest: bool [b, kv_heads, q, L].

    keys [b, h_kv, L, d] (all stored slots), queries [b, h_q, q, d]; query i sits at slot
    `q_start + i` and sees the `n = q_start + i + 1` slots `0 .. q_start + i`. When `n <= budget`
    it attends all of them. Otherwise it attends exactly `budget`: the `sinks` first slots, its
    `window` most recent ones, and `budget - sinks - window` of the candidates between them,
    taken page by page (pages of `page_size` slots counted from slot `sinks`) in the order of
    `page_scores`, the last page taken cut to its earliest candidate slots. The page the window
    starts in is scored on its candidate slots only. Every slot a query's selection reads lies
    before its window, so a chunk of queries gets exactly the masks one query at a time would.
    """
    b, h_kv, L, _ = keys.shape
    q = queries.shape[2]
    if q_start < 0 or q_start + q > L:
        raise ValueError(f"queries at slots {q_start}..{q_start + q - 1} do not fit in {L} stored slots")
    device = keys.device
    slots = torch.arange(L, device=device)
    n_visible = q_start + 1 + torch.arange(q, device=device)  # [q]
    visible = slots[None, :] < n_visible[:, None]  # [q, L]
    always = (slots[None, :] < sinks) | (slots[None, :] >= (n_visible - window)[:, None])
    attend = (always & visible).expand(b, h_kv, q, L).clone()
    quota = budget - sinks - window  # candidate slots each restricted query attends
    # Candidates: slots sinks .. n - w - 1, in pages counted from slot `sinks`.
    end = n_visible - window - sinks  # [q] candidate slots (relative to `sinks`) per query
    restricted = n_visible > budget
    if quota > 0 and bool(restricted.any()) and L > sinks:
        kmin_run, kmax_run = prefix_bounds(keys[:, :, sinks:], page_size)  # [b, h_kv, L - sinks, d]
        Lc = L - sinks
        n_pages = -(-Lc // page_size)
        last = (torch.arange(n_pages, device=device) * page_size + page_size - 1).clamp(max=Lc - 1)
        scores = page_scores(queries, kmin_run[:, :, last], kmax_run[:, :, last])  # [b, h_kv, q, P]
        # The page the candidates end in is scored on its candidate slots only (those before the window).
        e = (end - 1).clamp(min=0)  # last candidate slot per query
        cut = e // page_size  # [q]
        own = _own_page_scores(queries, kmin_run[:, :, e], kmax_run[:, :, e])  # [b, h_kv, q]
        pages = torch.arange(n_pages, device=device)
        scores = torch.where(pages == cut[:, None], own[..., None], scores)
        count = (end[:, None] - pages * page_size).clamp(min=0, max=page_size)  # [q, P] candidate slots per page
        scores = scores.masked_fill(count == 0, float("-inf"))
        order = scores.argsort(dim=-1, descending=True, stable=True)  # ties: the earlier page first
        c_sorted = count.expand(b, h_kv, q, n_pages).gather(-1, order)
        before = c_sorted.cumsum(-1) - c_sorted
        take_sorted = (quota - before).clamp(min=0).minimum(c_sorted)
        take = torch.zeros_like(take_sorted).scatter_(-1, order, take_sorted)  # [b, h_kv, q, P] slots per page
        rel = slots[sinks:] - sinks
        chosen = (rel % page_size) < take[..., rel // page_size]  # [b, h_kv, q, Lc]; implies a candidate slot
        attend[..., sinks:] |= chosen
    attend |= restricted.logical_not()[:, None] & visible  # short contexts: everything
    return attend & visible


@dataclass(frozen=True)
class Quest(Policy):
    """Query-aware page selection over the full cache (Tang et al., 2024); see the module docstring.

    page_size:    tokens per page (16 in Quest).
    sinks:        first tokens always attended (4).
    dense_layers: the first layers attend densely (Quest's paper leaves early layers, which are far
                  less sparse, dense; 0 here so every layer keeps the stated sparsity).
    The recent window is the cache's `window`; the budget `B` is the tokens each query attends once
    more than `B` are visible.
    """

    page_size: int = 16
    dense_layers: int = 0

    name = "quest"
    summary = "Selection, no eviction: attend sinks, window and the top 16-token pages by a q.k upper bound (B tokens)."
    evicts = False
    selects = True
    shared_heads_refusal = "it selects pages of stored keys per KV head at every step (a latent cache stores none)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 token, got {self.page_size}")
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")
        if self.sample or self.guarded or self.protect_sinks:
            raise ValueError("quest selects pages and evicts nothing: the eviction modifiers (sample, value_guard, "
                             "n_large, protect_sinks) do not apply; its parameters are page_size, sinks, dense_layers")

    # No `check` of its own: the contract's budget rule (B > w + sinks) is Quest's only rule. Any window works,
    # a window shorter than a page included: the page the window starts in is scored on its tokens before the
    # window, so a chunk of queries gets exactly the masks of one query at a time (tests/test_quest.py).

    @property
    def protected_slots(self) -> int:
        """The sinks are always attended (Quest has no `protect_sinks` switch)."""
        return self.sinks

    def attends_densely(self, layer_idx: int) -> bool:
        return layer_idx < self.dense_layers

    def attend_mask(self, keys: torch.Tensor, queries: torch.Tensor, q_start: int, budget: int,
                    window: int) -> torch.Tensor:
        """bool [b, kv_heads, q, L]: what each query attends (see `quest_mask`)."""
        return quest_mask(keys, queries, q_start, budget, window, self.sinks, self.page_size)

    def score(self, keys, values, queries, generator=None, **extra):
        raise RuntimeError("quest selects per step and never evicts")
