"""Tiny randomly initialised models built from configs: every test runs on a CPU in well under a second."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 96

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP threads
# that wait for each other make small matmuls many times slower.
torch.set_num_threads(1)


def tiny_model(arch: str = "qwen3", attn: str = "sdpa", seed: int = 0, layers: int = 2):
    """A 2-layer GQA model (4 query heads, 2 KV heads, head_dim 16) with random weights."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  attn_implementation=attn, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2,
                  bos_token_id=VOCAB - 3)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII, with pad and eos, left padding."""
    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"<bos>": VOCAB - 3, "<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.padding_side = "left"
    return tok


@pytest.fixture
def qwen3():
    return tiny_model("qwen3")


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()
