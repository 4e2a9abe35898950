"""The `vase` app: every command registered in --help's order, and the console entry point.

User errors end with one line on stderr and a non-zero exit; `--debug` shows the traceback.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Annotated, Optional

import typer
from typer.exceptions import TyperException

from .analyze import analyze_app, inspect
from .bench import bench
from .common import UserError, set_invocation
from .evaluate import evaluate, report, summarize
from .generate import generate
from .methods import methods
from .serve import serve

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Decode-time KV cache eviction for reasoning models (VaSE and baselines).")


@app.callback()
def _options(threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (default: torch's "
                                                            "choice). On a busy machine 1 is often faster.")] = None
             ) -> None:
    """Decode-time KV cache eviction for reasoning models (VaSE and baselines)."""
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        cap = max_threads()
        if threads > cap:  # torch accepts 100000 and the process dies (SIGSEGV) on its first parallel region
            raise UserError(f"--threads {threads} is more than this machine can use: at most {cap} (4 per CPU core, "
                            f"{cap // 4} cores here)")
        import torch

        torch.set_num_threads(threads)


def max_threads() -> int:
    """The most torch threads `--threads` accepts: 4 per CPU core this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return 4 * max(cores, 1)


app.command()(methods)
app.command()(generate)
app.command("eval")(evaluate)
app.command()(summarize)
app.command()(report)
app.command()(bench)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)
app.command()(inspect)
app.add_typer(analyze_app, name="analyze")


# -- entry point -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Console entry: one-line errors unless --debug."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("VASE_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    set_invocation(args)  # what a results file records as its command
    with warnings.catch_warnings():  # vase's own warnings as one line each; restored afterwards
        warnings.showwarning = _one_line_warning(warnings.showwarning)
        _run(args, debug)


def _one_line_warning(previous):
    """A showwarning that prints vase's own warnings as ``vase: warning: ...`` and hands others on."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the vase package: src/vase

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
