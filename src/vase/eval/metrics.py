"""Pure metric functions over per-sample records and next-token distributions.

A record is one completion, a dict with (at least) the keys the functions read:

- ``problem_id`` (str) and ``sample`` (int, the sample index within the problem),
- ``correct`` (bool), ``answer`` (extracted answer, str or None),
- ``length`` (number of generated tokens), ``failure`` (a class of FAILURE_CLASSES).

Every function takes the key names as keyword arguments, so records with other names work.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from vase.core import schedule
from vase.eval.failures import FAILURE_CLASSES

__all__ = [
    "pass_at_1",
    "agreement",
    "length_stats",
    "inflation",
    "compression_ratio",
    "failure_shares",
    "fidelity_metrics",
    "aggregate_fidelity",
    "FIDELITY_KEYS",
    "answered_share",
    "accuracy_split",
    "cap_share",
    "agreement_split",
    "kv_schedule",
    "first_evicted_target",
    "decode_steps",
    "kv_byte_steps",
    "kl_per_token",
]

Record = Mapping[str, Any]

#: Per-token means reported by :func:`fidelity_metrics` (besides ``n_tokens``).
FIDELITY_KEYS: tuple[str, ...] = ("kl_mean", "top1_agree", "top1_disagree_share", "dnll_mean")


def _require(records: Sequence[Record], what: str) -> None:
    if len(records) == 0:
        raise ValueError(f"{what}: no records")


def pass_at_1(
    records: Sequence[Record], *, problem_key: str = "problem_id", correct_key: str = "correct"
) -> tuple[float, float]:
    """pass@1 and its standard error over problems.

    Each problem's accuracy is the mean over its samples; pass@1 is the mean over problems
    (so a problem with more samples does not weigh more), and the standard error is the
    sample standard deviation (ddof=1) of per-problem accuracies over sqrt(#problems),
    0.0 for a single problem.
    """
    _require(records, "pass_at_1")
    per_problem: dict[Any, list[float]] = defaultdict(list)
    for r in records:
        per_problem[r[problem_key]].append(float(bool(r[correct_key])))
    accs = [sum(v) / len(v) for v in per_problem.values()]
    mean = sum(accs) / len(accs)
    if len(accs) < 2:
        return mean, 0.0
    return mean, statistics.stdev(accs) / math.sqrt(len(accs))


def _norm_answer(a: Any) -> str | None:
    # Whitespace carries no meaning in an extracted answer ("x = 5" vs "x=5").
    return None if a is None else "".join(str(a).split())


def agreement(
    records_method: Sequence[Record],
    records_full: Sequence[Record],
    *,
    problem_key: str = "problem_id",
    sample_key: str = "sample",
    answer_key: str = "answer",
    none_matches: bool = False,
) -> float:
    """Share of (problem, sample) pairs whose extracted answers are equal.

    Records are paired on ``(problem_id, sample)``; records present in only one list are
    ignored. Answers are compared as strings with whitespace removed. A pair where neither
    completion has an answer counts as agreeing only if ``none_matches``.

    Raises:
        ValueError: a duplicate (problem, sample) key, or no pair in common.
    """
    full: dict[tuple[Any, Any], Any] = {}
    for r in records_full:
        k = (r[problem_key], r[sample_key])
        if k in full:
            raise ValueError(f"agreement: duplicate full-cache record {k}")
        full[k] = _norm_answer(r.get(answer_key))
    seen: set[tuple[Any, Any]] = set()
    n = agree = 0
    for r in records_method:
        k = (r[problem_key], r[sample_key])
        if k in seen:
            raise ValueError(f"agreement: duplicate method record {k}")
        seen.add(k)
        if k not in full:
            continue
        a, b = _norm_answer(r.get(answer_key)), full[k]
        n += 1
        if a is None and b is None:
            agree += int(none_matches)
        else:
            agree += int(a == b)
    if n == 0:
        raise ValueError("agreement: no (problem, sample) pair in common")
    return agree / n


def answered_share(records: Sequence[Record], *, answer_key: str = "answer") -> float:
    """Share of records with an extracted answer (``answer`` not None)."""
    _require(records, "answered_share")
    return sum(r.get(answer_key) is not None for r in records) / len(records)


def cap_share(records: Sequence[Record], *, finished_key: str = "finished") -> float:
    """Share of records that stopped at the token cap (``finished`` False: no EOS)."""
    _require(records, "cap_share")
    return sum(not bool(r[finished_key]) for r in records) / len(records)


def accuracy_split(records: Sequence[Record], *, finished_key: str = "finished",
                   correct_key: str = "correct") -> dict[str, float | int | None]:
    """Accuracy of the completions that finished (EOS) and of those cut at the cap, apart.

    Returns ``acc_finished`` / ``acc_truncated`` (None where the group is empty) and the counts
    ``n_finished`` / ``n_truncated``: a truncated completion is right only by luck of its last number.
    """
    fin = [bool(r[correct_key]) for r in records if bool(r[finished_key])]
    cut = [bool(r[correct_key]) for r in records if not bool(r[finished_key])]
    return {
        "acc_finished": sum(fin) / len(fin) if fin else None,
        "acc_truncated": sum(cut) / len(cut) if cut else None,
        "n_finished": len(fin),
        "n_truncated": len(cut),
    }


def agreement_split(records_method: Sequence[Record], records_full: Sequence[Record], *,
                    answer_key: str = "answer", equivalent: Any = None) -> dict[str, float | int | None]:
    """Answer agreement with the full cache, with the unanswered cases apart.

    Pairs are the (problem, sample) both lists hold. ``agree`` is the share of pairs where both
    answered whose answers are equivalent (``equivalent(method, full)``, default math-verify via
    :func:`vase.eval.grading.answers_equivalent`), None when no pair has both answers;
    ``both_none``, ``only_method``, ``only_full`` are shares of all pairs; ``n_pairs`` and
    ``n_both`` count them.

    Raises:
        ValueError: a duplicate (problem, sample) key, or no pair in common.
    """
    from vase.eval.paired import pair_records

    if equivalent is None:
        from vase.eval.grading import answers_equivalent as equivalent
    pairs = pair_records(records_method, records_full)
    if not pairs:
        raise ValueError("agreement_split: no (problem, sample) pair in common")
    both = agree = none = only_m = only_f = 0
    for m, f in pairs:
        a, b = m.get(answer_key), f.get(answer_key)
        if a is not None and b is not None:
            both += 1
            agree += bool(equivalent(a, b))
        elif a is None and b is None:
            none += 1
        elif a is None:
            only_f += 1
        else:
            only_m += 1
    n = len(pairs)
    return {"agree": agree / both if both else None, "both_none": none / n, "only_method": only_m / n,
            "only_full": only_f / n, "n_pairs": n, "n_both": both}


def kv_schedule(prompt_length: int, seen: int, *, budget: int | None, window: int,
                evicts: bool) -> dict[str, float | int]:
    """One sequence's stored K/V length over time, from the eviction schedule (`vase.core.schedule`, docs/methods.md).

    The cache holds the prompt, grows by one slot per fed token until it would pass
    ``max(P, B) + w`` (then ``B + w``) and drops to ``B`` just before the token that would pass.
    ``seen`` counts every token fed (prompt included). Returns ``evictions``, ``peak`` and
    ``time_mean``: the stored length averaged over the tokens fed after the prompt (the prompt
    length itself when nothing was fed after it), in tokens; multiply by bytes per token.
    The numbers are `vase.core.schedule.sequence_stats`'.
    """
    if seen < prompt_length:
        raise ValueError(f"kv_schedule: seen ({seen}) < prompt length ({prompt_length})")
    steps = seen - prompt_length
    s = schedule.sequence_stats(prompt_length, budget if evicts else None, window, steps)
    return {"evictions": s.evictions, "peak": s.peak,
            "time_mean": s.stored_sum / steps if steps else float(prompt_length)}


def decode_steps(length: int, finished: bool) -> int:
    """Tokens a sequence fed after its prompt: every generated token but the one sampled at the length cap."""
    return int(length) - (0 if finished or int(length) == 0 else 1)


def kv_byte_steps(record: Record) -> float | None:
    """K/V bytes held summed over the sequence's decode steps (byte-steps): ``kv_bytes_time_mean`` times
    :func:`decode_steps`. None when the record has no time mean. Summed over sequences and divided by the
    reference's same sum, a sequence that runs to the cap weighs by the steps it ran (a mean of
    per-sequence ratios would let a looping method look cheap)."""
    mean = record.get("kv_bytes_time_mean")
    if mean is None or record.get("length") is None:
        return None
    return float(mean) * decode_steps(int(record["length"]), bool(record.get("finished", True)))


def first_evicted_target(prompt_length: int, *, budget: int | None, window: int, evicts: bool) -> int | None:
    """Index of the first teacher-forced target whose distribution comes from an evicted cache.

    Row t of :func:`vase.generation.generate.forced_log_probs` predicts target t from the prompt and
    targets ``< t``: the cache has then seen ``P + t`` tokens, and it first evicts when that
    would pass ``max(P, B) + w``: one past `vase.core.schedule.first_eviction_step`. None for a method
    that never evicts.
    """
    if not evicts or budget is None:
        return None
    return schedule.first_eviction_step(prompt_length, budget, window) + 1


def length_stats(records: Sequence[Record], *, key: str = "length") -> tuple[float, float]:
    """Mean and median output length (tokens) over records."""
    _require(records, "length_stats")
    lengths = [float(r[key]) for r in records]
    return statistics.fmean(lengths), float(statistics.median(lengths))


def inflation(method_mean_len: float, full_mean_len: float) -> float:
    """Output length inflation: method mean length / full-cache mean length (1.0 = none)."""
    if full_mean_len <= 0:
        raise ValueError(f"inflation: full-cache mean length must be > 0, got {full_mean_len}")
    return method_mean_len / full_mean_len


def compression_ratio(full_mean_len: float, budget: int) -> float:
    """The paper's compression ratio: mean full-cache output length / budget B."""
    if budget <= 0:
        raise ValueError(f"compression_ratio: budget must be > 0, got {budget}")
    return full_mean_len / budget


def failure_shares(records: Sequence[Record], *, key: str = "failure") -> dict[str, float]:
    """Share of records in each failure class; every class of FAILURE_CLASSES is present."""
    _require(records, "failure_shares")
    counts = {c: 0 for c in FAILURE_CLASSES}
    for r in records:
        c = r[key]
        if c not in counts:
            raise ValueError(
                f"failure_shares: unknown failure class {c!r}; known: {FAILURE_CLASSES}"
            )
        counts[c] += 1
    return {c: n / len(records) for c, n in counts.items()}


def fidelity_metrics(
    full_logprobs: torch.Tensor, comp_logprobs: torch.Tensor, targets: torch.Tensor
) -> dict[str, float | int]:
    """Fidelity of a compressed cache's next-token distributions to the full cache's.

    Args:
        full_logprobs, comp_logprobs: ``[T, V]`` log-probabilities (logits also work: rows
            are renormalised with log_softmax in float64, which leaves log-probs unchanged
            up to rounding and removes bf16 normalisation drift).
        targets: ``[T]`` token ids actually generated (teacher-forced on both caches).

    Returns:
        ``kl_mean``: mean over tokens of KL(full || compressed) = sum_v p_full (log p_full -
        log p_comp); ``top1_agree``: share of tokens whose argmax agrees;
        ``top1_disagree_share``: 1 - top1_agree; ``dnll_mean``: mean of NLL_comp(target) -
        NLL_full(target) (positive = the compressed cache finds the text less likely);
        ``n_tokens``: T.
    """
    if full_logprobs.shape != comp_logprobs.shape or full_logprobs.dim() != 2:
        raise ValueError(
            f"fidelity_metrics: need two [T, V] tensors of one shape, got "
            f"{tuple(full_logprobs.shape)} and {tuple(comp_logprobs.shape)}"
        )
    T = full_logprobs.shape[0]
    if targets.shape != (T,):
        raise ValueError(f"fidelity_metrics: targets must be [T]=[{T}], got {tuple(targets.shape)}")
    if T == 0:
        raise ValueError("fidelity_metrics: no tokens")
    lf = torch.log_softmax(full_logprobs.detach().to(torch.float64), dim=-1)
    lc = torch.log_softmax(comp_logprobs.detach().to(device=lf.device, dtype=torch.float64), dim=-1)
    p = lf.exp()
    # Terms with p_full == 0 contribute 0 (not 0 * -inf = nan).
    kl = torch.where(p > 0, p * (lf - lc), torch.zeros_like(p)).sum(dim=-1)
    agree = (lf.argmax(dim=-1) == lc.argmax(dim=-1)).to(torch.float64).mean().item()
    idx = targets.to(device=lf.device, dtype=torch.long).unsqueeze(-1)
    dnll = (lf.gather(-1, idx) - lc.gather(-1, idx)).squeeze(-1)
    return {
        "kl_mean": kl.mean().item(),
        "top1_agree": agree,
        "top1_disagree_share": 1.0 - agree,
        "dnll_mean": dnll.mean().item(),
        "n_tokens": int(T),
    }


def kl_per_token(full_logprobs: torch.Tensor, comp_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(full || compressed) of each row: ``[T, V]`` log-probs (or logits) -> ``[T]`` float64, as in
    :func:`fidelity_metrics` (rows renormalised in float64, p_full = 0 terms count 0)."""
    if full_logprobs.shape != comp_logprobs.shape or full_logprobs.dim() != 2:
        raise ValueError(f"kl_per_token: need two [T, V] tensors of one shape, got {tuple(full_logprobs.shape)} "
                         f"and {tuple(comp_logprobs.shape)}")
    lf = torch.log_softmax(full_logprobs.detach().to(torch.float64), dim=-1)
    lc = torch.log_softmax(comp_logprobs.detach().to(device=lf.device, dtype=torch.float64), dim=-1)
    p = lf.exp()
    return torch.where(p > 0, p * (lf - lc), torch.zeros_like(p)).sum(dim=-1)


def aggregate_fidelity(per_problem: Iterable[Mapping[str, float | int]]) -> dict[str, float | int]:
    """Token-weighted means of :func:`fidelity_metrics` results over many problems.

    Each result weighs by its ``n_tokens``, so the aggregate equals the metrics of all tokens
    pooled. Adds ``n_problems``; ``n_tokens`` is the total.
    """
    items = list(per_problem)
    total = sum(int(m["n_tokens"]) for m in items)
    if total == 0:
        raise ValueError("aggregate_fidelity: no tokens")
    out: dict[str, float | int] = {
        k: sum(float(m[k]) * int(m["n_tokens"]) for m in items) / total for k in FIDELITY_KEYS
    }
    out["n_tokens"] = total
    out["n_problems"] = len(items)
    return out
