"""vase's own decode loop as an :class:`~vase.engines.Engine`: :func:`vase.generate` and
:func:`vase.generation.generate.forced_log_probs` over a loaded transformers model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vase.core.spec import Request, carried, set_beside
from vase.generation.generate import ChunkObserver, GenerationOutput

from .base import kv_bytes_per_token

__all__ = ["TransformersEngine"]


class TransformersEngine:
    """A transformers model and its tokenizer, generating with vase's bounded cache.

    Args:
        model, tokenizer: a loaded causal LM and its tokenizer (see :meth:`load`).
        generate_fn: ``vase.generate`` (default) or anything with its signature and output
            (``generate_fn(model, tokenizer, prompts, **settings)``), e.g. a test's stand-in.
        forced_fn: ``vase.generation.generate.forced_log_probs`` (default) or a stand-in with its signature.
    """

    name = "transformers"

    def __init__(self, model, tokenizer, *, generate_fn: Callable[..., GenerationOutput] | None = None,
                 forced_fn: Callable[..., torch.Tensor] | None = None):
        from vase.generation.generate import forced_log_probs, generate

        self.model = model
        self._tokenizer = tokenizer
        self._generate = generate_fn or generate
        self._forced = forced_fn or forced_log_probs
        self._bpt: int | None = None

    @classmethod
    def load(cls, model: str | None = None, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
             attn_implementation: str = "sdpa", **fns: Any) -> TransformersEngine:
        """Load `model` with :func:`vase.models.load_model` (None: the embedded SmolLM2-135M-Instruct);
        `fns`: ``generate_fn`` / ``forced_fn`` as in the constructor."""
        from vase.models import load_model

        mdl, tok = load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation)
        return cls(mdl, tok, **fns)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes per token of the model in its own dtype (:func:`vase.engines.kv_bytes_per_token`)."""
        if self._bpt is None:
            self._bpt = kv_bytes_per_token(self.model)
        return self._bpt

    def start(self) -> None:
        """Nothing to start: the model is loaded."""

    def generate(self, prompts: Sequence[str], *, method: str = "vase-attnv", budget: int = 512, window: int = 64,
                 max_new_tokens: int = 2048, temperature: float = 0.6, top_p: float = 0.95, top_k: int | None = None,
                 greedy: bool = False, seed: int | Sequence[int] | None = None, chat_template: bool = True,
                 request: Request | None = None, **params: Any) -> GenerationOutput:
        """``generate_fn(model, tokenizer, prompts, ...)`` with these settings: see :func:`vase.generate`
        (`params`: the method's parameters and vase.generate's other options, e.g. ``ignore_eos``). With
        `request` (a validated Request), that goes down in place of the method, budget, window and parameters."""
        what = _request_or_keywords(request, method, budget, window, seed)
        return self._generate(self.model, self._tokenizer, prompts, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                              chat_template=chat_template, **what, **params)

    def forced_log_probs(self, prompt_ids: Sequence[int] | torch.Tensor, target_ids: Sequence[int] | torch.Tensor, *,
                         method: str = "full", budget: int = 512, window: int = 64, seed: int | None = None,
                         max_chunk: int | None = None, on_chunk: ChunkObserver | None = None,
                         request: Request | None = None, **params: Any) -> torch.Tensor:
        """``forced_fn(model, prompt_ids [P], target_ids [T], ...)`` -> float32 log-probs [T, vocab]: see
        :func:`vase.generation.generate.forced_log_probs`. `max_chunk` and `on_chunk` are passed only when given,
        so a stand-in without them raises TypeError only when they are asked for."""
        extra: dict[str, Any] = {}
        if max_chunk is not None:
            extra["max_chunk"] = max_chunk
        if on_chunk is not None:
            extra["on_chunk"] = on_chunk
        what = _request_or_keywords(request, method, budget, window, seed, "full")
        return self._forced(self.model, prompt_ids, target_ids, **what, **extra, **params)

    def close(self) -> None:
        """Nothing to release: the model belongs to whoever loaded it."""


def _request_or_keywords(request: Request | None, method: Any, budget: Any, window: Any, seed: Any,
                         default_method: str = "vase-attnv") -> dict[str, Any]:
    """What goes down to `generate_fn` / `forced_fn`: the Request as it is (and a seed, when given), or, without
    one, the keywords as before (seed 0 when not given), so a stand-in written for them still works. A method,
    budget or window set beside the request is refused (`vase.core.spec.carried`)."""
    if request is not None:
        request = carried(request, **set_beside(method, budget, window, default_method))
        return {"request": request, **({} if seed is None else {"seed": seed})}
    return {"method": method, "budget": budget, "window": window, "seed": 0 if seed is None else seed}
