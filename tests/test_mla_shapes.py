"""Bench shapes with multi-head latent attention (issue 42): the traffic model counts the latent cache."""

from vase.bench.shapes import build_random_model
from vase.bench.traffic import ModelBytes
from vase.engines.base import kv_bytes_per_token


def test_latent_cache_bytes_per_token():
    """One latent vector of kv_lora_rank + qk_rope_head_dim per token and layer, not per-head K and V."""
    for name, layers in (("deepseek-r1", 61), ("deepseek-v2-lite", 27), ("kimi-k2", 61)):
        model = build_random_model(name, dtype="bfloat16", device="meta", attn_implementation="eager")
        assert kv_bytes_per_token(model) == layers * (512 + 64) * 2, name


def test_mla_moe_reads_only_routed_experts():
    """DeepSeek's n_routed_experts is found: a step reads 8 of 256 experts, so ~37B of 671B parameters."""
    model = build_random_model("deepseek-r1", dtype="bfloat16", device="meta", attn_implementation="eager")
    sizes = ModelBytes.from_model(model)
    assert sizes.expert_fraction == 8 / 256
    assert 1.3e12 < sizes.weights < 1.4e12 and 6.5e10 < sizes.weights_read(1) < 8e10
