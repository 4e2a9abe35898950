"""vase: value-aware stochastic KV cache eviction (VaSE) and its baselines for transformers.

    import vase
    out = vase.generate(model, tokenizer, prompts, method="vase-attnv", budget=512)
    cache = vase.EvictionCache(model, method="snapkv", budget=512)   # for model.generate
    cache = vase.CompiledEvictionCache(model, method="snapkv", budget=512)   # the same, decode step compiled

Importing vase changes nothing global; building an EvictionCache installs vase's attention
function on that model. The transformers parts load on first use, so that `vase.core.policies`
and `vase.core.schedule` (pure torch / pure Python) import without transformers, e.g. in an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vase.core.lazy import lazy_exports

__version__ = "0.1.0"

#: public name -> submodule that defines it (imported on first access)
_LAZY = {
    "EvictedStateError": "caches.eager", "EvictionCache": "caches.eager",
    "GenerationOutput": "generation.generate", "Sampler": "generation.generate", "forced_log_probs": "generation.generate",
    "generate": "generation.generate", "cache_kwargs": "hf.compat", "generate_kwargs": "hf.compat", "CompiledEvictionCache": "caches.compiled",
    "UnknownMethodError": "core.policies", "get_policy": "core.policies", "method_names": "core.policies",
}

__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:
    from .caches.eager import EvictedStateError, EvictionCache
    from .hf.compat import cache_kwargs, generate_kwargs
    from .generation.generate import GenerationOutput, Sampler, forced_log_probs, generate
    from .caches.compiled import CompiledEvictionCache
    from .core.policies import UnknownMethodError, get_policy, method_names


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
