"""vLLM test helpers: a tiny random Llama (fp32, head_dim 32: the smallest vLLM's CPU attention takes) and
the in-process engine plumbing the vLLM test files share.

Two layers, 4 query and 2 KV heads, a character tokenizer (tests.helpers_tiny). The weights are
drawn with a large init scale so the next-token distribution is peaked (clear argmaxes), which
keeps greedy parity checks meaningful. Saved once per directory; bit-identical from the seed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os

import torch


def save_tiny_llama(path: str, seed: int = 0, kv_heads: int = 2, heads: int = 4, layers: int = 2) -> str:
    """Write the model and tokenizer to `path` (if not there yet); returns `path`. `layers`: decoder layers."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers_tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32 * heads, intermediate_size=256, num_hidden_layers=layers,
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


def engine_args(**overrides):
    """The EngineArgs fields the plugin reads before the config is built (defaults as vLLM 0.32 has them)."""
    from types import SimpleNamespace

    from vllm.config.compilation import CompilationConfig

    args = dict(speculative_config=None, kv_cache_dtype="auto", kv_transfer_config=None, enable_prefix_caching=None,
                scheduler_cls=None, worker_cls="auto", async_scheduling=None, attention_backend=None,
                enforce_eager=False, compilation_config=CompilationConfig())
    args.update(overrides)
    return SimpleNamespace(**args)


def start_llm(options: dict, vase: dict | None):
    """An in-process `vllm.LLM` (no engine subprocess, one OpenMP thread) with vase's section, if any, built on
    parallel groups of its own (`release_engines`)."""
    from vllm import LLM

    release_engines()
    with env(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1"):
        return LLM(**options, additional_config=vase or {})


def release_engines() -> None:
    """Finalize the engines earlier tests dropped and tear down vLLM's parallel groups, so the next engine builds its
    own. Each in-process engine initializes process-wide groups once and never for a second model: a MoE model after
    a dense one finds no expert group ("expert parallel group is not initialized", seen in a worker that ran
    test_vllm_spec then test_vllm_linear), and an engine finalized late, after the next one started, tears down the
    groups under it ("pipeline model parallel group is not initialized", seen in CI after a fixture failed while its
    traceback held the engine)."""
    import torch.distributed
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized() or torch.distributed.is_initialized():  # an engine ran here
        gc.collect()  # never frozen in the suite (tests/conftest.py skips vLLM's freeze): a dropped engine goes here
        parallel_state.cleanup_dist_env_and_memory()


def stop_llm(llm) -> None:
    """Shut an in-process engine down now: its parallel groups are torn down here, not whenever the garbage collector
    finalizes it (which then does nothing)."""
    llm.llm_engine.engine_core.shutdown()


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


@functools.lru_cache(maxsize=4)
def _reference_model(path: str, dtype: str, attn: str | None):
    """`path` loaded once per (dtype, attention) for the references of a test file (about 1 s a load of the embedded
    model; a file compares each method and prompt): only read under no_grad, each reference with its own cache."""
    from vase.models import load_model

    return load_model(path, dtype=dtype, **({"attn_implementation": attn} if attn else {}))[0]


def transformers_greedy(path: str, method: str, ids: list[int], n_new: int, budget: int, window: int,
                        seed: int = 0, attn: str | None = None, storage=None, dtype: str = "float32") -> dict:
    """The reference the plugin is compared with: greedy decode of `path` through vase's EvictionCache.

    Returns tokens, log-probs per step [n_new, vocab] and the kept positions per eviction (logical tokens seen when
    it ran -> per evicting layer [kv_heads][budget]); a hybrid model's sliding layers are transformers' own.
    `storage`: the cache's storage spec (e.g. `Fp8Spec("fp8", rounding="zero")`, vLLM's CPU fp8); None: dense.
    `dtype`: the model's (bfloat16 for a linear-attention hybrid, which vLLM's CPU build runs in bf16 only)."""
    from vase.caches.eager import EvictionCache
    from vase.hf.compat import cache_kwargs

    model = _reference_model(path, dtype, attn)
    cache = EvictionCache(model, method, budget, window, seed=seed, storage=storage)
    evicting = cache.evicting_layers
    tokens, logps, kept = [], [], {}
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), **cache_kwargs(cache))
        for t in range(n_new):
            lp = torch.log_softmax(out.logits[0, -1].double(), -1)
            logps.append(lp)
            tokens.append(int(lp.argmax()))
            if t == n_new - 1:
                break
            before = evicting[0].evictions
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[len(ids) + t]]),
                        **cache_kwargs(cache))
            if evicting[0].evictions > before:
                kept[len(ids) + t] = [layer.positions[0, :, :budget].tolist() for layer in evicting]
    return {"tokens": tokens, "logps": torch.stack(logps), "kept": kept}


def vllm_batch(llm, method: str, prompts: list[list[int]], n_new: int, after_step=None) -> list[dict]:
    """The prompts as one greedy batch through the plugin (policy swapped on the shared engine): per prompt its
    tokens, top-5 log-probs and kept positions per eviction. `after_step()` runs after every engine step (a test's
    invariant checks)."""
    from vase.core.policies import get_policy

    r = runner(llm)
    r.vase_policy = get_policy(method)
    r.vase_record = {}
    for i, ids in enumerate(prompts):
        llm.llm_engine.add_request(f"q{i}", {"prompt_token_ids": ids}, greedy(n_new, logprobs=5))
    outs = {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
        if after_step is not None:
            after_step()
    record = {rid.rsplit("-", 1)[0]: entry for rid, entry in r.vase_record.items()}
    r.vase_record = None
    results = []
    for i in range(len(prompts)):
        o = outs[f"q{i}"]
        kept = {e["seen"]: e["positions"] for e in record[f"q{i}"]["kept"]}
        results.append({"tokens": list(o.token_ids), "logprobs": o.logprobs, "kept": kept})
    return results
