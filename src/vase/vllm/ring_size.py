"""How many requests the query ring holds and what it costs: sized from the KV pool, not from `max_num_seqs`.

Each running request that reads queries needs its last `w` post-RoPE queries in every evicted layer:
`layers * q_heads * w * head_dim` elements, 18 MiB for Qwen3-8B at w = 64 in bf16, about a fifth of the
request's bounded K/V at B = 512. vLLM 0.32 sets `max_num_seqs` to 1,024 on large GPUs, so a ring for
`max_num_seqs` rows would take 19 GiB from the pool for requests the pool may never hold at their bounded size.

The rule (one function, `ring_rows`, asked by the scheduler and the workers alike, so both count the same rows):
the ring holds as many requests as the pool holds at their bounded size, `num_blocks // ceil((B + w) / block)`,
at most `max_num_seqs`; the scheduler admits no more running requests than that (`VaseScheduler`), so a short
request that would fit in the pool's blocks waits for a row instead of finding none. Before vLLM sizes the pool
from the memory it measured, the workers take the rows' bytes from it (`ring_reserve`), so the ring is paid for
by the pool, per request it can hold. No vLLM import: the docs' arithmetic runs without vLLM.
"""

from __future__ import annotations

from ..core.schedule import max_blocks

__all__ = ["ring_bytes_per_request", "ring_rows", "ring_reserve", "ring_log_line"]


def ring_bytes_per_request(layers: int, q_heads: int, window: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one request's ring row: its last `window` queries in each of `layers` evicted layers."""
    return layers * q_heads * window * head_dim * dtype_bytes


def ring_rows(num_blocks: int, block_size: int, budget: int, window: int, max_num_seqs: int,
              stores: bool = True) -> int:
    """Rows of the ring: the requests the pool of `num_blocks` holds at their bounded size (ceil((B + w) / block)
    blocks each), at most `max_num_seqs` and at least 1; `max_num_seqs` when the ring stores nothing (a policy
    that reads no queries: its rows cost no memory, and the scheduler keeps vLLM's limit)."""
    if not stores:
        return max_num_seqs
    return max(1, min(max_num_seqs, num_blocks // max_blocks(budget, window, block_size)))


def ring_reserve(available: int, kv_bytes_per_request: int, ring_bytes: int, max_num_seqs: int) -> int:
    """Bytes to take from the `available` KV memory before the pool is sized, so that the ring the pool then
    calls for (`ring_rows`) fits in them. A request costs `kv_bytes_per_request` (its bounded K/V in every
    layer) plus `ring_bytes`: r = available // (kv + ring) of them fit (at most `max_num_seqs`). Taking r rows
    could leave a pool that holds r + 1 bounded requests (whose ring would not fit), so the reserve also takes
    what the pool would need for the (r + 1)-th: between r and r + 1 rows. 0 when the ring stores nothing."""
    if ring_bytes <= 0 or available <= 0 or kv_bytes_per_request <= 0:
        return 0
    rows = min(max_num_seqs, available // (kv_bytes_per_request + ring_bytes))
    reserve = rows * ring_bytes
    if rows < max_num_seqs:  # leave the pool below r + 1 bounded requests
        reserve = max(reserve, available - (rows + 1) * kv_bytes_per_request + 1)
    return min(available, reserve)


def ring_log_line(rows: int, pool_holds: int, max_num_seqs: int, ring_bytes: int, pool_bytes: int,
                  bounded_blocks: int) -> str:
    """The start-up line: the ring's rows, why (`pool_holds` requests of `bounded_blocks` blocks fit in the pool),
    and its bytes as a share of the KV pool's `pool_bytes`."""
    share = 100.0 * ring_bytes / pool_bytes if pool_bytes else float("nan")
    return (f"vase: query ring for {rows} running requests (the KV pool holds {pool_holds} at their bounded size of "
            f"{bounded_blocks} blocks, max_num_seqs is {max_num_seqs}): {ring_bytes / 2**20:.1f} MiB, "
            f"{share:.1f} % of the {pool_bytes / 2**20:.1f} MiB pool")
