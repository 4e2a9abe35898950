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

#: installed only by an extra (not installable here from the core's dependencies)
EXTRAS_ONLY = ("matplotlib", "math_verify", "vllm")
#: not imported by `import vase` and a generation (transformers 5 itself installs these: its own CLI)
NOT_IMPORTED = EXTRAS_ONLY + ("typer", "rich")


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
    stats = cache.stats()
    kept = stats["stored_length"]
    if not (stats["evictions"] > 0 and kept < 21):  # 21 written: the last sampled token is never fed back
        problems.append(f"no eviction: {stats['evictions']} evictions, the cache holds {kept} of 21 tokens")
    for name in NOT_IMPORTED:
        if name in sys.modules:
            problems.append(f"{name} is imported by vase in a core-only install")
    for name in EXTRAS_ONLY:
        if importlib.util.find_spec(name) is not None:
            problems.append(f"{name} is installed in a core-only install")
    if problems:
        sys.exit("\n".join(problems))
    print(f"ok: core install generated 12 tokens, {stats['evictions']} evictions, the cache holds {kept} of 21, "
          "no extra present")


if __name__ == "__main__":
    main()
