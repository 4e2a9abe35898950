"""vase: value-aware stochastic KV cache eviction (VaSE) and its baselines for transformers.

    import vase
    out = vase.generate(model, tokenizer, prompts, method="vase-attnv", budget=512)
    cache = vase.EvictionCache(model, method="snapkv", budget=512)   # for model.generate
    cache = vase.CompiledEvictionCache(model, method="snapkv", budget=512)   # the same, decode step compiled

Importing vase changes nothing global; building an EvictionCache installs vase's attention
function on that model. The transformers parts load on first use, so that `vase.policies`
and `vase.schedule` (pure torch / pure Python) import without transformers, e.g. in an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vase.lazy import lazy_exports

__version__ = "0.1.0"

#: public name -> submodule that defines it (imported on first access)
_LAZY = {
    "EvictedStateError": "cache", "EvictionCache": "cache",
    "GenerationOutput": "generation", "Sampler": "generation", "forced_log_probs": "generation",
    "generate": "generation", "cache_kwargs": "compat", "generate_kwargs": "compat", "CompiledEvictionCache": "static_generate",
    "UnknownMethodError": "policies", "get_policy": "policies", "method_names": "policies",
}

__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:
    from .cache import EvictedStateError, EvictionCache
    from .compat import cache_kwargs, generate_kwargs
    from .generation import GenerationOutput, Sampler, forced_log_probs, generate
    from .static_generate import CompiledEvictionCache
    from .policies import UnknownMethodError, get_policy, method_names


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
