"""The `vase` command: methods, generate, eval, summarize, bench.

User errors end with one line on stderr and a non-zero exit; `--debug` shows the traceback.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table
from typer.exceptions import TyperException

from .checks import check_sampling

# Nothing here imports torch's model stack, transformers or vLLM at import time: `vase --help`, `vase methods`
# and every refusal of a flag or config value answer at once; each command imports what it needs.

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Decode-time KV cache eviction for reasoning models (VaSE and baselines).")
console = Console()


@app.callback()
def _options(threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (default: torch's "
                                                            "choice). On a busy machine 1 is often faster.")] = None
             ) -> None:
    """Decode-time KV cache eviction for reasoning models (VaSE and baselines)."""
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
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


def warn(message: str) -> None:
    """One line on stderr for a value that is legal but ignored (or risky): the flag and what happens."""
    print(f"vase: warning: {message}", file=sys.stderr)


def given(ctx: typer.Context | None, name: str) -> bool:
    """Whether the user typed option ``name`` (not just its default)."""
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")  # by name: typer may vendor click


#: Integers torch must be able to hold (a larger budget overflows a C long deep inside torch).
_INT_MAX = 2**31 - 1


def check_range(flag: str, value: int | None, maximum: int = _INT_MAX, minimum: int | None = None) -> None:
    """A flag's integer within what torch can hold: one line naming the flag instead of torch's overflow."""
    if value is None:
        return
    if abs(value) > maximum:
        raise UserError(f"{flag} {value} is too large (at most {maximum})")
    if minimum is not None and value < minimum:
        raise UserError(f"{flag} must be >= {minimum}, got {value}")


def check_model_opt(model: str | None) -> None:
    if model is not None and not model.strip():
        raise UserError(f"--model is empty ({model!r}): give a hub id, a model folder or a .gguf file, or leave "
                        f"--model out for the default")


def check_out_dir(path: Path | None, flag: str) -> None:
    """An output folder that can be created or used: not a file, not a dangling symlink (checked before work)."""
    if path is None:
        return
    if path.is_symlink() and not path.exists():
        raise UserError(f"{flag} {path} is a symbolic link to nothing ({os.readlink(path)}): remove the link or "
                        f"give another folder")
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder: give a folder (it is created if missing)")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{flag} {path}: {parent} is a file, not a folder: give a folder")


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
                   window: int | None = None, storage: dict | None = None) -> dict:
    """Parse `--param` items and check every method takes them (types and ranges included) and, when given,
    that each budget leaves room for the window and the method's sinks, and holds the slots the method
    reserves (n_large, --quant-guard): all before any slow model load."""
    from .checks import check_budget_window
    from .eval.config import check_reserves
    from .policies import get_policy

    params = parse_params(items)
    for name in methods:
        policy = get_policy(name, **params)
        if params and not (policy.evicts or policy.selects):
            warn(f"--param {', '.join(sorted(params))} is ignored by {policy.name!r}: it keeps every token")
        for b in budgets or []:
            check_range("--budget", b)
            check_budget_window(b, window, policy)
            check_reserves(policy.name, b, policy, storage)
    return params


def split_list(text: str, kind=str, flag: str = "the list") -> list:
    """``"a,b"`` -> ``["a", "b"]`` as ``kind``; an empty list is refused (``--budgets ''`` is no budget)."""
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not items:
        raise UserError(f"{flag} is empty ({text!r}): give a comma-separated list, e.g. {flag} "
                        f"{'128,256' if kind is int else ('4,8' if kind is float else 'snapkv,vase-attnv')}")
    return items


def _quiet_loading() -> None:
    """Turn off transformers' weight-loading bars (vase shows its own progress); imports transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load(model: str | None, dtype: str, device: str, attn: str):
    from .models import load_model

    _quiet_loading()
    with err_console.status(f"loading {model or 'the default model'}..."):
        return load_model(model, dtype=dtype, device=device, attn_implementation=attn)


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
        table.add_row(name, cls.summary, shown if cls.evicts or cls.selects else "-")
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
        if file.is_dir():
            raise UserError(f"--file {file} is a folder, not a prompt file: give a text file (one prompt per line)")
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
    from .quant import quant_kwargs

    return quant_kwargs(kv_bits, quant_guard)


@app.command()
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
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    attn: AttnOpt = "sdpa",
    engine: Annotated[str, typer.Option(help="transformers (vase's decode loop) or vllm (vLLM with the vase "
                                        "plugin; no streaming, no --kv-bits).")] = "transformers",
) -> None:
    """Generate with a bounded KV cache, streaming the answer, then print a summary."""
    if engine not in ("transformers", "vllm"):
        raise UserError(f"unknown --engine {engine!r}: use transformers or vllm")
    check_model_opt(model)
    check_range("--seed", seed, 2**63 - 1)
    check_range("--max-new-tokens", max_new_tokens)
    prompts = read_prompts(prompt, file)
    quant = quant_options(kv_bits, quant_guard)  # checked before the model loads
    params = checked_params([method], param, budgets=[budget], window=window, storage=quant)
    if compare:
        checked_params([compare], None, budgets=[budget], window=window, storage=quant)
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
    if engine == "vllm":
        if quant:
            raise UserError("--kv-bits/--quant-guard run on the transformers engine only: drop them, or use "
                            "--engine transformers")
        run, tok = vllm_runner(model, dtype, device, window, seed)
        mdl = None
    else:
        from .generation import generate as run

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
            from .eval.paired import first_divergence

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
    from .units import human_bytes

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

    if task is not None and task_file is not None:
        raise UserError(f"give --task or --task-file, not both: --task {task} would label the problems of "
                        f"{task_file} as {task!r} (the file's name labels them; name it e.g. {task}-mine.jsonl)")
    check_model_opt(model)
    params = parse_params(param)
    method_list = split_list(methods, str, "--methods") if methods is not None else None
    overrides = dict(
        task=task, task_file=str(task_file) if task_file else None, question_field=question_field,
        answer_field=answer_field, data_dir=str(data_dir) if data_dir else None, methods=method_list,
        budgets=split_list(budgets, int, "--budgets") if budgets is not None else None, window=window,
        samples=samples, limit=limit, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        greedy=greedy, seed=seed, batch_size=batch_size, fidelity=fidelity,
        output_dir=str(output_dir) if output_dir else None, model=model, dtype=dtype, device=device,
        attn_implementation=attn, engine=engine,
    )
    cfg = load_config(config, overrides)
    if cfg.task is None and cfg.task_file is None:
        overrides["task"] = "arith"
        cfg = load_config(config, overrides)
    if params:  # -p applies to the methods the run resolves to (flag, config file or default), not the flag alone
        overrides["method_params"] = eval_params(cfg, params)
        cfg = load_config(config, overrides)
    check_out_dir(Path(cfg.output_dir).expanduser(), "--output-dir")
    _quiet_loading()
    from .eval.runner import run_eval

    run_dir = run_eval(cfg, wide=wide)
    console.print(f"results: {run_dir}")


def eval_params(cfg, params: dict) -> dict[str, dict]:
    """``-p KEY=VALUE`` of `vase eval` spread over the run's methods: each key goes to every method that takes
    it (full keeps every token and takes none). A key no method takes is an error; one that some take is a
    warning naming the others."""
    from dataclasses import fields

    from .eval.config import FULL, ConfigError
    from .quant import CACHE_STORAGE_OPTIONS

    specs = {label: s for label, s in cfg.method_specs().items() if label != FULL}
    if not specs:
        warn(f"--param {', '.join(sorted(params))} is ignored: the run holds only {FULL!r}, which keeps every token")
        return {}
    takes = {label: {f.name for f in fields(type(s.policy))} | set(CACHE_STORAGE_OPTIONS) for label, s in specs.items()}
    out: dict[str, dict] = {label: {} for label in specs}
    for key, value in params.items():
        users = [label for label in specs if key in takes[label]]
        if not users:
            raise ConfigError(f"--param {key}: no method of this run takes it ({', '.join(specs)}); see `vase "
                              f"methods` for each method's parameters")
        others = [label for label in specs if label not in users]
        if others:
            warn(f"--param {key} applies to {', '.join(users)} only ({', '.join(others)} take no {key!r})")
        for label in users:
            out[label][key] = value
    return {label: p for label, p in out.items() if p}


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

    check_run_dir(run_dir)
    reference = ("full", None)
    try:
        reference = parse_reference(against) if against else ("full", None)
        rows = build(run_dir, reference=reference, wide=wide)
    except BaseException as e:
        # An old summary must not pass for this run's (as `vase eval` does when its summary fails).
        stem = "summary" if tuple(reference) == ("full", None) else f"summary-vs-{reference[0]}-{reference[1]}"
        for stale in (f"{stem}.csv", f"{stem}.md"):
            (run_dir / stale).unlink(missing_ok=True)
        if isinstance(e, ValueError):
            raise UserError(str(e)) from None
        raise
    if not rows:
        raise UserError(f"no finished samples in {run_dir}")
    if against:
        console.print(f"wrote {run_dir}/summary-vs-{reference[0]}-{reference[1]}.csv and .md")
    else:
        console.print(f"wrote {run_dir / 'summary.csv'}, {run_dir / 'summary.md'} and plots")


def check_run_dir(run_dir: Path) -> None:
    if run_dir.is_file():
        raise UserError(f"{run_dir} is a file, not a run folder: give the folder `vase eval` printed after "
                        f"'results:'")
    if not run_dir.is_dir():
        raise UserError(f"no such run folder: {run_dir}")


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

    check_run_dir(run_dir)
    if out is not None and out.is_dir():
        raise UserError(f"--out {out} is a folder: give the HTML file to write, e.g. {out / 'report.html'}")
    found = []
    for d in inspect or ():
        if d.is_dir():
            found.append(d)
        else:
            warn(f"--inspect {d}: {'not a folder' if d.exists() else 'no such folder'}; ignored (give a `vase "
                 f"inspect` output folder)")
    try:
        path = write_report(run_dir, out, inspect_dirs=found)
    except FileNotFoundError as e:
        raise UserError(str(e)) from e
    console.print(f"wrote {path}")


# -- vase bench ------------------------------------------------------------------------------------------------
@app.command()
def bench(
    ctx: typer.Context,
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
    check_model_opt(model)
    check_out_dir(out, "--out")
    method_list, budget_list = split_list(methods, str, "--methods"), split_list(budgets, int, "--budgets")
    if engine == "vllm":
        from .bench.vllm_bench import cli_bench

        paths = cli_bench(model, method_list, budget_list, split_list(lengths or "2048", int, "--lengths"),
                          requests=requests, prompt_len=prompt_length, window=window,
                          regimes=split_list(regimes, str, "--regimes"), pool_requests=pool_requests,
                          block_size=block_size, dtype=None if dtype == "auto" else dtype,
                          params=checked_params(method_list, param), out=out, log=console.print)
        console.print(f"wrote {', '.join(str(p) for p in paths.values())}")
        return
    if engine != "transformers":
        raise UserError(f"--engine must be transformers or vllm, got {engine!r}")
    ignored = [f"--{n.replace('_', '-')}" for n in ("requests", "regimes", "pool_requests", "block_size")
               if given(ctx, n)]
    if ignored:
        warn(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored on the transformers engine "
             f"(they size vLLM's pool): add --engine vllm, or drop {'it' if len(ignored) == 1 else 'them'}")
    length_list = split_list(lengths or "1024,4096", int, "--lengths")
    batch_list = split_list(batch_sizes, int, "--batch-sizes")
    quant = quant_options(kv_bits, None)
    params = {**checked_params(method_list, param, budgets=budget_list, window=window, storage=quant), **quant}
    from .bench.report import write_report
    from .bench.runner import run_bench

    if random_init:
        mdl = random_model(random_init, dtype, device, attn)
    else:
        mdl, _ = load(model, dtype, device, attn)
    rows = run_bench(mdl, method_list, budget_list, length_list, batch_list, prompt_length=prompt_length,
                     window=window, warmup=warmup, repeats=repeats, include_dynamic=not no_dynamic,
                     compile="both" if compile_ else False, **params)
    paths = write_report(rows, out, console=console)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())}")


def random_model(spec: str, dtype: str, device: str, attn: str):
    """`bench --random-init`: a named shape or a config.json, random weights; one line naming the file if bad."""
    from .bench.shapes import build_random_model
    from .models import resolve_device, resolve_dtype

    dev = resolve_device(device)
    _quiet_loading()
    try:
        return build_random_model(spec, resolve_dtype(dtype, dev), dev, attn)
    except Exception as e:  # noqa: BLE001 - any reader's or config class's error means "bad file"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--random-init {spec}: cannot build a model from it ({type(e).__name__}: {first[:200]}); "
                        f"give a transformers config.json (with model_type) or one of qwen3-0.6b, qwen3-4b, "
                        f"qwen3-14b, smollm2-135m") from None


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
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for the server before saying what to check "
                                                 "(it keeps waiting; 0 = never say).")] = 300.0,
) -> None:
    """Serve MODEL with vLLM's OpenAI-compatible server and the vase plugin.

    Any further option goes to vLLM unchanged (e.g. --max-model-len 8192 --kv-cache-memory-bytes 2000000000).
    One line says when the server answers (URL, model, method, budget); start-up takes 1-2 minutes on a CPU.
    """
    from .vllm.serve import exec_serve, require_vllm, run_serve, serve_argv

    require_vllm()
    extra = list(ctx.args)
    if model is not None and model.startswith("-"):  # no MODEL given: the first vLLM option landed there
        model, extra = None, [model, *extra]
    argv = serve_argv(model, method=method, budget=budget, window=window, params=parse_params(param), host=host,
                      port=port, extra=extra)
    err_console.print(f"vase serve: {' '.join(argv[1:])}", highlight=False, soft_wrap=True)
    if ready_timeout < 0:
        raise UserError(f"--ready-timeout must be >= 0 seconds, got {ready_timeout:g}")
    if os.environ.get("VASE_SERVE_EXEC") == "1":  # replace this process (no ready line), as before
        exec_serve(argv)
    code = run_serve(argv, ready_timeout)
    if code:
        raise typer.Exit(code)


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
    check_model_opt(model)
    check_range("--seed", seed, 2**63 - 1)
    check_out_dir(out, "--out")
    params = checked_params([method], param, budgets=[budget], window=window)
    from .analysis.inspect import inspect_generation

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


def analysis_prompts(task: str, *, limit: int, data_dir: Path | None, seed: int = 0, flag: str = "--task"
                     ) -> list[str]:
    """The prompts of an analysis task; an unknown task names the flag the analysis really has."""
    from .analysis.sweep import task_prompts
    from .eval.tasks import TaskError

    try:
        return task_prompts(task, limit=limit, data_dir=data_dir, seed=seed)
    except TaskError as e:
        if str(e).startswith("unknown task"):
            from .eval.tasks import TASK_NAMES

            extra = "retrieval, " if flag == "--tasks" else ""
            raise UserError(f"{flag}: unknown task {task!r}: choose from {extra}{', '.join(TASK_NAMES)}, arith-N, "
                            f"recall-N") from None
        raise


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
    check_model_opt(model)
    check_out_dir(out, "--out")
    checked_params(["snapkv", "vase-attnv"], None, budgets=[budget], window=window)  # before the model loads
    prompts = analysis_prompts(task, data_dir=data_dir, limit=limit)
    from .analysis.randomness import print_report, run_randomness

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
    from .analysis.sweep import markdown_table, run_sweep

    check_model_opt(model)
    check_out_dir(out, "--out")
    names = split_list(tasks, str, "--tasks")
    compression_list = split_list(compressions, float, "--compressions")
    prompts = {t: analysis_prompts(t, limit=limit, data_dir=data_dir, seed=seed, flag="--tasks") for t in names}
    caps = {t: retrieval_tokens if t == "retrieval" else max_new_tokens for t in names}
    mdl, tok = load(model, dtype, device, attn)
    report = run_sweep(mdl, tok, out, tasks=prompts, methods=split_list(methods, str, "--methods"),
                       compressions=compression_list, window=window, max_new_tokens=caps, seed=seed,
                       progress=lambda m: err_console.print(m, highlight=False))
    # A compression is measured when some problem ran at its own budget: a row whose every budget was clamped
    # to window + 8 (or that no problem reached) measures another compression than the one asked for.
    measured = {r["compression"] for r in report["rows"] if r["clamped"] < r["problems"]}
    empty = [c for c in compression_list if c not in measured]
    if empty:
        shown = ",".join(f"{c:g}" for c in empty)
        message = (f"--compressions {shown}: every run is too short for it (the budget is clamped to window + 8 = "
                   f"{window + 8}, or nothing was evicted): lower the compression or raise --max-new-tokens")
        if not measured:
            raise UserError(message)
        warn(message + "; those rows do not measure it")
    console.out(markdown_table(report), highlight=False)
    console.print(f"{report['seconds']:.0f} s; wrote {out}/sweep.json, sweep.csv, sweep.md, sweep.png")


# -- entry point -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Console entry: one-line errors unless --debug."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("VASE_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    with warnings.catch_warnings():  # vase's own warnings as one line each; restored afterwards
        warnings.showwarning = _one_line_warning(warnings.showwarning)
        _run(args, debug)


def _one_line_warning(previous):
    """A showwarning that prints vase's own warnings as ``vase: warning: ...`` and hands others on."""
    here = os.path.dirname(os.path.abspath(__file__))

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(here + os.sep):
            print(f"vase: warning: {str(message).strip().splitlines()[0]}", file=sys.stderr)
        else:
            previous(message, category, filename, lineno, file, line)

    return show


def _run(args: list[str], debug: bool) -> None:
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
