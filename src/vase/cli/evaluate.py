"""The run commands: `vase eval` (a resumable comparison run), `vase summarize` and `vase report` (its
tables, plots and HTML page, rebuilt from the run folder alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (ModelOpt, ParamOpt, UserError, check_model_opt, check_out_dir, console, parse_params,
                     quiet_loading, split_list, warn)

__all__ = ["evaluate", "eval_params", "summarize", "report", "check_run_dir"]


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
    kv_bits: Annotated[Optional[int], typer.Option("--kv-bits", help="The methods store old K/V in 8, 4 or 2 bits "
                                                   "(the same as -p kv_bits=N; full stays in full precision); see "
                                                   "docs/quantization.md.")] = None,
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
    from ..eval.config_files import load_config

    if task is not None and task_file is not None:
        raise UserError(f"give --task or --task-file, not both: --task {task} would label the problems of "
                        f"{task_file} as {task!r} (the file's name labels them; name it e.g. {task}-mine.jsonl)")
    check_model_opt(model)
    params = parse_params(param)
    if kv_bits is not None:  # one storage, one spelling: --kv-bits N is -p kv_bits=N (as on generate and bench)
        if "kv_bits" in params:
            raise UserError("the storage is given twice: --kv-bits and -p kv_bits: give it once")
        params["kv_bits"] = kv_bits
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
    if attn is not None:  # a flag the engine would ignore is refused, not dropped
        from ..core.capabilities import refuse_unsupported

        refuse_unsupported(cfg.engine, attn=True)
    if cfg.task is None and cfg.task_file is None:
        overrides["task"] = "arith"
        cfg = load_config(config, overrides)
    if params:  # -p applies to the methods the run resolves to (flag, config file or default), not the flag alone
        overrides["method_params"] = eval_params(cfg, params)
        cfg = load_config(config, overrides)
    check_out_dir(Path(cfg.output_dir).expanduser(), "--output-dir")
    quiet_loading()
    from ..eval.runner import run_eval

    run_dir = run_eval(cfg, wide=wide)
    console.print(f"results: {run_dir}")


def eval_params(cfg, params: dict) -> dict[str, dict]:
    """``-p KEY=VALUE`` of `vase eval` spread over the run's methods: each key goes to every method that takes
    it (full keeps every token and takes none). A key no method takes is an error; one that some take is a
    warning naming the others."""
    from dataclasses import fields

    from ..eval.config import FULL, ConfigError
    from ..storage.registry import storage_keywords

    specs = {label: s for label, s in cfg.method_specs().items() if label != FULL}
    if not specs:
        warn(f"--param {', '.join(sorted(params))} is ignored: the run holds only {FULL!r}, which keeps every token")
        return {}
    takes = {label: {f.name for f in fields(type(s.policy))} | set(storage_keywords()) for label, s in specs.items()}
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


def summarize(
    run_dir: Annotated[Path, typer.Argument(help="A run folder written by `vase eval`.")],
    against: Annotated[Optional[str], typer.Option(help="Pair every row with METHOD:BUDGET instead of full "
                                                   "(e.g. snapkv:64); writes summary-vs-METHOD-BUDGET.csv/md.")]
    = None,
    wide: Annotated[bool, typer.Option("--wide", help="Print every column of the table (default: the main ones "
                                       "that fit the terminal; all are in summary.csv and report.html).")] = False,
) -> None:
    """Rebuild the table, CSV, Markdown and plots of a run from its JSONL files alone."""
    from ..eval.report import parse_reference
    from ..eval.report import summarize as build

    check_run_dir(run_dir)
    reference = ("full", None)
    from ..eval.store import StoreError

    try:
        reference = parse_reference(against) if against else ("full", None)
        rows = build(run_dir, reference=reference, wide=wide)
    except StoreError as e:  # a record the summary cannot read (a bad line, field or value): nothing was written,
        raise UserError(str(e)) from None  # so the last good summary stays, and the line names the record and field
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
    from ..eval.identity import read_run_config

    read_run_config(run_dir)  # a config.json that is not JSON: one line, not a page without its settings


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run folder written by `vase eval`.")],
    out: Annotated[Optional[Path], typer.Option(help="HTML file to write (default RUN_DIR/report.html).")] = None,
    inspect: Annotated[Optional[list[Path]], typer.Option(help="`vase inspect` output folders whose kept-token "
                                                          "maps to show (RUN_DIR/inspect/ is always searched).")]
    = None,
) -> None:
    """The run as one self-contained HTML page: table with paired intervals, plots, per-problem drill-down."""
    from ..eval.html import write_report

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
