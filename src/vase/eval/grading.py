"""Answer extraction and correctness checking with math-verify.

The paper grades a completion by the content of its last ``\\boxed{...}``; equivalence with
the gold answer is decided by math-verify (``verify(parse(gold), parse(pred))``, gold first,
because math-verify's comparison is not symmetric for sets and intervals).
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = [
    "last_boxed",
    "last_number",
    "extract_answer",
    "gold_for_parse",
    "answers_match",
    "answers_equivalent",
    "is_correct",
]

log = logging.getLogger(__name__)

# \boxed and \fbox both appear in model outputs; "\boxed " followed by a bare token is a
# (rare) form without braces that MATH solutions also use.
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b\s*")
# A number with optional thousands separators and decimals; commas are stripped after
# matching so that "1,234" reads as 1234 but "1, 2" reads as two numbers.
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_COMMA_NUMBER_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_HASH_ANSWER_RE = re.compile(r"####\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")
_SAYS_ANSWER_RE = re.compile(r"[Tt]he (?:final )?answer is:?\s*\$?(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")


def _braced_group(text: str, start: int) -> str | None:
    """Return the content of the brace group opening at ``text[start] == '{'``.

    Braces escaped as ``\\{`` / ``\\}`` do not count (they are literal set braces), nested
    groups do. Returns None when the group never closes (a truncated completion).
    """
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Nested braces are kept (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``). A trailing
    box that never closes is skipped in favour of the last complete one, because a
    truncated completion may end inside an unfinished box. Returns None if there is none.
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        pos = m.end()
        if pos < len(text) and text[pos] == "{":
            content = _braced_group(text, pos)
        else:
            # "\boxed 5": the answer is the next whitespace-free token.
            tok = re.match(r"[^\s$]+", text[pos:])
            content = tok.group(0).rstrip(".") if tok else None
        if content is not None and content.strip():
            return content.strip()
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` with thousands separators removed, or None."""
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "")


def extract_answer(text: str, *, numeric_fallback: bool = False) -> str | None:
    """Extract the final answer of a completion.

    The answer is the content of the last ``\\boxed{...}``; without a box, the number of the
    last ``#### N`` (GSM8K's marker), else of the last "the answer is N". Only when ``numeric_fallback``
    is True (meant for numeric tasks such as GSM8K) does a completion without a box fall
    back to its last number; the paper's protocol asks for a box, so the default is strict.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    # Explicit final-answer markers that prompts ask for: GSM8K's "#### N" and "The answer is N".
    for marker in (_HASH_ANSWER_RE, _SAYS_ANSWER_RE):
        found = marker.findall(text)
        if found:
            return found[-1].replace(",", "")
    if numeric_fallback:
        return last_number(text)
    return None


def gold_for_parse(gold: str) -> str:
    """Wrap a gold answer so that math-verify's LaTeX extractor reads it.

    A bare gold such as ``18`` or ``\\frac{14}{3}`` has no anchor for math-verify, so it
    is boxed; golds that already carry ``\\boxed`` or ``$`` delimiters are kept as they are.
    Thousands separators in a plain number are removed (``1,234`` -> ``1234``) so that the
    comma is not read as a tuple separator.
    """
    g = str(gold).strip()
    if "\\boxed" in g or g.startswith("$"):
        return g
    return _box(g)


def _box(answer: str) -> str:
    a = answer.strip()
    if _COMMA_NUMBER_RE.match(a):
        a = a.replace(",", "")
    return "\\boxed{" + a + "}"


def _timeout_for_thread(timeout_s: int | None) -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread; in
    # any other thread it raises ValueError, so the timeout must be switched off there.
    if threading.current_thread() is threading.main_thread():
        return timeout_s
    return None


def answers_match(pred_answer: str, gold: str, *, timeout_s: int | None = 5) -> bool:
    """Whether an extracted answer is mathematically equal to the gold answer.

    Any math-verify exception or timeout counts as "not equal": grading must never crash
    an evaluation run.
    """
    try:
        from math_verify import parse, verify  # lazy: sympy is slow to import
        from math_verify.errors import TimeoutException
    except ImportError as e:  # pragma: no cover - math-verify is a hard dependency
        raise ImportError("grading needs math-verify: pip install math-verify") from e

    timeout = _timeout_for_thread(timeout_s)
    try:
        gold_parsed = parse(gold_for_parse(gold), parsing_timeout=timeout)
        # The prediction is already a box's content: box it again whatever it starts with.
        pred_parsed = parse(_box(pred_answer), parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except TimeoutException:  # a BaseException subclass in math-verify
        log.debug("math-verify timed out on %r vs gold %r", pred_answer, gold)
        return False
    except Exception:  # noqa: BLE001 - any parser failure is a wrong answer, not a crash
        log.debug("math-verify failed on %r vs gold %r", pred_answer, gold, exc_info=True)
        return False


def answers_equivalent(answer: str | None, reference: str | None, *, timeout_s: int | None = 5) -> bool:
    """Whether two extracted answers say the same thing (``\\frac12`` and ``0.5`` do).

    Equal after removing whitespace, or equal for math-verify with ``reference`` in the gold
    role. A missing answer (None) is never equivalent to anything, not even another None.
    """
    if answer is None or reference is None:
        return False
    if "".join(str(answer).split()) == "".join(str(reference).split()):
        return True
    return answers_match(str(answer), str(reference), timeout_s=timeout_s)


def is_correct(
    prediction_text: str,
    gold: str,
    *,
    numeric_fallback: bool = False,
    timeout_s: int | None = 5,
) -> bool:
    """Grade a whole completion against the gold answer.

    The answer is extracted with :func:`extract_answer` (last ``\\boxed{}``; the last
    number only if ``numeric_fallback``); a completion without an answer is wrong.
    """
    pred = extract_answer(prediction_text, numeric_fallback=numeric_fallback)
    if pred is None:
        return False
    return answers_match(pred, gold, timeout_s=timeout_s)
