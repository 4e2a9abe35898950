"""Tiny random hybrid-attention and MoE models (float64 by default), one per family vase supports.

Each has 4 layers mixing full attention with the family's other layer type, 4 query heads over
2 KV heads of head_dim 16, and builds and decodes on a CPU in well under a second:

- ``gemma3``:     Gemma 3 text (sliding window 8 on layers 0-2, full attention on layer 3)
- ``gpt-oss``:    gpt-oss (sliding 8 / full alternating, learned attention sinks, 4 experts top-2)
- ``qwen3-next``: Qwen3-Next (3 gated-delta-net linear-attention layers to 1 full, MoE)
- ``qwen3.5``:    Qwen3.5 text (3 linear-attention layers to 1 full, dense MLP)
- ``qwen3-moe``:  Qwen3-MoE (full attention, 4 experts top-2)
- ``llama4``:     Llama 4 text (chunked-local RoPE layers 0 and 2 with chunk 8 = the window, global NoPE
                  full-attention layers 1 and 3 with attention-temperature tuning from position 3 on;
                  layer 1 MoE, 4 experts top-1 and a shared expert)
- ``deepseek-v3``, ``deepseek-v2`` (MLA): 3 layers of multi-head latent attention, 4 heads (key 16 + 8 RoPE,
                  value 12) over a 16 + 8 latent; layer 0 dense, layers 1-2 MoE (4 routed experts top-2 and a
                  shared one); V3 with a query LoRA and group-limited routing
"""

from __future__ import annotations

import torch

from .conftest import VOCAB

FAMILIES = ("gemma3", "gpt-oss", "qwen3-next", "qwen3.5", "qwen3-moe", "llama4")
#: multi-head latent attention (tests/test_mla.py): the latent cache is every layer's, shared by the heads
MLA = ("deepseek-v3", "deepseek-v2")

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=2048, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2,
               bos_token_id=VOCAB - 3)


def hybrid_config(family: str, window: int = 8):
    """The config of a tiny model of `family` (see the module docstring)."""
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**_COMMON, intermediate_size=128, num_hidden_layers=4, sliding_window=window,
                                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                query_pre_attn_scalar=16)
    if family == "gpt-oss":
        from transformers import GptOssConfig

        return GptOssConfig(**_COMMON, intermediate_size=32, num_hidden_layers=4, sliding_window=window,
                            num_local_experts=4, num_experts_per_tok=2,
                            layer_types=["sliding_attention", "full_attention"] * 2)
    if family == "qwen3-next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**_COMMON, intermediate_size=64, num_hidden_layers=4,
                               layer_types=["linear_attention"] * 3 + ["full_attention"],
                               linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32)
    if family == "qwen3.5":
        from transformers.models.qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**_COMMON, intermediate_size=64, num_hidden_layers=4,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"],
                                 linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                 linear_num_key_heads=2, linear_num_value_heads=4)
    if family == "qwen3-moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**_COMMON, intermediate_size=64, num_hidden_layers=2, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "llama4":
        from transformers import Llama4TextConfig

        # no_rope_layers: 1 = RoPE (chunked-local), 0 = NoPE (global, full attention); floor_scale 4 turns the
        # NoPE layers' temperature tuning on from the 4th token (at the real 8,192 it would never act here)
        return Llama4TextConfig(**_COMMON, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4,
                                no_rope_layers=[1, 0, 1, 0], attention_chunk_size=window, moe_layers=[1],
                                num_local_experts=4, num_experts_per_tok=1, floor_scale=4, attn_scale=0.5)
    if family in MLA:
        from transformers import DeepseekV2Config, DeepseekV3Config

        mla = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                   max_position_embeddings=2048, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2, bos_token_id=VOCAB - 3,
                   intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
        if family == "deepseek-v3":  # a query LoRA too; routing in 2 groups of 2 experts, the best group kept
            return DeepseekV3Config(**mla, q_lora_rank=24, n_group=2, topk_group=1)
        return DeepseekV2Config(**mla, q_lora_rank=None, n_group=1, topk_group=1)
    raise ValueError(family)


def hybrid_model(family: str, attn: str | None = None, seed: int = 0, dtype: torch.dtype = torch.float64,
                 window: int = 8):
    """A tiny random `family` model, in eval mode (gpt-oss runs eager: transformers gives it no sdpa)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = attn or ("eager" if family == "gpt-oss" else "sdpa")
    kwargs = {"experts_implementation": "eager"} if family in ("gpt-oss", "qwen3-next", "qwen3-moe", *MLA) else {}
    # eager experts: a plain loop over the chosen experts (grouped_mm takes no float64)
    model = AutoModelForCausalLM.from_config(hybrid_config(family, window), attn_implementation=attn, **kwargs)
    if family == "gpt-oss":  # the initialiser leaves the sinks at N(0, 0.02): make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.to(dtype).eval()
