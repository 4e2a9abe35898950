"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi K2) in the vLLM plugin: the latent cache evicted.

vLLM 0.32's MLA layers (`MLAAttention`, CPU backend `CPU_MLA`) cache one latent row per token and layer,
`[kv_c_normed (kv_lora_rank) | k_pe (qk_rope_head_dim)]`, in a tensor [num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim] (one "KV head" shared by every query head; `bind_kv_cache` squeezes vLLM's head dim), slot s of a
request at row `block_ids[s // block_size] * block_size + s % block_size` (`CPUMLAImpl.do_kv_cache_update` writes
through `kv_cache.view(-1, row)`). vase evicts it as its transformers engine evicts transformers' latent cache
(`vase.hf.latent`): one kept set per layer shared by every head, B tokens per layer, chosen by
`vase.core.shared_heads.choose_shared` from the heads' up-projected keys and values of the candidates:

- keys [k, H, n, qk_nope + qk_rope] = `[kv_b_proj(c)_nope | k_pe]` and values [k, H, n, v_head_dim] = `kv_b_proj(c)_v`,
  the layer's own `kv_b_proj` (transformers' `expand_kv`), for the candidates only;
- queries: the last w post-RoPE queries of every head [k, H, w, qk_nope + qk_rope] as the layer receives them
  (`MLAAttention.forward_impl`'s `q`, before vLLM absorbs `W_UK` into the decode query), recorded into the query
  ring by `install_latent` (a class swap of the layer, as `vase.vllm.capture` swaps an attention implementation).
  The head's score `q . k = q_nope . W_UK c + q_pe . k_pe` is the absorbed query `[W_UK^T q_nope | q_pe]` against
  the latent row, the product the decode kernel takes; it is computed on the up-projected keys so that methods
  reading the keys themselves (key norms, key redundancy) score what the transformers engine scores;
- the compaction moves whole latent rows (`gather_rows` / `scatter_rows`).

No vLLM import: the tests run it on tensors shaped as vLLM allocates them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.kernel import gather_slots, keep_index
from ..core.policies import Policy
from ..core.policy_state import draw_layer_state, ensure_slot_state
from ..core.shared_heads import choose_shared, shared_heads_problem
from ..hf.latent import LATENT_MODEL_TYPES
from .config import VaseConfigError
from .paged import EvictionJob, slot_index

__all__ = ["LatentProjection", "evict_latent_batch", "gather_rows", "install_latent", "is_latent_model",
           "latent_cache", "latent_engine_refusal", "query_size", "latent_model_refusal", "scatter_rows"]

_DROP = "or drop additional_config['vase']"


def is_latent_model(model_config: Any) -> bool:
    """Whether vLLM runs this `ModelConfig`'s attention as MLA (`use_mla`)."""
    return bool(getattr(model_config, "use_mla", False))


def latent_model_refusal(model_config: Any) -> str | None:
    """Why the plugin cannot evict this MLA model's latent cache, in one line (None: it can, or it is not MLA)."""
    if not is_latent_model(model_config):
        return None
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    kind = getattr(text, "model_type", None)
    if kind not in LATENT_MODEL_TYPES:
        return (f"{model_config.model} ({kind}) uses multi-head latent attention in a way vase has not been run on "
                f"(the plugin evicts the latent cache of {', '.join(LATENT_MODEL_TYPES)}): run it without vase "
                f"{_DROP}")
    return None


def latent_engine_refusal(vllm_config: Any, policy: Policy | None) -> str | None:
    """Why the plugin cannot evict an MLA model under this engine config and method, in one line (None: it can).

    MoE layers are not refused: the experts run on what attention returns, and tests/test_vllm_mla_moe.py compares
    DeepSeek-V2 and -V3 models with a routed layer with the transformers engine (one worker)."""
    if not is_latent_model(vllm_config.model_config):
        return None
    problem = shared_heads_problem(policy) if policy is not None else None
    if problem:
        return problem
    parallel = vllm_config.parallel_config
    untested = [name for name, present in (
        (f"tensor_parallel_size={parallel.tensor_parallel_size}", parallel.tensor_parallel_size > 1),
        (f"pipeline_parallel_size={parallel.pipeline_parallel_size}", parallel.pipeline_parallel_size > 1),
        (f"data_parallel_size={parallel.data_parallel_size}", parallel.data_parallel_size > 1),
        ("speculative decoding", getattr(vllm_config, "speculative_config", None) is not None)) if present]
    if untested:
        # TP splits the query heads over ranks: each rank's head mean would choose another kept set
        return (f"vase evicts vLLM's MLA latent cache with one worker and plain decoding (tests/test_vllm_mla.py), "
                f"not with {', '.join(untested)}: drop that setting {_DROP}")
    if _cpu_rotary_kernel(vllm_config):
        return ("vLLM 0.32's CPU rotary kernel, which enforce_eager turns on, mis-reads an MLA layer's strided query "
                "and key views (most positions stay 0: docs/vllm.md, 'RoPE in vLLM 0.32's CPU build'): add "
                "compilation_config={'custom_ops': ['-rotary_embedding']} or drop enforce_eager")
    return None


def _cpu_rotary_kernel(vllm_config: Any) -> bool:
    """Whether vLLM runs its CPU rotary kernel (`RotaryEmbedding.forward_cpu`) under this config: on a CPU, with the
    rotary custom op on by vLLM's rule (`CustomOp.enabled`: 'all' or '+rotary_embedding', and no '-rotary_embedding';
    vLLM adds 'all' to an eager run's custom ops)."""
    from vllm.platforms import current_platform

    compilation = getattr(vllm_config, "compilation_config", None)
    ops = list(getattr(compilation, "custom_ops", None) or [])
    on = "-rotary_embedding" not in ops and ("all" in ops or "+rotary_embedding" in ops)
    return on and current_platform.is_cpu()


class LatentProjection:
    """One MLA layer's up-projection of latent rows (transformers' `expand_kv`, with the layer's `kv_b_proj`)."""

    def __init__(self, weight: torch.Tensor, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int):
        if weight.shape != (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank):
            raise VaseConfigError(f"vase up-projects MLA latents with kv_b_proj's plain weight [heads * (qk_nope + v), "
                                  f"kv_lora_rank], got {tuple(weight.shape)} (a quantised or repacked kv_b_proj): "
                                  f"run the model unquantised {_DROP}")
        self.weight = weight
        self.num_heads, self.rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim

    @classmethod
    def of_layer(cls, layer: Any) -> "LatentProjection":
        """From vLLM's `MLAAttention` layer (after its weights are loaded)."""
        return cls(layer.kv_b_proj.weight, int(layer.num_heads), int(layer.kv_lora_rank),
                   int(layer.qk_nope_head_dim), int(layer.qk_rope_head_dim), int(layer.v_head_dim))

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [k, n, kv_lora_rank + qk_rope] -> the heads' keys [k, H, n, qk_nope + qk_rope] and values
        [k, H, n, v_head_dim] (the products transformers' `expand_kv` makes, in its order)."""
        k, n, _ = rows.shape
        c, k_pe = rows[..., : self.rank], rows[..., self.rank:]
        kv = torch.nn.functional.linear(c, self.weight).view(k, n, self.num_heads, self.nope + self.v).transpose(1, 2)
        k_nope, values = kv.split([self.nope, self.v], dim=-1)
        keys = kv.new_empty(k, self.num_heads, n, self.nope + self.rope)
        keys[..., : self.nope].copy_(k_nope)
        keys[..., self.nope:].copy_(k_pe[:, None].expand(-1, self.num_heads, -1, -1))
        return keys, values


def query_size(layer: Any) -> int:
    """The channels of one head's query the ring records: an MLA layer's qk_nope + qk_rope (its `head_size` is the
    latent row's), else the layer's head size."""
    return int(getattr(layer, "qk_head_dim", None) or layer.head_size)


def latent_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """One MLA layer's cache as [num_blocks, block_size, row]: vLLM's [num_blocks, 1, block_size, row] squeezed (as
    `MLAAttention.bind_kv_cache` holds it)."""
    return kv_cache.squeeze(1) if kv_cache.dim() == 4 else kv_cache


def gather_rows(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows (`blocks`, `offsets`) [n] of `cache` [num_blocks, block_size, row]: [n, row]."""
    return cache[blocks, offsets]


def scatter_rows(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` [n, row] to (`blocks`, `offsets`) [n] of `cache`, in place."""
    cache[blocks, offsets] = rows.to(cache.dtype)


def evict_latent_batch(cache: torch.Tensor, jobs: list[EvictionJob], length: int, queries: torch.Tensor | None,
                       policy: Policy, budget: int, window: int, layer: int, projection: LatentProjection,
                       block_size: int | None = None, sort_kept: bool = False, write: bool = True) -> torch.Tensor:
    """Evict k requests of one length in one MLA layer: `vase.vllm.paged.evict_paged_batch` for a latent cache.

    cache: [num_blocks, block_size, kv_lora_rank + qk_rope] (`latent_cache`); jobs: the k requests, each with `length`
    stored rows; queries: [k, H, w, qk_nope + qk_rope] post-RoPE in time order (None when the policy reads none).
    The policy keeps B - w candidates for every head (`choose_shared` on the candidates' up-projections), the w most
    recent follow; its per-slot state is one number per token [1, 1, slots], its per-layer state drawn for one "KV
    head" of kv_lora_rank channels (as the transformers engine's latent layer). write: False runs the policy and
    moves nothing. Returns the kept slot indices [k, 1, B] (in their new order)."""
    cache_bs = cache.shape[1]
    bs = block_size or cache_bs
    k, n_cand = len(jobs), length - window
    where = [slot_index(job.block_ids, length, bs, cache_bs) for job in jobs]
    blocks, offsets = torch.cat([w[0] for w in where]), torch.cat([w[1] for w in where])
    stored = gather_rows(cache, blocks, offsets).view(k, length, -1)  # moved unchanged by the compaction
    keys, values = projection.expand(stored[:, :n_cand])
    device = stored.device
    extra: dict[str, torch.Tensor] = {}
    for job in jobs:  # the state hooks, per request: one "KV head"
        ensure_slot_state(policy, job.state.slot_state.setdefault(layer, {}), 1, 1, length, device)
        ready = [layer in job.state.layer_state]  # hook 2, right before the request's first eviction in `layer`
        draw_layer_state(policy, job.state.layer_state.setdefault(layer, {}), ready, [0], [job.state.generator], 1, 1,
                         projection.rank, device)
    for name in policy.slot_state:
        extra[name] = torch.cat([job.state.slot_state[layer][name][:, :, :n_cand] for job in jobs])
    for name in jobs[0].state.layer_state[layer]:
        extra[name] = torch.cat([job.state.layer_state[layer][name] for job in jobs])
    generators = [job.state.generator for job in jobs] if policy.stochastic else None
    kept = choose_shared(policy, keys, values, queries if policy.needs_queries else None, budget, window, generators,
                         extra)
    index = keep_index(kept, length, window, sort_kept)  # [k, 1, B]
    if write:  # every survivor was read above, before any write: the targets overlap the sources
        targets = [(w[0][:budget], w[1][:budget]) if job.target_block_ids is None
                   else slot_index(job.target_block_ids, budget, bs, cache_bs) for job, w in zip(jobs, where)]
        survivors = stored.gather(1, index[:, 0, :, None].expand(-1, -1, stored.shape[-1]))  # [k, B, row]
        scatter_rows(cache, torch.cat([t[0] for t in targets]), torch.cat([t[1] for t in targets]),
                     survivors.reshape(k * budget, -1))
    for name in policy.slot_state:
        for j, job in enumerate(jobs):
            tensor = job.state.slot_state[layer][name]
            tensor[:, :, :n_cand] = extra[name][j:j + 1]
            moved = torch.zeros_like(tensor)
            moved[:, :, :budget] = gather_slots(tensor, index[j:j + 1])
            job.state.slot_state[layer][name] = moved
    return index


def _forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs):
    """Record the planned rows of the layer's post-RoPE query [tokens, H, qk_nope + qk_rope], then attend."""
    ring = self.vase_ring
    if ring is not None and attn_metadata is not None:
        ring.record(self.layer_name, q)
    return super(self._vase_latent_class, self).forward_impl(q, k_c_normed, k_pe, kv_cache, attn_metadata, output,
                                                             *args, **kwargs)


_LATENT_CAPTURING: dict[type, type] = {}


def install_latent(layer: Any, ring: Any = None) -> None:
    """Make one vLLM `MLAAttention` layer record its queries into `ring` before attending (class swap, state kept)."""
    cls = type(layer)
    if not getattr(cls, "vase_capturing", False):
        if cls not in _LATENT_CAPTURING:
            sub = type(f"Vase{cls.__name__}", (cls,), {"__module__": __name__, "forward_impl": _forward_impl,
                                                        "vase_ring": None, "vase_capturing": True})
            sub._vase_latent_class = sub
            _LATENT_CAPTURING[cls] = sub
        layer.__class__ = _LATENT_CAPTURING[cls]
    if ring is not None:
        layer.vase_ring = ring


def check_latent_layer(name: str, layer: Any, impl: Any) -> None:
    """Refuse, at model load, an MLA layer the plugin was not written for: vLLM's CPU MLA implementation with a plain
    `kv_b_proj` (no sparse indexer, no sliding window), in one line."""
    kind = type(impl).__name__
    if kind != "CPUMLAImpl" and "CPUMLAImpl" not in [c.__name__ for c in type(impl).__mro__]:
        raise VaseConfigError(f"vase evicts MLA layers under vLLM's CPU MLA backend, layer {name} uses {kind} {_DROP}")
    if getattr(layer, "indexer", None) is not None or getattr(layer, "sliding_window", None) is not None:
        raise VaseConfigError(f"MLA layer {name} has a sparse indexer or a sliding window, which vase does not evict "
                              f"beside {_DROP}")
    weight = getattr(getattr(layer, "kv_b_proj", None), "weight", None)
    if weight is None or weight.numel() == 0:
        raise VaseConfigError(f"MLA layer {name} keeps no plain kv_b_proj weight (vLLM repacked it), which vase needs "
                              f"to score the latent cache: run the model in float32 {_DROP}")
