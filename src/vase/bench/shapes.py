"""Random-weight models with the shapes of real architectures, for throughput and memory benchmarks.

Decode speed and memory depend on the shapes (layers, heads, head_dim, hidden and MLP sizes,
vocabulary), not on the weights, so a benchmark can run a Qwen3-14B-shaped model without
downloading anything:

    model = build_random_model("qwen3-4b", dtype=torch.bfloat16, device="cuda")
    model = build_random_model("path/to/config.json", num_layers=4)

Weights are allocated uninitialised (transformers' `no_init_weights`, directly on the target
device) and then filled with N(0, initializer_range) (norm weights with 1) from a seeded
generator: one pass, no CPU round trip, and no uninitialised memory (NaN or denormal floats
would distort timings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                          PreTrainedConfig, Qwen3Config, Qwen3NextConfig)
from transformers.models.deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v3 import DeepseekV3Config
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

__all__ = ["SHAPES", "build_random_model", "resolve_shape", "shape_names"]

_QWEN3_COMMON: dict[str, Any] = dict(
    vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6,
    hidden_act="silu", use_sliding_window=False, attention_bias=False,
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)

_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}

#: name -> (config class, keyword arguments). Values from the models' published config.json files.
SHAPES: dict[str, tuple[type[PreTrainedConfig], dict[str, Any]]] = {
    "qwen3-0.6b": (Qwen3Config, dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                     num_attention_heads=16, tie_word_embeddings=True)),
    "qwen3-4b": (Qwen3Config, dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                   num_attention_heads=32, tie_word_embeddings=True)),
    "qwen3-8b": (Qwen3Config, dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, tie_word_embeddings=False)),
    "qwen3-14b": (Qwen3Config, dict(_QWEN3_COMMON, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                    num_attention_heads=40, tie_word_embeddings=False)),
    # SmolLM2-135M-Instruct: the shapes of vase's embedded default model.
    "smollm2-135m": (LlamaConfig, dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                       head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
                                       rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2,
                                       pad_token_id=2)),
    # Hybrid reasoning models (docs/models.md): vase evicts their full-attention layers only.
    # Qwen3.5: 3 gated-delta-net (linear-attention) layers to 1 full-attention layer. Attention shapes from the
    # published 0.8B / 27B training arguments; the linear-attention dims are transformers' Qwen3_5TextConfig
    # defaults (16 key heads, 32 value heads of 128, conv kernel 4, as published for Qwen3.5-35B-A3B).
    "qwen3.5-0.8b": (Qwen3_5TextConfig, dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                                             num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                                             head_dim=256, tie_word_embeddings=True, max_position_embeddings=262144,
                                             rope_parameters=_QWEN35_ROPE)),
    "qwen3.5-27b": (Qwen3_5TextConfig, dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                                            num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                                            head_dim=256, tie_word_embeddings=False, max_position_embeddings=262144,
                                            rope_parameters=_QWEN35_ROPE)),
    # Qwen3.5-35B-A3B: the mid-size MoE, 40 layers (30 linear, 10 full), 256 experts, 8 routed + 1 shared per token.
    "qwen3.5-35b-a3b": (Qwen3_5MoeTextConfig, dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                                                   num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                                   num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                                   shared_expert_intermediate_size=512, tie_word_embeddings=False,
                                                   max_position_embeddings=262144, rope_parameters=_QWEN35_ROPE)),
    # Qwen3-Next-80B-A3B: 48 layers (36 linear, 12 full), 512 experts, 10 routed + 1 shared per token.
    "qwen3-next-80b-a3b": (Qwen3NextConfig, dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                                                 num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                                                 head_dim=256, num_experts=512, num_experts_per_tok=10,
                                                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                                 max_position_embeddings=262144, rope_parameters=_QWEN35_ROPE)),
    # gpt-oss-20b: 24 layers alternating sliding (128) and full attention, learned sinks, 32 experts, 4 per token.
    "gpt-oss-20b": (GptOssConfig, dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                       num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                                       head_dim=64, sliding_window=128, num_local_experts=32, num_experts_per_tok=4,
                                       max_position_embeddings=131072)),
    # Gemma 3 1B: 26 layers, five sliding (512) to one full attention, one KV head of 256.
    "gemma3-1b": (Gemma3TextConfig, dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                         num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                                         max_position_embeddings=32768)),
    # Gemma 3 270M: 18 layers (full attention on every sixth, 3 of 18), the 1B's attention on a 640-wide model.
    "gemma3-270m": (Gemma3TextConfig, dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                           num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                           head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                                           max_position_embeddings=32768)),
    # Multi-head latent attention (bench shapes only: the traffic model counts the latent cache, kv_lora_rank +
    # qk_rope_head_dim per token and layer; the transformers engine evicts them, the vLLM plugin refuses them). DeepSeek-R1 (671B): 61
    # layers, the first 3 dense, 256 routed experts (8 per token) + 1 shared; RoPE scaling left at default.
    "deepseek-r1": (DeepseekV3Config, dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                           moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                                           num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                                           num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
                                           routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                           max_position_embeddings=163840, tie_word_embeddings=False)),
    # DeepSeek-V2-Lite (16B): 27 layers, the first dense, 64 routed experts (6 per token) + 2 shared, no q LoRA.
    "deepseek-v2-lite": (DeepseekV2Config, dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                                                moe_intermediate_size=1408, num_hidden_layers=27,
                                                num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                                                n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
                                                n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=None,
                                                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                                max_position_embeddings=163840, tie_word_embeddings=False)),
    # Kimi K2 (1T): DeepSeek-V3's architecture with 64 heads, 384 routed experts (8 per token) + 1 shared.
    "kimi-k2": (DeepseekV3Config, dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                                       moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
                                       num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
                                       num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
                                       routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536,
                                       qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                       max_position_embeddings=131072, tie_word_embeddings=False)),
    # For tests: a 2-layer GQA Qwen3 (4 query heads, 2 KV heads, head_dim 16) that decodes in microseconds.
    "tiny": (Qwen3Config, dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=32768, tie_word_embeddings=True, use_sliding_window=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                               bos_token_id=253, eos_token_id=255, pad_token_id=254)),
}


def shape_names() -> list[str]:
    return list(SHAPES)


def resolve_shape(name_or_config_json: str | Path | PreTrainedConfig,
                  num_layers: int | None = None) -> PreTrainedConfig:
    """The config for a shape name, a config.json file (or a directory holding one), or a config object.

    `num_layers` overrides the number of decoder layers (a shorter model with the same per-layer cost).
    """
    if isinstance(name_or_config_json, PreTrainedConfig):
        config = type(name_or_config_json).from_dict(name_or_config_json.to_dict())
    else:
        key = str(name_or_config_json).strip()
        if key.lower() in SHAPES:
            cls, kwargs = SHAPES[key.lower()]
            config = cls(**kwargs)
            config.name_or_path = f"random:{key.lower()}"
        else:
            path = Path(key).expanduser()
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"unknown model shape {key!r}: use one of {', '.join(SHAPES)}, or a path to a "
                                 "config.json")
            data = json.loads(path.read_text())
            if "model_type" not in data:
                raise ValueError(f"{path} has no model_type: not a transformers config.json")
            data.pop("quantization_config", None)  # random weights are dense
            config = AutoConfig.for_model(data.pop("model_type"), **data)
            config.name_or_path = f"random:{path}"
    if num_layers is not None:
        text = config.get_text_config()
        depth = int(text.num_hidden_layers)
        shape = str(getattr(config, "name_or_path", "") or type(config).__name__).removeprefix("random:")
        if not 1 <= num_layers <= depth:  # more would build a deeper model than the shape (or fail on its layer types)
            raise LayersError(f"{shape} has {depth} decoder layers: give 1..{depth}, got {num_layers}")
        types = list(getattr(text, "layer_types", None) or [])
        if types and "full_attention" in types and "full_attention" not in types[:num_layers]:
            first = types.index("full_attention")
            raise LayersError(f"the first {num_layers} of {shape}'s layers hold no full-attention layer (the first is "
                              f"layer {first}), so nothing would be evicted: give at least {first + 1}")
        text.num_hidden_layers = num_layers
        if types:
            text.layer_types = types[:num_layers]
    return config


class LayersError(ValueError):
    """A layer count (`num_layers`, the bench's --layers) the shape cannot be cut to."""


_POOL = 1_000_003  # a prime: consecutive rows of a weight matrix get different slices of the pool
_SHIFTS = 65_536


@torch.no_grad()
def _fill_random(model: torch.nn.Module, std: float, seed: int) -> None:
    """N(0, std) weights, norm scales 1, biases 0.

    One pool of ~1M normal draws is tiled over every weight (drawing 600M normals on a CPU
    takes ~10 s; copying takes well under one): the values are Gaussian with the right
    scale, which is all a throughput benchmark needs.
    """
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    pools: dict[torch.dtype, torch.Tensor] = {}
    for i, (name, param) in enumerate(model.named_parameters()):
        if param.dim() == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
            continue
        if param.dtype not in pools:
            pools[param.dtype] = torch.randn(_POOL + _SHIFTS, generator=gen, device=device,
                                             dtype=torch.float32).mul_(std).to(param.dtype)
        shift = (i * 7919) % _SHIFTS  # each tensor starts at its own place in the pool
        pool, flat = pools[param.dtype][shift:shift + _POOL], param.view(-1)
        rows = flat.numel() // _POOL
        if rows:  # one strided copy: small copies in a Python loop are several times slower
            flat[:rows * _POOL].view(rows, _POOL).copy_(pool.expand(rows, _POOL))
        rest = flat.numel() - rows * _POOL
        if rest:
            flat[rows * _POOL:].copy_(pool[:rest])


def build_random_model(name_or_config_json: str | Path | PreTrainedConfig = "tiny",
                       dtype: torch.dtype | str = torch.float32,
                       device: torch.device | str = "cpu", attn_implementation: str = "sdpa",
                       num_layers: int | None = None, seed: int = 0):
    """A causal LM with the shapes of `name_or_config_json` and random weights, in eval mode.

    name_or_config_json: a name from `SHAPES` (qwen3-0.6b, qwen3-4b, qwen3-14b, smollm2-135m, the hybrid
    qwen3.5-0.8b, qwen3.5-27b, qwen3.5-35b-a3b, qwen3-next-80b-a3b, gpt-oss-20b, gemma3-1b and gemma3-270m, the MLA deepseek-r1, deepseek-v2-lite and kimi-k2, tiny), a path to a config.json (or its directory), or a config object.
    """
    from transformers.initialization import no_init_weights

    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16}[dtype.lower()]
    config = resolve_shape(name_or_config_json, num_layers)
    device = torch.device(device)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device)
    model.tie_weights()  # no_init_weights also skips the tying that init_weights does
    _fill_random(model, float(getattr(config.get_text_config(), "initializer_range", 0.02)), seed)
    model.requires_grad_(False)
    model.eval()
    model.vase_shape = str(getattr(config, "name_or_path", "") or type(config).__name__)
    return model
