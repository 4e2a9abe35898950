"""Generation engines behind one protocol (:class:`Engine`): generate, teacher-force where supported,
count K/V bytes per token, close.

    from vase.engines import TransformersEngine, VllmEngine
    engine = TransformersEngine.load(None, dtype="float32")          # vase's own decode loop
    engine = VllmEngine(None, dtype="float32", seed=0)               # vLLM's LLM.generate + the vase plugin
    out = engine.generate(prompts, method="vase-attnv", budget=512, window=64, seed=0)

Engines sit above the core (:mod:`vase.generation.generate`, :mod:`vase.vllm`) and below the harness
(eval, bench, analysis, the CLI). Nothing here imports vLLM until an engine is started, and the
names below load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vase.core.lazy import lazy_exports

#: public name -> submodule that defines it (imported on first access)
_LAZY = {
    "Engine": "base", "kv_bytes_per_token": "base",
    "TransformersEngine": "transformers",
    "VllmEngine": "vllm", "VllmOutput": "vllm", "vllm_available": "vllm", "vllm_version": "vllm",
    "engine_args": "vllm", "start_llm": "vllm", "start_engine": "vllm", "llm_eos_ids": "vllm",
}

__all__ = list(_LAZY)

if TYPE_CHECKING:
    from .base import Engine, kv_bytes_per_token
    from .transformers import TransformersEngine
    from .vllm import (VllmEngine, VllmOutput, engine_args, llm_eos_ids, start_engine, start_llm, vllm_available,
                       vllm_version)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
