"""Per-request cache statistics of the vLLM plugin: a pure function of the schedule.

Both sides of the plugin follow `vase.core.schedule` from the request's prefill length and the
tokens it generated, so what a request holds is known without asking the engine:

    from vase.vllm.stats import request_stats
    s = request_stats(cfg, prompt_len=len(out.prompt_token_ids), n_generated=len(out.outputs[0].token_ids),
                      block_size=128, kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes)

The tests check `blocks` against what vLLM's KV cache manager holds. Lengths are per layer
and KV head. `n_generated` counts the tokens vLLM returned; the last one is sampled but never
written to the cache, so `n_generated - 1` are stored (0 when nothing was generated).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core import schedule
from .config import VaseVllmConfig


@dataclass(frozen=True)
class RequestStats:
    """What one request's KV cache looks like after it generated `n_generated` tokens."""

    evictions: int  # eviction events (each one in every layer)
    tokens_evicted: int  # tokens dropped per layer and KV head: seen - stored
    stored_tokens: int  # tokens held per layer and KV head (physical length)
    seen_tokens: int  # tokens written to the cache (logical length)
    blocks: int  # KV blocks the request holds in vLLM's pool
    blocks_full: int  # blocks stock vLLM would hold for the same tokens
    kv_bytes: int  # K/V bytes in the held tokens, all layers
    kv_bytes_full: int  # K/V bytes stock vLLM would hold (seen tokens)

    def as_dict(self) -> dict:
        return asdict(self)


def max_blocks(cfg: VaseVllmConfig, block_size: int) -> int:
    """The most blocks a request holds after its first eviction: ceil((B + w) / block_size)."""
    return schedule.max_blocks(cfg.budget, cfg.window, block_size)


def stored_after(cfg: VaseVllmConfig, prefill_len: int, n_written: int) -> int:
    """Physical length (per layer and KV head) after `n_written` tokens followed a prefill of `prefill_len`."""
    return schedule.physical_length(prefill_len, cfg.budget, cfg.window, n_written)


def request_stats(cfg: VaseVllmConfig, prompt_len: int, n_generated: int, block_size: int,
                  kv_bytes_per_token: int = 0) -> RequestStats:
    """Cache statistics of a request with `prompt_len` prompt tokens after it generated `n_generated` tokens.

    `kv_bytes_per_token` = 2 * layers * kv_heads * head_dim * dtype bytes (0: bytes not reported).
    Blocks: before the first eviction a request holds ceil(seen / block_size) like stock vLLM;
    from the first eviction on, `max_blocks(cfg, block_size)` (the rest went back to the pool).
    A preempted request holds these numbers throughout: its recomputing prefill replays the schedule
    (`vase.vllm.steps`); `evictions` counts the schedule's evictions once (a replay repeats them).
    """
    s = schedule.sequence_stats(prompt_len, cfg.budget, cfg.window, max(n_generated - 1, 0))
    blocks_full = schedule.cdiv(s.seen, block_size)
    blocks = blocks_full if s.evictions == 0 else min(blocks_full, max_blocks(cfg, block_size))
    return RequestStats(evictions=s.evictions, tokens_evicted=s.seen - s.stored, stored_tokens=s.stored,
                        seen_tokens=s.seen, blocks=blocks, blocks_full=blocks_full,
                        kv_bytes=s.stored * kv_bytes_per_token, kv_bytes_full=s.seen * kv_bytes_per_token)


def summarize(rows: list[dict]) -> dict:
    """Totals over requests of per-request stats dicts (evictions, kv_bytes, kv_bytes_full): the summary line's numbers."""
    return {key: sum(int(r.get(key, 0)) for r in rows) for key in ("evictions", "kv_bytes", "kv_bytes_full")}
