"""docs/architecture.md draws src/vase as it is: its layers drawing names every top-level entry of the package and
nothing else, in the order of the import layers (`tests/test_import_graph.LAYERS`), and the page names every
module."""

from __future__ import annotations

import re
from pathlib import Path

from .test_import_graph import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "vase"
PAGE = ROOT / "docs" / "architecture.md"
MARKER = "<!-- layers:"


def drawn_layers(text: str) -> list[list[str]]:
    """The layers drawing (the code block after the marker), top first: each line's entries (`core/`, `__init__.py`)."""
    block = text.split(MARKER, 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines() if line.strip()]
    out = []
    for line in lines:
        entries = []
        for word in line.split():
            if re.fullmatch(r"\w+/|\w+\.py", word):
                entries.append(word)
            else:
                break
        out.append(entries)
    return out


def package_entries() -> set[str]:
    """src/vase's top-level entries: its packages (`core/`) and modules (`__init__.py`)."""
    return ({f"{d.name}/" for d in PKG.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
            | {p.name for p in PKG.glob("*.py")})


def test_the_drawing_parses_lines_of_entries():
    text = f"{MARKER} -->\n```\ncli/     the command\nbench/ analysis/   harness\n__init__.py  face\n```\n"
    assert drawn_layers(text) == [["cli/"], ["bench/", "analysis/"], ["__init__.py"]]


def test_the_drawing_names_every_top_level_entry_and_nothing_else():
    drawn = [e for line in drawn_layers(PAGE.read_text()) for e in line]
    assert len(drawn) == len(set(drawn)), f"drawn twice: {sorted(e for e in drawn if drawn.count(e) > 1)}"
    actual = package_entries()
    assert not actual - set(drawn), f"docs/architecture.md's layers drawing lacks: {sorted(actual - set(drawn))}"
    assert not set(drawn) - actual, f"docs/architecture.md draws what src/vase lacks: {sorted(set(drawn) - actual)}"
    assert len(actual) <= 14, f"src/vase has {len(actual)} top-level entries: a newcomer meets them all"


def test_the_drawing_is_the_import_layers():
    drawn = [{("vase" if e == "__init__.py" else "vase." + e.rstrip("/")) for e in line}
             for line in drawn_layers(PAGE.read_text())]
    assert drawn == [set(layer) for layer in reversed(LAYERS)]


def test_the_page_names_every_module():
    text = PAGE.read_text()
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.name == "__init__.py":
            continue
        if len(rel.parts) == 1 or rel.parts[0] in ("core", "files", "hf", "storage", "caches", "generation"):
            if rel.parts[:2] == ("core", "policies"):  # one file per method: the folder is named
                continue
            if f"src/vase/{rel.as_posix()}" not in text:
                missing.append(f"src/vase/{rel.as_posix()}")
        elif not re.search(rf"\b{re.escape(rel.stem)}\b", text):  # a package's module, by its name
            missing.append(f"src/vase/{rel.as_posix()}")
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"
