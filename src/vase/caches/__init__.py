"""The evicting caches transformers decodes through: eager (EvictionCache), static (the fixed-shape
layers) and compiled (CompiledEvictionCache)."""
