"""The package's import graph has no cycle: every `from .x import` / `import vase.x`, at module level and inside
functions, read statically (AST) from src/vase, so a lazy import cannot hide a cycle either.

KNOWN_CYCLES is empty (the last one, generation <-> compiled, went when both took the shared decode pieces from
vase.generation.decoding): any cycle fails."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "vase"


def module_name(path: Path) -> str:
    """`src/vase/eval/runner.py` -> `vase.eval.runner`; a package's `__init__.py` -> the package."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in its body (module level, functions, methods, branches).

    `from .a import b` counts as importing `a.b` when that is a module, else `a`; `import vase.a.b` as `vase.a.b`.
    A package's `__init__` is not counted for its submodules (Python runs it, but that is no cycle of ours
    unless the `__init__` itself imports back, which its own edges show)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            names = [f"{target}.{a.name}" for a in node.names]
            subs = [n for n in names if n in modules]
            out.update(subs)
            if len(subs) < len(names) and target in modules:
                out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
    out.discard(me)
    return out


def import_graph() -> dict[str, set[str]]:
    files = sorted((SRC / PACKAGE).rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, modules) for p in files}


#: cycles that predate this test, as the set of modules on each (strongly connected components of the graph)
KNOWN_CYCLES: set[frozenset[str]] = set()


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The modules of each cycle: every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[frozenset[str]] = set()

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                out.add(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walk_sees_lazy_imports_and_finds_a_planted_cycle():
    graph = import_graph()
    assert "vase.storage.registry" in graph["vase.caches.eager"]  # the cache picks its storage through the registry
    assert "vase.storage.quantized" not in graph["vase.caches.eager"]  # and names no storage class
    assert "vase.generation.generate" in graph["vase.eval.runner"]  # imported inside functions only
    assert "vase.core.schedule" in graph["vase.vllm.stats"]  # `from .. import schedule`
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(planted) == ["a", "b", "c", "a"] and cycles(planted) == {frozenset("abc")}
    assert find_cycle({"a": {"b"}, "b": set()}) is None and cycles({"a": {"b"}, "b": set()}) == set()


def test_the_storages_meet_the_cache_without_a_cycle():
    graph = import_graph()
    assert "vase.caches.eager" not in graph["vase.storage.quantized"] and "vase.caches.eager" not in graph["vase.storage.protocol"]
    assert not any({"vase.caches.eager", "vase.storage.quantized"} & c for c in cycles(graph))


def test_the_package_has_no_import_cycle_but_the_known_ones():
    graph = import_graph()
    found = cycles(graph)
    new = found - KNOWN_CYCLES
    assert not new, "import cycle: " + "; ".join(" -> ".join(find_cycle({m: graph[m] & c for m in c})) for c in new)


#: The harness: it imports the core, never the other way (issue 28).
HARNESS = ("vase.eval", "vase.bench", "vase.analysis", "vase.cli")


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def library_imports_of_the_harness(graph: dict[str, set[str]]) -> list[str]:
    """Every `library -> harness` edge, as "importer -> imported" (the library: `vase` minus HARNESS)."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if not _in(m, HARNESS)
                  for t in targets if _in(t, HARNESS))


def test_the_library_imports_nothing_from_the_harness():
    graph = import_graph()
    assert "vase.core.spec" in graph["vase.caches.eager"]  # the walk sees the core's edges ...
    assert library_imports_of_the_harness({"vase.generation.batched": {"vase.eval.paired"}}) == ["vase.generation.batched -> vase.eval.paired"]
    assert library_imports_of_the_harness(graph) == []  # ... and none of them points up


def private_imports() -> list[str]:
    """Every `from vase.x import _name` (a module reaching into another's private names), as "module: name"."""
    out = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == PACKAGE):
                out += [f"{module_name(path)}: {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_test_oracles_live_under_tests():
    assert not (SRC / PACKAGE / "vllm" / "reference.py").exists()  # the paged-attention oracle is tests/vllm_reference.py


def test_one_atomic_file_writer():
    """Files are replaced in one place (`vase.files.atomic`); the model store's folder renames are another operation."""
    writers = sorted(module_name(p) for p in (SRC / PACKAGE).rglob("*.py")
                     if "os.replace(" in p.read_text() or ".replace(path)" in p.read_text())
    assert writers == ["vase.files.atomic"]


#: The layers of `src/vase`, from the ground up: a module imports its own layer and those below, never one above
#: (docs/architecture.md draws them, top first; tests/test_layout_doc.py holds the drawing to this). Folders of one
#: layer may import each other (no cycle: test_the_package_has_no_import_cycle_but_the_known_ones).
#: `vase` alone is `vase/__init__.py`, the public face, above the library's layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("vase.core",), ("vase.files",), ("vase.hf",), ("vase.models",), ("vase.storage",), ("vase.caches",),
    ("vase.generation", "vase.vllm"), ("vase.engines",), ("vase",), ("vase.eval",), ("vase.bench", "vase.analysis"),
    ("vase.cli",))


def layer_of(module: str) -> int:
    """The index in LAYERS of the deepest layer package holding `module` (`vase` alone: the public face)."""
    found = [i for i, layer in enumerate(LAYERS) for p in layer
             if (module == p or module.startswith(p + ".")) and p != "vase"]
    if found:
        return found[0]
    assert module == "vase", f"{module} is in no layer: add its folder to LAYERS (and to docs/architecture.md)"
    return next(i for i, layer in enumerate(LAYERS) if "vase" in layer)


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every edge from a lower layer to a higher one, as "importer -> imported"."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def test_every_import_runs_down_the_layers():
    graph = import_graph()
    assert back_arrows({"vase.core.spec": {"vase.storage.registry"}}) == ["vase.core.spec -> vase.storage.registry"]
    assert back_arrows(graph) == []


def test_the_core_imports_only_the_core():
    graph = import_graph()
    assert "vase.core.storage_specs" in graph["vase.core.spec"]  # the walk sees the core's own edges
    outside = sorted(f"{m} -> {t}" for m, targets in graph.items() if _in(m, ("vase.core",))
                     for t in targets if not _in(t, ("vase.core",)))
    assert outside == []


def test_import_vase_loads_no_harness():
    """`import vase` and its public names (EvictionCache, generate, ...) bring none of eval, bench, analysis, cli."""
    import subprocess
    import sys

    code = ("import sys, vase\n"
            "vase.EvictionCache, vase.generate, vase.CompiledEvictionCache, vase.get_policy\n"
            f"print(sorted(m for m in sys.modules if m.startswith({HARNESS!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(SRC)}).stdout.strip()
    assert out == "[]", out
