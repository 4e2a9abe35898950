"""The embedded tasks, generated from a seed (no download).

``arith`` / ``arith-N``: multi-step arithmetic word problems with exact integer answers. ``recall`` /
``recall-N``: a value stated first, then N steps of unrelated actions, then the question about the
value (what a method keeps decides whether the value is still there when the answer is written).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable, Literal

from vase.eval.problems import Problem, TaskError

__all__ = [
    "ARITH_DEFAULT_STEPS",
    "ARITH_DEFAULT_SIZE",
    "RECALL_DEFAULT_STEPS",
    "synthetic_family",
    "load_synthetic",
    "generate_arith",
    "generate_recall",
    "apply_arith_op",
]

ARITH_DEFAULT_STEPS = 3
ARITH_DEFAULT_SIZE = 200
RECALL_DEFAULT_STEPS = 4

_ARITH_RE = re.compile(r"^arith(?:-(\d+))?$")
_RECALL_RE = re.compile(r"^recall(?:-(\d+))?$")


def synthetic_family(name: str) -> Literal["arith", "recall"] | None:
    """Which generator a task name means (``arith``, ``arith-N``, ``recall``, ``recall-N``); None for other names."""
    n = name.strip().lower()
    if _ARITH_RE.match(n):
        return "arith"
    if _RECALL_RE.match(n):
        return "recall"
    return None


def load_synthetic(name: str, *, limit: int | None = None, seed: int = 0) -> list[Problem] | None:
    """The problems of an embedded task name (``limit`` of them, default 200); None for any other name."""
    key = name.strip().lower()
    n = ARITH_DEFAULT_SIZE if limit is None else limit
    if (m := _ARITH_RE.match(key)) is not None:
        return generate_arith(n, steps=int(m.group(1)) if m.group(1) else ARITH_DEFAULT_STEPS, seed=seed)
    if (m := _RECALL_RE.match(key)) is not None:
        return generate_recall(n, steps=int(m.group(1)) if m.group(1) else RECALL_DEFAULT_STEPS, seed=seed)
    return None


# ----------------------------------------------------------------------------- arith

_NAMES = (
    ("Mia", "she"), ("Leo", "he"), ("Ava", "she"), ("Noah", "he"), ("Zoe", "she"),
    ("Omar", "he"), ("Lena", "she"), ("Ravi", "he"), ("Ines", "she"), ("Tom", "he"),
)
_ITEMS = ("apples", "marbles", "stickers", "coins", "books", "pencils", "cards", "shells")
_MAX_VALUE = 200  # keeps every intermediate value small enough to do in one's head
_MAX_DELTA = 20

# op -> (sentence templates, function); {k} is the operand, {pro} the pronoun.
_OPS: dict[str, tuple[tuple[str, ...], Callable[[int, int], int]]] = {
    "+": (("buys {k} more", "finds {k} more", "is given {k} more"), lambda v, k: v + k),
    "-": (("gives away {k}", "loses {k}", "sells {k}"), lambda v, k: v - k),
    "*": (("doubles what {pro} has", "triples what {pro} has"), lambda v, k: v * k),
    "/": (("gives away half of them",), lambda v, k: v // k),
}


def _arith_step(rng: random.Random, v: int) -> tuple[str, int, str]:
    """Choose one operation valid for the current value ``v`` (results stay in 1.._MAX)."""
    choices: list[str] = []
    if v + 1 <= _MAX_VALUE:
        choices.append("+")
    if v >= 2:
        choices.append("-")
    if v * 2 <= _MAX_VALUE:
        choices.append("*")
    if v >= 4 and v % 2 == 0:
        choices.append("/")
    op = rng.choice(choices)
    if op == "+":
        k = rng.randint(1, min(_MAX_DELTA, _MAX_VALUE - v))
        phrase = rng.choice(_OPS["+"][0])
    elif op == "-":
        k = rng.randint(1, min(_MAX_DELTA, v - 1))
        phrase = rng.choice(_OPS["-"][0])
    elif op == "*":
        k = 3 if v * 3 <= _MAX_VALUE and rng.random() < 0.3 else 2
        phrase = _OPS["*"][0][0 if k == 2 else 1]
    else:
        k = 2
        phrase = _OPS["/"][0][0]
    return op, k, phrase


def apply_arith_op(value: int, op: str, k: int) -> int:
    """Apply one arith step; used by the generator and to check answers independently."""
    return _OPS[op][1](value, k)


def generate_arith(
    n: int = ARITH_DEFAULT_SIZE, *, steps: int = ARITH_DEFAULT_STEPS, seed: int = 0
) -> list[Problem]:
    """Generate ``n`` arithmetic word problems of ``steps`` operations each.

    Example: "Mia has 12 apples. She buys 7 more. Then she gives away 5. Then she doubles
    what she has. How many apples does Mia have now?" (answer 28). One ``random.Random``
    seeded with ``seed`` is drawn from in order, so the first ``m`` problems of any set are
    the same whatever ``n`` is. Every intermediate value is a positive integer <= 200;
    ``meta`` holds ``start`` and ``ops`` (``[op, k]`` pairs) to re-derive the answer.
    """
    if steps < 1:
        raise TaskError(f"arith needs at least 1 step, got {steps}")
    if n < 0:
        raise TaskError(f"arith set size must be >= 0, got {n}")
    rng = random.Random(seed)
    name = "arith" if steps == ARITH_DEFAULT_STEPS else f"arith-{steps}"
    problems: list[Problem] = []
    for i in range(n):
        person, pro = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        v = rng.randint(2, _MAX_DELTA)
        start = v
        sentences = [f"{person} has {v} {item}."]
        ops: list[list[Any]] = []
        for s in range(steps):
            op, k, phrase = _arith_step(rng, v)
            v = apply_arith_op(v, op, k)
            assert 1 <= v <= _MAX_VALUE  # the op choice above guarantees this
            lead = pro.capitalize() if s == 0 else f"Then {pro}"
            sentences.append(f"{lead} {phrase.format(k=k, pro=pro)}.")
            ops.append([op, k])
        sentences.append(f"How many {item} does {person} have now?")
        problems.append(
            Problem(
                id=f"{name}-{i:04d}",
                question=" ".join(sentences),
                answer=str(v),
                task=name,
                meta={"index": i, "source": f"arith(seed={seed}, steps={steps})",
                      "start": start, "ops": ops, "steps": steps},
            )
        )
    return problems


# ----------------------------------------------------------------------------- recall

_ACTIONS = (
    "walks to the park", "reads a book", "feeds the cat", "calls a friend", "paints a fence", "bakes bread",
    "waters the plants", "cleans the kitchen", "writes a letter", "plays the piano", "visits the library",
    "rides a bike",
)


def generate_recall(n: int = ARITH_DEFAULT_SIZE, *, steps: int = RECALL_DEFAULT_STEPS, seed: int = 0) -> list[Problem]:
    """Generate ``n`` recall problems: a value first, ``steps`` unrelated actions, then the question.

    Example (steps=2): "Leo has a box with 47 coins. Then Leo reads a book. Then Leo bakes bread.
    How many coins are in the box?" (answer 47). The prompt (:mod:`vase.eval.prompts`) asks for
    "The answer is N."; with a window ``w`` of 4 the first eviction comes before the number is
    written, so the answer depends on whether the value was kept. Values are 11..99; one
    ``random.Random(seed)`` is drawn from in order (prefix-stable like arith).
    """
    if not 1 <= steps <= len(_ACTIONS):
        raise TaskError(f"recall needs 1 to {len(_ACTIONS)} steps, got {steps}")
    if n < 0:
        raise TaskError(f"recall set size must be >= 0, got {n}")
    rng = random.Random(seed)
    name = "recall" if steps == RECALL_DEFAULT_STEPS else f"recall-{steps}"
    problems = []
    for i in range(n):
        person, _ = rng.choice(_NAMES)
        value = rng.randint(11, 99)
        acts = " ".join(f"Then {person} {a}." for a in rng.sample(_ACTIONS, steps))
        problems.append(Problem(
            id=f"{name}-{i:04d}", question=f"{person} has a box with {value} coins. {acts} How many coins are in "
                                          f"the box?",
            answer=str(value), task=name,
            meta={"index": i, "source": f"recall(seed={seed}, steps={steps})", "steps": steps}))
    return problems
