"""The light modules stay light: each imports in a fresh interpreter without transformers or vLLM (issue 17).

`vase serve`, `vase --help`, config checks, reports and the pure core must answer without the model stack;
the heavy parts (loading, generation, the plugin's workers) import it only when they run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Public modules that must import without transformers and vLLM (torch is allowed).
LIGHT_MODULES = [
    "vase",
    "vase.core.policies",
    "vase.core.schedule",
    "vase.core.checks",
    "vase.hf.support",
    "vase.storage.packing",
    "vase.models",
    "vase.generation.batched",
    "vase.eval.config",
    "vase.eval.tasks",
    "vase.eval.synthetic",
    "vase.eval.table",
    "vase.eval.render",
    "vase.eval.plots",
    "vase.eval.report",
    "vase.eval.html",
    "vase.vllm.serve",
    "vase.cli",
]

HEAVY = ("transformers", "vllm")

#: One interpreter imports torch (allowed, and most of each probe's time), then forks a fresh child per module: the
#: child imports the module and prints the heavy modules it then holds.
_PROBE = """
import importlib, json, os, sys
import torch
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
            found = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})[:5]
        except BaseException as exc:
            found = "import failed: " + repr(exc)
        print(json.dumps([module, found]), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
""".format(heavy=HEAVY)


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    """Per module, the heavy modules a fresh interpreter (forked once torch is imported) holds after importing it."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, *LIGHT_MODULES], capture_output=True, text=True,
                          env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-800:]
    results = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
    assert set(results) == set(LIGHT_MODULES), proc.stderr[-800:]
    return results


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_module_imports_neither_transformers_nor_vllm(module, imported):
    assert imported[module] == [], f"import {module} pulled in {imported[module]}"


#: what only the extras install (cli, eval, vllm) and the harness packages: the core must not import them
EXTRAS_ONLY = ("typer", "rich", "matplotlib", "math_verify", "vllm", "vase.cli", "vase.eval", "vase.bench",
               "vase.analysis")

_CORE_PROBE = """
import json, sys
import vase
vase.EvictionCache, vase.generate, vase.CompiledEvictionCache
print(json.dumps(sorted(m for m in sys.modules if m.startswith({extras!r}))[:8]))
""".format(extras=EXTRAS_ONLY)


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def test_core_api_imports_no_extra_and_no_harness():
    """`import vase` and its public classes work on `pip install vase` alone (issue 43)."""
    proc = subprocess.run([sys.executable, "-c", _CORE_PROBE], capture_output=True, text=True, env=_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-800:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_console_script_without_cli_extra_says_which_extra():
    """With typer missing, `vase` exits with one line naming `vase[cli]`, not a traceback."""
    code = "import sys; sys.modules['typer'] = None; sys.argv = ['vase', '--help']; from vase.cli.entry import main; main()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "vase: the command needs 'typer', which a core install lacks: pip install 'vase[cli]'"]


def test_console_script_names_the_eval_extra_when_a_harness_package_is_missing(monkeypatch, capsys):
    """A command that reaches for math-verify or matplotlib on a core install ends in one line naming `vase[eval]`;
    any other missing module is not hidden."""
    import importlib

    from vase.cli import entry

    cli_main_module = importlib.import_module("vase.cli.main")

    def needs(name):
        def run():
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return run

    monkeypatch.setattr(cli_main_module, "main", needs("math_verify"))
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert stop.value.code == "vase: the command needs 'math_verify', which a core install lacks: pip install 'vase[eval]'"
    monkeypatch.setattr(cli_main_module, "main", needs("not_a_vase_extra"))
    with pytest.raises(ModuleNotFoundError):
        entry.main()
