"""Failure class of a completion, checked on the end of its text (ALGORITHMS.md section 7).

Classes, checked in this order (the first that applies wins):

- ``garbage``: more than 30 non-ASCII characters in the last 100, or one character making
  up more than half of the last 200 (i.e. more than 100 occurrences).
- ``phrase_loop``: a substring of 10 to 40 characters occurring 5 or more times in a row
  (5 consecutive copies) within the last 500 characters.
- ``truncated``: the length cap was hit and the end-of-thinking marker never appeared.
- ``ok``: none of the above.
"""

from __future__ import annotations

import re
from collections import Counter

__all__ = [
    "FAILURE_CLASSES",
    "is_garbage",
    "has_phrase_loop",
    "is_truncated",
    "classify_failure",
]

FAILURE_CLASSES: tuple[str, ...] = ("garbage", "phrase_loop", "truncated", "ok")

NON_ASCII_WINDOW = 100
NON_ASCII_MAX = 30
DOMINANT_WINDOW = 200
LOOP_WINDOW = 500
LOOP_MIN_LEN, LOOP_MAX_LEN = 10, 40
LOOP_MIN_COPIES = 5

# One copy captured, then at least 4 more back to back = 5 consecutive copies. DOTALL so a
# loop that spans lines (the usual case) is seen. The lazy group tries short units first,
# but any unit length works: a match exists iff some 10-40 char unit repeats 5 times.
_LOOP_RE = re.compile(
    rf"(.{{{LOOP_MIN_LEN},{LOOP_MAX_LEN}}}?)\1{{{LOOP_MIN_COPIES - 1},}}", re.DOTALL
)


def is_garbage(text: str) -> bool:
    """More than 30 non-ASCII characters in the last 100, or one character > half of the last 200.

    **Decision**: "over half of the last 200" is read as more than 100 occurrences, so a
    completion shorter than 200 characters (a bare "5") is not garbage just for being short.
    """
    tail = text[-NON_ASCII_WINDOW:]
    if sum(1 for c in tail if ord(c) > 127) > NON_ASCII_MAX:
        return True
    tail = text[-DOMINANT_WINDOW:]
    if not tail:
        return False
    (_, top), = Counter(tail).most_common(1)
    return top > DOMINANT_WINDOW // 2


def has_phrase_loop(text: str) -> bool:
    """A 10-40 character substring repeated 5+ times in a row within the last 500 characters.

    A loop that ended earlier than the last 500 characters does not count; one that runs
    into the window counts when 5 whole copies lie inside it.
    """
    return _LOOP_RE.search(text[-LOOP_WINDOW:]) is not None


def is_truncated(text: str, hit_length_cap: bool, end_marker: str | None = None) -> bool:
    """Length cap hit without the end-of-thinking marker (``end_marker=None``: the cap alone)."""
    if not hit_length_cap:
        return False
    return end_marker is None or end_marker not in text


def classify_failure(text: str, hit_length_cap: bool, end_marker: str | None = None) -> str:
    """Failure class of a completion: one of :data:`FAILURE_CLASSES`.

    ``hit_length_cap`` says whether generation stopped at ``max_new_tokens``;
    ``end_marker`` is the end-of-thinking marker (e.g. ``"</think>"``) when the model has one.
    """
    if is_garbage(text):
        return "garbage"
    if has_phrase_loop(text):
        return "phrase_loop"
    if is_truncated(text, hit_length_cap, end_marker):
        return "truncated"
    return "ok"
