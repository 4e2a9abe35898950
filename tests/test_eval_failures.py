"""Failure classes: the rules on hand-made edge cases, and the confusion counts on a labelled fixture.

tests/fixtures/failures.jsonl holds constructed completions (``source: constructed``) and real ones
from runs of the embedded SmolLM2-135M (``source: real ...``), each labelled by hand.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from vase.eval.failures import (
    FAILURE_CLASSES,
    classify_failure,
    has_loop,
    is_garbage,
    is_truncated,
    loop_start,
)

FIXTURE = Path(__file__).parent / "fixtures" / "failures.jsonl"


def load_fixture() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_classes_tuple() -> None:
    assert FAILURE_CLASSES == ("garbage", "phrase_loop", "truncated", "ok")


def test_fixture_confusion_counts() -> None:
    entries = load_fixture()
    assert len(entries) >= 30 and sum(e["source"].startswith("real") for e in entries) >= 10
    confusion = Counter((e["label"], classify_failure(e["text"], e["hit_length_cap"])) for e in entries)
    # (label, predicted) -> count.
    assert dict(confusion) == EXPECTED_CONFUSION, dict(confusion)
    assert sum(EXPECTED_CONFUSION.values()) == len(entries)


# Measured on the 47 entries (26 constructed, 21 real). The one miss is real: "Then, we multiply 1.33 by
# 1.33, which equals 1.33. Finally, we multiply ..." varies its first word, then leaves the loop for
# "So, the final answer is" at the cap: neither sentence blocks nor back-to-back phrases repeat exactly.
EXPECTED_CONFUSION = {
    ("phrase_loop", "phrase_loop"): 8,
    ("phrase_loop", "truncated"): 1,
    ("ok", "ok"): 22,
    ("truncated", "truncated"): 10,
    ("garbage", "garbage"): 6,
}


def test_sentence_loop_with_changing_numbers() -> None:
    text = "Let me count. " + " ".join(f"She has now {n} - 1 = {n - 1} cards remaining." for n in range(16, 12, -1))
    assert has_loop(text)  # 4 copies once digits are normalised
    three = "Let me count. " + " ".join(f"She has now {n} - 1 = {n - 1} cards remaining." for n in range(16, 13, -1))
    assert not has_loop(three)  # a 40-character block needs 4 copies
    assert loop_start(text) == len("Let me count. ")


def test_long_block_needs_three_copies_and_must_reach_the_end() -> None:
    para = "To find the total we multiply the number of boxes by the coins in each box and add the rest. "
    assert len(para) >= 80
    assert has_loop("Intro. " + para * 3)
    assert not has_loop("Intro. " + para * 2)
    assert not has_loop("Intro. " + para * 5 + "Then the answer is different, so we stop here. The answer is 4.")


def test_loop_cut_mid_copy_by_the_cap() -> None:
    assert has_loop("Intro. " + "We know that the red box holds 12 coins. " * 4 + "We know that the re")
    assert has_loop("so " + "and then " * 6 + "and th")


@pytest.mark.parametrize("text", [
    "The matrix is\n" + "\n".join(["[0, 0, 0]"] * 10),
    "1/3 = 0." + "3" * 200,
    " + ".join(["1"] * 80),
    "x = " + " + ".join(["\\frac{1}{3}"] * 8),
    "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0",
])
def test_no_false_loop_or_garbage_on_number_patterns(text: str) -> None:
    assert classify_failure(text, hit_length_cap=False) == "ok"


def test_no_garbage_on_code_or_other_scripts() -> None:
    code = "def f(x):\n" + "".join(f"        if x > {i}:\n            return g(x, {i})\n" for i in range(5))
    assert not is_garbage(code + " " * 150)
    assert not is_garbage("这是一个用中文写的推理过程，我们先计算每个盒子里的硬币，然后把它们加起来得到答案。" * 2)
    assert not is_garbage("Ответ: сначала считаем монеты, потом складываем их. Итого двадцать семь монет.")
    assert not is_garbage("Die Antwort lautet: zuerst zählen wir die Münzen, dann addieren wir. Ergebnis: 27.")


def test_garbage_rules() -> None:
    assert is_garbage("The box has " + "\ufffd" * 6)
    assert not is_garbage("The box has " + "\ufffd" * 5)
    assert is_garbage("x" + "жд漢字αβابكم" * 12)  # Cyrillic, CJK, Greek, Arabic mixed
    assert is_garbage("so\n" + "####\n" * 20)  # 80 '#' of 80 non-space characters
    assert not is_garbage("|---|---|---|\n" * 3)  # a table rule: too few to be garbage


def test_truncated_and_order() -> None:
    body = "We reason about the boxes one at a time and keep going"
    assert is_truncated(body, hit_length_cap=True)
    assert not is_truncated(body, hit_length_cap=False)
    assert classify_failure(body, hit_length_cap=True) == "truncated"
    assert classify_failure(body, hit_length_cap=True, end_marker="</think>") == "truncated"
    assert classify_failure("<think>" + body + "</think> 3", hit_length_cap=True, end_marker="</think>") == "ok"
    loop = "Intro. " + "Let me check the answer again. " * 6
    assert classify_failure(loop, hit_length_cap=True) == "phrase_loop"  # a loop wins over truncated
