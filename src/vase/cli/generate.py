"""`vase generate`: prompts through a bounded KV cache, streamed, with a summary line (and, with --compare,
a second method on the same seeds and where the two part). The batching is :mod:`vase.generation.batched`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..core.checks import check_sampling
from .common import (ModelArgs, ParamOpt, SeedOpt, UserError, WindowOpt, check_range, checked_requests, console,
                     given, model_options, quant_options, warn)

__all__ = ["generate", "read_prompts", "engine_runner", "print_summary"]


def read_prompts(prompt: str | None, file: Path | None) -> list[str]:
    """The prompts of PROMPT or --file (one per line, blank lines skipped; '-' reads stdin)."""
    from ..files.textfiles import decode_utf8

    if prompt is not None and file is not None:
        raise UserError("give a PROMPT or --file, not both")
    if prompt == "-" or (file is not None and str(file) == "-"):
        try:
            lines = sys.stdin.read().splitlines()
        except UnicodeDecodeError as exc:
            raise UserError(f"the prompts on stdin are not UTF-8 text ({exc.reason} at byte {exc.start}): convert "
                            f"them to UTF-8") from None
    elif file is not None:
        if file.is_dir():
            raise UserError(f"--file {file} is a folder, not a prompt file: give a text file (one prompt per line)")
        if not file.exists():
            raise UserError(f"no such prompt file: {file}")
        try:  # a device or pipe (/dev/null, <(cmd)) is read like a file
            data = file.read_bytes()
        except OSError as exc:
            raise UserError(f"--file {file}: cannot read it ({exc.strerror or exc})") from None
        lines = decode_utf8(data, str(file), "save the file as UTF-8", UserError).splitlines()
    elif prompt is not None:
        return [prompt]
    else:
        raise UserError("give a PROMPT, or --file F (one prompt per line; '-' reads stdin)")
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        where = "on stdin" if file is None or str(file) == "-" else f"in {file}"
        raise UserError(f"no prompts found {where} (one prompt per line)")
    return prompts


@model_options(check=False)  # the engine is checked first
def generate(
    ctx: typer.Context,
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt ('-' reads prompts from stdin).")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Prompts, one per line ('-' = stdin).")] = None,
    method: Annotated[str, typer.Option(help="Eviction method (see `vase methods`).")] = "vase-attnv",
    budget: Annotated[int, typer.Option(help="KV pairs kept per layer and KV head.")] = 512,
    window: WindowOpt = 64,
    param: ParamOpt = None,
    kv_bits: Annotated[int, typer.Option("--kv-bits", help="Store old K/V in 8, 4 or 2 bits (16 = full precision); "
                                         "see docs/quantization.md.")] = 16,
    quant_guard: Annotated[Optional[int], typer.Option(help="With --kv-bits: old tokens per KV head kept in full "
                                                       "precision (default: sinks + the value guard; 0 = none).")]
    = None,
    compare: Annotated[Optional[str], typer.Option(help="Run the prompt under a second method too "
                                                   "and show where the outputs diverge.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 512,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (paper: 0.6).")] = 0.6,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling (paper: 0.95).")] = 0.95,
    top_k: Annotated[Optional[int], typer.Option(help="Top-k sampling (off by default).")] = None,
    greedy: Annotated[bool, typer.Option("--greedy", help="Take the argmax instead of sampling.")] = False,
    seed: SeedOpt = 0,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch when reading several.")] = 8,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template.")] = True,
    model: ModelArgs = ModelArgs(),
    engine: Annotated[str, typer.Option(help="transformers (vase's decode loop) or vllm (vLLM with the vase "
                                        "plugin; no streaming, no --kv-bits).")] = "transformers",
) -> None:
    """Generate with a bounded KV cache, streaming the answer, then print a summary."""
    from ..core.capabilities import engine_info, engine_names, refuse_unsupported
    from ..core.spec import split_storage

    if engine not in engine_names():
        raise UserError(f"unknown --engine {engine!r}: use {' or '.join(engine_names())}")
    refuse_unsupported(engine, attn=given(ctx, "attn"))  # a flag the engine would ignore
    model.check()
    check_range("--seed", seed, 2**63 - 1)
    check_range("--max-new-tokens", max_new_tokens)
    prompts = read_prompts(prompt, file)
    quant = quant_options(kv_bits, quant_guard)
    # The request spec checks the method, its parameters, the budget, the reserves and the storage (--kv-bits or
    # -p kv_bits=, one spelling of one rule) against the engine, before the model loads.
    # The validated requests are carried down to vase.generate / the engine as they are (never validated again).
    params, requests = checked_requests([method], param, budgets=[budget], window=window, storage=quant,
                                        engine=engine)
    request, other = requests[method, budget], None
    quant = {**quant, **split_storage(params)[1]}  # the storage applies to both methods of --compare, however spelled
    if compare:
        other = checked_requests([compare], None, budgets=[budget], window=window, storage=quant,
                                 engine=engine)[1][compare, budget]
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)
    if greedy:
        ignored = [f for f, name in (("--temperature", "temperature"), ("--top-p", "top_p"), ("--top-k", "top_k"))
                   if given(ctx, name)]
        if ignored:
            warn(f"{'/'.join(ignored)} is ignored with --greedy (it takes the argmax)")
    if not chat and any(not p for p in prompts):
        raise UserError("an empty prompt with --no-chat gives the model nothing to start from: give some text")
    if batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    info = engine_info(engine)
    if info.loads_model:  # the engine loads its own model (vLLM) and schedules the prompts
        run, tok = engine_runner(engine, model, seed)
        mdl = None
    else:
        from ..generation.generate import generate as run

        mdl, tok = model.load()
    from ..generation.batched import generate_batches

    single = len(prompts) == 1

    def stream(row: int, text: str) -> None:
        console.out(text, end="", highlight=False)

    steps = generate_batches(run, mdl, tok, prompts, method=request, compare=other, seed=seed,
                             batch_size=batch_size, stream=stream if single else None, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, chat_template=chat)
    _print_steps(steps, single, method, compare, budget)

def _print_steps(steps, single: bool, method: str, compare: str | None, budget: int) -> None:
    """Print what `generate_batches` yields: a rule per method and the streamed text (one prompt) or each prompt's
    text when its batch is done, the summary line, and where --compare's tokens diverge."""
    from ..generation.batched import Divergence, Finished, Started

    for step in steps:
        if isinstance(step, Started) and single:
            console.rule(f"[bold]{step.method}[/]" + ("" if step.second else f" B={budget}"))
        elif isinstance(step, Finished):
            if single:
                console.out("")
            elif not step.second:
                for r, text in enumerate(step.output.texts):
                    console.rule(f"[bold]prompt {step.start + r + 1}[/]: {step.prompts[r][:60]}")
                    console.out(text, highlight=False)
            print_summary(step.method, step.output)
        elif isinstance(step, Divergence):
            label = f"prompt {step.index + 1}: " if not single else ""
            if step.at is None:
                console.print(f"{label}{method} and {compare} produced identical tokens ({step.n_tokens} tokens)")
            else:
                console.print(f"{label}{method} and {compare} diverge at token {step.at} (after ...{step.context!r})")


def engine_runner(name: str, model: ModelArgs, seed: int):
    """`vase generate --engine NAME` for an engine that loads its own model (the registry's ``loads_model``): a
    `vase.generate`-like function over the started engine, and its tokenizer."""
    from ..core.capabilities import engine_class, engine_info
    from ..models import resolve_device, resolve_dtype
    from ..vllm.stats import summarize

    # The method, budget, window and seed were checked by the request spec (checked_requests); dtype and device here,
    # before the engine starts. (An EvalConfig used to check them, with eval's default budgets and methods.)
    resolve_dtype(model.dtype, resolve_device(model.device))
    engine = engine_class(name)(model.model, dtype=model.dtype, device=model.device, seed=seed)
    engine.start()
    streams = engine_info(name).streaming

    def run(mdl, tok, batch, stream=None, **kwargs):
        # the engine loads its own model: mdl and tok are unused
        out = engine.generate(batch, **kwargs, **({"stream": stream} if streams else {}))
        if not {"evictions", "kv_bytes", "kv_bytes_full"} <= out.stats.keys():
            out.stats.update(summarize(out.stats["rows"]))  # totals for the summary line
        if stream is not None and not streams:
            stream(0, out.texts[0])
        return out

    return run, engine.tokenizer


def print_summary(method: str, out) -> None:
    """One dim line: tokens, speed, evictions, KV bytes held against the full cache's."""
    from ..core.units import human_bytes

    s = out.stats
    console.print(
        f"[dim]{method}: {out.new_tokens} tokens, {out.tokens_per_second:.1f} tok/s, "
        f"{s.get('evictions', 0)} evictions, KV held {human_bytes(s.get('kv_bytes', 0))} "
        f"vs {human_bytes(s.get('kv_bytes_full', 0))} full[/]", highlight=False)
