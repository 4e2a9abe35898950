"""The `vase` console script: the CLI, or one line naming the extra when it is not installed.

Imports nothing of the CLI before it runs (`vase.cli` loads its names on first use), so that a core-only
install (`pip install vase`) answers `pip install 'vase[cli]'` instead of a traceback when typer or rich is
missing.
"""

from __future__ import annotations

import sys

#: top-level packages the `vase` command needs -> the extra that installs them (transformers 5 itself brings
#: typer, rich and pyyaml, so on a core install the command starts and a harness command names `eval`)
CLI_NEEDS = {"typer": "cli", "rich": "cli", "yaml": "cli", "math_verify": "eval", "matplotlib": "eval"}


def _missing_extra(exc: ModuleNotFoundError) -> str:
    """The one line for a package an extra installs; re-raise any other missing module."""
    missing = (exc.name or "").split(".")[0]
    if missing not in CLI_NEEDS:
        raise exc
    return f"vase: the command needs {missing!r}, which a core install lacks: pip install 'vase[{CLI_NEEDS[missing]}]'"


def main() -> None:
    """Run the `vase` command; exit 1 with one line when a package of the `cli` or `eval` extra is missing."""
    try:
        from vase.cli.main import main as cli_main
    except ModuleNotFoundError as exc:
        sys.exit(_missing_extra(exc))
    try:
        cli_main()
    except ModuleNotFoundError as exc:  # a harness command reaching for math-verify or matplotlib
        sys.exit(_missing_extra(exc))
