"""The engine protocol, and the one count of K/V bytes per token every engine and report uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from vase.core.spec import Request
    from vase.generation.generate import ChunkObserver, GenerationOutput

__all__ = ["Engine", "kv_bytes_per_token"]


class Engine(Protocol):
    """What the harness asks of a generation engine (:class:`~vase.engines.TransformersEngine`,
    :class:`~vase.engines.VllmEngine`).

    An engine owns its model and tokenizer; methods and budgets are per call. What it can do (teacher
    forcing, its own batching, loading its own model, ...) is its entry in :mod:`vase.core.capabilities`,
    which every door reads; :meth:`forced_log_probs` raises NotImplementedError where ``forcing`` is False.
    Its constructor is ``Class(model, tokenizer)`` (a loaded transformers model) or, with the registry's
    ``loads_model``, ``Class(model_name, dtype=, device=, seed=)``.
    """

    #: its registry name (the eval's ``engine`` setting, ``--engine``).
    name: str

    @property
    def tokenizer(self) -> Any:
        """The tokenizer prompts are encoded with (after :meth:`start`)."""
        ...

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token takes over all layers in a dense cache of the engine's dtype."""
        ...

    def start(self) -> None:
        """Load what generation needs (idempotent; no engine process yet for vLLM)."""
        ...

    def generate(self, prompts: Sequence[str], *, method: str = "vase-attnv", budget: int = 512, window: int = 64,
                 max_new_tokens: int = 2048, temperature: float = 0.6, top_p: float = 0.95, top_k: int | None = None,
                 greedy: bool = False, seed: int | Sequence[int] | None = None, chat_template: bool = True,
                 request: Request | None = None, **params: Any) -> GenerationOutput:
        """Generate from `prompts` (one completion each) with `method` at budget B and window w, or with
        `request`, a validated :class:`vase.core.spec.Request` carried down as it is (never validated again).

        Row r is seeded with ``seed + r`` (or ``seed[r]``; None: the request's seed, else 0) for sampling and
        eviction. Returns texts,
        generated ids per row (EOS excluded), prompt lengths, finished-on-EOS flags, wall seconds, and
        ``stats["rows"]``: per row ``evictions``, ``kv_bytes``, ``kv_bytes_peak``, ``kv_bytes_full``.
        `params` are the method's parameters.
        """
        ...

    def forced_log_probs(self, prompt_ids: Sequence[int] | torch.Tensor, target_ids: Sequence[int] | torch.Tensor, *,
                         method: str = "full", budget: int = 512, window: int = 64, seed: int | None = None,
                         max_chunk: int | None = None, on_chunk: ChunkObserver | None = None,
                         request: Request | None = None, **params: Any) -> torch.Tensor:
        """Teacher-force `target_ids` [T] after `prompt_ids` [P]: float32 log-probs [T, vocab], row t the
        distribution that predicted target t (see :func:`vase.generation.generate.forced_log_probs`)."""
        ...

    def close(self) -> None:
        """Release what the engine started (vLLM: its engine core, KV pool and weights)."""
        ...


def kv_bytes_per_token(source: Any, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of K and V one token adds over the layers whose cache grows with the sequence, dense and
    unquantised: 2 x full-attention layers x kv_heads x head_dim x element bytes (every layer of a model
    with full attention throughout; a hybrid model's sliding and linear-attention layers hold a bounded
    amount instead, `vase.hf.hybrid.bounded_bytes`, which a cache's own stats count).

    source: a transformers model (its config and its parameters' dtype), or a model config with
    `dtype` given (a torch dtype or its name: "float32", "bfloat16", ...). A multimodal config's
    text config is used.
    """
    from vase.hf.hybrid import full_attention_layers, kv_bytes_per_layer_token

    if dtype is None:
        cfg, dtype = source.config, next(source.parameters()).dtype
    else:
        cfg = source
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8
    return len(full_attention_layers(cfg)) * kv_bytes_per_layer_token(cfg, size)
