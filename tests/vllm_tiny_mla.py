"""A tiny random DeepSeek-V3 for the vLLM plugin's MLA tests (tests/test_vllm_mla.py): fp32, 2 layers, 4 heads, the
head dims vLLM's CPU MLA kernel takes (qk_nope 128 + qk_rope 64 over a 512 latent: rows of 576), value heads of 128,
no query LoRA, dense MLP layers (first_k_dense_replace = num_hidden_layers), the character tokenizer.

The RoPE half of the latent row (`k_pe`) is live, so a head's score is `q_nope . W_UK c + q_pe . k_pe` in both
engines. The tests run vLLM with `ROPE_OPTIONS` (its rotary embedding in PyTorch): with `enforce_eager=True` vLLM 0.32
turns every custom op on, and its CPU rotary kernel (`torch.ops._C.rotary_embedding`) mis-reads the strided 3-D
views DeepSeek's MLA layer hands it (`q[..., qk_nope:]` [T, H, 64] and `k_pe` [T, 1, 64] inside the 576-wide
row): it rotates one head per token at the head stride, so most `q_pe` heads and most prompt `k_pe` rows keep
position 0, and the writes land in other heads' and rows' channels (docs/vllm.md, "RoPE in vLLM 0.32's CPU
build"). With the PyTorch rotary, stock vLLM's prompt log-probs equal transformers' within 2e-5."""

from __future__ import annotations

import os

import torch

#: vLLM options the MLA tests add: the rotary embedding in PyTorch (`RotaryEmbedding.forward_native`), not vLLM 0.32's
#: CPU kernel, which rotates DeepSeek's strided q_pe / k_pe views wrongly under enforce_eager (module docstring)
ROPE_OPTIONS = dict(compilation_config={"custom_ops": ["-rotary_embedding"]})


def save_tiny_mla(path: str, seed: int = 0, family: str = "deepseek-v3", moe: bool = False,
                  grouped: bool = False) -> str:
    """Write the model (`family`: deepseek-v3 or deepseek-v2, the same dims) and tokenizer to `path` (if not there
    yet); returns `path`. `moe`: layer 1 routes to experts (first_k_dense_replace = 1; 4 routed experts, 2 per token,
    1 shared), DeepSeek-V3's router as its real configs declare it (`topk_method="noaux_tc"`, sigmoid scores, the
    `e_score_correction_bias` drawn non-zero so that vLLM must load it), DeepSeek-V2's greedy softmax top-k.
    `grouped` (with `moe`): DeepSeek's group-limited routing at tiny size, 8 routed experts in 4 groups, each token
    routed to 3 experts within its best 2 groups (`n_group=4, topk_group=2`; DeepSeek-V3/R1 declare 256 experts in 8
    groups, 4 kept, 8 per token), V2's as `topk_method="group_limited_greedy"`. 3 per token, not 2: V2 ranks a group
    by its best expert, so the best 2 experts always lie in the best 2 groups and 2 per token would route as without
    groups (measured on this model: 0 of 87 prompt tokens routed differently; with 3 per token 52 of 87, V3 51)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    from tests.helpers_tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    router = {"deepseek-v3": dict(topk_method="noaux_tc", scoring_func="sigmoid"),
              "deepseek-v2": dict(topk_method="greedy", scoring_func="softmax")}[family] if moe else {}
    experts = dict(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    if grouped:
        experts = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
        if family == "deepseek-v2":
            router["topk_method"] = "group_limited_greedy"
    config_class = {"deepseek-v3": DeepseekV3Config, "deepseek-v2": DeepseekV2Config}[family]
    cfg = config_class(vocab_size=len(tok), hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=2048, eos_token_id=1, pad_token_id=0, bos_token_id=1,
                       intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                       first_k_dense_replace=1 if moe else 2,
                       n_shared_experts=1, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                       v_head_dim=128, q_lora_rank=None, initializer_range=0.15,
                       tie_word_embeddings=False, torch_dtype="float32", **experts, **router)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:  # V3's router: a live correction (zeros would load as well as none)
                bias.copy_(torch.randn(bias.shape) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
