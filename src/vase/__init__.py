"""vase: value-aware stochastic KV cache eviction (VaSE) and its baselines for transformers.

    import vase
    out = vase.generate(model, tokenizer, prompts, method="vase-attnv", budget=512)
    cache = vase.EvictionCache(model, method="snapkv", budget=512)   # for model.generate

Importing vase changes nothing global; building an EvictionCache installs vase's attention
function on that model.
"""

from .cache import EvictedStateError, EvictionCache
from .generation import GenerationOutput, Sampler, forced_log_probs, generate
from .policies import UnknownMethodError, get_policy, method_names

__version__ = "0.1.0"

__all__ = [
    "EvictedStateError", "EvictionCache", "GenerationOutput", "Sampler", "UnknownMethodError", "forced_log_probs",
    "generate", "get_policy", "method_names", "__version__",
]
