"""Failure classes: the rules on hand-made edge cases, and minimum precision and recall per class on
two labelled fixtures.

- tests/fixtures/failures.jsonl (the development set): constructed completions (``source: constructed``)
  and real ones from runs of the embedded SmolLM2-135M (``source: real ...``), labelled by hand. The
  rules were written while looking at it, so it only guards against regressions.
- tests/fixtures/failures_heldout.jsonl (the held-out set): 40 completions of real runs under eviction
  (embedded SmolLM2-135M, the embedded arith and recall tasks at small budgets), labelled by reading
  each text before the classifier was run on any of them; the rules were not changed afterwards.
  A second batch (2026-12-02, 72 more, greedy at B = 12 / 16: snapkv, streamingllm, vase-attnv, h2o, tova;
  commands in each item's ``source``) brought the loops to 8. The rules find 5 of them: the 3 they miss
  repeat a sentence whose words change from copy to copy ("He sold / has sold N shells to a customer."),
  which the sentence-loop rule (digits normalised, words exact) does not count. So loop recall is 0.62,
  below its 0.75 floor: that floor is a strict xfail until the rule learns near-copies (and is checked on
  a new held-out batch, since this one has now been seen).

Both assert floors, not counts: precision and recall of each class must reach the numbers in
``DEV_FLOORS`` / ``HELDOUT_FLOORS`` (fixed before the held-out items were classified).
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
HELDOUT = Path(__file__).parent / "fixtures" / "failures_heldout.jsonl"

#: class -> (minimum precision, minimum recall) on the development set.
DEV_FLOORS = {"phrase_loop": (0.85, 0.85), "truncated": (0.85, 0.85), "ok": (0.85, 0.85), "garbage": (0.85, 0.85)}
#: class -> (minimum precision, minimum recall) on the held-out set; a class is scored once it has
#: at least MIN_CLASS_ITEMS labelled items (fewer make a rate meaningless).
HELDOUT_FLOORS = {"phrase_loop": (0.80, 0.75), "truncated": (0.75, 0.75), "ok": (0.90, 0.90), "garbage": (0.50, 0.50)}
MIN_CLASS_ITEMS = 3


def load_fixture(path: Path = FIXTURE) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def precision_recall(pairs: list[tuple[str, str]], cls: str) -> tuple[float, float]:
    """(precision, recall) of `cls` over (label, predicted) pairs; 1.0 where nothing was predicted / labelled."""
    tp = sum(lab == cls and pred == cls for lab, pred in pairs)
    predicted = sum(pred == cls for _, pred in pairs)
    labelled = sum(lab == cls for lab, _ in pairs)
    return (tp / predicted if predicted else 1.0), (tp / labelled if labelled else 1.0)


def _check_floors(entries: list[dict], floors: dict[str, tuple[float, float]], min_items: int = 1,
                  waived_recall: frozenset[str] = frozenset()) -> dict:
    """Assert each class's floors (recall not asserted for `waived_recall`); returns class -> (precision, recall)."""
    pairs = [(e["label"], classify_failure(e["text"], e["hit_length_cap"])) for e in entries]
    scored = {}
    for cls, (p_min, r_min) in floors.items():
        if sum(lab == cls for lab, _ in pairs) < min_items:
            continue
        p, r = precision_recall(pairs, cls)
        scored[cls] = (p, r)
        r_min = 0.0 if cls in waived_recall else r_min
        assert p >= p_min and r >= r_min, (f"{cls}: precision {p:.2f} (floor {p_min}), recall {r:.2f} (floor {r_min}); "
                                           f"confusion {dict(Counter(pairs))}")
    return scored


def test_precision_recall_by_hand() -> None:
    pairs = [("ok", "ok"), ("ok", "truncated"), ("truncated", "truncated"), ("phrase_loop", "truncated")]
    assert precision_recall(pairs, "truncated") == (1 / 3, 1.0)
    assert precision_recall(pairs, "ok") == (1.0, 0.5)
    assert precision_recall(pairs, "phrase_loop") == (1.0, 0.0)
    assert precision_recall(pairs, "garbage") == (1.0, 1.0)


def test_classes_tuple() -> None:
    assert FAILURE_CLASSES == ("garbage", "phrase_loop", "truncated", "ok")


def test_development_fixture_floors() -> None:
    entries = load_fixture()
    assert len(entries) >= 30 and sum(e["source"].startswith("real") for e in entries) >= 10
    assert set(_check_floors(entries, DEV_FLOORS)) == set(FAILURE_CLASSES)


def test_heldout_fixture_is_real() -> None:
    entries = load_fixture(HELDOUT)
    assert len(entries) >= 40 and all(e["source"].startswith("real") for e in entries)
    assert len({e["text"] for e in entries}) == len(entries)  # no duplicates


#: Loop recall on the held-out set is below its floor (see the module docstring); everything else is asserted.
KNOWN_MISSES = frozenset({"phrase_loop"})


def test_heldout_fixture_floors() -> None:
    scored = _check_floors(load_fixture(HELDOUT), HELDOUT_FLOORS, MIN_CLASS_ITEMS, waived_recall=KNOWN_MISSES)
    assert set(scored) == set(FAILURE_CLASSES) - {"garbage"}  # no garbage in real runs yet: too few to score


# raises=AssertionError: only the floor's own assertion is the expected failure; a missing or unreadable fixture
# (FileNotFoundError, a JSON error) fails the test instead of reading as XFAIL.
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="held-out loop recall is 5/8 = 0.62 < 0.75: the 3 loops missed repeat a "
                                      "sentence whose words change between copies (module docstring)")
def test_heldout_loop_recall_floor() -> None:
    _check_floors(load_fixture(HELDOUT), {"phrase_loop": HELDOUT_FLOORS["phrase_loop"]}, MIN_CLASS_ITEMS)


def test_heldout_fixture_tests_more_than_the_length_cap() -> None:
    """The rule "capped -> truncated, else ok" misses a floor that the classifier meets: the held-out set
    checks more than the length cap."""
    entries = load_fixture(HELDOUT)
    cap_only = [(e["label"], "truncated" if e["hit_length_cap"] else "ok") for e in entries]
    pairs = [(e["label"], classify_failure(e["text"], e["hit_length_cap"])) for e in entries]
    beaten = [cls for cls, (p_min, r_min) in HELDOUT_FLOORS.items()
              if sum(lab == cls for lab, _ in pairs) >= MIN_CLASS_ITEMS
              and not (precision_recall(cap_only, cls)[0] >= p_min)
              and precision_recall(pairs, cls)[0] >= p_min]
    assert "truncated" in beaten, beaten  # a capped loop is not "truncated": only the classifier tells them apart


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
