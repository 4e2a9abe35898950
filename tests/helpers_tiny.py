"""A tiny random Qwen3 model and a character-level tokenizer with a chat template, for eval tests.

Importable from subprocesses (``from tests.helpers_tiny import tiny_model_and_tokenizer``), which
build bit-identical weights from the same seed. Tests that compare tokens across batch compositions
or processes pass ``dtype=torch.float64``, so that another CPU's float32 rounding cannot flip a token
(see tests/conftest.py).
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level WordLevel vocab: digits, letters, punctuation, space, newline, pad, eos."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in string.digits + string.ascii_letters + string.punctuation + " \n":
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """Weights drawn in float32 from `seed`, then cast to `dtype` (float64 holds the same weights exactly)."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      eos_token_id=1, pad_token_id=0, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).to(dtype).eval()


def tiny_model_and_tokenizer(seed: int = 0, dtype: torch.dtype = torch.float32):
    tok = tiny_tokenizer()
    return tiny_model(len(tok), seed, dtype), tok
