"""A tiny random Llama (fp32, head_dim 32: the smallest vLLM's CPU attention takes) saved for vLLM tests.

Two layers, 4 query and 2 KV heads, a character tokenizer (tests.helpers_tiny). The weights are
drawn with a large init scale so the next-token distribution is peaked (clear argmaxes), which
keeps greedy parity checks meaningful. Saved once per directory; bit-identical from the seed.
"""

from __future__ import annotations

import os

import torch


def save_tiny_llama(path: str, seed: int = 0, kv_heads: int = 2, heads: int = 4) -> str:
    """Write the model and tokenizer to `path` (if not there yet); returns `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers_tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32 * heads, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
                      max_position_embeddings=2048, eos_token_id=1, pad_token_id=0, bos_token_id=1,
                      initializer_range=0.15, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
