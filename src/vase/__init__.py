"""vase: value-aware stochastic KV cache eviction for transformers."""
