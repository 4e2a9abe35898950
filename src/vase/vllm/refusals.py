"""Settings the plugin refuses because it would give wrong tokens (or untested results) under them.

Each check reads the *built* `VllmConfig` (after vLLM resolved "auto" values from the checkpoint)
or one attention layer at model load, and raises `VaseConfigError` with one line naming the
setting and the fix. The reasons are in docs/vllm.md. Duck-typed: no vLLM import, so the tests
can hand in small stand-ins.
"""

from __future__ import annotations

import os
from typing import Any

from .config import VaseConfigError
from .fp8 import EVICTED_FP8, UNCOMPARED_FP8, evicts_under, storage_dtype

_DROP = "or drop additional_config['vase']"


def _is_alibi(hf_config: Any) -> bool:
    """Whether a Hugging Face config describes an ALiBi model (BLOOM, MPT, Falcon-alibi, Baichuan-13B ...)."""
    if getattr(hf_config, "model_type", None) == "bloom" or getattr(hf_config, "alibi", False):
        return True
    attn = getattr(hf_config, "attn_config", None)
    if isinstance(attn, dict):
        return bool(attn.get("alibi"))
    return bool(getattr(attn, "alibi", False)) or bool(getattr(hf_config, "position_embedding_type", "") == "alibi")


def v2_runner_reason(vllm_config: Any, env: dict | None = None) -> str:
    """Which setting made vLLM pick its V2 model runner (the one the user can change)."""
    env = os.environ if env is None else env
    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
        return "attention_config.hisparse_config is set (HiSparse needs the V2 runner): drop it"
    if getattr(vllm_config, "watermark_config", None) is not None:
        return "watermark_config is set (watermarking needs the V2 runner): drop it"
    if env.get("VLLM_USE_V2_MODEL_RUNNER") is not None:
        return f"VLLM_USE_V2_MODEL_RUNNER={env['VLLM_USE_V2_MODEL_RUNNER']}: set VLLM_USE_V2_MODEL_RUNNER=0"
    return "vLLM picks it by default on this platform: set VLLM_USE_V2_MODEL_RUNNER=0"


def check_built_config(vllm_config: Any, env: dict | None = None) -> None:
    """Refuse, on the built config, every setting under which vase's eviction would be wrong or is untested."""
    model = vllm_config.model_config
    name = model.model
    if _is_alibi(getattr(model, "hf_text_config", None) or model.hf_config) or _is_alibi(model.hf_config):
        raise VaseConfigError(f"{name} uses ALiBi position biases, which vLLM's kernel computes from the physical slot "
                              f"(wrong after an eviction): use a RoPE model {_DROP}")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype in UNCOMPARED_FP8:
        raise VaseConfigError(f"{UNCOMPARED_FP8[cache_dtype]} {_DROP}")
    if not evicts_under(cache_dtype):
        raise VaseConfigError(f"vase evicts an unquantised or fp8 KV cache, but the KV cache dtype resolved to "
                              f"{cache_dtype} (from kv_cache_dtype or the checkpoint's quantization config): pass "
                              f"kv_cache_dtype='auto' or one of {', '.join(EVICTED_FP8)} {_DROP}")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise VaseConfigError(f"vase frees and rewrites KV blocks that a KV connector (kv_transfer_config, "
                              f"disaggregated prefill, offloading) would move behind its back: drop kv_transfer_config "
                              f"{_DROP}")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise VaseConfigError(f"vase's vLLM plugin hooks vLLM's V1 model runner, and this engine would run V2 because "
                              f"{v2_runner_reason(vllm_config, env)}")
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 and getattr(model, "is_moe", False):
        # vllm/v1/engine/core.py run_engine_core: a dense model's DP ranks are independent engine cores
        # (`reconfigure_for_independent_dp_rank`, tested: tests/test_vllm_dp.py); an MoE model's run DPEngineCoreProc,
        # which steps all ranks in one wave and pads idle ranks with dummy batches for the experts' collectives.
        raise VaseConfigError(f"vase's vLLM plugin runs data_parallel_size > 1 for dense models only: {name} is an MoE "
                              f"model, whose ranks vLLM steps in one wave with dummy batches on idle ranks "
                              f"(DPEngineCoreProc; untested with eviction): use data_parallel_size=1, or one engine "
                              f"per process (`torchrun --nproc-per-node N -m vase.cli eval --engine vllm ...`) {_DROP}")


def check_attention_layer(name: str, impl: Any, model_dtype: Any, sliding: bool = False) -> None:
    """Refuse, at model load, an attention layer whose kernel would read evicted slots wrongly. `sliding`: the
    runner leaves sliding-window layers to vLLM in their own KV cache group (the CPU runner; vase.vllm.groups)."""
    if getattr(impl, "alibi_slopes", None) is not None:
        raise VaseConfigError(f"attention layer {name} has ALiBi slopes, which vLLM's kernel applies by physical slot "
                              f"(wrong after an eviction): use a RoPE model {_DROP}")
    kv_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    if not evicts_under(kv_dtype):
        raise VaseConfigError(f"attention layer {name} stores its KV cache as {kv_dtype}; vase evicts it unquantised "
                              f"or fp8: use kv_cache_dtype='auto' or one of {', '.join(EVICTED_FP8)} {_DROP}")
    if not sliding and getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
        raise VaseConfigError(f"attention layer {name} uses a sliding window, which vase does not combine with "
                              f"eviction: use a model with full attention {_DROP}")


#: The attention layer classes the plugin evicts (an allow-list: chunked-local, cross, encoder-only, MLA, linear and
#: any layer type vLLM adds later are refused in the evicted group).
EVICTABLE_LAYERS = ("vllm.model_executor.layers.attention.attention.Attention",)


def check_evicted_layer(name: str, layer: Any) -> None:
    """Refuse, once the KV cache groups are known, a layer in the group vase evicts that is not plain full
    attention: a class outside `EVICTABLE_LAYERS` (chunked-local attention is a subclass, refused), or a sliding
    window (vLLM puts sliding layers there when its hybrid KV cache manager is off)."""
    cls = type(layer)
    kind = f"{cls.__module__}.{cls.__qualname__}"
    if kind not in EVICTABLE_LAYERS:
        raise VaseConfigError(f"layer {name} is a {cls.__qualname__} in the KV cache group vase evicts, and vase "
                              f"evicts plain full attention only ({', '.join(EVICTABLE_LAYERS)}): use a model whose "
                              f"evicted layers are full attention, leave vLLM's hybrid KV cache manager on "
                              f"(disable_hybrid_kv_cache_manager unset) {_DROP}")
    impl = getattr(layer, "impl", None)
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)) or getattr(layer, "sliding_window", None) is not None:
        raise VaseConfigError(f"layer {name} uses a sliding window but sits in the full-attention KV cache group vase "
                              f"evicts (vLLM's hybrid KV cache manager is off): leave disable_hybrid_kv_cache_manager "
                              f"unset (or False) {_DROP}")
    if getattr(impl, "attention_chunk_size", None) or getattr(layer, "attention_chunk_size", None):
        raise VaseConfigError(f"layer {name} uses chunked local attention in the KV cache group vase evicts (its "
                              f"chunks would follow physical slots): use a model with full attention {_DROP}")


def check_kv_tensor(name: str, kv_dtype: Any, model_dtype: Any, cache_dtype: Any = "auto") -> None:
    """Refuse a layer whose allocated KV cache is not in the dtype its `cache_dtype` implies (the model's, or uint8
    for fp8: a quantised cache chosen late)."""
    expected = storage_dtype(cache_dtype, model_dtype)
    if kv_dtype != expected:
        raise VaseConfigError(f"attention layer {name} got a {kv_dtype} KV cache for a {model_dtype} model with "
                              f"kv_cache_dtype {cache_dtype} (expected {expected}); vase evicts it unquantised or fp8: "
                              f"use kv_cache_dtype='auto' {_DROP}")


# -- the shape of the work: pooling models, heads split finer than the KV heads, K/V of different sizes ------------
def check_runner_shape(vllm_config: Any) -> None:
    """Refuse, on the built config, a pooling model and tensor parallelism wider than the model's KV heads."""
    model = vllm_config.model_config
    if getattr(model, "runner_type", "generate") == "pooling":
        raise VaseConfigError(f"{model.model} runs as a pooling model (embeddings, scores: no sampled tokens, so "
                              f"nothing is decoded and nothing to evict): use a generative model {_DROP}")
    tp = vllm_config.parallel_config.tensor_parallel_size
    kv_heads = model.get_total_num_kv_heads()
    if tp > kv_heads:
        # vLLM then replicates each KV head over tp / kv_heads ranks, each holding only part of the head's
        # query group: query-scored kept sets would differ between the copies and from TP = 1
        raise VaseConfigError(f"{model.model} has {kv_heads} KV head(s), fewer than tensor_parallel_size={tp} (vLLM "
                              f"replicates them, and each copy would see only part of its queries, so kept sets "
                              f"would differ from TP = 1): use tensor_parallel_size <= {kv_heads} {_DROP}")


def check_head_sizes(name: str, layer: Any) -> None:
    """Refuse, at model load, an attention layer whose values are not the keys' size (eviction splits one
    [.., 2 * head_size] tensor into equal halves)."""
    head_size = getattr(layer, "head_size", None)
    head_size_v = getattr(layer, "head_size_v", head_size)
    if head_size_v != head_size:
        raise VaseConfigError(f"attention layer {name} has keys of {head_size} and values of {head_size_v} channels; "
                              f"vase evicts caches whose keys and values have one head size: use a model with equal "
                              f"key and value head sizes {_DROP}")


#: One line for vLLM's beam search (offline `LLM.beam_search` and the server's `use_beam_search`).
BEAM_SEARCH_REFUSAL = ("vase does not run under vLLM's beam search (it sends one max_tokens=1 request per step, each "
                       "re-prefilled, so nothing is ever evicted): sample without beam search or drop "
                       "additional_config['vase']")


# -- speculative decoding: n-gram proposals, draft models, EAGLE heads ------------------------------------------------
#: The proposers that run with eviction: n-gram lookup (no KV cache of its own), a draft model and an EAGLE / EAGLE-3
#: head (their layers in the target's KV cache group, evicted sink + recent at the same steps, slots made physical:
#: `vase.vllm.drafter`; an EAGLE head's first pass writes at the target's slots, already physical).
EVICTED_PROPOSERS = ("ngram", "draft_model", "eagle", "eagle3")


def _spec_field(spec: Any, name: str) -> Any:
    return spec.get(name) if isinstance(spec, dict) else getattr(spec, name, None)


def speculative_refusal(spec: Any, window: int) -> str | None:
    """One line refusing `spec` (EngineArgs' `speculative_config` dict, or the built `SpeculativeConfig`) for an
    engine evicting with window `window`, or None when it runs: an n-gram, draft-model, EAGLE or EAGLE-3 proposer
    drafting fewer than `window` tokens. MTP layers (vLLM's "mtp" method: a model's own next-token layers) are
    refused as untested: they take the same proposer class, but no model with them runs here; K >= w would let vLLM
    pad a resumed request's first step (`pad_spec_decode`) past its first eviction boundary, which the scheduler
    cannot cut."""
    if spec is None:
        return None
    # vLLM also takes the legacy spelling model="[ngram]" (method unset)
    method = str(_spec_field(spec, "method") or _spec_field(spec, "model") or "").strip("[]") or None
    if method not in EVICTED_PROPOSERS:
        return (f"vase evicts with n-gram, draft-model or EAGLE speculation only, and speculative_config asks for the "
                f"{method or 'unnamed'} proposer (MTP layers: untested with eviction, no MTP model runs here): use "
                f"speculative_config={{'method': 'ngram', 'draft_model', 'eagle' or 'eagle3', ...}}, drop "
                f"speculative_config {_DROP}")
    k = _spec_field(spec, "num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return (f"vase needs speculative_config's num_speculative_tokens as a whole number of drafts from 1 to w - 1 "
                f"(w = {window}), got {k!r}: set it, e.g. 'num_speculative_tokens': 3")
    if k >= window:
        return (f"vase needs num_speculative_tokens ({k}) below the window w ({window}): a verify step must fit "
                f"between two eviction boundaries; lower num_speculative_tokens in speculative_config or raise "
                f"window {_DROP}")
    return None


def speculative_scope_refusal(vllm_config: Any, local_layers: bool) -> str | None:
    """One line refusing speculative decoding beside a setting it was not compared with (None when there is none, or
    no speculation): tests/test_vllm_spec.py runs a dense full-attention model, one worker, the model's KV dtype.
    `local_layers`: the model has sliding-window, chunked-local or linear-attention layers (`plugin.has_local_layers`)."""
    if getattr(vllm_config, "speculative_config", None) is None:
        return None
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    untested = [name for name, present in (
        (f"tensor_parallel_size={parallel.tensor_parallel_size}", parallel.tensor_parallel_size > 1),
        (f"pipeline_parallel_size={parallel.pipeline_parallel_size}", parallel.pipeline_parallel_size > 1),
        (f"data_parallel_size={parallel.data_parallel_size}", parallel.data_parallel_size > 1),
        (f"kv_cache_dtype={vllm_config.cache_config.cache_dtype}", vllm_config.cache_config.cache_dtype != "auto"),
        ("an MoE model", bool(getattr(model, "is_moe", False))),
        ("sliding-window, chunked or linear-attention layers", local_layers)) if present]
    if not untested:
        return None
    return (f"vase's speculation (n-gram, draft model, EAGLE) is compared on a dense full-attention model with one "
            f"worker and the model's KV dtype, not with {', '.join(untested)}: drop speculative_config or that setting "
            f"{_DROP}")
