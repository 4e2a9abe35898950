"""The GPU runner's step, simulated on CPU in every GPU cache layout, against dense attention over the kept tokens.

Each step is prepared as the GPU worker prepares it (`vase.vllm.offsets`: per-request plans,
physical positions for the slot mapping, physical sequence lengths; `capture`: the query window
ring), written with `reshape_and_cache` semantics and attended by the pure-PyTorch paged
attention (`tests/vllm_reference.py`) reading the same metadata fields the GPU kernels read. The
kept tokens come from the dense `EvictionCache` run on the same post-RoPE keys and queries, so
this checks compaction, slot mapping, sequence lengths, RoPE positions and capture together.
Three requests: one prefilled in two chunks, one arriving while the others decode.
"""

import numpy as np
import pytest
import torch

from vase.core import schedule
from vase.core.policies import get_policy
from vase.vllm.capture import CapturePlan, QueryRing
from vase.vllm.layouts import split_kv
from vase.vllm.offsets import capture_rows, physical_positions, physical_seq_lens, plan_batch
from vase.vllm.paged import RequestPolicyState, evict_paged
from tests.vllm_reference import dense_attention, paged_attention, rope, write_slots

from .test_vllm_gpu_layouts import LAYOUTS, vllm_layer_caches
from .test_vllm_paged import EVICTING, _dense_run

B, W, H, HQ, D, BS = 24, 8, 2, 4, 16, 4
PROMPTS = [10, 37, 5]
ARRIVAL = [0, 0, 3]  # step at which each request is first scheduled
CHUNK = 20  # prefill chunk (request 1's 37-token prompt takes two steps)


def _requests(seed=3):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for p in PROMPTS:
        n = schedule.first_limit(p, B, W) + 2 * W + 2  # three evictions
        k, v, q = (torch.randn(1, heads, n, D, generator=g) for heads in (H, H, HQ))
        v[0, :, 2] *= 9.0
        pos = torch.arange(n)
        reqs.append({"P": p, "n": n, "K": rope(k, pos), "V": v, "Q": rope(q, pos)})
    return reqs


def run(method, layout, kernel_block_size=None, seq_lens_fn=physical_seq_lens, num_blocks=96):
    """Simulate the steps; return the largest |paged - dense| over every token of every request."""
    policy = get_policy(method)
    reqs = _requests()
    raw, views = vllm_layer_caches(layout, num_blocks, BS, H, D, kernel_block_size=kernel_block_size)
    views[1].copy_(torch.randn(views[1].shape, generator=torch.Generator().manual_seed(1)))
    key_cache, value_cache = split_kv(views[1], D)
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))
    ring = QueryRing(["layer"], HQ, D, W, torch.float32, torch.device("cpu"))
    taken = 0
    for i, r in enumerate(reqs):
        need = -(-r["n"] // BS)  # room for the logical length: stale slots past the physical one, as after eviction
        r["blocks"], taken = blocks[taken:taken + need], taken + need
        r["slot"], r["computed"] = ring.acquire(), 0
        r["state"] = RequestPolicyState(generator=torch.Generator().manual_seed(11 + i))
        r["dense"] = [s[2][0] for s in _dense_run(method, r["K"], r["V"], r["Q"], r["P"], B, W, seed=11 + i)]
        r["stored"] = torch.empty(H, 0, dtype=torch.long)  # logical positions of the stored slots, per KV head
    worst, step, evictions = 0.0, 0, 0
    while any(r["computed"] < r["n"] for r in reqs):
        batch = [r for i, r in enumerate(reqs) if ARRIVAL[i] <= step and r["computed"] < r["n"]]
        step += 1
        computed = np.array([r["computed"] for r in batch])
        scheduled = np.array([min(CHUNK, r["P"] - r["computed"]) if r["computed"] < r["P"] else 1 for r in batch])
        starts = np.concatenate([[0], np.cumsum(scheduled)])
        prompts = np.array([r["P"] for r in batch])
        plans = plan_batch([str(id(r)) for r in batch], prompts, computed, scheduled, B, W)
        for r, plan, c in zip(batch, plans, computed):
            if plan.evict_from:  # before the step's writes, with the window the ring holds
                window = ring.window_of(0, r["slot"], int(c))
                evict_paged(key_cache, value_cache, r["blocks"], plan.evict_from, window, policy, plan.evict_to, W,
                            r["state"], 0, block_size=BS)
                r["stored"] = r["dense"].pop(0)
                evictions += 1
        offsets = np.array([p.offset for p in plans])
        positions = np.concatenate([c + np.arange(n) for c, n in zip(computed, scheduled)])
        phys = physical_positions(positions, offsets, scheduled)
        req_of = np.repeat(np.arange(len(batch)), scheduled)
        table = torch.zeros(len(batch), max(len(r["blocks"]) for r in batch), dtype=torch.long)
        for i, r in enumerate(batch):
            table[i, :len(r["blocks"])] = r["blocks"]
        slot_mapping = table[req_of, phys // BS] * BS + torch.from_numpy(phys % BS)
        seq_lens = torch.from_numpy(seq_lens_fn(computed + scheduled, offsets))
        tokens = [(r, int(c) + j) for r, c, n in zip(batch, computed, scheduled) for j in range(n)]
        key = torch.stack([r["K"][0, :, t] for r, t in tokens])  # [T, h, d], post-RoPE at logical t
        value = torch.stack([r["V"][0, :, t] for r, t in tokens])
        query = torch.stack([r["Q"][0, :, t] for r, t in tokens])
        write_slots(key_cache, value_cache, slot_mapping, key, value)
        src, slot, pos = (torch.from_numpy(a) for a in capture_rows(starts[:-1], computed, scheduled,
                                                                    np.array([r["slot"] for r in batch]), W))
        ring.plan = CapturePlan(src=src, slot=slot, pos=pos)
        ring.record("layer", query)  # what the capturing attention impl does before its kernel
        out = paged_attention(query, key_cache, value_cache, table, seq_lens, torch.from_numpy(starts), BS, D ** -0.5)
        for k, (r, t) in enumerate(tokens):
            r["stored"] = torch.cat([r["stored"], torch.full((H, 1), t)], dim=1)
            idx = r["stored"]
            keys = r["K"][0, torch.arange(H)[:, None], idx]  # [h, L, d]
            values = r["V"][0, torch.arange(H)[:, None], idx]
            expected = dense_attention(query[k], keys, values, D ** -0.5)
            worst = max(worst, float((out[k] - expected).abs().max()))
        for r, n in zip(batch, scheduled):
            r["computed"] += int(n)
    assert evictions == 9
    return worst


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_paged_reference_equals_dense_attention_over_kept_tokens(layout):
    assert run("vase-attnv", layout) < 1e-9


@pytest.mark.parametrize("method", EVICTING)
def test_every_method_with_a_kernel_block_split(method):
    """The default GPU layout (LBNHC) with vLLM's kernel block split (4-token blocks as two 2-token kernel blocks)."""
    assert run(method, LAYOUTS[1], kernel_block_size=2) < 1e-9


def test_logical_sequence_lengths_would_be_wrong():
    """The oracle is sensitive: attention reading logical lengths (stock vLLM's) differs from dense attention."""
    assert run("vase-attnv", LAYOUTS[1], seq_lens_fn=lambda seq_lens, offsets: seq_lens) > 1e-3
