"""Failure classes on crafted completions, including the boundaries of each rule."""

from __future__ import annotations

import random
import time

import pytest

from vase.eval.failures import (
    FAILURE_CLASSES,
    classify_failure,
    has_phrase_loop,
    is_garbage,
)


def filler(n: int, seed: int = 0) -> str:
    """Non-repeating lowercase ASCII text: random letters and spaces, no loops, no dominant char."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def test_classes_tuple() -> None:
    assert FAILURE_CLASSES == ("garbage", "phrase_loop", "truncated", "ok")


def test_ok_and_filler_is_clean() -> None:
    text = filler(2000) + " so the answer is \\boxed{42}."
    assert classify_failure(text, hit_length_cap=False) == "ok"
    assert classify_failure("5", hit_length_cap=False) == "ok"  # short is not garbage
    assert classify_failure("", hit_length_cap=False) == "ok"


@pytest.mark.parametrize("n_non_ascii, expected", [(30, "ok"), (31, "garbage")])
def test_non_ascii_boundary(n_non_ascii: int, expected: str) -> None:
    # Interleave the non-ASCII characters with ASCII filler inside the last 100 characters.
    chars = ["é"] * n_non_ascii + list(filler(100 - n_non_ascii, seed=1))
    random.Random(2).shuffle(chars)
    text = filler(300, seed=3) + "".join(chars)
    assert sum(ord(c) > 127 for c in text[-100:]) == n_non_ascii
    assert classify_failure(text, hit_length_cap=False) == expected


def test_non_ascii_before_window_does_not_count() -> None:
    text = "é" * 80 + filler(100, seed=4)
    assert not is_garbage(text)


@pytest.mark.parametrize("count, expected", [(100, False), (101, True)])
def test_dominant_char_boundary(count: int, expected: bool) -> None:
    chars = ["x"] * count + list(filler(200 - count, seed=5).replace("x", "y"))
    random.Random(6).shuffle(chars)
    text = filler(500, seed=7) + "".join(chars)
    assert is_garbage(text) is expected


def test_dominant_char_is_garbage_before_loop() -> None:
    # "!!!!" also contains a repeated 10-char unit; garbage is checked first.
    assert classify_failure(filler(300) + "!" * 300, hit_length_cap=True) == "garbage"


@pytest.mark.parametrize("copies, expected", [(4, "ok"), (5, "phrase_loop"), (12, "phrase_loop")])
def test_phrase_loop_copies_boundary(copies: int, expected: str) -> None:
    # Digits around a letters-only phrase: no rotation of the phrase extends the run.
    phrase = "wait, so we"  # 11 characters
    text = filler(300, seed=8) + "7" + phrase * copies + "31415926535"
    assert classify_failure(text, hit_length_cap=False) == expected


@pytest.mark.parametrize("unit_len, expected", [(9, False), (10, True), (40, True), (41, False)])
def test_phrase_loop_unit_length(unit_len: int, expected: bool) -> None:
    # A unit of all-distinct characters has no shorter period, so 5 copies of a 9-char unit
    # (45 chars) hold no 10-40 char unit 5 times (an 18-char one would need 90 chars), and
    # 5 copies of a 41-char unit hold none either.
    alphabet = [chr(c) for c in range(0x21, 0x7F) if not chr(c).isdigit()]
    unit = "".join(random.Random(unit_len).sample(alphabet, unit_len))
    assert has_phrase_loop("0" + unit * 5 + "1") is expected


def test_short_unit_loop_counts_when_long_enough() -> None:
    # "ab" x 25 = 50 chars holds "ababababab" (10 chars) x 5: a loop by the definition.
    assert has_phrase_loop("0" + "ab" * 25 + "1")
    assert not has_phrase_loop("0" + "ab" * 24 + "1")


def test_loop_across_lines() -> None:
    assert has_phrase_loop(filler(100) + "Let me check.\n" * 6)


def test_loop_outside_last_500_does_not_count() -> None:
    loop = "Let me recompute. " * 20
    assert classify_failure(loop + filler(500, seed=9), hit_length_cap=False) == "ok"
    # Five whole copies reaching into the window still count.
    assert classify_failure(loop + filler(400, seed=9), hit_length_cap=False) == "phrase_loop"


def test_loop_wins_over_truncated() -> None:
    text = filler(200) + "and then again " * 10
    assert classify_failure(text, hit_length_cap=True, end_marker="</think>") == "phrase_loop"


def test_truncated() -> None:
    body = filler(1000, seed=10)
    assert classify_failure(body, hit_length_cap=True) == "truncated"
    assert classify_failure(body, hit_length_cap=False) == "ok"
    assert classify_failure(body, hit_length_cap=True, end_marker="</think>") == "truncated"
    done = "<think>" + body + "</think> the answer is \\boxed{3}"
    assert classify_failure(done, hit_length_cap=True, end_marker="</think>") == "ok"
    assert classify_failure(body, hit_length_cap=False, end_marker="</think>") == "ok"


def test_loop_check_is_fast() -> None:
    # Near-loops (4 copies, then a break) at every offset are the regex's worst case.
    rng = random.Random(11)
    parts = []
    while sum(map(len, parts)) < 5000:
        unit = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(10, 40)))
        parts.append(unit * 4 + "#")
    text = "".join(parts)
    t0 = time.perf_counter()
    for _ in range(100):
        classify_failure(text, hit_length_cap=True)
    assert (time.perf_counter() - t0) / 100 < 0.05
