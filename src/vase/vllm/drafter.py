"""A drafter's own KV cache under eviction (speculative_config method "draft_model", "eagle" or "eagle3").

vLLM 0.32 puts the draft model's attention layers in the target's KV cache group when their KV spec is the target's
(same KV heads, head size, dtype: one `FullAttentionSpec`; `SpecDecodeBaseProposer.validate_same_kv_cache_group`
asserts the draft layers share one group), so a request's draft K/V lives in its blocks, in the draft layers' own
tensors: the plugin's physical length, block count and trims bound it with the target's. Two things are the plugin's:

1. Slots. The proposer maps positions to slots itself, from the logical positions through the block table
   (`compute_new_slot_mapping` in its first pass, `eagle_step_update_slot_mapping_and_metadata` in each later draft
   pass). `attach` swaps the proposer's class for one that makes those slots physical (`physical_draft_slots`): the
   step's offset (logical minus physical, `steps.StepPlan.offset`), and no slot (vLLM's PADDING_SLOT_ID: nothing
   written) at or past the request's next eviction boundary (`steps.draft_limit`), where the target evicts before it
   writes; the next verify step's first pass writes the verified tokens' draft K/V there again, as without eviction.
2. Eviction. The draft layers are compacted at the target's eviction steps, from the same length to the same B, with
   a kept set of their own: sink + recent (`streamingllm`), which reads no queries and draws nothing, so the target's
   policy state, generator and kept sets are those of decoding without speculation (`evict_draft_layers`).

The target's tokens need the target's cache only: the drafter proposes, its writes land in its own layers. No vLLM
import here.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core.policies import get_policy
from .paged import EvictionJob, Layout, RequestPolicyState, evict_paged_batch

#: vLLM's `vllm.v1.spec_decode.utils.PADDING_SLOT_ID`: the KV write kernels skip a token mapped to it
PADDING_SLOT_ID = -1
#: the draft layers' own kept set at each eviction: sink + recent (no queries, no draws)
DRAFT_METHOD = "streamingllm"


def draft_layer_names(runner) -> set[str]:
    """The attention layers of the runner's draft model (none for an n-gram proposer or without speculation)."""
    return set(getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", None) or ())


def physical_draft_slots(slots: torch.Tensor, positions: torch.Tensor, req_index: torch.Tensor,
                         offsets: torch.Tensor, limits: torch.Tensor, block_table: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """The physical slots [N] of N draft tokens. slots: vLLM's logical ones [N] (PADDING_SLOT_ID where it writes
    nothing: rejected tokens, past max_model_len); positions: logical [N]; req_index: each token's request row [N];
    offsets, limits: per request [R] (logical minus physical position; the first position with no slot);
    block_table: [R, max_blocks] block ids of `block_size` slots."""
    req = req_index.long()
    physical = positions.long() - offsets[req]
    ok = (slots != PADDING_SLOT_ID) & (positions.long() < limits[req]) & (physical >= 0)
    physical = torch.where(ok, physical, torch.zeros_like(physical))
    blocks = block_table[req, physical // block_size].long()
    return torch.where(ok, blocks * block_size + physical % block_size, torch.full_like(physical, PADDING_SLOT_ID))


class _PhysicalDraftSlots:
    """Mixed into the proposer's class (`attach`): its two slot computations made physical (module docstring)."""

    vase_runner = None  # the model runner, whose `_vase_step` sets vase_draft_offsets and vase_draft_limits [R]

    def _vase_remap(self, slots: torch.Tensor, positions: torch.Tensor, req_index: torch.Tensor,
                    block_table: torch.Tensor) -> torch.Tensor:
        runner = self.vase_runner
        return physical_draft_slots(slots, positions, req_index, runner.vase_draft_offsets,
                                    runner.vase_draft_limits, block_table, self.block_size)

    def set_inputs_first_pass(self, *args, **kwargs):
        num_tokens, token_indices, cad = super().set_inputs_first_pass(*args, **kwargs)
        if self.needs_extra_input_slots:  # else (EAGLE) the target's slot mapping, already physical
            starts = cad.query_start_loc_cpu.long()
            rows = torch.repeat_interleave(torch.arange(starts.numel() - 1), starts[1:] - starts[:-1],
                                           output_size=num_tokens)
            cad.slot_mapping = self._vase_remap(cad.slot_mapping[:num_tokens], self.positions[:num_tokens],
                                                rows.to(cad.slot_mapping.device), cad.block_table_tensor)
        return num_tokens, token_indices, cad

    def _update_positions_dependent_metadata(self, positions, common_attn_metadata, batch_size, input_batch_size,
                                             block_size):
        out = super()._update_positions_dependent_metadata(positions, common_attn_metadata, batch_size,
                                                           input_batch_size, block_size)
        slots = self._slot_mapping_buffer[:batch_size]
        rows = torch.arange(batch_size, device=slots.device)
        slots.copy_(self._vase_remap(slots, self.positions[:batch_size], rows, common_attn_metadata.block_table_tensor))
        common_attn_metadata.slot_mapping = slots
        return out


_CLASSES: dict[type, type] = {}


def attach(drafter, runner) -> None:
    """Swap `drafter`'s class (a vLLM `SpecDecodeBaseProposer` subclass) for one writing physical slots, read from
    `runner`'s per-step offsets and limits. One class per proposer class; state kept."""
    cls = type(drafter)
    if not issubclass(cls, _PhysicalDraftSlots):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Vase{cls.__name__}", (_PhysicalDraftSlots, cls), {"__module__": __name__})
        drafter.__class__ = _CLASSES[cls]
    drafter.vase_runner = runner


def evict_draft_layers(views: Callable[[str], tuple[torch.Tensor, torch.Tensor]], names: list[str],
                       jobs: list[EvictionJob], length: int, keep: int, window: int, layout: Layout | None,
                       block_size: int) -> None:
    """Compact the draft layers `names` of the k requests `jobs` (their blocks and copy-on-write targets, as the
    target's eviction this step) from `length` slots to `keep`, sink + recent (`DRAFT_METHOD`). `views(name)`: the
    layer's key and value caches [num_blocks, kv_heads, block_size, head_dim]."""
    policy = get_policy(DRAFT_METHOD)
    for layer, name in enumerate(names):
        keys, values = views(name)
        own = [EvictionJob(job.block_ids, RequestPolicyState(torch.Generator(device=keys.device)),
                           job.target_block_ids) for job in jobs]
        evict_paged_batch(keys, values, own, length, None, policy, keep, window, layer, layout=layout,
                          block_size=block_size)
