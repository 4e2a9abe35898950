"""One generation, looked at from inside: kept-token map, value magnitudes, loop onset."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from transformers import DynamicCache

from ..caches.eager import EvictionCache
from ..hf.compat import cache_kwargs
from ..core.scalars import plain, plain_items
from ..core.checks import check_flags, check_prompts, check_sampling, check_seed
from ..core.spec import Request, RequestSpec, carried, set_beside
from ..generation.generate import Sampler, decode, eos_ids, prepare_prompts
from ..hf.hybrid import full_attention_layers
from .kept import kept_map, plot_kept_map
from .loops import loop_onset
from .values import value_statistics


@torch.inference_mode()
def inspect_generation(model, tokenizer, prompt: str, out_dir: str | Path, *, method: str = "vase-attnv",
                       budget: int = 512, window: int = 64, max_new_tokens: int = 512, greedy: bool = False,
                       temperature: float = 0.6, top_p: float = 0.95, seed: int = 0, chat_template: bool = True,
                       request: Request | None = None, **method_params) -> dict:
    """Generate once under `method`, then write `kept.png` and `inspect.json` into `out_dir`.

    request: an already validated `vase.core.spec.Request` (the CLI's door, `checked_requests`) instead of `method`,
    `budget`, `window` and the method's parameters: the cache is built from it as it is, never validated again.

    Returns the report: the text, cache stats, the loop onset (token index or None), the share
    of positions each layer kept, and the value statistics of the full sequence's values (a hybrid model's
    full-attention layers only, as `kept_map`, each named by its index in the model).
    """
    # generate's checks, in generate's order: the prompt, the sampling and length, the seed, the switches, then
    # the prompt against the model's context and the request spec (in the cache), all before the folder is made
    if request is not None:
        request = carried(request, **set_beside(method, budget, window), **method_params)
        method, budget, window = request.method, request.budget, request.window
    budget, window, max_new_tokens, greedy, temperature, top_p, seed, chat_template = map(
        plain, (budget, window, max_new_tokens, greedy, temperature, top_p, seed, chat_template))
    method_params = plain_items(method_params)
    [prompt] = check_prompts(prompt) if isinstance(prompt, str) else check_prompts([prompt])
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=None, greedy=greedy)
    check_seed(seed, 1)
    check_flags(greedy=greedy, chat_template=chat_template)
    ids, mask, total = prepare_prompts(model, tokenizer, [prompt], chat_template, max_new_tokens)
    if request is None:  # the door: the one validation of this call's request (vase.core.spec)
        request = RequestSpec.of(method, budget, window, seed=[seed], **method_params).validate()
    cache = EvictionCache.from_request(model, replace(request, seed=[seed]), max_length=total)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generated, _, _ = decode(model, ids, mask, cache, max_new_tokens=max_new_tokens, seeds=[seed],
                             sampler=Sampler(greedy=greedy, temperature=temperature, top_p=top_p),
                             eos_token_ids=eos_ids(model, tokenizer))
    tokens = generated[0]
    kept = kept_map(cache)
    plot_kept_map(kept, out_dir / "kept.png", title=f"{method}, B={budget}: kept positions per layer and KV head")

    # Values of the whole sequence as the full cache holds them (the eviction run's are partly gone).
    full = DynamicCache(config=model.config)
    sequence = torch.cat([ids, torch.tensor([tokens], device=ids.device, dtype=ids.dtype)], dim=1)
    model(input_ids=sequence, **cache_kwargs(full), use_cache=True, logits_to_keep=1)
    # The full-attention layers only, as the kept map (a hybrid's linear-attention layers hold a recurrent state,
    # its sliding ones a window: neither is the sequence's values).
    attention = full_attention_layers(model.config)
    values = [full.layers[i].values for i in attention]
    report = {
        "method": repr(cache.policy),
        "budget": budget,
        "window": window,
        "prompt_tokens": int(ids.shape[1]),
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "generated_tokens": len(tokens),
        "stats": cache.stats(),
        "loop_onset_token": loop_onset(tokens, lambda t: tokenizer.decode(t, skip_special_tokens=True)),
        "kept_share_per_layer": [round(float(x), 4) for x in kept.float().mean(dim=(1, 2))],
        "values": value_statistics(values, layer_ids=attention),
    }
    (out_dir / "inspect.json").write_text(json.dumps(report, indent=2))
    return report
