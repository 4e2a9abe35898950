"""docs/layout.md names every module and package of src/vase (a newcomer finds each one there)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layout_page_names_every_module():
    text = (ROOT / "docs" / "layout.md").read_text()
    pkg = ROOT / "src" / "vase"
    missing = [f"src/vase/{p.name}" for p in sorted(pkg.glob("*.py"))
               if not p.name.startswith("__") and f"src/vase/{p.name}" not in text]
    missing += [f"src/vase/{d.name}/" for d in sorted(pkg.iterdir())
                if d.is_dir() and (d / "__init__.py").exists() and f"src/vase/{d.name}/" not in text]
    assert not missing, f"docs/layout.md does not name: {', '.join(missing)}"
