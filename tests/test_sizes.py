"""The harness stays in small pieces (issue 43): no module over 500 lines, no function over 80, in the folders
eval/, bench/, analysis/, cli/ and engines/. A split gives each new module one job and a name saying it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "vase"
HARNESS = ("eval", "bench", "analysis", "cli", "engines")
MAX_MODULE, MAX_FUNCTION = 500, 80


def _modules() -> list[Path]:
    return sorted(p for folder in HARNESS for p in (SRC / folder).glob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_harness_modules_and_functions_are_small(path):
    text = path.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= MAX_MODULE, f"{path.name}: {lines} lines (at most {MAX_MODULE}): split it by job"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION} lines: {long}"
