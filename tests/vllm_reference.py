"""A pure-PyTorch paged attention: what vLLM's GPU kernels compute, from the same inputs, slowly.

It reads the metadata fields the GPU backends read (block table, physical sequence lengths,
query start locations, slot mapping) and the cache through the logical
[num_blocks, kv_heads, block_size, head_dim] views, so a test can run a step exactly as the
runner prepares it and compare with dense attention over the tokens a request kept. It is the
oracle for the GPU layout tests; nothing in the plugin calls it.
"""

from __future__ import annotations

import torch

from vase.vllm.paged import slot_index


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate `x` [..., n, d] (d even, neox halves) to logical `positions` [n]."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.to(torch.float64)[:, None] * freq[None, :]  # [n, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def write_slots(key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> None:
    """`reshape_and_cache`: token t's key/value [T, kv_heads, d] to flat slot `slot_mapping[t]` [T] (-1: skipped).

    A flat slot is block * cache_block_size + offset in the caches [num_blocks, kv_heads, cache_block_size, d]."""
    bs = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots // bs, :, slots % bs] = key[keep].to(key_cache.dtype)
    value_cache[slots // bs, :, slots % bs] = value[keep].to(value_cache.dtype)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of each request's new queries over its stored slots.

    query: [T, q_heads, d]; caches: [num_blocks, kv_heads, cache_block_size, d] (any strides);
    block_table: [R, max_blocks] block ids of `block_size` tokens; seq_lens: [R] physical
    lengths after this step's writes; query_start_loc: [R + 1]. Query j of a request with n
    queries sees slots 0 .. seq_len - n + j. Returns [T, q_heads, d] (float64 math).
    """
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // key_cache.shape[1]
    cbs = key_cache.shape[2]
    for r in range(block_table.shape[0]):
        start, end, length = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        if end == start:
            continue
        blocks, offsets = slot_index(block_table[r], length, block_size, cbs)
        k = key_cache[blocks, :, offsets].to(torch.float64).repeat_interleave(group, dim=1)  # [L, hq, d]
        v = value_cache[blocks, :, offsets].to(torch.float64).repeat_interleave(group, dim=1)
        q = query[start:end].to(torch.float64)  # [n, hq, d]
        n = end - start
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]  # [n, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query [q_heads, d] over per-KV-head token lists: keys, values [kv_heads, L, d]. Returns [q_heads, d] (float64)."""
    group = query.shape[0] // keys.shape[0]
    k = keys.to(torch.float64).repeat_interleave(group, dim=0)
    v = values.to(torch.float64).repeat_interleave(group, dim=0)
    weights = (torch.einsum("hd,hld->hl", query.to(torch.float64), k) * scale).softmax(-1)
    return torch.einsum("hl,hld->hd", weights, v)
