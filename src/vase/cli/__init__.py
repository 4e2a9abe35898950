"""The `vase` command: methods, generate, eval, summarize, report, bench, serve, inspect, analyze.

One module per command group, each command a thin layer over a library function: :mod:`.methods`,
:mod:`.generate` (over :mod:`vase.generation.batched`), :mod:`.evaluate` (eval, summarize, report), :mod:`.bench`,
:mod:`.serve`, :mod:`.analyze` (inspect and the analyze studies). :mod:`.common` holds what they share
(consoles, option types, checks before any model loads); :mod:`.main` assembles the app. Nothing here
imports transformers or vLLM until a command needs a model. The helpers that lived in the old
``vase/cli.py`` are re-exported, so ``from vase.cli import checked_params`` keeps working.
"""

from __future__ import annotations

from vase.core.lazy import lazy_exports

# Imported on first use, so that the console script (:mod:`.entry`) can answer a core install's missing
# typer/rich in one line before anything here loads them.
_LAZY = {
    "UserError": "common", "console": "common", "err_console": "common", "check_range": "common",
    "checked_params": "common", "given": "common", "parse_params": "common", "quant_options": "common",
    "split_list": "common", "warn": "common", "eval_params": "evaluate", "read_prompts": "generate",
    "app": "main", "main": "main",
}
__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
