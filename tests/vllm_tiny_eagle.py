"""A random-init EAGLE / EAGLE-3 head for the tiny Llama of `tests.vllm_tiny` (its hidden size 128, 4 query and 2 KV
heads of 32, vocabulary), saved as vLLM 0.32 loads one (`EagleLlamaForCausalLM`, `Eagle3LlamaForCausalLM`): a
config.json and one safetensors file of `fc`, one decoder layer (`layers.0.` / `midlayer.`), norms, embeddings and
an LM head. Saved in well under a second; bit-identical from the seed.
"""

from __future__ import annotations

import json
import os

import torch

#: method -> the architecture vLLM builds for it
ARCHITECTURES = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}


def _layer(prefix: str, hidden: int, q_in: int, heads: int, kv_heads: int, head_dim: int, inter: int,
           scale: float) -> dict[str, torch.Tensor]:
    """One Llama decoder layer's weights; q/k/v read `q_in` features (2 * hidden in EAGLE-3's first layer)."""
    w = {f"{prefix}self_attn.q_proj.weight": torch.randn(heads * head_dim, q_in) * scale,
         f"{prefix}self_attn.k_proj.weight": torch.randn(kv_heads * head_dim, q_in) * scale,
         f"{prefix}self_attn.v_proj.weight": torch.randn(kv_heads * head_dim, q_in) * scale,
         f"{prefix}self_attn.o_proj.weight": torch.randn(hidden, heads * head_dim) * scale,
         f"{prefix}mlp.gate_proj.weight": torch.randn(inter, hidden) * scale,
         f"{prefix}mlp.up_proj.weight": torch.randn(inter, hidden) * scale,
         f"{prefix}mlp.down_proj.weight": torch.randn(hidden, inter) * scale,
         f"{prefix}post_attention_layernorm.weight": torch.ones(hidden)}
    return w


def save_tiny_eagle(path: str, target: str, method: str = "eagle3", seed: int = 0, kv_heads: int | None = None) -> str:
    """Write an EAGLE (`method` "eagle") or EAGLE-3 ("eagle3") head for the tiny Llama saved at `target` into `path`
    (if not there yet); returns `path`. `kv_heads`: the head layer's KV heads (default: the target's)."""
    if method not in ARCHITECTURES:
        raise ValueError(f"method must be one of {sorted(ARCHITECTURES)}, got {method!r}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from safetensors.torch import save_file

    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = kv_heads or cfg["num_key_value_heads"]
    head_dim, inter, vocab = cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
    torch.manual_seed(seed)
    scale = 0.15
    if method == "eagle":  # fc([embeds, hidden]) -> one layer without input norm; the target's LM head
        weights = _layer("layers.0.", hidden, hidden, heads, kv_heads, head_dim, inter, scale)
        weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * scale
    else:  # fc(3 target layers' hidden) -> one layer on [norm(embeds), norm(hidden)]; its own norm and LM head
        weights = _layer("midlayer.", hidden, 2 * hidden, heads, kv_heads, head_dim, inter, scale)
        weights.update({"midlayer.input_layernorm.weight": torch.ones(hidden),
                        "midlayer.hidden_norm.weight": torch.ones(hidden),
                        "fc.weight": torch.randn(hidden, 3 * hidden) * scale,
                        "norm.weight": torch.ones(hidden),
                        "lm_head.weight": torch.randn(vocab, hidden) * scale})
    os.makedirs(path, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    config = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                                   "rope_theta", "bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    config.update(architectures=[ARCHITECTURES[method]], model_type="llama", num_hidden_layers=1,
                  num_key_value_heads=kv_heads,
                  torch_dtype="float32", tie_word_embeddings=False, hidden_act="silu")
    if method == "eagle3":
        # the target's hidden states the fc reads: after its embeddings, first and second layer (vLLM's default for
        # a model this shallow would name fewer than the three fc inputs)
        config.update(draft_vocab_size=vocab, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path

