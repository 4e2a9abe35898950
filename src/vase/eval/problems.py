"""What every task is made of: :class:`Problem`, and :class:`TaskError` for a task that cannot be loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem", "TaskError"]


class TaskError(ValueError):
    """A task cannot be loaded; the message says why and what to do."""


@dataclass
class Problem:
    """One evaluation problem.

    ``answer`` is the gold final answer as a string (for GSM8K the number after ``####``
    with thousands separators removed). ``task`` is the task name, used to pick the prompt.
    """

    id: str
    question: str
    answer: str
    task: str
    meta: dict[str, Any] = field(default_factory=dict)
