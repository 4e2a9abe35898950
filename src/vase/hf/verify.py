"""Speculative verification on an evicting cache: what `vase.caches.eager.EvictionLayer` keeps to crop and defer.

Assisted generation and prompt-lookup decoding (transformers' `assistant_model=`, `prompt_lookup_num_tokens=`)
run one forward over k + 1 tokens (the last accepted token, then k drafts) and then `crop` the rejected drafts.
Two rules make that exact, i.e. the same tokens and kept sets as decoding one token per forward:

- crop: only the tokens of the last forward can be removed (and none an eviction compacted); the query ring
  is restored to what it held before that forward, then given back the accepted tokens' queries
  (`LastForward`), so only accepted queries ever enter the window an eviction scores with;
- deferral: when the schedule's eviction point falls inside the forward (after its first token, which is
  verified), the eviction that token-by-token decoding would run before writing token `limit` is computed
  during the forward, from the same candidates and the same query window (the ring's older queries and this
  forward's queries before the cut), and the forward's tokens from the cut on attend only to what it keeps
  (`cut_mask`). It is applied (compacted) once a crop or the next forward shows the token at the cut was
  accepted, else dropped and the policy's state and generators restored (`Snapshot`), so a rejected draft
  leaves no trace.

Batch of 1 (transformers' assisted generation is). Torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LastForward", "Snapshot", "Pending", "cut_mask"]


@dataclass
class LastForward:
    """The last multi-token forward after the prefill: what a crop of its tokens needs."""

    start: int  # tokens seen before it (logical)
    tokens: int  # tokens it wrote
    ring: torch.Tensor | None  # the query ring before it [b, q_heads, w, d] (None: the policy records no queries)
    queries_seen: int
    queries: torch.Tensor | None  # its post-RoPE queries [b, q_heads, tokens, d]


@dataclass
class Snapshot:
    """The policy's state before a deferred selection ran: restored when the selection is dropped."""

    generators: list[torch.Tensor]  # each row's generator state
    slot_state: dict[str, torch.Tensor]
    layer_state: dict[str, torch.Tensor]
    state_ready: list[bool]

    @classmethod
    def take(cls, generators: list[torch.Tensor], slot_state: dict[str, torch.Tensor],
             layer_state: dict[str, torch.Tensor], state_ready: list[bool]) -> "Snapshot":
        """`generators`: the rows' generator states to rewind to (`torch.Generator.get_state`)."""
        return cls(generators=generators,
                   slot_state={k: v.clone() for k, v in slot_state.items()},
                   layer_state={k: v.clone() for k, v in layer_state.items()}, state_ready=list(state_ready))

    def restore(self, generators: list[torch.Generator], slot_state: dict[str, torch.Tensor],
                layer_state: dict[str, torch.Tensor]) -> list[bool]:
        """Put the state back into the layer's dicts and rewind `generators`; returns state_ready."""
        for g, s in zip(generators, self.generators):
            g.set_state(s)
        slot_state.update(self.slot_state)
        layer_state.clear()
        layer_state.update(self.layer_state)
        return list(self.state_ready)


@dataclass
class Pending:
    """A deferred eviction: the one token-by-token decoding runs when row 0 stores `limit` real tokens."""

    limit: int  # real tokens stored when it runs (the cut)
    keep: torch.Tensor  # [1, kv_heads, B - w] the kept candidates, relative to the first real slot
    snapshot: Snapshot


def cut_mask(keep: torch.Tensor, n_cand: int, pad: int, length: int, q: int, first_cut: int,
             q_heads: int) -> torch.Tensor:
    """Which slots each of the `q` new queries may attend: bool [1, q_heads, q, length], True = attend.

    Queries `first_cut` .. q - 1 (the tokens from the cut on) lose the candidates the deferred eviction drops
    (slots pad .. pad + n_cand - 1 not in `keep` [1, kv_heads, k]); the earlier queries see every slot."""
    h = keep.shape[1]
    dropped = torch.ones(1, h, n_cand, dtype=torch.bool, device=keep.device)
    dropped.scatter_(2, keep, False)
    allowed = torch.ones(1, h, q, length, dtype=torch.bool, device=keep.device)
    allowed[:, :, first_cut:, pad: pad + n_cand] = ~dropped[:, :, None, :]
    return allowed.repeat_interleave(q_heads // h, dim=1)
