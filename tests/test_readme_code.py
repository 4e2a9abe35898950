"""README.md's Python code blocks run as written (the quick start), on a tiny random model in place of the
embedded one and with short generations. A block that imports vLLM is left to tests/test_vllm*.py (it starts
an engine, minutes on a CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import vase.models
from tests.helpers_tiny import tiny_model_and_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# What the test changes in a block: the model (no download, no 135M load) and the lengths (seconds, not minutes).
SUBSTITUTIONS = {"max_new_tokens=2048": "max_new_tokens=24"}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_readme_has_a_python_quick_start():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert any("vase.generate(" in b for b in blocks)


@pytest.mark.parametrize("block", [b for b in python_blocks((ROOT / "README.md").read_text())
                                   if "vllm" not in b], ids=lambda b: b.split("\n")[0][:40])
def test_readme_python_block_runs_as_written(block, monkeypatch):
    monkeypatch.setattr(vase.models, "load_model", lambda *a, **k: tiny_model_and_tokenizer())
    for old, new in SUBSTITUTIONS.items():
        block = block.replace(old, new)
    scope: dict = {"__name__": "__readme__"}
    exec(compile(block, "README.md", "exec"), scope)  # a NameError here is an undefined name in the README
    if "keep" in scope:
        assert tuple(scope["keep"].shape) == (1, 3, 512)
    if "out" in scope:
        assert len(scope["out"].texts) == 1
