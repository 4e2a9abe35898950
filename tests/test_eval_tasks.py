"""Task loading (fixtures in tmp_path, real files only if present), arith, and prompts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from vase.eval.grading import is_correct
from vase.eval.prompts import GSM8K_SUFFIX, MATH_SUFFIX, build_prompt, build_user_message
from vase.eval.tasks import (
    HUB_TASKS,
    TASK_NAMES,
    Problem,
    TaskError,
    apply_arith_op,
    load_jsonl_task,
    load_task,
    task_kind,
)

SHARED_DATA = Path("/work/shared/data")


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- arith


def test_arith_deterministic_and_seeded() -> None:
    a = load_task("arith", seed=3)
    b = load_task("arith", seed=3)
    assert len(a) == 200
    assert a == b
    assert load_task("arith", seed=4) != a
    assert load_task("arith", seed=3, limit=10) == a[:10]  # limit picks the first n
    assert len({p.id for p in a}) == 200


def solve_arith_text(question: str) -> int:
    """Independent solver: re-evaluate the steps from the question's words alone."""
    opening, *steps, _ = question.split(". ")
    value = int(re.fullmatch(r"\w+ has (\d+) \w+", opening).group(1))
    for sentence in steps:
        if m := re.search(r"(?:buys|finds|is given) (\d+) more", sentence):
            value += int(m.group(1))
        elif m := re.search(r"(?:gives away|loses|sells) (\d+)", sentence):
            value -= int(m.group(1))
        elif "doubles" in sentence:
            value *= 2
        elif "triples" in sentence:
            value *= 3
        elif "half" in sentence:
            assert value % 2 == 0
            value //= 2
        else:
            raise AssertionError(f"unknown step {sentence!r}")
        assert 1 <= value <= 200  # small, positive integers all the way
    return value


@pytest.mark.parametrize("name, steps", [("arith", 3), ("arith-1", 1), ("arith-5", 5), ("arith-40", 40)])
def test_arith_answers_are_exact(name: str, steps: int) -> None:
    problems = load_task(name, limit=50, seed=7)
    assert len(problems) == 50
    for p in problems:
        assert len(p.meta["ops"]) == steps
        assert p.question.count(". ") == steps + 1  # opening + one sentence per step
        assert p.answer == str(solve_arith_text(p.question))
        # meta's ops re-derive the same answer
        v = p.meta["start"]
        for op, k in p.meta["ops"]:
            v = apply_arith_op(v, op, k)
        assert str(v) == p.answer
        assert task_kind(p.task) == "gsm8k"
    # every kind of step shows up in a set of this size
    ops = {op for p in load_task(name, seed=7) for op, _ in p.meta["ops"]}
    assert ops == {"+", "-", "*", "/"}


def test_arith_bad_names() -> None:
    with pytest.raises(TaskError):
        load_task("arith-0")
    with pytest.raises(TaskError, match="unknown task"):
        load_task("arith-x")


# ----------------------------------------------------------------------------- hub formats


def test_gsm8k_format(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "gsm8k_test.jsonl", [
        {"question": "Q1?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "Q2?", "answer": "So 1000 + 234.\n#### 1,234"},
    ])
    ps = load_task("gsm8k", data_dir=tmp_path)
    assert [p.answer for p in ps] == ["7", "1234"]
    assert [p.id for p in ps] == ["gsm8k-0000", "gsm8k-0001"]
    assert ps[0] == Problem("gsm8k-0000", "Q1?", "7", "gsm8k", ps[0].meta)
    assert ps[1].meta["index"] == 1
    assert is_correct("\\boxed{1,234}", ps[1].answer)


def test_math500_format_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "math500_test.jsonl", [
        {"problem": "Half?", "solution": "long ... \\boxed{\\frac12}", "answer": "\\frac{1}{2}",
         "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
        {"problem": "Two?", "solution": "...", "answer": "2", "subject": "Algebra", "level": 2,
         "unique_id": "test/algebra/2.json"},
    ])
    monkeypatch.setenv("VASE_DATA_DIR", str(tmp_path))
    ps = load_task("math500", limit=1)
    assert len(ps) == 1
    p = ps[0]
    assert (p.id, p.question, p.answer, p.task) == ("test/algebra/1.json", "Half?", "\\frac{1}{2}", "math500")
    assert p.meta["subject"] == "Algebra" and p.meta["level"] == 1
    assert "solution" not in p.meta  # long fields are not carried along
    assert task_kind(p.task) == "math"


def test_aime_and_amc_formats(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "aime25.jsonl", [{"problem": "P", "answer": 70}, {"problem": "R", "answer": "588"}])
    ps = load_task("aime25", data_dir=tmp_path)
    assert [(p.id, p.answer) for p in ps] == [("aime25-0000", "70"), ("aime25-0001", "588")]
    # aime24 hub rows: integer ids and an answer only inside the solution's box
    (tmp_path / "aime24").mkdir()
    write_jsonl(tmp_path / "aime24" / "test.jsonl", [
        {"id": 60, "problem": "A", "solution": "\\boxed{204}"},
        {"id": 61, "problem": "B", "solution": "so \\boxed{25}"},
    ])
    ps = load_task("aime24", data_dir=tmp_path)
    assert [(p.id, p.answer) for p in ps] == [("aime24-60", "204"), ("aime24-61", "25")]
    write_jsonl(tmp_path / "amc23_test.jsonl", [{"id": 0, "question": "Q", "answer": 27.0},
                                                  {"id": 0, "question": "Q2", "answer": 3.0}])
    ps = load_task("amc23", data_dir=tmp_path)
    assert [p.id for p in ps] == ["amc23-0000", "amc23-0001"]  # duplicate ids: row index
    assert ps[0].question == "Q" and is_correct("\\boxed{27}", ps[0].answer)


def test_missing_local_file_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VASE_DATA_DIR", raising=False)
    # Simulate "no datasets installed" even where it is, so no network is touched.
    import builtins
    real_import = builtins.__import__

    def no_datasets(name: str, *a: Any, **k: Any) -> Any:
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(TaskError) as e:
        load_task("gsm8k", data_dir=tmp_path)
    msg = str(e.value)
    assert "gsm8k_test.jsonl" in msg and "--data-dir" in msg and "VASE_DATA_DIR" in msg
    assert "datasets" in msg and str(tmp_path) in msg
    assert isinstance(e.value, ValueError)


def test_unknown_task() -> None:
    with pytest.raises(TaskError, match="unknown task 'gsm9k'"):
        load_task("gsm9k")


# ----------------------------------------------------------------------------- any JSONL file


def test_custom_file_fields(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "mine.jsonl", [{"q": "What?", "gold": "\\sqrt{2}", "id": "x1"}])
    ps = load_task("mine", task_file=f, question_field="q", answer_field="gold")
    assert ps == [Problem("x1", "What?", "\\sqrt{2}", "mine", ps[0].meta)]
    assert load_jsonl_task(f, question_field="q", answer_field="gold")[0].task == "mine"
    # default field names: question/problem and answer
    g = write_jsonl(tmp_path / "plain.jsonl", [{"problem": "P?", "answer": "5"}])
    assert load_task("plain", task_file=g)[0].answer == "5"


def test_custom_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="not found"):
        load_task("x", task_file=tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{"question": oops}\n', encoding="utf-8")
    with pytest.raises(TaskError, match="line 2"):
        load_task("x", task_file=bad)
    f = write_jsonl(tmp_path / "f.jsonl", [{"q": "What?", "gold": "1"}])
    with pytest.raises(TaskError) as e:
        load_task("x", task_file=f, question_field="question", answer_field="gold")
    assert "'question'" in str(e.value) and "['gold', 'q']" in str(e.value)
    with pytest.raises(TaskError, match="no answer field"):
        load_task("x", task_file=f, question_field="q")
    with pytest.raises(TaskError, match="limit"):
        load_task("x", task_file=f, limit=-1)


# ----------------------------------------------------------------------------- real files


@pytest.mark.parametrize("name, rows", [("gsm8k", 1319), ("math500", 500), ("aime25", 30)])
def test_real_shared_files(name: str, rows: int) -> None:
    if not (SHARED_DATA / f"{name}_test.jsonl").is_file():
        pytest.skip("shared benchmark data not present")
    ps = load_task(name, data_dir=SHARED_DATA)
    assert len(ps) == rows
    assert len({p.id for p in ps}) == rows
    assert all(p.question and p.answer for p in ps)
    if name == "gsm8k":
        assert ps[0].answer == "18"
        assert all(re.fullmatch(r"-?\d+(\.\d+)?", p.answer) for p in ps)
        assert all(is_correct(f"so \\boxed{{{p.answer}}}", p.answer) for p in ps[:50])


# ----------------------------------------------------------------------------- names and prompts


def test_names_and_kinds() -> None:
    assert set(HUB_TASKS) == {"gsm8k", "math500", "aime24", "aime25", "amc23"}
    assert set(TASK_NAMES) == set(HUB_TASKS) | {"arith", "recall"}
    assert task_kind("gsm8k") == "gsm8k" and task_kind("arith-7") == "gsm8k"
    assert task_kind("recall") == "recall" and task_kind("recall-6") == "recall"
    assert {task_kind(n) for n in ("math500", "aime24", "aime25", "amc23", "custom")} == {"math"}


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> str:
        self.calls.append(kw)
        return "<user>" + messages[0]["content"] + "</user><assistant>"


def test_prompts() -> None:
    g = Problem("g", "How many?", "3", "gsm8k")
    m = Problem("m", "Solve x.", "1", "math500")
    a = Problem("a", "Mia has 2 apples.", "2", "arith-4")
    assert build_user_message(g) == "How many? Put your final answer within \\boxed{}."
    assert build_user_message(a).endswith(GSM8K_SUFFIX)
    assert build_user_message(m) == "Solve x.\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert MATH_SUFFIX.startswith("\n") and GSM8K_SUFFIX.startswith(" ")
    tok = FakeTokenizer()
    assert build_prompt(tok, m) == "<user>" + build_user_message(m) + "</user><assistant>"
    assert tok.calls[-1] == {"tokenize": False, "add_generation_prompt": True}
    build_prompt(tok, m, enable_thinking=False)
    assert tok.calls[-1]["enable_thinking"] is False
    assert build_prompt(tok, m, chat_template=False) == build_user_message(m)
    tok.chat_template = None
    assert build_prompt(tok, m) == build_user_message(m)
    assert build_prompt(None, m) == build_user_message(m)


def test_recall_task() -> None:
    from vase.eval.prompts import RECALL_SUFFIX
    from vase.eval.tasks import generate_recall

    a = load_task("recall", limit=5, seed=3)
    assert [p.id for p in a] == [f"recall-{i:04d}" for i in range(5)]
    assert load_task("recall", limit=3, seed=3) == a[:3]  # prefix-stable
    assert load_task("recall", limit=5, seed=4) != a
    for p in a:
        # The value is stated first, the question comes after the steps, and the answer is that value.
        m = re.match(r"(\w+) has a box with (\d+) coins\. ((?:Then \1 [a-z ]+\. ){4})How many coins are in the box\?$",
                     p.question)
        assert m is not None, p.question
        assert p.answer == m.group(2) and 11 <= int(p.answer) <= 99
        assert build_user_message(p) == p.question + RECALL_SUFFIX
        assert is_correct("1. ...\nThe answer is " + p.answer + ".", p.answer)
    assert len(generate_recall(2, steps=7)[0].question.split("Then ")) == 8
    assert load_task("recall-7", limit=2) == generate_recall(2, steps=7)
    with pytest.raises(TaskError):
        load_task("recall-0")
