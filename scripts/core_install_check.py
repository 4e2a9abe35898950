"""Run in a core-only venv (`pip install .`): vase imports, evicts while generating, and pulls in no extra.

Builds a tiny random Llama from a config (nothing downloaded), generates 12 tokens with budget 4 so that
eviction fires, and checks that the packages only the extras install are neither importable nor imported.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import vase

EXTRAS_ONLY = ("typer", "rich", "matplotlib", "math_verify", "vllm")


def main() -> None:
    """Exit 1 with one line per failure; print one `ok` line otherwise."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 10))
    cache = vase.EvictionCache(model, method="snapkv", budget=4, window=2)
    out = model.generate(ids, **vase.generate_kwargs(cache), max_new_tokens=12, do_sample=False, pad_token_id=0)
    problems = []
    if out.shape[1] != 22:
        problems.append(f"generate gave {tuple(out.shape)}, expected (1, 22)")
    kept = cache.get_seq_length()
    if not kept < 22:
        problems.append(f"no eviction: the cache holds {kept} of 22 tokens")
    for name in EXTRAS_ONLY:
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            problems.append(f"{name} is installed or imported in a core-only install")
    if problems:
        sys.exit("\n".join(problems))
    print(f"ok: core install generated 12 tokens, cache holds {kept} of 22, no extra present")


if __name__ == "__main__":
    main()
