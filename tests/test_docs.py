"""Every figure table in README.md and docs/ is rendered from a results file (scripts/render_docs.py, `make docs`).

Fails when a table differs from what its results file renders, when a table has neither a results marker nor
the 'no measured figures' declaration, or when a results file lacks its provenance. Pure text: no model, fast.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts" / "render_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rd = _render_docs()


def test_every_table_in_the_docs_is_rendered_from_its_results_file():
    problems = rd.check(ROOT)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "results").glob("*.json")), ids=lambda p: p.name)
def test_results_files_carry_provenance(path):
    data = json.loads(path.read_text())
    prov = data["provenance"]
    assert isinstance(data["rows"], list) and prov.get("date") and prov.get("command"), path.name
    if prov.get("source", "").startswith("transcribed"):  # not rerun: when and where it was first published
        assert prov.get("commit") and prov.get("machine") and prov["transcribed"]["from"], path.name
    elif "collected" not in prov.get("source", ""):  # measured through vase.files.provenance
        assert prov.get("commit") and prov["machine"].get("cpu") and prov.get("versions"), path.name


def test_every_relative_link_in_the_docs_resolves():
    import re

    broken = []
    for doc in rd.doc_files(ROOT):
        for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
            target = m.group(1)
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _site(tmp_path: Path, doc: str, rows=None, table=None) -> Path:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    from vase.files.provenance import write_results

    write_results(tmp_path / "docs" / "results" / "x.json", rows or [{"method": "full", "tok/s": "16.45"}],
                  {"date": "2026-12-03", "commit": "abc", "machine": {"cpu": "cpu", "cores": 2}, "command": "vase bench"},
                  table=table)
    (tmp_path / "README.md").write_text(doc)
    return tmp_path


def test_a_changed_cell_an_unmarked_table_and_a_missing_file_are_each_caught(tmp_path):
    root = _site(tmp_path, "x\n\n<!-- results: docs/results/x.json -->\n<!-- /results -->\n")
    doc = root / "README.md"
    assert any("differs" in p for p in rd.check(root))  # not rendered yet
    doc.write_text(rd.render_text(doc.read_text(), doc, root))
    assert rd.check(root) == []
    text = doc.read_text()
    assert "| full | 16.45 |" in text and "Measured 2026-12-03 at commit abc" in text and "`vase bench`" in text
    doc.write_text(text.replace("16.45", "16.46"))  # a figure typed by hand
    assert [p for p in rd.check(root) if "README.md:3: the table differs" in p]
    doc.write_text(text + "\n| a | b |\n|---|---|\n| 1 | 2 |\n")  # a table with no marker
    assert [p for p in rd.check(root) if "no results marker" in p]
    doc.write_text(text + "\n<!-- table: no measured figures -->\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert rd.check(root) == []
    doc.write_text(text + "\n```\n| a | b |\n|---|---|\n```\n")  # an example in a code fence
    assert rd.check(root) == []
    doc.write_text(text.replace("docs/results/x.json", "docs/results/y.json"))
    assert [p for p in rd.check(root) if "does not exist" in p]


def test_the_eval_table_is_drawn_as_vase_eval_prints_it(tmp_path):
    from vase.eval.report import summary_rows

    from tests.test_eval_report import rec

    samples = [rec("full", None, f"p{i}", 0, True, 10, "1") for i in range(16)]
    samples += [rec("m", 50, f"p{i}", 0, i >= 4, 10, "1") for i in range(16)]
    rows = summary_rows(samples)
    root = _site(tmp_path, "<!-- results: docs/results/x.json -->\n<!-- /results -->\n", rows=rows,
                 table={"render": "eval"})
    block = rd.render_block("docs/results/x.json", root / "README.md", root)
    assert "| m | 50 | 16 | 75.0 | 100 | -25.0 [-50.0, -6.2] | 0.125 |" in block
    assert "\n- not distinguishable from full on accuracy at n = 16 problems" in block  # the verdict, as a list
    assert "\n- *Measured 2026-12-03 at commit abc*\n- cpu, 2 cores\n- `vase bench`\n- results: " in block
    assert max(map(len, block.split("\n")[-6:])) < 200  # the lines under the table stay short


def test_summary_rows_compute_the_median_and_range_of_paired_repeats(tmp_path):
    root = _site(tmp_path, "", rows=[{"round": str(i), "ratio": v} for i, v in enumerate(["0.9", "1.2", "1.0"])])
    lines = rd._summary_table([{"figure": "f", "file": "docs/results/x.json", "median": "ratio", "format": ".3f"}],
                              root)
    assert "| f | 1.000 | median of 3 paired repeats, range 0.900..1.200 |" in lines[2]
    # rows that are not rounds (one per method) are named as what they are
    lines = rd._summary_table([{"figure": "f", "file": "docs/results/x.json", "median": "ratio", "format": ".3f",
                                "over": "methods (each the median of its rounds)"}], root)
    assert "| f | 1.000 | median of 3 methods (each the median of its rounds), range 0.900..1.200 |" in lines[2]


def test_summary_ratio_of_two_rows_is_taken_within_each_round(tmp_path):
    # compiled vase vs eager full from one bench run: each round's ratio, not the ratio of sorted or median rates
    root = _site(tmp_path, "", rows=[{"method": "vase", "compiled": True, "tok_s_runs": "2;1;4"},
                                     {"method": "full", "compiled": False, "tok_s_runs": "1;2;2"}])
    spec = {"of": {"method": "vase"}, "to": {"method": "full"}, "rounds": "tok_s_runs"}
    lines = rd._summary_table([{"figure": "f", "file": "docs/results/x.json", "ratio": spec, "unit": "x"}], root)
    assert "| f | 2.00x | median of 3 paired rounds, range 0.50..2.00 (spans 1: no difference shown) |" in lines[2]


def test_summary_rows_read_a_bench_rows_median_and_its_range(tmp_path):
    root = _site(tmp_path, "", rows=[{"method": "full", "vs_full": 1.0, "vs_full_lo": 1.0, "vs_full_hi": 1.0, "repeats": 3},
                                     {"method": "snapkv", "vs_full": 1.03, "vs_full_lo": 0.99, "vs_full_hi": 1.081,
                                      "repeats": 3}])
    lines = rd._summary_table([{"figure": "f", "file": "docs/results/x.json", "where": {"method": "snapkv"},
                                "paired": "vs_full", "unit": "x"}], root)
    assert "| f | 1.03x | median of 3 paired rounds, range 0.99..1.08 (spans 1: no difference shown) |" in lines[2]


_BROKEN = {  # issue 40: each ended `make docs` in a Python traceback, or drew a table it should not have
    "truncated": (b'{"provenance": {"date": "2026", "command": "x"}, "rows": [{"a": 1', r"not valid JSON .*truncated"),
    "empty": (b"", r"the file is empty"),
    "listless": (b'{"provenance": {"date": "2026"}}', r"not a results file"),
    "list-shaped": (b'[{"a": 1}]', r"not a results file"),
    "rows-not-list": (b'{"provenance": {}, "rows": {"a": 1}}', r"'rows' must be a list of objects, got dict"),
    "non-utf8": (b'{"provenance": {}, "rows": [{"a": "caf\xe9"}]}', r"not UTF-8"),
    "empty-rows": (b'{"provenance": {"date": "2026", "commit": "abc"}, "rows": []}', r"'rows' is empty"),
    "not-a-number": (b'{"provenance": {"date": "2026", "commit": "abc"}, "rows": [{"m": "a", "r": "fast"}], '
                     b'"table": {"formats": {"r": ".2f"}}}', r"column 'r' holds 'fast', not a number"),
    "missing": (None, r"results file docs/results/x.json does not exist"),
}


@pytest.mark.parametrize("case", list(_BROKEN))
def test_a_broken_results_file_is_one_line_naming_it(case, tmp_path, capsys):
    content, want = _BROKEN[case]
    root = _site(tmp_path, "x\n\n<!-- results: docs/results/x.json -->\n<!-- /results -->\n")
    readme = (root / "README.md").read_text()
    path = root / "docs" / "results" / "x.json"
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content)
    assert rd.main(["--root", str(root)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("render_docs: error: README.md: "), err
    assert "docs/results/x.json" in err[0] and __import__("re").search(want, err[0]), err
    assert (root / "README.md").read_text() == readme  # nothing drawn from it
    [problem] = rd.check(root)  # --check names it the same way
    assert problem.startswith("README.md:3: ") and __import__("re").search(want, problem), problem


def test_a_dirty_results_file_is_flagged_and_needs_a_reason(tmp_path):
    root = _site(tmp_path, "<!-- results: docs/results/x.json -->\n<!-- /results -->\n")
    path = root / "docs" / "results" / "x.json"
    data = json.loads(path.read_text())
    data["provenance"]["dirty"] = True
    path.write_text(json.dumps(data))
    doc = root / "README.md"
    doc.write_text(rd.render_text(doc.read_text(), doc, root))
    assert [p for p in rd.check(root) if "x.json: measured from a checkout with uncommitted changes" in p]
    assert "**From a checkout with uncommitted changes**: *Measured" in doc.read_text()
    data["provenance"]["dirty_note"] = "the diff was a comment"
    path.write_text(json.dumps(data))
    doc.write_text(rd.render_text(doc.read_text(), doc, root))
    assert rd.check(root) == []
    assert "**From a checkout with uncommitted changes** (the diff was a comment): *Measured" in doc.read_text()


def test_a_figure_typed_in_prose_is_found_unless_pinned_to_a_file_that_holds_it(tmp_path):
    rows = [{"method": "full", "ratio": 1.065, "ms": 85.9, "share": 0.125}]
    root = _site(tmp_path, "", rows=rows)
    doc = root / "README.md"
    link = "[x.json](docs/results/x.json)"

    def problems(text):
        doc.write_text(text)
        return [p for p in rd.check(root) if "README.md" in p]

    assert [p for p in problems("It runs 1.07x faster.\n") if "'1.07x' is a measured figure outside" in p]
    assert problems("Settings only: `--budget 128`, 4x compression, a 16 x 256 run, B = 128.\n") == []
    # pinned by a marker or a link: each number must be one of the file's, as printed
    assert problems("<!-- figures: docs/results/x.json -->\nIt runs 1.065x (85.9 ms, 12.5 %).\n") == []
    assert problems(f"It runs 1.06x at 85.9 ms ({link}).\n") == []  # 1.065 shown to 2 digits is 1.06
    assert [p for p in problems(f"It runs 1.07x ({link}).\n") if "'1.07x' is not in" in p]  # rounded up by hand
    bad = problems(f"It runs 1.07-1.09x, 76-83 ms in every row ({link}).\n")
    assert [p for p in bad if "'1.07-1.09x' is not in docs/results/x.json" in p]
    assert [p for p in bad if "'76-83 ms' is not in" in p]
    # a pin holds until the paragraph ends
    assert [p for p in problems("<!-- figures: docs/results/x.json -->\n1.065x\n\nthen 2.5x\n") if "'2.5x'" in p]
    assert [p for p in problems("<!-- figures: docs/results/nope.json -->\n1.065x\n") if "not a readable" in p]


def test_summary_groups_intervals_and_a_range_spanning_one(tmp_path):
    root = _site(tmp_path, "", rows=[{"method": "m", "vs_full": 1.027, "vs_full_lo": 0.971, "vs_full_hi": 1.694,
                                      "repeats": 9, "d": -43.75, "lo": -68.75, "hi": -18.75}])
    f = "docs/results/x.json"
    lines = rd._summary_table([
        {"group": "speed", "figure": "a", "file": f, "paired": "vs_full", "unit": "x", "format": ".3f"},
        {"group": "speed", "figure": "b", "file": f, "paired": "vs_full", "unit": "x"},
        {"group": "accuracy", "figure": "c", "file": f, "cell": "d", "interval": ["lo", "hi"], "format": "+.1f"}], root)
    assert lines[0].startswith("| | figure | value |") and lines[1].startswith("|---|---|")
    assert lines[2].startswith("| **speed** | a | 1.027x | median of 9 paired rounds, range 0.971..1.694 "
                               "(spans 1: no difference shown) |")
    assert lines[3].startswith("|  | b | 1.03x |")  # the group named once
    assert lines[4].startswith("| **accuracy** | c | -43.8 | 95% interval -68.8..-18.8 |")
    assert "spans 1" not in rd._spans_one("median of 5 paired rounds, range 1.11..1.15", "x")


def test_every_benchmark_script_has_a_row_in_benchmarks_readme():
    import re

    readme = (ROOT / "benchmarks" / "README.md").read_text()
    rows = set(re.findall(r"^\| `([\w.]+\.py)` \|", readme, flags=re.M))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert not scripts - rows, f"add a row to benchmarks/README.md for: {sorted(scripts - rows)}"
    assert not rows - scripts, f"benchmarks/README.md has rows for scripts that are gone: {sorted(rows - scripts)}"
    broken = [t for t in re.findall(r"\]\(([^)\s#]+)", readme) if not (ROOT / "benchmarks" / t).exists()]
    assert not broken, f"benchmarks/README.md links that do not resolve: {broken}"
