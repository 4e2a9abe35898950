"""Many prompts through one method (and, to compare, a second one) in batches, with where each pair parts.

    for step in generate_batches(vase.generate, model, tok, prompts, method="snapkv", compare="full",
                                 budget=64, window=16):
        ...

Row ``r`` of the whole prompt list uses ``seed + r`` under both methods, so a comparison is paired: the
same prompt, the same sampling seed. The steps come in the order they happen (a run is announced
before it starts, so its streamed text can be framed); ``vase generate`` prints them, this prints nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.spec import Request

__all__ = ["Started", "Finished", "Divergence", "generate_batches", "divergence", "first_divergence"]

def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first generated token where two sequences differ; None if they are identical.

    When one is a strict prefix of the other (one stopped earlier), the divergence is at the
    shorter length: that is where one produced EOS and the other a token.
    """
    n = min(len(a), len(b))
    for i in range(n):
        if int(a[i]) != int(b[i]):
            return i
    return None if len(a) == len(b) else n


#: Tokens before the first difference that :class:`Divergence` decodes, to show where it happened.
CONTEXT_TOKENS = 8


@dataclass(frozen=True)
class Started:
    """A run of ``method`` on a batch is about to start (its text may stream from now on)."""

    method: str
    start: int  # index of the batch's first prompt in the whole list
    prompts: list[str]
    second: bool  # the run of the method compared with


@dataclass(frozen=True)
class Finished:
    """A run of ``method`` on a batch is done; ``output`` is what the generate function returned."""

    method: str
    start: int
    prompts: list[str]
    second: bool
    output: Any


@dataclass(frozen=True)
class Divergence:
    """Where the two methods' tokens for one prompt part: ``at`` (None: identical), after ``context``."""

    index: int  # the prompt's index in the whole list
    at: int | None
    n_tokens: int  # tokens of the first method's completion
    context: str  # the tokens just before ``at``, decoded ("" when identical)


def divergence(index: int, ids: Sequence[int], other_ids: Sequence[int], tokenizer: Any) -> Divergence:
    """The first token where ``other_ids`` leave ``ids``, with the text just before it."""
    at = first_divergence(ids, other_ids)
    context = "" if at is None else tokenizer.decode(ids[max(0, at - CONTEXT_TOKENS):at], skip_special_tokens=True)
    return Divergence(index, at, len(ids), context)


def generate_batches(run: Callable[..., Any], model: Any, tokenizer: Any, prompts: Sequence[str], *,
                     method: str | Request, compare: str | Request | None = None, seed: int = 0, batch_size: int = 8,
                     stream: Callable[[int, str], None] | None = None, params: dict[str, Any] | None = None,
                     **kwargs: Any) -> Iterator[Started | Finished | Divergence]:
    """Run ``prompts`` through ``run`` (:func:`vase.generate` or one like it) ``batch_size`` at a time.

    ``method`` / ``compare``: a method name, or a validated :class:`vase.core.spec.Request`, which goes down to
    ``run`` as ``request=`` as it is (the CLI's, validated at its door: nothing downstream validates again).
    ``params`` are the first method's parameters when it is a name (the compared one runs with its defaults);
    ``kwargs`` (sampling, and with names budget, window, storage) go to both. Yields, per batch: Started and
    Finished for ``method``, then, with ``compare``, Started and Finished for it and one Divergence per prompt.
    """
    first = _request_of(method, params)
    second = _request_of(compare, None) if compare else None
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        seeds = [seed + start + r for r in range(len(batch))]
        yield Started(_name(method), start, batch, second=False)
        out = run(model, tokenizer, batch, seed=seeds, stream=stream, **first, **kwargs)
        yield Finished(_name(method), start, batch, second=False, output=out)
        if second is None:
            continue
        yield Started(_name(compare), start, batch, second=True)
        other = run(model, tokenizer, batch, seed=seeds, stream=stream, **second, **kwargs)
        yield Finished(_name(compare), start, batch, second=True, output=other)
        for r in range(len(batch)):
            yield divergence(start + r, out.token_ids[r], other.token_ids[r], tokenizer)


def _request_of(method: str | Request, params: dict[str, Any] | None) -> dict[str, Any]:
    """What names one run to ``run``: ``request=`` a carried Request, or ``method=`` and its parameters."""
    if isinstance(method, Request):
        if params:
            raise ValueError(f"params {sorted(params)} given beside a Request: the request holds its parameters")
        return {"request": method}
    return {"method": method, **(params or {})}


def _name(method: str | Request) -> str:
    return method.method if isinstance(method, Request) else method
