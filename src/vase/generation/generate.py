"""Generation with a bounded cache: the user-facing entry point.

    out = vase.generate(model, tokenizer, prompts, method="vase-attnv", budget=512,
                        max_new_tokens=2048, seed=0)

The decode loop is our own (not `model.generate`) so that each batch row samples from its
own generator (a row's output does not depend on what else is in the batch) and finished
rows leave the batch and the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..caches.eager import EvictionCache
from ..core.checks import check_flags, check_prompts, check_sampling, check_seed
from ..core.scalars import plain, plain_items, plain_seed
from ..core.spec import Request, RequestSpec, carried, set_beside
from ..hf.compat import cache_kwargs
from .decoding import Sampler, prefill, sampler_generators  # noqa: F401  (re-exported: vase.generation.generate.Sampler)
from ..core.policies import Policy

#: Sampling defaults of the paper's evaluation (the VaSE paper, arXiv 2606.03928).
PAPER_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": None}


@dataclass
class GenerationOutput:
    """What `generate` returns; lists have one entry per prompt, in order."""

    texts: list[str]
    token_ids: list[list[int]]  # generated ids, EOS excluded
    prompt_lengths: list[int]  # prompt tokens (no padding)
    finished: list[bool]  # True: stopped on EOS; False: hit max_new_tokens
    seconds: float  # wall time of prefill + decode
    prefill_seconds: float
    stats: dict = field(default_factory=dict)  # cache.stats() at the end

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else float("nan")


def row_seeds(seed: int | Sequence[int], batch: int) -> list[int]:
    """One seed per row: `seed + r` for an int, or the given list."""
    seeds = list(seed) if isinstance(seed, Sequence) else [seed + r for r in range(batch)]
    if len(seeds) != batch:
        raise ValueError(f"got {len(seeds)} seeds for {batch} prompts")
    return [int(s) for s in seeds]


def encode_prompts(tokenizer, prompts: Sequence[str], chat_template: bool = True,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask, [b, P] each; applies the chat template when asked and present."""
    templated = bool(chat_template and getattr(tokenizer, "chat_template", None))
    if templated:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
    else:
        texts = list(prompts)
    if tokenizer.pad_token is None:  # padding needs some id; pad slots are masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    # The template already holds the special tokens; without it the tokenizer adds its own (BOS).
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=not templated)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


@torch.inference_mode()
def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, *, max_new_tokens: int,
           sampler: Sampler, seeds: Sequence[int], eos_token_ids: Sequence[int] = (), ignore_eos: bool = False,
           on_token: Callable[[int, int], None] | None = None,
           row_stats: list[dict] | None = None) -> tuple[list[list[int]], list[bool], float]:
    """Prefill left-padded `input_ids` [b, P] and decode up to `max_new_tokens` per row.

    Works with an EvictionCache or any transformers Cache. Finished rows leave the batch.
    Returns (generated ids per row, finished-on-EOS per row, prefill seconds); with an
    EvictionCache, `row_stats` (if given) is filled with each row's final cache stats.
    """
    b = input_ids.shape[0]
    device = input_ids.device
    generators = sampler_generators(seeds, device)
    eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], device=device)
    positions, logits, prefill_seconds = prefill(model, input_ids, attention_mask, cache)
    generated: list[list[int]] = [[] for _ in range(b)]
    finished = [False] * b
    active = list(range(b))
    next_pos = positions[:, -1:] + 1
    # transformers' sliding layers (hybrid models) mask left padding from the 2-D mask at every step
    running_mask = attention_mask if getattr(cache, "needs_padding_mask", False) else None
    for _ in range(max_new_tokens):
        tokens = sampler(logits, [generators[r] for r in active])
        done = torch.isin(tokens, eos).tolist() if not ignore_eos else [False] * len(active)
        keep = []
        for i, (r, token) in enumerate(zip(active, tokens.tolist())):  # one device sync per step
            if done[i]:
                finished[r] = True
            else:
                generated[r].append(token)
                keep.append(i)
                if on_token is not None:
                    on_token(r, token)
        if not keep or len(generated[active[keep[0]]]) >= max_new_tokens:
            break
        if len(keep) < len(active):  # drop finished rows from the batch and the cache
            _save_row_stats(cache, active, row_stats)
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            tokens, next_pos = tokens[index], next_pos[index]
            active = [active[i] for i in keep]
            if running_mask is not None:
                running_mask = running_mask[index]
        mask_kw = {}
        if running_mask is not None:
            running_mask = torch.cat([running_mask, running_mask.new_ones(running_mask.shape[0], 1)], dim=-1)
            mask_kw["attention_mask"] = running_mask
        out = model(input_ids=tokens[:, None], position_ids=next_pos, **mask_kw, **cache_kwargs(cache),
                    use_cache=True)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    _save_row_stats(cache, active, row_stats)
    return generated, finished, prefill_seconds


def _save_row_stats(cache, active: list[int], row_stats: list[dict] | None) -> None:
    """Record the per-row stats of the rows still in the cache (before some leave it)."""
    if row_stats is None or not isinstance(cache, EvictionCache):
        return
    for r, stats in zip(active, cache.row_stats()):
        row_stats[r] = stats


def generate(model, tokenizer, prompts: str | Sequence[str], *, method: str | Policy = "vase-attnv",
             budget: int | None = 512, window: int = 64, max_new_tokens: int = 2048, temperature: float = 0.6,
             top_p: float = 0.95, top_k: int | None = None, greedy: bool = False,
             seed: int | Sequence[int] | None = None, chat_template: bool = True, ignore_eos: bool = False,
             sort_kept: bool = False, stream: Callable[[int, str], None] | None = None, compile: bool | str = False,
             request: Request | None = None, **method_params) -> GenerationOutput:
    """Generate from `prompts` with a bounded KV cache evicted by `method`.

    Sampling defaults are the paper's (temperature 0.6, top-p 0.95); `greedy=True` takes the
    argmax. Row r uses seed `seed + r` (or `seed[r]`) for both eviction and sampling, so a
    row's output does not depend on its batch. `stream(row, text)` receives decoded text
    pieces as they are generated. `compile=True` (or a `torch.compile` backend name; True is
    inductor) runs the decode steps compiled over fixed-shape buffers (`vase.generation.compiled`; `full` then
    uses transformers' StaticCache); the first call of a configuration compiles for a while.
    Extra keyword arguments are the method's parameters.

    request: an already validated `vase.core.spec.Request` (`RequestSpec(...).validate()`) instead of `method`,
    `budget`, `window` and the method's parameters: carried down to the cache as it is, never validated again.
    `seed` (None: the request's seed, else 0) seeds the rows either way.
    """
    request, seed = _carry(request, seed, {**set_beside(method, budget, window), **method_params})
    # numpy scalars are the numbers they hold (vase.core.scalars), then checked like them
    budget, window, max_new_tokens, temperature, top_p, top_k, greedy, chat_template, ignore_eos, sort_kept = map(
        plain, (budget, window, max_new_tokens, temperature, top_p, top_k, greedy, chat_template, ignore_eos,
                sort_kept))
    seed, method_params = plain_seed(seed), plain_items(method_params)
    prompt_list = check_prompts(prompts)  # types and ranges at the door, one line naming the argument
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)
    check_seed(seed, len(prompt_list))
    check_flags(chat_template=chat_template, ignore_eos=ignore_eos, sort_kept=sort_kept)
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile.strip())):
        raise TypeError(f"compile must be True, False or a torch.compile backend name, got {compile!r} "
                        f"({type(compile).__name__})")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a function stream(row, text), got {stream!r}")
    input_ids, attention_mask, total = prepare_prompts(model, tokenizer, prompt_list, chat_template, max_new_tokens)
    seeds = row_seeds(seed, len(prompt_list))
    if request is None:  # the door: the one validation of this call's request (vase.core.spec)
        request = RequestSpec.of(method, budget, window, seed=seeds, **method_params).validate()
    cache = EvictionCache.from_request(model, replace(request, seed=seeds), sort_kept=sort_kept, max_length=total)
    sampler = Sampler(greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k)
    run_decode = decode
    if compile:
        from functools import partial

        from .compiled import compile_cache, compiled_steps, config_key, decode_compiled

        cache = compile_cache(model, cache, input_ids.shape[0], input_ids.shape[1] + max_new_tokens)
        backend = compile if isinstance(compile, str) else "inductor"
        run_decode = partial(decode_compiled, steps=compiled_steps(config_key(model, cache, len(prompt_list)),
                                                                   backend=backend))

    on_token = None
    if stream is not None:
        so_far: dict[int, list[int]] = {}
        printed: dict[int, int] = {}

        def on_token(row: int, token: int) -> None:
            ids = so_far.setdefault(row, [])
            ids.append(token)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for a whole character
                stream(row, text[printed.get(row, 0):])
                printed[row] = len(text)

    start = time.perf_counter()
    rows: list[dict] = [{} for _ in prompt_list]
    ids, finished, prefill_seconds = run_decode(
        model, input_ids, attention_mask, cache, max_new_tokens=max_new_tokens, sampler=sampler, seeds=seeds,
        eos_token_ids=eos_ids(model, tokenizer), ignore_eos=ignore_eos, on_token=on_token, row_stats=rows)
    seconds = time.perf_counter() - start
    return GenerationOutput(
        texts=[tokenizer.decode(t, skip_special_tokens=True) for t in ids],
        token_ids=ids,
        prompt_lengths=attention_mask.sum(-1).tolist(),
        finished=finished,
        seconds=seconds,
        prefill_seconds=prefill_seconds,
        stats={**_final_stats(cache, compile), "rows": rows},
    )


def _carry(request: Request | None, seed: Any, given: dict[str, Any]) -> tuple[Request | None, Any]:
    """(the carried request, refused with keywords `given` beside it, or None; the seed: as given, else the
    request's, else 0)."""
    if request is None:
        return None, 0 if seed is None else seed
    request = carried(request, **given)
    return request, request.seed if seed is None else seed


def prepare_prompts(model, tokenizer, prompts: Sequence[str], chat_template: bool, max_new_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Encode `prompts` on the model's device and check them against the model: (input_ids [b, P], attention_mask
    [b, P], the length to preallocate from `check_context`). ValueError for a prompt that encodes to no tokens or is
    longer than the model's context. Every entry point that decodes (`generate`, `vase inspect`) goes through it."""
    device = next(model.parameters()).device
    input_ids, attention_mask = encode_prompts(tokenizer, prompts, chat_template, device)
    for i in (attention_mask.sum(-1) == 0).nonzero().flatten().tolist():  # would decode from padding alone
        raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens (empty, and no chat template or "
                         f"BOS to start from): give some text, or use a tokenizer with a chat template")
    total = check_context(model, attention_mask.sum(-1).tolist(), max_new_tokens)
    return input_ids, attention_mask, total


def model_context(model) -> int | None:
    """The model's context length (``max_position_embeddings`` of its text config), or None if it has none."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    n = getattr(cfg, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_context(model, prompt_lengths: Sequence[int], max_new_tokens: int) -> int | None:
    """Prompts must fit the model's context (ValueError naming the prompt); prompt + cap beyond it is only
    warned about (generation usually stops earlier). Returns the length to preallocate the full cache for:
    prompt + cap, or None (grow as needed) when that passes the context, e.g. ``--max-new-tokens 99999999999``."""
    import warnings

    longest = max(prompt_lengths, default=0)
    context = model_context(model)
    if context is None:
        return longest + max_new_tokens
    for i, n in enumerate(prompt_lengths):
        if n > context:
            raise ValueError(f"prompt {i} is {n} tokens, longer than the model's context ({context} tokens, "
                             f"max_position_embeddings): shorten it")
    if longest + max_new_tokens > context:
        warnings.warn(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) passes the model's context "
                      f"({context} tokens): text past it is unreliable; lower --max-new-tokens to "
                      f"{max(1, context - longest)} or less", stacklevel=3)
        return None
    return longest + max_new_tokens


def _final_stats(cache, compiled: bool) -> dict:
    """cache.stats() at the end (of the static form when the compiled decode converted it)."""
    if compiled:
        from .compiled import decode_compiled

        if decode_compiled.last_cache is not None:
            return decode_compiled.last_cache.stats()
        if not isinstance(cache, EvictionCache):
            return {"method": "full", "evictions": 0}
    return cache.stats()


def eos_ids(model, tokenizer, *, generation_eos: int | Sequence[int] | None = None) -> list[int]:
    """Every token that ends generation: the generation config's EOS ids and the tokenizer's, sorted.

    model: a transformers model (its ``generation_config.eos_token_id`` is read), or None with
    ``generation_eos`` given instead (another engine's generation config, e.g. vLLM's)."""
    found: set[int] = set()
    gen_eos = (generation_eos if model is None
               else getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            found.add(value)
        elif value is not None:
            found.update(int(v) for v in value)
    return sorted(found)


#: ``on_chunk(cache, start, n)`` of :func:`forced_log_probs`: a context manager entered around each chunk's forward.
ChunkObserver = Callable[[EvictionCache, int, int], AbstractContextManager]


@torch.inference_mode()
def forced_log_probs(model, prompt_ids: Sequence[int] | torch.Tensor, target_ids: Sequence[int] | torch.Tensor, *,
                     method: str | Policy = "full", budget: int | None = 512, window: int = 64, seed: int | None = None,
                     max_chunk: int | None = None, on_chunk: ChunkObserver | None = None,
                     request: Request | None = None, **method_params) -> torch.Tensor:
    """Teacher-force `target_ids` after `prompt_ids` through a cache evicted by `method`.

    prompt_ids: [P] token ids; target_ids: [T] token ids (T >= 1). Returns float32 log-probabilities
    [T, vocab] on the model's device: row t is the distribution that predicted target t. Tokens are
    fed in chunks that end exactly where token-by-token decoding would evict, so the cache evicts the
    same way as when generating; `max_chunk` caps the tokens per call (full in chunks of `w` measures
    the arithmetic noise floor of the fidelity metrics). Extra keyword arguments go to the
    EvictionCache (the method's parameters, ``kv_bits``, ...).

    on_chunk: the studies' window on the loop (they observe it instead of copying it). For each chunk
    of targets ``target_ids[start:start + n]`` (they yield rows ``start + 1 .. start + n``),
    ``on_chunk(cache, start, n)`` returns a context manager entered just before that chunk's forward
    and left just after it: state read on entry is the cache before the chunk, on exit after it (an
    eviction made by the chunk shows in the layers' ``evictions``). The prompt's forward is not a
    chunk; T = 1 feeds no chunk at all.

    request: a validated `vase.core.spec.Request` instead of `method`, `budget`, `window` and the cache keywords
    (as in :func:`generate`); `seed` (None: the request's, else 0) seeds the cache.
    """
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, device=device).view(1, -1)
    target = torch.as_tensor(target_ids, device=device).view(-1)
    if target.numel() == 0:
        raise ValueError("target_ids is empty")
    request, seed = _carry(request, seed, {**set_beside(method, budget, window, "full"), **method_params})
    if request is None:  # the door: the one validation of this call's request
        request = RequestSpec.of(method, plain(budget), plain(window), seed=[plain(seed)], **method_params).validate()
    else:
        check_seed(plain(seed))
    cache = EvictionCache.from_request(model, replace(request, seed=[plain(seed)]),
                                       max_length=prompt.shape[1] + target.numel())
    out = model(input_ids=prompt, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    pieces = [out.logits[0, -1:].float().log_softmax(-1)]
    fed, total = 0, target.numel() - 1
    layer0 = cache.evicting_layers[0]  # a hybrid model's sliding and linear layers follow the fed tokens
    while fed < total:
        n = min(layer0.room(), total - fed, max_chunk or total)
        chunk = target[fed:fed + n].view(1, -1)
        pos = torch.arange(layer0.seen, layer0.seen + n, device=device).view(1, -1)
        with on_chunk(cache, fed, n) if on_chunk is not None else nullcontext():
            out = model(input_ids=chunk, position_ids=pos, **cache_kwargs(cache), use_cache=True)
        pieces.append(out.logits[0].float().log_softmax(-1))
        fed += n
    return torch.cat(pieces)
