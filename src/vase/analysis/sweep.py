"""Eviction vs selection at equal sparsity: a fidelity sweep over compression ratios and tasks.

For each task and problem, the full cache samples its own continuation; that trajectory is
teacher-forced through every method (evicting exactly as in decoding) at budgets set by the
compression target and the run's length:

    B = round((P + T) / c)        (P prompt tokens, T full's generated tokens, c in 4, 8, 16)

clamped to at least `window + 8` (the report marks clamped budgets). The fidelity is measured on
the targets after the first eviction (the same targets for Quest): mean KL(full || method) and
top-1 agreement with full, pooled over the problems' tokens.

Equal sparsity: after its first eviction an evicting cache at budget B attends to B + 1 .. B + w
tokens (it refills its window between evictions). Quest at budget K attends exactly K tokens per
query once more than K are visible, so each problem runs it at K = the evicting cache's mean over
the scored steps, rounded (`equal_sparsity_budget`). The table reports the tokens each method
attends per scored step (mean over steps, and over layers for Quest's dense layers).

Tasks: `arith` (embedded reasoning problems), any task `vase.eval.tasks.load_task` knows
(`gsm8k`, `math500` with a data dir), and `retrieval`: the embedded long-context task below, where
the values asked for are stated at the start of a long prompt (prefill dominates).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..eval.metrics import aggregate_fidelity, fidelity_metrics, first_evicted_target
from ..core.policies import get_policy
from ..core.spec import Request, RequestSpec
from ..core.schedule import physical_length

DEFAULT_METHODS = ("streamingllm", "snapkv", "rkv", "vase-attnv", "vase-dkv", "quest")
DEFAULT_COMPRESSIONS = (4, 8, 16)

# -- the embedded retrieval task -----------------------------------------------------------------------------

_NAMES = ("Alder", "Birch", "Cedar", "Dogwood", "Elm", "Fir", "Ginkgo", "Hazel", "Juniper", "Larch", "Maple",
          "Oak", "Pine", "Rowan", "Spruce", "Teak", "Willow", "Yew", "Ash", "Beech")
_FILLER_SUBJECTS = ("The committee", "A visitor", "The old clerk", "Our neighbour", "The river pilot", "A student",
                    "The baker", "The night guard")
_FILLER_VERBS = ("walked past", "wrote a note about", "spoke at length about", "quietly repaired", "looked at",
                 "painted", "forgot about", "asked about")
_FILLER_OBJECTS = ("the harbour wall", "the garden gate", "a broken lamp", "the village market", "the long bridge",
                   "an empty shelf", "the winter schedule", "a faded map")
_FILLER_TAILS = ("before noon.", "in the rain.", "without a word.", "for the third time.", "after lunch.",
                 "as usual.", "with some care.", "while it was still dark.")


@dataclass(frozen=True)
class RetrievalProblem:
    """A long prompt whose first lines state codes; the question at the end asks for `asked` of them."""

    prompt: str
    asked: tuple[str, ...]
    answer: dict[str, str]


def retrieval_problems(n: int, *, n_facts: int = 8, n_asked: int = 4, filler_sentences: int = 60,
                       seed: int = 0) -> list[RetrievalProblem]:
    """`n` seeded problems: `n_facts` codes stated first, then `filler_sentences` of unrelated text,
    then a question asking for `n_asked` of the codes (so the answer spans several lines)."""
    if not 1 <= n_asked <= n_facts <= len(_NAMES):
        raise ValueError(f"need 1 <= n_asked ({n_asked}) <= n_facts ({n_facts}) <= {len(_NAMES)}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        names = rng.sample(_NAMES, n_facts)
        codes = {name: str(rng.randint(1000, 9999)) for name in names}
        facts = " ".join(f"The code of project {name} is {codes[name]}." for name in names)
        filler = " ".join(f"{rng.choice(_FILLER_SUBJECTS)} {rng.choice(_FILLER_VERBS)} {rng.choice(_FILLER_OBJECTS)} "
                          f"{rng.choice(_FILLER_TAILS)}" for _ in range(filler_sentences))
        asked = tuple(rng.sample(names, n_asked))
        question = (f"Using the notes above, give the codes of projects {', '.join(asked[:-1])} and {asked[-1]}, "
                    "one per line, as 'project: code'.")
        out.append(RetrievalProblem(f"Notes: {facts}\n\n{filler}\n\n{question}", asked,
                                    {a: codes[a] for a in asked}))
    return out


def task_prompts(task: str, *, limit: int, data_dir: str | Path | None = None, seed: int = 0) -> list[str]:
    """User messages of the first `limit` problems of `task` (`retrieval` or any `load_task` name)."""
    if task == "retrieval":
        return [p.prompt for p in retrieval_problems(limit, seed=seed)]
    from ..eval.prompts import build_user_message
    from ..eval.tasks import load_task

    return [build_user_message(p) for p in load_task(task, data_dir=data_dir, limit=limit, seed=seed)]


# -- the sweep --------------------------------------------------------------------------------------------------


def sweep_budget(run_length: int, compression: float, window: int) -> tuple[int, bool]:
    """(budget, clamped): round(run_length / compression), at least window + 8."""
    if compression <= 1:
        raise ValueError(f"compression must be > 1, got {compression}")
    b = round(run_length / compression)
    floor = window + 8
    return (b, False) if b >= floor else (floor, True)


def evicting_attended_sum(prompt_len: int, n_targets: int, budget: int, window: int, first_row: int) -> int:
    """Tokens an evicting cache attends, summed over the forced rows `first_row .. n_targets - 1`.

    Row t predicts target t with `prompt_len + t` tokens written, so its query attends the
    schedule's stored length `physical_length(P, B, w, t)` (itself included)."""
    if not 1 <= first_row <= n_targets:
        raise ValueError(f"first_row ({first_row}) must be in 1..{n_targets}")
    return sum(physical_length(prompt_len, budget, window, t) for t in range(first_row, n_targets))


def equal_sparsity_budget(prompt_len: int, n_targets: int, budget: int, window: int, first_row: int) -> int:
    """Quest's budget K for one problem: the tokens the evicting cache at `budget` attends per
    scored row (rows `first_row ..`), on average, rounded. Quest then attends exactly K per row."""
    total = evicting_attended_sum(prompt_len, n_targets, budget, window, first_row)
    return int(total / (n_targets - first_row) + 0.5) if n_targets > first_row else budget


def selection_attended_sum(prompt_len: int, n_targets: int, budget: int, first_row: int, *, n_layers: int,
                           dense_layers: int = 0) -> float:
    """Tokens a selection (Quest) at `budget` attends, summed over rows `first_row .. n_targets - 1`
    and averaged over layers: `min(P + t, budget)` in a selecting layer, `P + t` in a dense one."""
    dense = min(dense_layers, n_layers)
    total = 0.0
    for t in range(first_row, n_targets):
        n = prompt_len + t
        total += (dense * n + (n_layers - dense) * min(n, budget)) / n_layers
    return total


def parse_method(spec: str) -> tuple[str, dict]:
    """`name` or `name:key=value;key=value` (values as YAML scalars) -> (name, params)."""
    import yaml

    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(";")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"method {spec!r}: parameters are key=value, got {item!r}")
        params[key.strip()] = yaml.safe_load(value)
    return name.strip(), params


def _selects(method: str) -> bool:
    name, params = parse_method(method)
    return get_policy(name, **params).selects


def run_sweep(model, tokenizer, out_dir: str | Path, *, tasks: dict[str, list[str]],
              methods: Sequence[str] = DEFAULT_METHODS, compressions: Sequence[float] = DEFAULT_COMPRESSIONS,
              window: int = 16, max_new_tokens: dict[str, int] | int = 256, seed: int = 0,
              chat_template: bool = True, progress: Callable[[str], None] | None = None) -> dict:
    """Fidelity of every method at every compression on every task's prompts; writes sweep.json,
    sweep.csv, sweep.md and sweep.png into `out_dir` and returns the report.

    methods: names, or `name:key=value;key=value` for parameters (e.g. `quest:dense_layers=2`).
    tasks: task name -> prompts (user messages). max_new_tokens: full's trajectory length cap,
    one for all tasks or per task.
    """
    from ..generation.generate import encode_prompts, forced_log_probs, generate

    say = progress or (lambda msg: None)
    for m in methods:
        get_policy(*parse_method(m)[:1], **parse_method(m)[1])  # fail before any work on an unknown method
    compressions = [int(c) if float(c).is_integer() else float(c) for c in compressions]
    for c in compressions:
        sweep_budget(1000, c, window)  # fail before any work on a bad compression
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # after the checks: a refused sweep leaves no folder behind
    start, cpu_start = time.perf_counter(), time.process_time()
    device = next(model.parameters()).device
    cells: dict[tuple, list[dict]] = {}
    budgets: dict[tuple, list[tuple[int, bool]]] = {}
    attended: dict[tuple, list[float]] = {}  # (task, method, c) -> [attended tokens summed over rows, rows]
    n_layers = int(model.config.num_hidden_layers)
    validated: dict[tuple, Request] = {}  # each request checked once, then carried by every run that asks for it
    full_request = _request(validated, "full", {}, 512, 64)  # generate's and forced_log_probs' defaults
    skipped: list[dict] = []
    trajectories = []
    for task, prompts in tasks.items():
        cap = max_new_tokens if isinstance(max_new_tokens, int) else max_new_tokens[task]
        say(f"{task}: full samples {len(prompts)} trajectories of up to {cap} tokens")
        full = generate(model, tokenizer, prompts, request=full_request, max_new_tokens=cap, seed=seed,
                        temperature=0.6, top_p=0.95, chat_template=chat_template)
        for i, prompt in enumerate(prompts):
            ids, _ = encode_prompts(tokenizer, [prompt], chat_template, device)
            prompt_ids, targets = ids[0].tolist(), full.token_ids[i]
            P, T = len(prompt_ids), len(targets)
            trajectories.append({"task": task, "problem": i, "prompt_tokens": P, "target_tokens": T,
                                 "text": full.texts[i][:400]})
            if T < 2:
                skipped.append({"task": task, "problem": i, "reason": f"full generated {T} tokens"})
                continue
            say(f"{task} {i}: {P} prompt + {T} target tokens")
            full_lp = forced_log_probs(model, prompt_ids, targets, request=full_request, seed=0)
            target_t = torch.tensor(targets)
            for c in compressions:
                budget, clamped = sweep_budget(P + T, c, window)
                t0 = first_evicted_target(P, budget=budget, window=window, evicts=True)
                if t0 >= T:
                    skipped.append({"task": task, "problem": i, "compression": c,
                                    "reason": f"no eviction before the end ({P} + {T} tokens, B = {budget})"})
                    continue
                budgets.setdefault((task, c), []).append((budget, clamped))
                quest_budget = equal_sparsity_budget(P, T, budget, window, t0)
                for m in methods:
                    name, params = parse_method(m)
                    b, seen = _method_budget(m, P, T, budget, window, t0, quest_budget, n_layers)
                    say(f"{task} {i}: {m} at {c}x (B = {b})")
                    request = _request(validated, name, params, b, window)
                    lp = forced_log_probs(model, prompt_ids, targets, request=request, seed=seed)
                    cells.setdefault((task, m, c), []).append(fidelity_metrics(full_lp[t0:], lp[t0:], target_t[t0:]))
                    acc = attended.setdefault((task, m, c), [0.0, 0])
                    acc[0] += seen
                    acc[1] += T - t0
                    del lp
            del full_lp
    rows = _sweep_rows(cells, budgets, attended)
    report = {"config": {"methods": list(methods), "compressions": list(compressions), "window": window,
                         "max_new_tokens": max_new_tokens, "seed": seed, "tasks": {k: len(v) for k, v in tasks.items()},
                         "quest_budget": "per problem: round(mean tokens the evicting cache attends per scored row)"},
              "rows": rows, "trajectories": trajectories, "skipped": skipped,
              "seconds": round(time.perf_counter() - start, 1),
              "cpu_seconds": round(time.process_time() - cpu_start, 1)}  # wall time depends on the machine's load
    write_sweep(report, out_dir)
    return report


def _request(validated: dict[tuple, Request], name: str, params: dict, budget: int, window: int) -> Request:
    """Method `name` with `params` at `budget`: validated on its first ask (SpecError, one line), then the same
    `Request` for every problem that runs it at that budget."""
    key = (name, json.dumps(params, sort_keys=True, default=str), budget, window)
    if key not in validated:
        validated[key] = RequestSpec.of(name, budget, window, **params).validate()
    return validated[key]


def _method_budget(m: str, P: int, T: int, budget: int, window: int, t0: int, quest_budget: int,
                   n_layers: int) -> tuple[int, float]:
    """Method `m`'s budget on one problem (a selecting method: the equal-sparsity one) and the tokens it attends,
    summed over the scored rows t0..T-1 (P prompt + T target tokens)."""
    name, params = parse_method(m)
    policy = get_policy(name, **params)
    if _selects(m):
        seen = selection_attended_sum(P, T, quest_budget, t0, n_layers=n_layers,
                                      dense_layers=sum(map(policy.attends_densely, range(n_layers))))
        return quest_budget, seen
    if policy.evicts:
        return budget, evicting_attended_sum(P, T, budget, window, t0)
    return budget, sum(P + t for t in range(t0, T))  # full: everything visible


def _sweep_rows(cells: dict[tuple, list[dict]], budgets: dict[tuple, list[tuple[int, bool]]],
                attended: dict[tuple, list[float]]) -> list[dict]:
    """One row per (task, method, compression): the fidelity aggregated over its problems, the budgets and the
    tokens attended per scored row."""
    rows = []
    for (task, m, c), parts in cells.items():
        agg = aggregate_fidelity(parts)
        bs = budgets[(task, c)]
        rows.append({"task": task, "method": m, "compression": c, "kl": agg["kl_mean"], "top1": agg["top1_agree"],
                     "dnll": agg["dnll_mean"], "tokens": agg["n_tokens"], "problems": agg["n_problems"],
                     "budget_mean": sum(b for b, _ in bs) / len(bs), "clamped": sum(cl for _, cl in bs),
                     "attended_mean": attended[(task, m, c)][0] / attended[(task, m, c)][1],
                     "selection": _selects(m)})
    return rows


CSV_COLUMNS = ("task", "method", "compression", "budget_mean", "clamped", "attended_mean", "kl", "top1", "dnll",
               "tokens", "problems")


def markdown_table(report: dict) -> str:
    """One table per task: methods x compression, cells 'KL / top-1 / tokens attended per step'."""
    rows = report["rows"]
    comps = report["config"]["compressions"]
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        by = {(r["method"], r["compression"]): r for r in rows if r["task"] == task}
        bs = {c: next((r["budget_mean"] for r in rows if r["task"] == task and r["compression"] == c), None)
              for c in comps}
        lines.append(f"**{task}**: KL(full || method) after the first eviction / top-1 agreement with full / "
                     "tokens attended per step (mean)")
        lines.append("")
        lines.append("| method | " + " | ".join(f"{c}x (B={bs[c]:.0f})" if bs[c] else f"{c}x" for c in comps) + " |")
        lines.append("|---|" + "---|" * len(comps))
        for m in report["config"]["methods"]:
            cells = []
            for c in comps:
                r = by.get((m, c))
                cells.append("-" if r is None else f"{r['kl']:.3f} / {r['top1']:.1%} / {r['attended_mean']:.1f}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_sweep(report: dict, out_dir: Path) -> None:
    """sweep.json, sweep.csv, sweep.md and sweep.png."""
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=2))
    lines = [",".join(CSV_COLUMNS)]
    for r in report["rows"]:
        lines.append(",".join(f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]) for c in CSV_COLUMNS))
    (out_dir / "sweep.csv").write_text("\n".join(lines) + "\n")
    (out_dir / "sweep.md").write_text(markdown_table(report))
    plot_sweep(report, out_dir / "sweep.png")


def plot_sweep(report: dict, path: Path) -> Path:
    """KL vs compression, one panel per task, one line per method (Quest dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(5 * max(1, len(tasks)), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for m in report["config"]["methods"]:
            pts = sorted((r["compression"], r["kl"]) for r in rows if r["task"] == task and r["method"] == m)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "--o" if _selects(m) else "-o", label=m, ms=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("compression (run length / B)")
        ax.set_ylabel("KL(full || method)")
        ax.set_title(task)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
