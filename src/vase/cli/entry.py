"""The `vase` console script: the CLI, or one line naming the extra when it is not installed.

Imports nothing of the CLI before it runs (`vase.cli` loads its names on first use), so that a core-only
install (`pip install vase`) answers `pip install 'vase[cli]'` instead of a traceback when typer or rich is
missing.
"""

from __future__ import annotations

import sys

#: top-level packages the `vase` command needs -> the extra that installs them
CLI_NEEDS = {"typer": "cli", "rich": "cli", "yaml": "cli"}


def main() -> None:
    """Run the `vase` command; exit 1 with one line when the `cli` extra is missing."""
    try:
        from vase.cli.main import main as cli_main
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in CLI_NEEDS:
            raise
        sys.exit(f"vase: the command needs {missing!r}, which a core install lacks: "
                 f"pip install 'vase[{CLI_NEEDS[missing]}]'")
    cli_main()
