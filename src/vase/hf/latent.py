"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi K2) in transformers: what its cache holds and how
vase scores it.

transformers' `DeepseekV2Attention` / `DeepseekV3Attention` cache the compressed latent, one "KV head" shared by
every query head: `update(kv_nope, k_rot)` stores the normalised latent [b, 1, L, kv_lora_rank] as the cache's
keys and the RoPE'd shared key part [b, 1, L, qk_rope_head_dim] as its values, and the module up-projects them
(`expand_kv`) to the heads' keys [b, h, L, qk_nope + qk_rope] and values [b, h, L, v_head_dim] before its
attention call. vase's evicting layer therefore keeps one kept set per layer shared by every head (the latent
cache's slots, B tokens per layer), the same tokens a serving engine's latent cache would keep. To score the
candidates it asks the module to up-project them (`LatentChooser`) and chooses with the shared-heads rules of
`vase.core.shared_heads` (scores averaged over heads, the value magnitude over the heads' concatenated values).

Only the model types whose modules do exactly this are run (`LATENT_MODEL_TYPES`); other MLA variants (a
top-k indexer beside the latent, as DeepSeek-V3.2's DSA) are refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import SpecError
from ..core.policies import Policy
from ..core.shared_heads import choose_shared, shared_heads_problem
from .hybrid import text_config

__all__ = ["LATENT_MODEL_TYPES", "LatentChooser", "is_latent", "latent_choosers", "latent_problem",
           "latent_request_problem"]

#: model types whose attention caches the latent through `Cache.update` and up-projects it with `expand_kv`
#: (tests/test_mla.py runs them); Kimi K2 is a `deepseek_v3`
LATENT_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def is_latent(config: Any) -> bool:
    """Whether the decoder uses multi-head latent attention (its config has a `kv_lora_rank`)."""
    return bool(getattr(text_config(config), "kv_lora_rank", None))


def latent_problem(config: Any) -> str | None:
    """Why vase cannot evict this MLA config (None when it can, or when the config is not MLA)."""
    cfg = text_config(config)
    if not is_latent(cfg):
        return None
    kind = getattr(cfg, "model_type", None)
    if kind not in LATENT_MODEL_TYPES:
        return (f"model_type {kind!r} uses multi-head latent attention in a way vase has not been run on "
                f"(it evicts the latent cache of {', '.join(LATENT_MODEL_TYPES)})")
    return None


def latent_request_problem(policy: Policy, storage_config: Any = None) -> str | None:
    """Why this method or storage cannot run on a latent cache, in one line (None when it can)."""
    problem = shared_heads_problem(policy)
    if problem:
        return problem
    if storage_config is not None:
        return (f"storage {type(storage_config).__name__} is not supported on multi-head latent attention (the cache "
                f"holds the latent, not per-head K/V): use full precision (no kv_bits / kv_dtype)")
    return None


class LatentChooser:
    """`vase.core.kernel.choose` for one MLA layer: up-projects the latent candidates with the layer's attention
    module (`expand_kv`) and chooses one kept set for every head (`vase.core.shared_heads.choose_shared`)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, policy: Policy, latent: torch.Tensor, rope: torch.Tensor, queries: torch.Tensor | None,
                 budget: int, window: int, generator: Any = None,
                 state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """latent [b, 1, n, kv_lora_rank], rope [b, 1, n, qk_rope_head_dim]: the candidates as the cache holds
        them; queries [b, h, w, dk] -> the kept candidates [b, 1, B - w]."""
        with torch.no_grad():
            keys, values = self.module.expand_kv(latent, rope)
        return choose_shared(policy, keys, values, queries, budget, window, generator, state)


def latent_choosers(model: Any, policy: Policy, storage_config: Any = None) -> dict[int, LatentChooser]:
    """One `LatentChooser` per attention layer of an MLA `model` (by `layer_idx`); empty for other models.

    Raises SpecError (one line) for a method or storage that cannot run on a latent cache."""
    if model is None or not is_latent(model.config):
        return {}
    problem = latent_request_problem(policy, storage_config)
    if problem:
        raise SpecError(f"{type(model).__name__}: {problem}")
    choosers = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if callable(getattr(module, "expand_kv", None)) and isinstance(idx, int):
            choosers[idx] = LatentChooser(module)
    if not choosers:
        raise ValueError(f"{type(model).__name__}: the config has kv_lora_rank but no attention module up-projects a "
                         f"latent cache (expand_kv): vase cannot score it")
    return choosers
