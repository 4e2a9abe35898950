"""`make docs` redraws the tables and nothing else: in a fresh clone (pyproject.toml newer than .venv's stamp) it
must not rebuild the venv first."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_docs_does_not_reinstall_the_venv_when_pyproject_is_newer(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    stamp = tmp_path / ".venv" / ".installed"
    stamp.write_text("")
    (tmp_path / "pyproject.toml").write_text("")
    os.utime(stamp, (1_000_000, 1_000_000))  # the stamp older than pyproject.toml, as in a fresh clone
    out = subprocess.run(["make", "-n", "docs"], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert "scripts/render_docs.py" in out and ".venv/bin/python" in out
    assert "pip" not in out and "venv" not in out.replace(".venv/bin/python", ""), out
    # without a venv it uses $(PY), still without installing anything
    shutil.rmtree(tmp_path / ".venv")
    out = subprocess.run(["make", "-n", "docs", "PY=python3.99"], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    assert "python3.99 scripts/render_docs.py" in out and "pip" not in out, out


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_runs_the_suite_in_two_xdist_workers_a_file_each():
    """`make test` and `make test-tf-latest` split the suite by file over 2 pytest-xdist workers (the dev extra has
    pytest-xdist); TEST_WORKERS=0 runs it serially, in one process."""
    def dry(*args: str) -> str:
        # -o: take the venv stamps as up to date, so that a dry run prints only the test command
        # --no-print-directory: run from `make test` this is a sub-make, which would print "make[1]: Leaving ..."
        return subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "-o",
                               ".venv-tf-latest/.installed", *args],
                              cwd=REPO, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    assert dry("test") == ".venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder"
    assert dry("test-tf-latest").startswith(".venv-tf-latest/bin/python -m pytest -n 2 --dist loadfile "
                                            "--no-loadscope-reorder ")
    assert dry("test", "TEST_WORKERS=0") == ".venv/bin/python -m pytest -p no:xdist"
    assert '"pytest-xdist' in (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]


def test_the_slow_files_named_first_exist():
    """tests/conftest.py's SLOW_FIRST (the files `make test` hands out first) names test files that exist, each once:
    a renamed or split file must be named again, or it would silently go back to the end of the order."""
    from tests.conftest import SLOW_FIRST

    assert len(set(SLOW_FIRST)) == len(SLOW_FIRST)
    assert [name for name in SLOW_FIRST if not (REPO / "tests" / name).is_file()] == []
