"""The `vase` command: methods, generate, eval, summarize, report, bench, serve, inspect, analyze.

One module per command group, each command a thin layer over a library function: :mod:`.methods`,
:mod:`.generate` (over :mod:`vase.generation.batched`), :mod:`.evaluate` (eval, summarize, report), :mod:`.bench`,
:mod:`.serve`, :mod:`.analyze` (inspect and the analyze studies). :mod:`.common` holds what they share
(consoles, option types, checks before any model loads); :mod:`.main` assembles the app. Nothing here
imports transformers or vLLM until a command needs a model. The helpers that lived in the old
``vase/cli.py`` are re-exported, so ``from vase.cli import checked_params`` keeps working.
"""

from __future__ import annotations

from .common import (UserError, check_range, checked_params, console, err_console, given, parse_params,
                     quant_options, split_list, warn)
from .evaluate import eval_params
from .generate import read_prompts
from .main import app, main

__all__ = ["app", "main", "UserError", "console", "err_console", "check_range", "checked_params", "given",
           "parse_params", "quant_options", "split_list", "warn", "eval_params", "read_prompts"]
