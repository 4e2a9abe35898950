"""Where the vLLM engine used to live: it is :mod:`vase.engines.vllm` now.

Kept only while ``vase.cli`` (``vase generate --engine vllm``) and ``vase.eval.config`` (the run's
vLLM version) import from here: :class:`VllmEngine` below takes the old ``EvalConfig`` and the old
``generate(model, tokenizer, prompts, ...)`` call and hands both to :class:`vase.engines.VllmEngine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vase.engines import vllm as _vllm
from vase.engines.vllm import VllmOutput, vllm_available, vllm_version

__all__ = ["VllmEngine", "VllmOutput", "vllm_available", "vllm_version"]


class VllmEngine:
    """The old ``VllmEngine(config)``: a :class:`vase.engines.VllmEngine` built from an EvalConfig's model,
    dtype, device and seed, whose ``generate`` takes (and ignores) a model and a tokenizer first."""

    def __init__(self, config, *, in_process: bool = True, **engine_kwargs: Any):
        self.engine = _vllm.VllmEngine(config.model, dtype=config.dtype, device=config.device, seed=config.seed,
                                       in_process=in_process, **engine_kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def start(self) -> None:
        self.engine.start()

    def generate(self, model, tokenizer, prompts: Sequence[str], **settings: Any) -> VllmOutput:
        """:meth:`vase.engines.VllmEngine.generate` (``model`` and ``tokenizer`` are ignored: vLLM loads its own)."""
        return self.engine.generate(prompts, **settings)

    def close(self) -> None:
        self.engine.close()
