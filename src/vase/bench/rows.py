"""From a bench's timed runs to its rows: rates and their spread, the step cost of an eviction, the traffic model's
ceiling beside each row, and the paired ratios against the full and dynamic baselines."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from ..core.policies import get_policy
from ..storage.registry import byte_model
from ..core.schedule import num_evictions
from .paired import paired_ratio
from .traffic import ModelBytes, StepTraffic, decode_traffic, gain_share


#: the two full-cache references every benchmark can include
BASELINES = ("full", "dynamic")


def expected_evictions(prompt_length: int, new_tokens: int, budget: int, window: int) -> int:
    """Eviction events the schedule predicts for one unpadded row (`vase.core.schedule`, docs/methods.md).

    After prefill the cache holds P tokens; the N new tokens need N - 1 more forwards (the
    last token is never fed back). The first eviction runs before the token that would pass
    max(P, B) + w, then one every w tokens.
    """
    return num_evictions(prompt_length, budget, window, max(new_tokens - 1, 0))


def segment_rates(steps: list[float], batch: int, segments: int) -> list[float]:
    n = len(steps)
    k = max(1, min(segments, n))
    rates = []
    for i in range(k):
        part = steps[i * n // k:(i + 1) * n // k]
        rates.append(len(part) * batch / sum(part) if part and sum(part) > 0 else math.nan)
    return rates


def evict_step_cost(steps: list[float], evicted: list[bool], radius: int = 8) -> float:
    costs = []
    for i, ev in enumerate(evicted):
        if not ev:
            continue
        near = [steps[j] for j in range(max(0, i - radius), min(len(steps), i + radius + 1)) if not evicted[j]]
        if near:
            costs.append(steps[i] - statistics.median(near))
    return 1000 * statistics.median(costs) if costs else math.nan


# -- the grid ------------------------------------------------------------------------------------
def _median(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(vals) if vals else math.nan


def model_label(model) -> str:
    label = getattr(model, "vase_shape", None) or getattr(model.config, "name_or_path", "") or ""
    return str(label) or type(model).__name__


def summarise(runs: list[dict], model, device, dtype, method: str, budget: int | None, length: int, batch: int,
               prompt_length: int, window: int, repeats: int, compiled: bool = False) -> dict:
    # Selection (Quest) attends B tokens per step but holds the full cache and evicts nothing.
    selects = method not in BASELINES and not get_policy(method).evicts
    evicts = method not in BASELINES and not selects
    evictions = runs[0]["evictions"]
    expected = expected_evictions(prompt_length, length, budget, window) if evicts else 0
    fired = evictions > 0 if evicts else None
    flag = ""
    if evicts and not fired:
        flag = (f"eviction never fired: prompt {prompt_length} + {length} new tokens <= budget {budget} + window "
                f"{window}; not a speed-up")
    elif evicts and evictions != expected:
        flag = f"{evictions} evictions, schedule predicts {expected}"
    elif selects:
        flag = "selection: holds the full cache; a dense kernel still reads all of it"
    segs = [_median([r["seg_tok_s"][i] for r in runs]) for i in range(len(runs[0]["seg_tok_s"]))]
    seg_ratio = segs[-1] / segs[0] if len(segs) > 1 and segs[0] > 0 else math.nan
    # each round's own last/first ratio: its spread says whether a flat rate is within the noise
    run_ratios = [r["seg_tok_s"][-1] / r["seg_tok_s"][0] for r in runs
                  if len(r["seg_tok_s"]) > 1 and r["seg_tok_s"][0] > 0]
    steady = [_median([r["steady_tok_s"][i] for r in runs]) for i in range(len(runs[0]["steady_tok_s"]))]
    steady_ratio = steady[-1] / steady[0] if len(steady) > 1 and steady[0] > 0 else math.nan
    if evicts and fired and steady_ratio < 0.95:
        flag = (flag + "; " if flag else "") + (f"rate fell after the first eviction (last/first part "
                                                f"{steady_ratio:.2f})")
    return {
        "model": model_label(model),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "attn": _base_attention(model),
        "batch": batch,
        "method": method,
        "budget": budget if evicts or selects else None,
        "window": window if evicts or selects else None,
        "prompt_length": prompt_length,
        "new_tokens": length,
        "repeats": repeats,
        "tok_s": _median([r["tok_s"] for r in runs]),
        "tok_s_runs": ";".join(repr(float(r['tok_s'])) for r in runs),  # one per round, in order: the pairs
        "seg_tok_s": ";".join(f"{s:.2f}" for s in segs),
        "seg_ratio": seg_ratio,
        "seg_ratio_lo": min(run_ratios) if run_ratios else math.nan,
        "seg_ratio_hi": max(run_ratios) if run_ratios else math.nan,
        "steady_ratio": steady_ratio,
        "compiled": compiled,
        "step_ms": _median([r["step_ms"] for r in runs]),
        "decode_s": _median([r["decode_s"] for r in runs]),
        "prefill_s": _median([r["prefill_s"] for r in runs]),
        "evictions": evictions,
        "expected_evictions": expected if evicts else None,
        "eviction_fired": fired,
        "evict_ms": _median([r["evict_ms"] for r in runs]),
        "evict_step_ms": _median([r["evict_step_ms"] for r in runs]),
        "evict_share": _median([r["evict_share"] for r in runs]),
        "kv_bytes": runs[0]["kv_bytes"],
        "kv_bytes_alloc": runs[0]["kv_bytes_alloc"],
        "kv_bytes_full": runs[0]["kv_bytes_full"],
        "stored_length": runs[0]["stored_length"],
        "peak_mem_bytes": int(_median([r["peak_mem_bytes"] for r in runs])),
        "peak_mem_delta_bytes": int(_median([r["peak_mem_delta_bytes"] for r in runs])),
        "mem_method": runs[0]["mem_method"],
        "vs_full": None,
        "vs_full_lo": None,
        "vs_full_hi": None,
        "vs_dynamic": None,
        "vs_dynamic_lo": None,
        "vs_dynamic_hi": None,
        "ceiling_vs_full": None,
        "gain_vs_full": None,
        "ceiling_vs_dynamic": None,
        "gain_vs_dynamic": None,
        "kv_vs_full": None,
        "flag": flag,
    }


def _base_attention(model) -> str:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    return impl.removeprefix("vase_")


def row_traffic(model, method: str, budget: int | None, window: int, prompt_length: int, new_tokens: int,
                batch: int, compiled: bool = False, sizes: ModelBytes | None = None,
                **method_params) -> StepTraffic | None:
    """The traffic model's mean bytes per decode step of one bench configuration; None for selection
    methods (Quest: the dense kernel reads the full cache, its own traffic is not modelled)."""
    sizes = sizes or ModelBytes.from_model(model)
    if method in BASELINES:
        return decode_traffic(sizes, method, prompt_length, new_tokens, batch, compiled=compiled)
    policy = get_policy(method)
    if not policy.evicts:
        return None
    quant = byte_model(model, policy, budget, window, method_params)  # the storage's own (`vase.storage.registry`)
    return decode_traffic(sizes, "evicting", prompt_length, new_tokens, batch, budget, window, compiled=compiled,
                          quant=quant)


def add_traffic(row: dict, model, sizes: ModelBytes | None, bandwidth: float | None, method_params: dict) -> None:
    """The row's bytes per step and, with a bandwidth, the fastest rate it allows and the share reached."""
    t = None if sizes is None else row_traffic(
        model, row["method"], row["budget"], window=row["window"] or 0, prompt_length=row["prompt_length"],
        new_tokens=row["new_tokens"], batch=row["batch"], compiled=bool(row["compiled"]), sizes=sizes,
        **method_params)
    row.update(bytes_step=None, bytes_weights=None, bytes_kv=None, roofline_tok_s=None, roofline_share=None,
               bandwidth_gbs=bandwidth / 1e9 if bandwidth else None)
    if t is None:
        return
    row.update(bytes_step=t.total, bytes_weights=t.weights, bytes_kv=t.kv)
    if bandwidth:
        row["roofline_tok_s"] = bandwidth * row["batch"] / t.total
        row["roofline_share"] = row["tok_s"] / row["roofline_tok_s"]


def _runs(row: dict) -> list[float]:
    raw = row.get("tok_s_runs")
    return [float(v) for v in str(raw).split(";") if v] if raw not in (None, "") else []


def _ratio(row: dict, ref: dict) -> tuple[float, float, float] | None:
    """Row over reference: paired per round when both carry one rate per round, else the ratio of the medians."""
    mine, theirs = _runs(row), _runs(ref)
    if mine and len(mine) == len(theirs):
        med, lo, hi = paired_ratio(mine, theirs)
        return None if math.isnan(med) else (med, lo, hi)
    if ref["tok_s"] and ref["tok_s"] > 0:
        r = row["tok_s"] / ref["tok_s"]
        return r, r, r
    return None


def _ceiling(row: dict, ref: dict) -> float | None:
    mine, theirs = row.get("bytes_step"), ref.get("bytes_step")
    return theirs / mine if mine and theirs else None


def add_ratios(rows: list[dict]) -> list[dict]:
    """Fill the ratios of `rows` in place (also for partial results); returns rows.

    `vs_full` / `vs_dynamic` (median over paired rounds, range in `_lo` / `_hi`), `kv_vs_full`, and
    beside each ratio the ceiling the traffic model allows (the reference's bytes per step over the
    row's) and the share of the ceiling's gain reached, (ratio - 1) / (ceiling - 1)."""
    refs: dict[tuple, dict] = {}
    for row in rows:
        if row["method"] in BASELINES:
            refs[(row["method"], row["batch"], row["new_tokens"], bool(row.get("compiled")))] = row
    for row in rows:
        if row["eviction_fired"] is False:
            continue  # never report a configuration that did not evict as a speed-up
        comp = bool(row.get("compiled"))  # compiled rows against the compiled full cache (StaticCache)
        for name, ref in (("full", refs.get(("full", row["batch"], row["new_tokens"], comp))),
                          ("dynamic", refs.get(("dynamic", row["batch"], row["new_tokens"], False)))):
            ratio = _ratio(row, ref) if ref else None
            if ratio is None:
                continue
            row[f"vs_{name}"], row[f"vs_{name}_lo"], row[f"vs_{name}_hi"] = ratio
            ceiling = _ceiling(row, ref)
            row[f"ceiling_vs_{name}"] = ceiling
            row[f"gain_vs_{name}"] = gain_share(ratio[0], ceiling)
            if name == "full" and ref["kv_bytes"]:
                row["kv_vs_full"] = row["kv_bytes"] / ref["kv_bytes"]
    return rows
