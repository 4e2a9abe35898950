"""Evaluation tasks: load benchmark problems from a local JSONL file, the hub, or generate them.

Three sources, tried in this order:

1. ``task_file``: any JSONL file, with the question and answer fields named by the caller.
2. A named task (:data:`HUB_TASKS`): a local file in ``data_dir`` (or ``$VASE_DATA_DIR``)
   in the hub's row format, else the hub itself through ``datasets`` (imported lazily).
3. The embedded tasks ``arith`` / ``arith-N``: seeded multi-step arithmetic word problems
   with exact integer answers, and ``recall`` / ``recall-N``: a value stated first, then N
   steps of unrelated actions, then the question about the value (what a method keeps decides
   whether the value is still there when the answer is written). Neither needs a download;
   they are generated in :mod:`vase.eval.synthetic` (its names are re-exported here).

Every failure a user can cause (missing file, bad JSON line, missing field, unknown name,
no hub access) raises :class:`TaskError` with a message that says what to do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vase.eval.grading import last_boxed
from vase.eval.problems import Problem, TaskError
from vase.eval.synthetic import (ARITH_DEFAULT_SIZE, ARITH_DEFAULT_STEPS, RECALL_DEFAULT_STEPS, apply_arith_op,
                                 generate_arith, generate_recall, load_synthetic, synthetic_family)

__all__ = [
    "Problem",
    "TaskError",
    "HubTask",
    "HUB_TASKS",
    "TASK_NAMES",
    "ARITH_DEFAULT_STEPS",
    "ARITH_DEFAULT_SIZE",
    "RECALL_DEFAULT_STEPS",
    "DATA_DIR_ENV",
    "task_kind",
    "load_task",
    "load_jsonl_task",
    "generate_arith",
    "generate_recall",
    "apply_arith_op",
    "parse_gsm8k_answer",
]

DATA_DIR_ENV = "VASE_DATA_DIR"

# Field names tried, in order, when the caller names none (hub formats differ per task).
_QUESTION_FIELDS = ("question", "problem", "Question", "Problem")
_ANSWER_FIELDS = ("answer", "Answer")
# Extra row fields kept in Problem.meta only when small: solutions and rationales are long
# and are not needed once the gold answer is extracted.
_META_MAX_CHARS = 200


@dataclass(frozen=True)
class HubTask:
    """Where a named task lives on the hub and how its local files are named."""

    name: str
    hub_id: str
    hub_config: str | None
    split: str
    kind: Literal["gsm8k", "math"]


HUB_TASKS: dict[str, HubTask] = {
    "gsm8k": HubTask("gsm8k", "openai/gsm8k", "main", "test", "gsm8k"),
    "math500": HubTask("math500", "HuggingFaceH4/MATH-500", None, "test", "math"),
    "aime24": HubTask("aime24", "math-ai/aime24", None, "test", "math"),
    "aime25": HubTask("aime25", "math-ai/aime25", None, "test", "math"),
    "amc23": HubTask("amc23", "math-ai/amc23", None, "test", "math"),
}

#: Every task name :func:`load_task` accepts without a file (``arith-N`` too).
TASK_NAMES: tuple[str, ...] = (*HUB_TASKS, "arith", "recall")

def task_kind(name: str) -> Literal["gsm8k", "math", "recall"]:
    """Prompt family of a task: ``"gsm8k"`` for GSM8K and arith, ``"recall"`` for recall,
    ``"math"`` otherwise.

    Unknown names (custom JSONL tasks) get the math prompt, the paper's default; a custom
    name starting with ``gsm8k`` gets the GSM8K prompt.
    """
    n = name.strip().lower()
    family = synthetic_family(n)
    if family == "recall":
        return "recall"
    if n.startswith("gsm8k") or family == "arith":
        return "gsm8k"
    return "math"


def parse_gsm8k_answer(answer: str) -> str:
    """Gold number of a GSM8K answer: the text after ``#### ``, thousands separators removed."""
    if "####" not in answer:
        raise TaskError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


# ----------------------------------------------------------------------------- JSONL files


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        raise TaskError(f"task file {path} is a folder, not a JSONL file: give the file inside it (--task-file)")
    if not path.is_file():
        raise TaskError(f"task file not found: {path}")
    rows: list[dict[str, Any]] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskError(f"{path}: line {lineno} is not UTF-8 text ({e.reason} at byte {e.start} of the "
                                f"line): save the file as UTF-8") from None
            if not line.strip():
                continue  # tolerate blank lines, e.g. a trailing newline
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise TaskError(f"{path}: line {lineno} is not a JSON object")
            rows.append(row)
    return rows


def _pick_field(
    row: dict[str, Any], wanted: str | None, candidates: tuple[str, ...], what: str, where: str
) -> str:
    """The field of ``row`` to read: ``wanted`` if given, else the first candidate present."""
    if wanted is not None:
        if wanted not in row:
            raise TaskError(
                f"{where}: no {what} field {wanted!r}; fields present: {sorted(row)}"
            )
        return wanted
    for c in candidates:
        if c in row:
            return c
    raise TaskError(
        f"{where}: no {what} field (tried {list(candidates)}); fields present: {sorted(row)}"
        f"; name it with --{what}-field"
    )


def _gold(row: dict[str, Any], answer_field: str | None, kind: str, where: str) -> str:
    """Gold answer string of a row, in the row's hub format."""
    if answer_field is None and not any(c in row for c in _ANSWER_FIELDS) and "solution" in row:
        # MATH-style rows without an answer column: the gold is the solution's last box.
        boxed = last_boxed(str(row["solution"]))
        if boxed is None:
            raise TaskError(f"{where}: no answer field and no \\boxed{{}} in 'solution'")
        return boxed
    key = _pick_field(row, answer_field, _ANSWER_FIELDS, "answer", where)
    value = row[key]
    if value is None:
        raise TaskError(f"{where}: answer field {key!r} is null")
    text = str(value).strip()
    if kind == "gsm8k":
        # Hub GSM8K rows hold the rationale with the gold after "####"; pre-extracted
        # copies hold the bare number. Either way the gold is a number without commas.
        return parse_gsm8k_answer(text) if "####" in text else text.replace(",", "")
    return text


def _rows_to_problems(
    rows: list[dict[str, Any]],
    *,
    task: str,
    source: str,
    question_field: str | None,
    answer_field: str | None,
) -> list[Problem]:
    kind = task_kind(task)
    ids = _row_ids(rows, task)
    problems: list[Problem] = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i + 1}"
        q_key = _pick_field(row, question_field, _QUESTION_FIELDS, "question", where)
        gold = _gold(row, answer_field, kind, where)
        meta: dict[str, Any] = {"index": i, "source": source}
        for k, v in row.items():
            if k in (q_key, answer_field, "solution", *_ANSWER_FIELDS):
                continue
            if isinstance(v, (int, float, bool)) or (
                isinstance(v, str) and len(v) <= _META_MAX_CHARS
            ):
                meta[k] = v
        question = row[q_key]
        if question is None or isinstance(question, (dict, list, bool)) or not str(question).strip():
            # str(None) would send the prompt "None"
            raise TaskError(f"{where}: question field {q_key!r} is {json.dumps(question)}: give every row a question "
                            f"text (or name the right field with --question-field)")
        problems.append(Problem(ids[i], str(question), gold, task, meta))
    return problems


def _row_ids(rows: list[dict[str, Any]], task: str) -> list[str]:
    """Stable problem ids: the rows' ``unique_id``/``id`` when unique, else the row index."""
    for key in ("unique_id", "id"):
        if rows and all(r.get(key) not in (None, "") for r in rows):
            # Integer ids ("0", "1", ...) mean nothing on their own: prefix the task.
            ids = [
                str(r[key]) if isinstance(r[key], str) and not str(r[key]).isdigit()
                else f"{task}-{r[key]}"
                for r in rows
            ]
            if len(set(ids)) == len(ids):
                return ids
    return [f"{task}-{i:04d}" for i in range(len(rows))]


def load_jsonl_task(
    path: str | Path,
    *,
    task: str | None = None,
    question_field: str | None = None,
    answer_field: str | None = None,
) -> list[Problem]:
    """Load problems from any JSONL file (one JSON object per line).

    Without ``question_field`` / ``answer_field`` the fields ``question``/``problem`` and
    ``answer`` are tried. ``task`` defaults to the file stem and sets the prompt family
    (see :func:`task_kind`); a GSM8K-kind task extracts the gold after ``####``.
    """
    p = Path(path).expanduser()
    name = task or p.stem
    rows = _read_jsonl(p)
    if not rows:
        raise TaskError(f"task file is empty: {p}")
    return _rows_to_problems(
        rows, task=name, source=str(p), question_field=question_field, answer_field=answer_field
    )


# ----------------------------------------------------------------------------- named tasks


def _local_candidates(spec: HubTask, data_dir: Path) -> list[Path]:
    n = spec.name
    return [
        data_dir / f"{n}_test.jsonl",
        data_dir / f"{n}.jsonl",
        data_dir / n / "test.jsonl",  # the math-evaluation-harness layout data/<task>/test.jsonl
    ]


def _resolve_data_dir(data_dir: str | Path | None) -> Path | None:
    if data_dir is not None:
        where, p = "--data-dir", Path(data_dir).expanduser()
    else:
        env = os.environ.get(DATA_DIR_ENV)
        if not env:
            return None
        where, p = DATA_DIR_ENV, Path(env).expanduser()
    if p.exists() and not p.is_dir():
        raise TaskError(f"{where} {p} is a file, not a folder: give the folder that holds <task>_test.jsonl")
    return p


def _missing_message(spec: HubTask, data_dir: Path | None, reason: str) -> str:
    looked = f" (looked in {data_dir})" if data_dir is not None else ""
    return (
        f"no local file for task {spec.name!r}{looked}: put {spec.name}_test.jsonl in "
        f"--data-dir DIR (or set {DATA_DIR_ENV}), or install `datasets` and connect to the "
        f"hub ({spec.hub_id}); {reason}"
    )


def _load_hub_rows(spec: HubTask, data_dir: Path | None) -> list[dict[str, Any]]:
    try:
        import datasets  # lazy: an optional dependency (the `hub` extra)
    except ImportError as e:
        raise TaskError(_missing_message(spec, data_dir, "`datasets` is not installed")) from e
    try:
        args = (spec.hub_id, spec.hub_config) if spec.hub_config else (spec.hub_id,)
        ds = datasets.load_dataset(*args, split=spec.split)
    except Exception as e:  # noqa: BLE001 - offline, gated, renamed: all mean "no hub"
        raise TaskError(
            _missing_message(spec, data_dir, f"the hub failed: {type(e).__name__}: {e}")
        ) from e
    return [dict(r) for r in ds]


def _load_named(
    spec: HubTask,
    data_dir: Path | None,
    question_field: str | None,
    answer_field: str | None,
) -> list[Problem]:
    if data_dir is not None:
        for cand in _local_candidates(spec, data_dir):
            if cand.is_file():
                return load_jsonl_task(
                    cand, task=spec.name, question_field=question_field, answer_field=answer_field
                )
    rows = _load_hub_rows(spec, data_dir)
    return _rows_to_problems(
        rows,
        task=spec.name,
        source=f"hub:{spec.hub_id}",
        question_field=question_field,
        answer_field=answer_field,
    )


# ----------------------------------------------------------------------------- entry point


def check_task_sources(name: str, *, data_dir: Any = None, task_file: Any = None, question_field: Any = None,
                       answer_field: Any = None) -> None:
    """TaskError (one line) for a source setting the task would not read: ``data_dir`` beside a task file (the file
    is read), and ``data_dir`` or a field name on a generated task (arith, recall: nothing is read)."""
    if task_file is not None:
        if data_dir is not None:
            raise TaskError(f"data_dir (--data-dir) is not read with a task file ({task_file}): drop it, or drop the "
                            f"task file to load {name!r} from the folder")
        return
    given = [f"{n} (--{n.replace('_', '-')})" for n, v in (("data_dir", data_dir), ("question_field", question_field),
                                                         ("answer_field", answer_field)) if v is not None]
    if given and load_synthetic(name, limit=0) is not None:
        raise TaskError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not read by {name!r}, a task "
                        f"generated in vase: drop {'it' if len(given) == 1 else 'them'}, or give a JSONL file with "
                        f"--task-file (a field name is read from that file)")


def load_task(
    name: str,
    *,
    data_dir: str | Path | None = None,
    task_file: str | Path | None = None,
    question_field: str | None = None,
    answer_field: str | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> list[Problem]:
    """Load the problems of a task.

    Args:
        name: a task of :data:`TASK_NAMES`, ``arith-N`` (N steps), or, with ``task_file``,
            any label (it selects the prompt family through :func:`task_kind`).
        data_dir: folder with local files (``<name>_test.jsonl``, ``<name>.jsonl`` or
            ``<name>/test.jsonl``); defaults to ``$VASE_DATA_DIR``. Tried before the hub.
        task_file: a JSONL file to load instead of a named task.
        question_field, answer_field: field names in the file (default: ``question`` or
            ``problem``, and ``answer``).
        limit: keep the first ``limit`` problems (file order; for arith, the set size,
            default 200).
        seed: seed of the arith generator; files and hub sets are never shuffled.

    Raises:
        TaskError: unknown name, missing file, bad JSON line, missing field, or no local
            file and no hub access.
    """
    if limit is not None and limit < 0:
        raise TaskError(f"limit must be >= 0, got {limit}")
    check_task_sources(name, data_dir=data_dir, task_file=task_file, question_field=question_field,
                       answer_field=answer_field)
    key = name.strip().lower()

    if task_file is not None:
        problems = load_jsonl_task(
            task_file, task=name, question_field=question_field, answer_field=answer_field
        )
    elif (synthetic := load_synthetic(key, limit=limit, seed=seed)) is not None:
        return synthetic  # generated to the asked size: nothing to cut
    elif key in HUB_TASKS:
        problems = _load_named(
            HUB_TASKS[key], _resolve_data_dir(data_dir), question_field, answer_field
        )
    else:
        raise TaskError(
            f"unknown task {name!r}: choose one of {', '.join(TASK_NAMES)}, arith-N, recall-N, "
            f"or give a JSONL file with --task-file"
        )
    return problems if limit is None else problems[:limit]
