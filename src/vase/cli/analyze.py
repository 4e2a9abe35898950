"""The analysis commands: `vase inspect` (inside one generation) and the `vase analyze` studies
(randomness: why sampling helps; sweep: eviction vs selection at equal sparsity)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ..core.checks import check_sampling

from .common import (ModelArgs, ParamOpt, SeedOpt, UserError, WindowOpt, check_out_dir, check_range, checked_requests,
                     console, err_console, model_options, split_list, warn)

__all__ = ["inspect", "analyze_app", "analysis_prompts", "MAX_SEEDS"]

#: `vase analyze randomness --seeds` at most (99999999999 ran until killed).
MAX_SEEDS = 256

analyze_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="Studies: why sampling helps (randomness); eviction vs selection (sweep).")
TaskOpt = Annotated[str, typer.Option(help="Task of the prompts: arith (embedded), gsm8k, math500, ...")]
DataDirOpt = Annotated[Optional[Path], typer.Option(help="Folder of task files (or $VASE_DATA_DIR).")]


@model_options(check=False)  # --seed is checked before --out
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
    model: ModelArgs = ModelArgs(),
) -> None:
    """Look inside one generation: kept tokens per head, value magnitudes, loop onset."""
    model.check()
    check_range("--seed", seed, 2**63 - 1)
    check_range("--max-new-tokens", max_new_tokens)  # generate's checks, before the model loads
    check_sampling(max_new_tokens=max_new_tokens, temperature=0.6, top_p=0.95, top_k=None, greedy=greedy)
    check_out_dir(out, "--out")
    _, requests = checked_requests([method], param, budgets=[budget], window=window)  # the door: validated once
    from ..analysis.inspect import inspect_generation

    mdl, tok = model.load()
    report = inspect_generation(mdl, tok, prompt, out, request=requests[method, budget],
                                max_new_tokens=max_new_tokens, greedy=greedy, seed=seed)
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


def analysis_prompts(task: str, *, limit: int, data_dir: Path | None, seed: int = 0, flag: str = "--task"
                     ) -> list[str]:
    """The prompts of an analysis task; an unknown task names the flag the analysis really has."""
    if limit < 1:  # else the study would start and stop at "prompts is empty", naming no flag
        raise UserError(f"--limit must be >= 1 (problems to study), got {limit}")
    from ..analysis.sweep import task_prompts
    from ..eval.tasks import TaskError

    try:
        return task_prompts(task, limit=limit, data_dir=data_dir, seed=seed)
    except TaskError as e:
        if str(e).startswith("unknown task"):
            from ..eval.tasks import TASK_NAMES

            extra = "retrieval, " if flag == "--tasks" else ""
            raise UserError(f"{flag}: unknown task {task!r}: choose from {extra}{', '.join(TASK_NAMES)}, arith-N, "
                            f"recall-N") from None
        raise


@analyze_app.command("randomness")
@model_options
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
    model: ModelArgs = ModelArgs(),
) -> None:
    """Deterministic vs stochastic eviction (snapkv vs snapkv-sample, vase-attnv top-k vs sampled)."""
    if not 1 <= seeds <= MAX_SEEDS:  # each seed is one more teacher-forced run of every stochastic arm and problem
        raise UserError(f"--seeds must be in 1..{MAX_SEEDS} (each is one more run of every stochastic method on every "
                        f"problem), got {seeds}")
    check_range("--max-new-tokens", max_new_tokens, minimum=1)
    check_range("--loop-tokens", loop_tokens, minimum=0)  # 0 skips the free generation; -1 skipped it silently
    from ..analysis.randomness import DEFAULT_ARMS, print_report, run_randomness, study_requests

    # the door, before the model loads: every request of the study (full, each arm, each control's budgets) once
    requests = study_requests(DEFAULT_ARMS, None, seeds, budget, window)
    prompts = analysis_prompts(task, data_dir=data_dir, limit=limit)
    mdl, tok = model.load()
    report = run_randomness(mdl, tok, prompts, out, budget=budget, window=window, seeds=seeds, requests=requests,
                            max_new_tokens=max_new_tokens, loop_tokens=loop_tokens, seed=seed,
                            progress=lambda m: err_console.print(m, highlight=False))
    print_report(report, console)
    console.print(f"wrote {out}/randomness.json, randomness.csv, attn_error.png, mechanisms.png")


@analyze_app.command("sweep")
@model_options
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
    model: ModelArgs = ModelArgs(),
) -> None:
    """Fidelity of eviction methods and Quest (selection) at equal sparsity, at several compressions."""
    from ..analysis.sweep import markdown_table, run_sweep

    names = split_list(tasks, str, "--tasks")
    compression_list = split_list(compressions, float, "--compressions")
    for flag, items in (("--tasks", names), ("--compressions", compression_list)):
        twice = sorted({x for x in items if items.count(x) > 1}, key=items.index)
        if twice:  # each would be computed (and shown) twice
            raise UserError(f"{flag} lists {', '.join(f'{x:g}' if isinstance(x, float) else x for x in twice)} "
                            f"twice: give each once")
    check_range("--max-new-tokens", max_new_tokens, minimum=1)
    check_range("--retrieval-tokens", retrieval_tokens, minimum=1)
    prompts = {t: analysis_prompts(t, limit=limit, data_dir=data_dir, seed=seed, flag="--tasks") for t in names}
    caps = {t: retrieval_tokens if t == "retrieval" else max_new_tokens for t in names}
    mdl, tok = model.load()
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
