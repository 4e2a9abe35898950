"""Grading: answer extraction and math-verify equivalence."""

from __future__ import annotations

import threading

import pytest

from vase.eval.grading import (
    answers_match,
    extract_answer,
    gold_for_parse,
    is_correct,
    last_boxed,
    last_number,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{3}, final \\boxed{5}", "5"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped set braces do not close the box
        ("\\boxed {7}", "7"),
        ("\\fbox{8}", "8"),
        ("\\boxed 9.", "9"),
        ("done \\boxed{4} then \\boxed{\\frac{1}{", "4"),  # unfinished last box is skipped
        ("within \\boxed{}. so \\boxed{6}", "6"),
        ("put it in \\boxed{} please", None),  # empty box (the prompt's echo) is no answer
        ("no box, the answer is 12", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_extract_answer_numeric_fallback_is_explicit() -> None:
    text = "She has 3 + 4 = 7 apples, then 1,234 coins in total."
    assert extract_answer(text) is None
    assert extract_answer(text, numeric_fallback=True) == "1234"
    assert extract_answer("x \\boxed{5} and 9", numeric_fallback=True) == "5"  # box wins
    assert last_number("values -3.5 and -2") == "-2"
    assert last_number("no digits") is None


@pytest.mark.parametrize(
    "pred, gold, ok",
    [
        ("The answer is \\boxed{18}.", "18", True),
        ("The answer is \\boxed{17}.", "18", False),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", True),
        ("\\boxed{\\frac{14}{3}}", "\\frac{13}{3}", False),
        ("\\boxed{1,234}", "1234", True),  # gsm8k golds are stored without commas
        ("\\boxed{1234}", "1,234", True),  # ... but a comma gold still works
        ("\\boxed{1,450,000}", "1450000", True),
        ("\\boxed{\\$18}", "18", True),
        ("\\boxed{(3,\\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
        ("\\boxed{\\text{(C)}}", "\\text{(C)}", True),
        ("the answer is 18", "18", True),  # an explicit "the answer is N" counts without a box
        ("The final answer is: 1,234.", "1234", True),
        ("so #### 18\nmore text with 3", "18", True),  # GSM8K's marker, wherever the text goes on
        ("The answer is 17.\nThe answer is 18", "18", True),  # the last statement wins
        ("so she has 18 eggs", "18", False),  # a bare number: wrong unless the fallback is on
        ("", "18", False),
        ("\\boxed{x^2+", "5", False),
    ],
)
def test_is_correct(pred: str, gold: str, ok: bool) -> None:
    assert is_correct(pred, gold) is ok


def test_is_correct_fallback() -> None:
    assert is_correct("so she has 18 eggs", "18", numeric_fallback=True)
    assert not is_correct("so she has 17 eggs", "18", numeric_fallback=True)


def test_gold_wrapping() -> None:
    assert gold_for_parse("18") == "\\boxed{18}"
    assert gold_for_parse("1,234") == "\\boxed{1234}"
    assert gold_for_parse("$x$") == "$x$"
    assert gold_for_parse("\\boxed{3}") == "\\boxed{3}"


def test_garbage_never_crashes() -> None:
    for pred in ["\\boxed{\\frac{", "\\boxed{}}}}", "\\boxed{" + "(" * 60 + "}", "\\boxed{\x00\x01}"]:
        assert is_correct(pred, "1") in (True, False)
    assert answers_match("}{", "{}") is False


def test_works_outside_main_thread() -> None:
    # math-verify's signal-based timeout raises in worker threads unless switched off.
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.append(is_correct("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert results == [True]
