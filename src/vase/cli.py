"""The `vase` command: methods, generate, eval, summarize, bench.

User errors end with one line on stderr and a non-zero exit; `--debug` shows the traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console
from typer.exceptions import TyperException
from rich.table import Table

from .checks import check_sampling

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Decode-time KV cache eviction for reasoning models (VaSE and baselines).")
console = Console()


@app.callback()
def _options(threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (default: torch's "
                                                            "choice). On a busy machine 1 is often faster.")] = None
             ) -> None:
    """Decode-time KV cache eviction for reasoning models (VaSE and baselines)."""
    if threads is not None:
        import torch

        torch.set_num_threads(max(1, threads))
err_console = Console(stderr=True)

# -- options shared by several subcommands ---------------------------------------------------------------------
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Hub id, local directory or .gguf file "
                                                 "(default: the embedded SmolLM2-135M-Instruct).")]
DtypeOpt = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda or auto.")]
AttnOpt = Annotated[str, typer.Option("--attn", help="Attention kernel: sdpa, eager or flash_attention_2.")]
WindowOpt = Annotated[int, typer.Option(help="Recent tokens never evicted (also the eviction interval).")]
ParamOpt = Annotated[Optional[list[str]], typer.Option("--param", "-p", help="A method parameter, KEY=VALUE "
                                                        "(repeatable), e.g. -p n_large=64.")]
SeedOpt = Annotated[int, typer.Option(help="Seed for eviction and sampling (row r uses seed + r).")]


class UserError(Exception):
    """An error the user can fix; printed as one line."""


def parse_params(items: list[str] | None) -> dict:
    """`KEY=VALUE` strings to a dict, values parsed as YAML scalars (64 -> int, true -> bool)."""
    params = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--param takes KEY=VALUE, got {item!r}")
        try:
            params[key.strip().replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise UserError(f"--param {item!r}: the value is not a valid YAML scalar ({problem}); quote it or fix "
                            f"it, e.g. -p n_large=64") from None
    return params


def checked_params(methods: list[str], items: list[str] | None, *, budgets: list[int] | None = None,
                   window: int | None = None) -> dict:
    """Parse `--param` items and check every method takes them (types and ranges included) and, when given,
    that each budget leaves room for the window and the method's sinks: all before any slow model load."""
    from .checks import check_budget_window
    from .policies import get_policy

    params = parse_params(items)
    for name in methods:
        policy = get_policy(name, **params)
        for b in budgets or []:
            check_budget_window(b, window, policy)
    return params


def split_list(text: str, kind=str) -> list:
    try:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from None


def load(model: str | None, dtype: str, device: str, attn: str):
    from .models import load_model

    with err_console.status(f"loading {model or 'the default model'}..."):
        return load_model(model, dtype=dtype, device=device, attn_implementation=attn)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


# -- vase methods ------------------------------------------------------------------------------------------------
@app.command()
def methods() -> None:
    """List every method with its parameters, defaults and what it does."""
    from .policies import POLICIES, get_policy

    table = Table(title="vase methods")
    table.add_column("method", style="bold")
    table.add_column("what it does")
    table.add_column("parameters (defaults)")
    for name, cls in POLICIES.items():
        params = get_policy(name).params()
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        table.add_row(name, cls.summary, shown if cls.evicts or getattr(cls, "selects", False) else "-")
    console.print(table)
    console.print("Modifiers compose with any method: -p value_guard=0.25 (or n_large=N), -p sample=true, "
                  "-p protect_sinks=true.")


# -- vase generate ---------------------------------------------------------------------------------------------
def read_prompts(prompt: str | None, file: Path | None) -> list[str]:
    if prompt is not None and file is not None:
        raise UserError("give a PROMPT or --file, not both")
    if prompt == "-" or (file is not None and str(file) == "-"):
        try:
            lines = sys.stdin.read().splitlines()
        except UnicodeDecodeError as exc:
            raise UserError(f"the prompts on stdin are not UTF-8 text ({exc.reason} at byte {exc.start}): convert "
                            f"them to UTF-8") from None
    elif file is not None:
        if not file.is_file():
            raise UserError(f"no such prompt file: {file}")
        data = file.read_bytes()
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            line = data[:exc.start].count(b"\n") + 1
            raise UserError(f"{file}: line {line} is not UTF-8 text ({exc.reason}): save the file as UTF-8") from None
    elif prompt is not None:
        return [prompt]
    else:
        raise UserError("give a PROMPT, or --file F (one prompt per line; '-' reads stdin)")
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError("no prompts found (one prompt per line)")
    return prompts


def quant_options(kv_bits: int, quant_guard: int | None) -> dict:
    """The EvictionCache keywords of --kv-bits / --quant-guard (none when they are left at their defaults)."""
    if kv_bits == 16 and quant_guard is None:
        return {}
    from .quant_cache import quant_kwargs

    return quant_kwargs(kv_bits, quant_guard)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None if one is a prefix of the other and equal length."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@app.command()
def generate(
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
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    attn: AttnOpt = "sdpa",
    engine: Annotated[str, typer.Option(help="transformers (vase's decode loop) or vllm (vLLM with the vase "
                                        "plugin; no streaming, no --kv-bits).")] = "transformers",
) -> None:
    """Generate with a bounded KV cache, streaming the answer, then print a summary."""
    from .generation import generate as run

    if engine not in ("transformers", "vllm"):
        raise UserError(f"unknown --engine {engine!r}: use transformers or vllm")
    prompts = read_prompts(prompt, file)
    params = checked_params([method], param, budgets=[budget], window=window)
    quant = quant_options(kv_bits, quant_guard)  # checked before the model loads
    if compare:
        checked_params([compare], None, budgets=[budget], window=window)
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)
    if not chat and any(not p for p in prompts):
        raise UserError("an empty prompt with --no-chat gives the model nothing to start from: give some text")
    if batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    if engine == "vllm":
        if quant:
            raise UserError("--kv-bits/--quant-guard run on the transformers engine only: drop them or --engine vllm")
        run, tok = vllm_runner(model, dtype, device, window, seed)
        mdl = None
    else:
        mdl, tok = load(model, dtype, device, attn)
    common = dict(budget=budget, window=window, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_p=top_p, top_k=top_k, greedy=greedy, chat_template=chat, **quant)
    single = len(prompts) == 1

    def stream(row: int, text: str) -> None:
        console.out(text, end="", highlight=False)

    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        seeds = [seed + start + r for r in range(len(batch))]
        if single:
            console.rule(f"[bold]{method}[/] B={budget}")
        out = run(mdl, tok, batch, method=method, seed=seeds, stream=stream if single else None, **common, **params)
        if single:
            console.out("")
        else:
            for r, text in enumerate(out.texts):
                console.rule(f"[bold]prompt {start + r + 1}[/]: {batch[r][:60]}")
                console.out(text, highlight=False)
        print_summary(method, out)
        if compare:
            if single:
                console.rule(f"[bold]{compare}[/]")
            other = run(mdl, tok, batch, method=compare, seed=seeds, stream=stream if single else None, **common)
            if single:
                console.out("")
            print_summary(compare, other)
            for r in range(len(batch)):
                at = first_divergence(out.token_ids[r], other.token_ids[r])
                label = f"prompt {start + r + 1}: " if not single else ""
                if at is None:
                    console.print(f"{label}{method} and {compare} produced identical tokens "
                                  f"({len(out.token_ids[r])} tokens)")
                else:
                    context = tok.decode(out.token_ids[r][max(0, at - 8):at], skip_special_tokens=True)
                    console.print(f"{label}{method} and {compare} diverge at token {at} (after ...{context!r})")


def vllm_runner(model: str | None, dtype: str, device: str, window: int, seed: int):
    """`vase generate --engine vllm`: a `vase.generate`-like function over vLLM, and the tokenizer."""
    from .eval.config import EvalConfig
    from .eval.vllm_engine import VllmEngine
    from .vllm.stats import summarize

    engine = VllmEngine(EvalConfig(model=model, dtype=dtype, device=device, window=window, seed=seed))
    engine.start()

    def run(mdl, tok, batch, stream=None, **kwargs):
        out = engine.generate(mdl, tok, batch, **kwargs)
        out.stats.update(summarize(out.stats["rows"]))  # totals for the summary line
        if stream is not None:
            stream(0, out.texts[0])
        return out

    return run, engine.tokenizer


def print_summary(method: str, out) -> None:
    s = out.stats
    console.print(
        f"[dim]{method}: {out.new_tokens} tokens, {out.tokens_per_second:.1f} tok/s, "
        f"{s.get('evictions', 0)} evictions, KV held {human_bytes(s.get('kv_bytes', 0))} "
        f"vs {human_bytes(s.get('kv_bytes_full', 0))} full[/]", highlight=False)


# -- vase eval / summarize ------------------------------------------------------------------------------------
@app.command("eval")
def evaluate(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="A YAML or TOML config; flags override it.")] = None,
    task: Annotated[Optional[str], typer.Option(help="gsm8k, math500, aime24, aime25, amc23, arith, arith-N "
                                                "(default: arith, the embedded task).")] = None,
    task_file: Annotated[Optional[Path], typer.Option(help="Any JSONL file of problems.")] = None,
    question_field: Annotated[Optional[str], typer.Option(help="Question field of --task-file.")] = None,
    answer_field: Annotated[Optional[str], typer.Option(help="Answer field of --task-file.")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Folder with <task>_test.jsonl files "
                                                     "(or set VASE_DATA_DIR).")] = None,
    methods: Annotated[Optional[str], typer.Option(help="Comma-separated methods; full always runs as the "
                                                   "reference.")] = None,
    budgets: Annotated[Optional[str], typer.Option(help="Comma-separated budgets.")] = None,
    window: Annotated[Optional[int], typer.Option(help="Recent tokens never evicted.")] = None,
    samples: Annotated[Optional[int], typer.Option(help="Samples per problem (pass@1 = mean accuracy).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Use the first N problems.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Length cap per completion.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature (paper: 0.6).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus sampling (paper: 0.95).")] = None,
    greedy: Annotated[Optional[bool], typer.Option("--greedy/--sample", help="Greedy decoding.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Base seed.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per generate call.")] = None,
    fidelity: Annotated[Optional[bool], typer.Option("--fidelity/--no-fidelity", help="Teacher-force the full "
                                                     "cache's trajectory through each method: KL, top-1 agreement "
                                                     "(transformers engine only).")] = None,
    engine: Annotated[Optional[str], typer.Option(help="transformers (default: vase's decode loop) or vllm "
                                                  "(vLLM's LLM.generate with the vase plugin; no --fidelity).")] = None,
    param: ParamOpt = None,
    output_dir: Annotated[Optional[Path], typer.Option(help="Where run folders go (default: runs).")] = None,
    model: ModelOpt = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda or auto.")] = None,
    attn: Annotated[Optional[str], typer.Option("--attn", help="sdpa, eager or flash_attention_2.")] = None,
    wide: Annotated[bool, typer.Option("--wide", help="Print every column of the table (default: the main ones "
                                       "that fit the terminal; all are in summary.csv and report.html).")] = False,
) -> None:
    """Compare methods on a reasoning task: accuracy, agreement with full, failures, fidelity.

    Every finished sample is saved at once; run the same command again to resume.
    """
    from .eval.config import load_config
    from .eval.runner import run_eval

    params = parse_params(param)
    method_list = split_list(methods) if methods else None
    overrides = dict(
        task=task, task_file=str(task_file) if task_file else None, question_field=question_field,
        answer_field=answer_field, data_dir=str(data_dir) if data_dir else None, methods=method_list,
        budgets=split_list(budgets, int) if budgets else None, window=window, samples=samples, limit=limit,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy, seed=seed,
        batch_size=batch_size, fidelity=fidelity, output_dir=str(output_dir) if output_dir else None, model=model,
        dtype=dtype, device=device, attn_implementation=attn, engine=engine,
        method_params={m: params for m in (method_list or [])} if params else None,
    )
    cfg = load_config(config, overrides)
    if cfg.task is None and cfg.task_file is None:
        cfg = load_config(config, {**overrides, "task": "arith"})
    run_dir = run_eval(cfg, wide=wide)
    console.print(f"results: {run_dir}")


@app.command()
def summarize(
    run_dir: Annotated[Path, typer.Argument(help="A run folder written by `vase eval`.")],
    against: Annotated[Optional[str], typer.Option(help="Pair every row with METHOD:BUDGET instead of full "
                                                   "(e.g. snapkv:64); writes summary-vs-METHOD-BUDGET.csv/md.")]
    = None,
    wide: Annotated[bool, typer.Option("--wide", help="Print every column of the table (default: the main ones "
                                       "that fit the terminal; all are in summary.csv and report.html).")] = False,
) -> None:
    """Rebuild the table, CSV, Markdown and plots of a run from its JSONL files alone."""
    from .eval.report import parse_reference
    from .eval.report import summarize as build

    if not run_dir.is_dir():
        raise UserError(f"no such run folder: {run_dir}")
    try:
        reference = parse_reference(against) if against else ("full", None)
        rows = build(run_dir, reference=reference, wide=wide)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not rows:
        raise UserError(f"no finished samples in {run_dir}")
    if against:
        console.print(f"wrote {run_dir}/summary-vs-{reference[0]}-{reference[1]}.csv and .md")
    else:
        console.print(f"wrote {run_dir / 'summary.csv'}, {run_dir / 'summary.md'} and plots")


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run folder written by `vase eval`.")],
    out: Annotated[Optional[Path], typer.Option(help="HTML file to write (default RUN_DIR/report.html).")] = None,
    inspect: Annotated[Optional[list[Path]], typer.Option(help="`vase inspect` output folders whose kept-token "
                                                          "maps to show (RUN_DIR/inspect/ is always searched).")]
    = None,
) -> None:
    """The run as one self-contained HTML page: table with paired intervals, plots, per-problem drill-down."""
    from .eval.html import write_report

    if not run_dir.is_dir():
        raise UserError(f"no such run folder: {run_dir}")
    try:
        path = write_report(run_dir, out, inspect_dirs=inspect or ())
    except FileNotFoundError as e:
        raise UserError(str(e)) from e
    console.print(f"wrote {path}")


# -- vase bench ------------------------------------------------------------------------------------------------
@app.command()
def bench(
    methods: Annotated[str, typer.Option(help="Comma-separated eviction methods (full and dynamic are added).")]
    = "vase-attnv,vase-dkv",
    budgets: Annotated[str, typer.Option(help="Comma-separated budgets.")] = "512",
    lengths: Annotated[Optional[str], typer.Option(help="Comma-separated numbers of new tokens (default 1024,4096; "
                                                   "--engine vllm: one length, default 2048).")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1",
    window: WindowOpt = 64,
    prompt_length: Annotated[int, typer.Option(help="Random prompt tokens before decoding.")] = 128,
    warmup: Annotated[int, typer.Option(help="Untimed runs per configuration.")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed runs; the median is reported.")] = 1,
    no_dynamic: Annotated[bool, typer.Option("--no-dynamic", help="Skip transformers' DynamicCache.")] = False,
    random_init: Annotated[Optional[str], typer.Option(help="Random weights of a real architecture: qwen3-0.6b, "
                                                       "qwen3-4b, qwen3-14b, smollm2-135m, or a config.json.")] = None,
    param: ParamOpt = None,
    kv_bits: Annotated[int, typer.Option("--kv-bits", help="The methods store old K/V in 8, 4 or 2 bits "
                                         "(full and dynamic stay in full precision).")] = 16,
    out: Annotated[Path, typer.Option(help="Folder for bench.csv, bench.md and the plots.")] = Path("bench-out"),
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    attn: AttnOpt = "sdpa",
    engine: Annotated[str, typer.Option(help="transformers, or vllm: N requests at once into one vLLM engine with a "
                                        "fixed KV pool, stock vLLM (full) vs each method.")] = "transformers",
    requests: Annotated[int, typer.Option(help="--engine vllm: requests submitted at once.")] = 16,
    regimes: Annotated[str, typer.Option(help="--engine vllm: KV pool sizes, ample (holds every request at full "
                                         "length) and/or tight (a quarter of them).")] = "ample,tight",
    pool_requests: Annotated[Optional[float], typer.Option(help="--engine vllm: instead of --regimes, a pool that "
                                                           "holds this many requests at full length.")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="--engine vllm: KV block size (vLLM's default: 128 on "
                                                     "CPU, 16 on GPU).")] = None,
    compile_: Annotated[bool, typer.Option("--compile", help="Also run each configuration with its decode step "
                                           "torch.compile'd (full: transformers' StaticCache; the first run of each "
                                           "compiles, untimed).")] = False,
) -> None:
    """Decode throughput and memory of each method against the full cache, per output length."""
    from .bench.report import write_report
    from .bench.runner import run_bench

    if engine == "vllm":
        from .bench.vllm_bench import cli_bench

        paths = cli_bench(model, split_list(methods), split_list(budgets, int), split_list(lengths or "2048", int),
                          requests=requests, prompt_len=prompt_length, window=window, regimes=split_list(regimes),
                          pool_requests=pool_requests, block_size=block_size, dtype=None if dtype == "auto" else dtype,
                          params=checked_params(split_list(methods), param), out=out, log=console.print)
        console.print(f"wrote {', '.join(str(p) for p in paths.values())}")
        return
    if engine != "transformers":
        raise UserError(f"--engine must be transformers or vllm, got {engine!r}")
    lengths = lengths or "1024,4096"
    method_list = split_list(methods)
    params = {**checked_params(method_list, param, budgets=split_list(budgets, int), window=window),
              **quant_options(kv_bits, None)}
    if random_init:

        from .bench.shapes import build_random_model
        from .models import resolve_device, resolve_dtype

        dev = resolve_device(device)
        mdl = build_random_model(random_init, resolve_dtype(dtype, dev), dev, attn)
    else:
        mdl, _ = load(model, dtype, device, attn)
    rows = run_bench(mdl, method_list, split_list(budgets, int), split_list(lengths, int),
                     split_list(batch_sizes, int), prompt_length=prompt_length, window=window, warmup=warmup,
                     repeats=repeats, include_dynamic=not no_dynamic, compile="both" if compile_ else False,
                     **params)
    paths = write_report(rows, out, console=console)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())}")


# -- vase serve ------------------------------------------------------------------------------------------------
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="Model directory, .gguf file or hub id (default: the "
                                                   "embedded SmolLM2-135M-Instruct).")] = None,
    method: Annotated[str, typer.Option(help="Eviction method (see `vase methods`); full = stock vLLM.")]
    = "vase-attnv",
    budget: Annotated[int, typer.Option(help="KV pairs kept per layer and KV head.")] = 2048,
    window: WindowOpt = 64,
    param: ParamOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Serve MODEL with vLLM's OpenAI-compatible server and the vase plugin.

    Any further option goes to vLLM unchanged (e.g. --max-model-len 8192 --kv-cache-memory-bytes 2000000000).
    """
    from .vllm.serve import exec_serve, require_vllm, serve_argv

    require_vllm()
    extra = list(ctx.args)
    if model is not None and model.startswith("-"):  # no MODEL given: the first vLLM option landed there
        model, extra = None, [model, *extra]
    argv = serve_argv(model, method=method, budget=budget, window=window, params=parse_params(param), host=host,
                      port=port, extra=extra)
    err_console.print(f"vase serve: {' '.join(argv[1:])}", highlight=False, soft_wrap=True)
    exec_serve(argv)


# -- vase inspect ----------------------------------------------------------------------------------------------
@app.command()
def inspect(
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    method: Annotated[str, typer.Option(help="Eviction method.")] = "vase-attnv",
    budget: Annotated[int, typer.Option(help="KV pairs kept per layer and KV head.")] = 128,
    window: WindowOpt = 64,
    param: ParamOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 512,
    greedy: Annotated[bool, typer.Option("--greedy", help="Take the argmax instead of sampling.")] = False,
    seed: SeedOpt = 0,
    out: Annotated[Path, typer.Option(help="Folder for kept.png and inspect.json.")] = Path("inspect-out"),
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    attn: AttnOpt = "sdpa",
) -> None:
    """Look inside one generation: kept tokens per head, value magnitudes, loop onset."""
    from .analysis.inspect import inspect_generation

    params = checked_params([method], param, budgets=[budget], window=window)
    mdl, tok = load(model, dtype, device, attn)
    report = inspect_generation(mdl, tok, prompt, out, method=method, budget=budget, window=window,
                                max_new_tokens=max_new_tokens, greedy=greedy, seed=seed, **params)
    console.rule(f"[bold]{method}[/] B={budget}")
    console.out(report["text"], highlight=False)
    s = report["stats"]
    onset = report["loop_onset_token"]
    console.print(f"{report['generated_tokens']} tokens, {s['evictions']} evictions; "
                  + (f"phrase loop from token {onset}" if onset is not None else "no phrase loop"))
    table = Table(title="value magnitude (range) per layer: max / per-head median")
    for col in ("layer", "max/median", "share > 5x", "kept share", "top positions"):
        table.add_column(col)
    for v, share in zip(report["values"], report["kept_share_per_layer"]):
        table.add_row(str(v["layer"]), f"{v['max_over_median']:.2f}", f"{v['share_over_threshold']:.2%}",
                      f"{share:.2%}", ", ".join(map(str, v["top_positions"])))
    console.print(table)
    console.print(f"wrote {out / 'kept.png'} and {out / 'inspect.json'}")


# -- vase analyze ------------------------------------------------------------------------------------------------
analyze_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="Studies: why sampling helps (randomness); eviction vs selection (sweep).")
app.add_typer(analyze_app, name="analyze")
TaskOpt = Annotated[str, typer.Option(help="Task of the prompts: arith (embedded), gsm8k, math500, ...")]
DataDirOpt = Annotated[Optional[Path], typer.Option(help="Folder of task files (or $VASE_DATA_DIR).")]


@analyze_app.command("randomness")
def analyze_randomness(
    task: TaskOpt = "arith",
    data_dir: DataDirOpt = None,
    limit: Annotated[int, typer.Option(help="Problems (trajectories) to study.")] = 2,
    budget: Annotated[int, typer.Option(help="KV pairs kept per layer and KV head.")] = 96,
    window: WindowOpt = 16,
    seeds: Annotated[int, typer.Option(help="Eviction seeds of each stochastic method (the ensemble).")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="Length of full's trajectories.")] = 256,
    loop_tokens: Annotated[Optional[int], typer.Option(help="Free-generation length for loop onset "
                                                       "(default: --max-new-tokens; 0 skips).")] = None,
    seed: SeedOpt = 0,
    out: Annotated[Path, typer.Option(help="Folder for randomness.json/.csv and the plots.")] = Path("randomness-out"),
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    attn: AttnOpt = "sdpa",
) -> None:
    """Deterministic vs stochastic eviction (snapkv vs snapkv-sample, vase-attnv top-k vs sampled)."""
    from .analysis.randomness import print_report, run_randomness
    from .analysis.sweep import task_prompts

    checked_params(["snapkv", "vase-attnv"], None, budgets=[budget], window=window)  # before the model loads
    prompts = task_prompts(task, data_dir=data_dir, limit=limit)
    mdl, tok = load(model, dtype, device, attn)
    report = run_randomness(mdl, tok, prompts, out, budget=budget, window=window, seeds=seeds,
                            max_new_tokens=max_new_tokens, loop_tokens=loop_tokens, seed=seed,
                            progress=lambda m: err_console.print(m, highlight=False))
    print_report(report, console)
    console.print(f"wrote {out}/randomness.json, randomness.csv, attn_error.png, mechanisms.png")


@analyze_app.command("sweep")
def analyze_sweep(
    tasks: Annotated[str, typer.Option(help="Comma-separated: retrieval (embedded long-context), arith, gsm8k, "
                                       "math500, ...")] = "arith,retrieval",
    methods: Annotated[str, typer.Option(help="Comma-separated methods (eviction and quest); "
                                         "parameters as name:key=value;key=value.")] =
        "streamingllm,snapkv,rkv,vase-attnv,vase-dkv,quest",
    compressions: Annotated[str, typer.Option(help="Comma-separated compression targets (run length / B).")] =
        "4,8,16",
    data_dir: DataDirOpt = None,
    limit: Annotated[int, typer.Option(help="Problems per task.")] = 2,
    window: WindowOpt = 16,
    max_new_tokens: Annotated[int, typer.Option(help="Length cap of full's trajectories (reasoning tasks).")] = 256,
    retrieval_tokens: Annotated[int, typer.Option(help="Length cap of the retrieval answers.")] = 64,
    seed: SeedOpt = 0,
    out: Annotated[Path, typer.Option(help="Folder for sweep.json/.csv/.md and sweep.png.")] = Path("sweep-out"),
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    attn: AttnOpt = "sdpa",
) -> None:
    """Fidelity of eviction methods and Quest (selection) at equal sparsity, at several compressions."""
    from .analysis.sweep import markdown_table, run_sweep, task_prompts

    names = split_list(tasks)
    prompts = {t: task_prompts(t, limit=limit, data_dir=data_dir, seed=seed) for t in names}
    caps = {t: retrieval_tokens if t == "retrieval" else max_new_tokens for t in names}
    mdl, tok = load(model, dtype, device, attn)
    report = run_sweep(mdl, tok, out, tasks=prompts, methods=split_list(methods),
                       compressions=split_list(compressions, float), window=window, max_new_tokens=caps, seed=seed,
                       progress=lambda m: err_console.print(m, highlight=False))
    console.out(markdown_table(report), highlight=False)
    console.print(f"{report['seconds']:.0f} s; wrote {out}/sweep.json, sweep.csv, sweep.md, sweep.png")


# -- entry point -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Console entry: one-line errors unless --debug."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("VASE_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars; vase shows its own progress
    try:
        result = app(args=args, prog_name="vase", standalone_mode=False)
        if result == 130:  # typer turns Ctrl-C into Exit(130), which comes back as the return value here
            print(_interrupted_line(args), file=sys.stderr)
        if isinstance(result, int) and result:  # --help and friends return their exit code
            sys.exit(result)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print(_interrupted_line(args), file=sys.stderr)
        sys.exit(130)
    except TyperException as exc:  # usage errors: bad flag, bad value, unknown command
        if debug:
            raise
        print(f"vase: error: {exc.format_message()} (see vase --help)", file=sys.stderr)
        sys.exit(2)
    except (UserError, ValueError, TypeError, OSError, RuntimeError) as exc:  # errors with a message for the user
        if debug:
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"vase: error: {message}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - anything else is a bug, still one line without --debug
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"vase: error: {type(exc).__name__}: {first} (a bug in vase? rerun with --debug for the traceback)",
              file=sys.stderr)
        sys.exit(1)


def _interrupted_line(args: list[str]) -> str:
    """What Ctrl-C prints: `vase eval` keeps every finished sample, so the same command resumes."""
    rest = list(args)
    while rest and rest[0].startswith("-"):  # global options before the command (--threads N)
        rest = rest[2:] if rest[0] == "--threads" else rest[1:]
    if rest[:1] == ["eval"]:
        return "vase: interrupted; every finished sample is saved: run the same command again to resume"
    return "vase: interrupted"


if __name__ == "__main__":
    main()
