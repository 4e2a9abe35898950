"""vLLM test helpers: a tiny random Llama (fp32, head_dim 32: the smallest vLLM's CPU attention takes) and
the in-process engine plumbing the vLLM test files share.

Two layers, 4 query and 2 KV heads, a character tokenizer (tests.helpers_tiny). The weights are
drawn with a large init scale so the next-token distribution is peaked (clear argmaxes), which
keeps greedy parity checks meaningful. Saved once per directory; bit-identical from the seed.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def env(**values: str):
    """Set environment variables for the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_llm(options: dict, vase: dict | None):
    """An in-process `vllm.LLM` (no engine subprocess, one OpenMP thread) with vase's section, if any."""
    from vllm import LLM

    with env(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1"):
        return LLM(**options, additional_config=vase or {})


def core(llm):
    """The engine core of an in-process LLM."""
    return llm.llm_engine.engine_core.engine_core


def runner(llm):
    """The model runner of an in-process LLM (vase's runner when the plugin is on)."""
    return core(llm).model_executor.driver_worker.worker.model_runner


def greedy(max_tokens: int, **kw):
    """Greedy sampling of exactly `max_tokens` tokens."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
