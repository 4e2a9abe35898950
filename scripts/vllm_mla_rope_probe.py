"""Why stock vLLM 0.32 (CPU build) and transformers part on a DeepSeek model with a live RoPE half (docs/vllm.md,
"RoPE in vLLM 0.32's CPU build"). Run from the repository root:

    PYTHONPATH=src:. python scripts/vllm_mla_rope_probe.py

1. The kernel: `RotaryEmbedding.forward_cpu` (`torch.ops._C.rotary_embedding`) on the views DeepSeek's MLA layer
   passes (`vllm/model_executor/layers/mla.py`: `q[..., qk_nope:]` [T, H, 64] of a [T, H, 192] query, `k_pe`
   [T, 1, 64] inside the [T, 576] latent row) against `forward_native`: which channels it changed.
2. The engines: stock vLLM (enforce_eager with custom ops on, then with `-rotary_embedding`; vLLM's default compiled
   mode) against transformers on the tiny DeepSeek-V3 of tests/vllm_tiny_mla.py: prompt log-probs of a 60-token
   prompt and 100 greedy tokens."""

from __future__ import annotations

import os
import sys
import tempfile

import torch


def kernel_probe(tokens: int = 5, heads: int = 4) -> None:
    """Print where vLLM's CPU rotary kernel writes on MLA's strided views, and how far its result is from PyTorch's."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False)
    torch.manual_seed(0)
    pos = torch.arange(tokens)
    q, row = torch.randn(tokens, heads, 192), torch.randn(tokens, 576)
    want_q, want_k = rope.forward_native(pos, q[..., 128:].clone(), row[:, None, 512:].clone())
    q2, row2 = q.clone(), row.clone()
    got_q, got_k = rope.forward_cpu(pos, q2[..., 128:], row2.split([512, 64], dim=-1)[1].unsqueeze(1))
    changed = (q2 != q).any(-1)  # [T, H]
    print("kernel: q heads changed per token (nope part changed:", bool((q2[..., :128] != q[..., :128]).any()), ")",
          [[h for h in range(heads) if changed[t, h]] for t in range(tokens)])
    print(f"kernel: q_pe max |cpu - pytorch| {(got_q - want_q).abs().max():.3g}; k_pe max |cpu - pytorch| "
          f"{(got_k - want_k).abs().max():.3g}; latent c channels written: {int((row2[:, :512] != row[:, :512]).sum())}")


def engine_probe(path: str) -> None:
    """Print stock vLLM's distance from transformers (true positions and position_ids 0) on `path`."""
    from transformers import AutoModelForCausalLM

    from tests.test_vllm_exact import prompt_ids
    from tests.vllm_tiny import greedy, start_llm, stop_llm

    ids = prompt_ids(60, 42)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = torch.tensor(ids[1:])[:, None]
    with torch.no_grad():
        true = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(1, target)[:, 0]
        zero = model(torch.tensor([ids]), position_ids=torch.zeros(1, len(ids), dtype=torch.long)).logits[0, :-1]
        zero = zero.log_softmax(-1).gather(1, target)[:, 0]
        hf = model.generate(torch.tensor([ids]), max_new_tokens=100, min_new_tokens=100, do_sample=False)
    hf_tokens = hf[0, len(ids):].tolist()
    print(f"transformers: prompt log-probs, true positions vs position_ids 0: {(true - zero).abs().max():.3g}")
    options = dict(model=path, max_model_len=512, kv_cache_memory_bytes=2**23, enforce_eager=True, dtype="float32",
                   seed=0)
    for name, extra in (("custom ops on (enforce_eager's default)", {}),
                        ("custom_ops ['-rotary_embedding']", {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}),
                        ("compiled (no enforce_eager: custom ops off)", {"enforce_eager": False})):
        llm = start_llm(dict(options, **extra), None)
        out = llm.generate([{"prompt_token_ids": ids}], greedy(100, prompt_logprobs=0))[0]
        stop_llm(llm)
        got = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
        tokens = list(out.outputs[0].token_ids)
        same = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), len(tokens))
        print(f"vLLM, {name}: prompt log-probs vs transformers {(got - true).abs().max():.3g}, vs transformers with "
              f"position_ids 0 {(got - zero).abs().max():.3g}; greedy tokens equal transformers' through {same} of 100")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from tests.vllm_tiny_mla import save_tiny_mla

    kernel_probe()
    with tempfile.TemporaryDirectory() as tmp:
        engine_probe(save_tiny_mla(os.path.join(tmp, "tiny-mla")))
