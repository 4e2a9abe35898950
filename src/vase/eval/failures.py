"""Failure class of a completion, checked on the end of its text.

Classes, checked in this order (the first that applies wins):

- ``garbage``: the end of the text is not language: control, unassigned or replacement
  characters (more than 5 in the last 200), letters of 4 or more scripts mixed in the last 100
  letters, or one symbol (not a letter, digit or whitespace) making up more than half of the
  last 200 non-space characters. Indented code (whitespace) and text in any one script pass.
- ``phrase_loop``: the text ends in a repetition loop, at either of two scales, with every
  run of digits read as the same number (a loop that recounts "16 - 1 = 15" then "15 - 1 = 14"
  is still a loop):
  *sentence loop*: the last sentences (units ending in ``.``, ``!``, ``?`` or a newline) repeat
  a block of 1 to 8 sentences (8 to 400 characters) 4 or more times in a row (3 if the block is
  80 characters or longer), up to the end of the text (a trailing partial copy allowed);
  *phrase loop*: a 4 to 60 character unit repeated 5 or more times back to back up to the end
  (a trailing partial copy allowed), within the last 500 characters.
  Only units with words count (3+ letters outside LaTeX commands): a zero matrix, a repeating
  decimal or "1 + 1 + ... + 1" is not a loop.
- ``truncated``: the length cap was hit and the end-of-thinking marker never appeared.
- ``ok``: none of the above.

:func:`loop_start` is the one detector; ``vase inspect`` (:mod:`vase.analysis.loops`) uses it too.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

__all__ = [
    "FAILURE_CLASSES",
    "is_garbage",
    "has_loop",
    "has_phrase_loop",
    "is_truncated",
    "classify_failure",
]

FAILURE_CLASSES: tuple[str, ...] = ("garbage", "phrase_loop", "truncated", "ok")

GARBAGE_WINDOW = 200
BAD_CHARS_MAX = 5
SCRIPT_WINDOW = 100  # letters
SCRIPTS_MAX = 3
SYMBOL_MIN = 60  # a dominant symbol needs this many copies (a short "----" rule is fine)

SENTENCE_WINDOW = 3000  # characters of the tail searched for sentence loops
SENTENCE_MAX_PERIOD = 8  # sentences per repeated block
BLOCK_MIN_CHARS, BLOCK_MAX_CHARS = 8, 400
BLOCK_COPIES, LONG_BLOCK_COPIES, LONG_BLOCK_CHARS = 4, 3, 80
PHRASE_WINDOW = 500
PHRASE_MIN_LEN, PHRASE_MAX_LEN, PHRASE_COPIES = 4, 60, 5
MIN_LETTERS = 3

_DIGITS = re.compile(r"\d+")
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")
_SENTENCE = re.compile(r"[^.!?\n]*(?:[.!?]+|\n+)|[^.!?\n]+$")


def _script(c: str) -> str:
    """The script of a letter, from its Unicode name ("LATIN", "CJK", "CYRILLIC", ...)."""
    try:
        name = unicodedata.name(c)
    except ValueError:
        return "?"
    return name.split(" ", 1)[0]


def is_garbage(text: str) -> bool:
    """The end of ``text`` is not language (see the module docstring for the three rules)."""
    tail = text[-GARBAGE_WINDOW:]
    if not tail:
        return False
    bad = sum(1 for c in tail if c == "\ufffd" or (unicodedata.category(c) in ("Cc", "Cn", "Co", "Cs")
                                                   and c not in "\n\t\r"))
    if bad > BAD_CHARS_MAX:
        return True
    letters = [c for c in text[-4 * SCRIPT_WINDOW:] if c.isalpha()][-SCRIPT_WINDOW:]
    if len({_script(c) for c in letters}) > SCRIPTS_MAX:
        return True
    solid = [c for c in tail if not c.isspace()]
    if solid:
        (c, n), = Counter(solid).most_common(1)
        if not c.isalnum() and n >= SYMBOL_MIN and n > len(solid) // 2:
            return True
    return False


def _has_words(run: str, copies: int = 1) -> bool:
    """At least MIN_LETTERS letters per copy outside LaTeX commands (checked on the whole run, so a
    unit that starts inside ``\\frac`` does not count its tail as a word)."""
    return sum(c.isalpha() for c in _LATEX_CMD.sub("", run)) >= MIN_LETTERS * copies


def _sentence_loop(norm: str) -> int | None:
    """Start (in ``norm``) of a sentence-block loop running to the end, or None."""
    spans = [(m.start() + len(m.group()) - len(m.group().lstrip()), m.end())
             for m in _SENTENCE.finditer(norm) if m.group().strip()]
    units = [norm[a:b].strip() for a, b in spans]
    for p in range(1, SENTENCE_MAX_PERIOD + 1):
        for drop in (0, 1):  # the last sentence may be a copy cut short by the length cap
            n = len(units) - drop
            if n < 2 * p:
                continue
            if drop and not any(units[n - p + j].startswith(units[-1]) for j in range(p)):
                continue
            block = units[n - p:n]
            size = sum(len(u) + 1 for u in block)
            if not BLOCK_MIN_CHARS <= size <= BLOCK_MAX_CHARS or not _has_words(" ".join(block)):
                continue
            copies = 1
            while n - (copies + 1) * p >= 0 and units[n - (copies + 1) * p:n - copies * p] == block:
                copies += 1
            need = LONG_BLOCK_COPIES if size >= LONG_BLOCK_CHARS else BLOCK_COPIES
            if copies >= need:
                return spans[n - copies * p][0]
    return None


def _phrase_loop(norm: str) -> int | None:
    """Start (in ``norm``) of a short unit repeated back to back up to the end, or None.

    The text may stop inside a copy (the length cap cuts anywhere): a trailing partial copy of
    ``r < L`` characters is allowed. Shortest units are tried first.
    """
    n = len(norm)
    for L in range(PHRASE_MIN_LEN, PHRASE_MAX_LEN + 1):
        for r in range(L):
            end = n - r  # the last whole copy ends here
            if end - PHRASE_COPIES * L < 0:
                break
            unit = norm[end - L:end]
            if not unit.startswith(norm[end:]):
                continue
            copies = 1
            while end - (copies + 1) * L >= 0 and norm[end - (copies + 1) * L:end - copies * L] == unit:
                copies += 1
            if copies >= PHRASE_COPIES and _has_words(norm[end - copies * L:end], copies):
                return end - copies * L
    return None


def loop_start(text: str) -> int | None:
    """Character index in ``text`` where its final repetition loop begins, or None.

    Digit runs are compared as equal. The index is exact for texts without digits and
    approximate (within the digit runs' length change) otherwise.
    """
    for window, find in ((SENTENCE_WINDOW, _sentence_loop), (PHRASE_WINDOW, _phrase_loop)):
        offset = max(0, len(text) - window)
        norm = _DIGITS.sub("0", text[offset:])
        start = find(norm)
        if start is not None:
            # Map back: count characters of text[offset:] up to the normalised index.
            return offset + _denormalise_index(text[offset:], start)
    return None


def _denormalise_index(original: str, norm_index: int) -> int:
    i = j = 0
    while i < len(original) and j < norm_index:
        if original[i].isdigit():
            while i < len(original) and original[i].isdigit():
                i += 1
        else:
            i += 1
        j += 1
    return i


def has_loop(text: str) -> bool:
    """Whether ``text`` ends in a sentence or phrase loop (see the module docstring)."""
    return loop_start(text) is not None


has_phrase_loop = has_loop  # the older name


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
    if has_loop(text):
        return "phrase_loop"
    if is_truncated(text, hit_length_cap, end_marker):
        return "truncated"
    return "ok"
