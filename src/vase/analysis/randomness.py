"""Why does sampling what to keep beat top-k? Deterministic vs stochastic versions of one scorer.

For the same teacher-forced trajectories (full's own samples, so every method sees the same
tokens) and the same budget, each method is traced while it evicts exactly as in decoding:

- attention-output error: per layer and fed token, ||o - o_full|| / ||o_full|| of the attention
  module's output (after o_proj), against the full cache on the same tokens;
- coverage: per layer and KV head, the share of positions that were ever eviction candidates
  and survived at least one eviction; overlap: the Jaccard index of the candidates kept by
  consecutive evictions (top-k that keeps starving the same entries has overlap near 1);
- the ensemble hypothesis: over K seeds, KL(full || seed-averaged next-token distribution)
  against the mean single-seed KL. Convexity (Jensen) makes the first <= the second for *any*
  caches that differ, so the ratio alone says nothing about randomness: the control mixes K
  deterministic (top-k) runs at neighbouring budgets, whose differences owe nothing to a seed,
  and the study compares the two ratios (bootstrapped over problems, paired on the same rows);
- loop onset in free generation (sampling) per method, with the failure classes' loop rule.

Tensor layouts: kept/candidate sets are bool [..., N] over sequence positions; log-probs are
[T, vocab] (row t predicts target t, as in `vase.generation.generate.forced_log_probs`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.policies import get_policy
from ..core.spec import Request, RequestSpec, carried, set_beside
from .randomness_report import print_report, write_files
from .randomness_stats import (Mixture, bootstrap_ratio, bootstrap_ratio_difference, consecutive_overlap, coverage,
                               ensemble_kl, jaccard, relative_error, token_kl)

__all__ = ["Arm", "Control", "Trace", "run_randomness", "study_requests", "traced_forced", "attention_modules", "print_report",
           # the measures, from randomness_stats
           "Mixture", "bootstrap_ratio", "bootstrap_ratio_difference", "consecutive_overlap", "coverage", "ensemble_kl",
           "jaccard", "relative_error", "token_kl"]


# -- tracing one teacher-forced run --------------------------------------------------------------------------


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention module of each decoder layer (those with a `layer_idx`), in layer order."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__]
    if not mods:
        raise ValueError(f"{type(model).__name__}: found no attention modules with a layer_idx to hook")
    return sorted(mods, key=lambda m: m.layer_idx)


def _held(layer, n_total: int, upto: int | None = None) -> torch.Tensor:
    """bool [kv_heads, n_total]: the sequence positions row 0 of `layer` stores in slots [0, upto)."""
    pos = layer.positions[0, :, : layer.length if upto is None else upto].cpu()
    out = torch.zeros(pos.shape[0], n_total + 1, dtype=torch.bool)
    out.scatter_(1, torch.where(pos >= 0, pos, n_total), True)
    return out[:, :n_total]


@dataclass
class Trace:
    """What one teacher-forced run recorded."""

    log_probs: torch.Tensor  # [T, V] float32
    attn_out: torch.Tensor | None  # [layers, T - 1, hidden]: attention outputs of the fed targets (reference runs)
    attn_err: torch.Tensor | None  # [layers, T - 1] relative error against a reference's attn_out
    kept: list[torch.Tensor] = field(default_factory=list)  # per eviction: bool [layers, kv_heads, N]
    candidates: list[torch.Tensor] = field(default_factory=list)  # per eviction: bool [layers, kv_heads, N]
    evict_targets: list[int] = field(default_factory=list)  # per eviction: index of the first target fed after it


@torch.inference_mode()
def traced_forced(model, prompt_ids: Sequence[int], target_ids: Sequence[int], *, method: str = "full",
                  budget: int = 512, window: int = 64, seed: int = 0, reference: torch.Tensor | None = None,
                  keep_outputs: bool = False, request: Request | None = None, **method_params) -> Trace:
    """Teacher-force `target_ids` [T] after `prompt_ids` [P] through `vase.generation.generate.forced_log_probs`
    (same chunks, same evictions, same log-probs), observing each chunk to record kept sets and
    attention outputs.

    reference: [layers, T - 1, hidden] attention outputs of a full run (layers: the modules of
    `attention_modules`, in order); the trace then holds the
    relative error per layer and fed target. keep_outputs: keep this run's own outputs (for full).
    request: a validated `Request` instead of `method`, `budget`, `window` and the method's parameters (carried to
    `forced_log_probs` as it is); None: they are validated there.
    """
    from ..generation.generate import forced_log_probs

    if request is not None:
        request = carried(request, **set_beside(method, budget, window, "full"), **method_params)
        window = request.window
        what: dict = {"request": request}
    else:
        what = dict(method=method, budget=budget, window=window, **method_params)

    P, T = len(prompt_ids), len(target_ids)
    if T < 2:
        raise ValueError(f"need at least 2 target tokens to trace, got {T}")
    n_total = P + T
    mods = attention_modules(model)
    n_layers = len(mods)
    hidden = model.config.get_text_config().hidden_size
    outputs = torch.zeros(n_layers, T - 1, hidden) if keep_outputs else None
    errors = torch.zeros(n_layers, T - 1) if reference is not None else None
    fed = [-1]  # targets fed before the current chunk; -1 outside the chunks (the prompt)
    # The row of each hooked module: a hybrid's attention layers are not 0..n-1 (Qwen3.5: 3, 7, ...).
    row = {m.layer_idx: i for i, m in enumerate(mods)}

    def hook(module, args, output):
        if fed[0] < 0:
            return
        out = (output[0] if isinstance(output, tuple) else output)[0].detach().float().cpu()  # [q, hidden]
        a, b = fed[0], fed[0] + out.shape[0]
        if outputs is not None:
            outputs[row[module.layer_idx], a:b] = out
        if errors is not None:
            errors[row[module.layer_idx], a:b] = relative_error(out, reference[row[module.layer_idx], a:b])

    trace = Trace(log_probs=torch.empty(0), attn_out=None, attn_err=None)

    @contextmanager
    def observe(cache, start: int, n: int):
        layers = cache.evicting_layers
        before = [layer.evictions for layer in layers]
        offered = torch.stack([_held(layer, n_total, layer.length - window) for layer in layers])
        fed[0] = start
        yield
        fed[0] = -1
        if any(layer.evictions != b for layer, b in zip(layers, before)):
            held = torch.stack([_held(layer, n_total) for layer in layers])
            trace.candidates.append(offered)
            trace.kept.append(held & offered)
            trace.evict_targets.append(start + 1)  # row start + 1 is the first predicted after the eviction

    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        log_probs = forced_log_probs(model, list(prompt_ids), list(target_ids), seed=seed, on_chunk=observe, **what)
    finally:
        for h in handles:
            h.remove()
    trace.log_probs = log_probs.cpu()
    trace.attn_out, trace.attn_err = outputs, errors
    return trace


# -- the study ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """One method of the study: a label, the registered method and its parameters."""

    label: str
    method: str
    params: dict = field(default_factory=dict)

    @property
    def stochastic(self) -> bool:
        return get_policy(self.method, **self.params).stochastic


#: Deterministic / stochastic pairs of the same scorer (the VaSE paper's ablations, docs/methods.md).
DEFAULT_ARMS = (
    Arm("snapkv", "snapkv"),
    Arm("snapkv-sample", "snapkv-sample"),
    Arm("vase-attnv-topk", "vase-attnv", {"sample": False}),
    Arm("vase-attnv", "vase-attnv"),
)


@dataclass(frozen=True)
class Control:
    """The Jensen control of a seed mixture: a deterministic method run at `budget + offset` for each
    offset, its runs mixed like seeds. `versus` names the stochastic arm it is compared with."""

    label: str
    method: str
    versus: str
    params: dict = field(default_factory=dict)
    offsets: tuple[int, ...] = (-6, -2, 2, 6)


#: Top-k at 4 neighbouring budgets (mean B), against the 4-seed mixtures of the sampled twins.
DEFAULT_CONTROLS = (
    Control("snapkv@B±2,6", "snapkv", "snapkv-sample"),
    Control("vase-attnv-topk@B±2,6", "vase-attnv", "vase-attnv", {"sample": False}),
)


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def run_randomness(model, tokenizer, prompts: Sequence[str], out_dir: str | Path, *, arms: Sequence[Arm] = DEFAULT_ARMS,
                   controls: Sequence[Control] | None = None, budget: int = 96, window: int = 16, seeds: int = 4,
                   max_new_tokens: int = 256, seed: int = 0, loop_tokens: int | None = None,
                   chat_template: bool = True, progress: Callable[[str], None] | None = None,
                   requests: Mapping[str | tuple[str, int], Request] | None = None) -> dict:
    """Run the study on `prompts` and write `randomness.json`, `randomness.csv` and the plots into `out_dir`.

    Trajectories: the full cache's own sample (temperature 0.6, top-p 0.95, `seed`) of up to
    `max_new_tokens` per prompt. Stochastic arms run `seeds` eviction seeds, deterministic ones
    one. Each control mixes its method's runs at `budget + offset` (default: those of
    `DEFAULT_CONTROLS` whose arm runs); it is compared with its `versus` arm on the rows after the last of their first evictions. Loop onset: each arm
    generates freely (same sampling and seed) for `loop_tokens` (default `max_new_tokens`)
    tokens; 0 skips it. Returns the report dict.
    `requests`: the study's validated requests (`study_requests`, the CLI's door); None: validated here, once each;
    every run carries its own.
    """
    from ..generation.generate import encode_prompts, eos_ids, generate

    controls = _check_study(arms, controls, seeds, loop_tokens, budget, window)
    req = dict(requests) if requests is not None else study_requests(arms, controls, seeds, budget, window)
    say = progress or (lambda msg: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    loop_tokens = max_new_tokens if loop_tokens is None else loop_tokens
    sampling = dict(temperature=0.6, top_p=0.95, chat_template=chat_template)

    say(f"full: sampling {len(prompts)} trajectories of up to {max_new_tokens} tokens")
    full_gen = generate(model, tokenizer, list(prompts), request=req["full"], max_new_tokens=max_new_tokens,
                        seed=seed, **sampling)
    device = next(model.parameters()).device
    per_arm: dict[str, dict] = {a.label: {"kl": [], "top1": [], "kl_mix": [], "kl_single": [], "err_layer": [],
                                          "err_time": [], "coverage": [], "overlap": [], "evictions": []}
                                for a in arms}
    # per problem: (first scored row, mixture KL per row, mean single KL per row) of every mixed arm and control
    mixed: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {a.label: [] for a in arms}
    mixed.update({c.label: [] for c in controls})
    problems = []
    for i, prompt in enumerate(prompts):
        ids, _ = encode_prompts(tokenizer, [prompt], chat_template, device)
        prompt_ids = ids[0].tolist()
        targets = full_gen.token_ids[i]
        if len(prompt_ids) + len(targets) - 1 <= max(len(prompt_ids), budget) + window:
            say(f"prompt {i}: full stopped after {len(targets)} tokens, before any eviction; skipped")
            continue
        say(f"prompt {i}: {len(prompt_ids)} prompt + {len(targets)} target tokens; full reference")
        ref = traced_forced(model, prompt_ids, targets, request=req["full"], keep_outputs=True)
        problems.append({"prompt_tokens": len(prompt_ids), "target_tokens": len(targets)})
        for arm in arms:
            _measure_arm(model, prompt_ids, targets, ref, arm, seeds if arm.stochastic else 1, req[arm.label], seed,
                         per_arm[arm.label], mixed[arm.label], lambda msg, i=i: say(f"prompt {i}: {msg}"))
        for ctl in controls:
            mixed[ctl.label].append(_measure_control(model, prompt_ids, targets, ref, ctl, budget, window, seed, req,
                                                     lambda msg, i=i: say(f"prompt {i}: {msg}")))
        del ref
    if not problems:
        raise ValueError(f"no trajectory was long enough to evict (budget {budget} + window {window}): lower "
                         "--budget or raise --max-new-tokens")

    loops = _free_generation(model, tokenizer, prompts, arms, req, loop_tokens, seed, sampling, say) \
        if loop_tokens > 0 else {}

    report = _summarise(per_arm, arms, loops, problems, dict(
        budget=budget, window=window, seeds=seeds, max_new_tokens=max_new_tokens, loop_tokens=loop_tokens,
        seed=seed, prompts=len(prompts), eos=eos_ids(model, tokenizer),
        attn_layers=[m.layer_idx for m in attention_modules(model)]))  # what attn_err_per_layer's entries are
    report["controls"], report["comparisons"] = _controls(mixed, controls, budget, seed)
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["cpu_seconds"] = round(time.process_time() - cpu_start, 1)  # wall time depends on the machine's load
    write_files(report, per_arm, out_dir)
    return report


def study_requests(arms: Sequence[Arm], controls: Sequence[Control] | None, seeds: int, budget: int,
                   window: int) -> dict[str | tuple[str, int], Request]:
    """The study's door: every request it runs, validated once (SpecError, one line): ``"full"``, each arm by its
    label, each control at each of its budgets by ``(label, budget)`` (`controls` None: the default ones for
    `seeds`, as `run_randomness` picks them)."""
    out: dict[str | tuple[str, int], Request] = {"full": RequestSpec.of("full", budget, window).validate()}
    for a in arms:  # the budget given first: its problem is named before a control's neighbouring budget's
        out[a.label] = RequestSpec.of(a.method, budget, window, **a.params).validate()
    for c in _check_study(arms, controls, seeds, None, budget, window):
        for o in c.offsets:
            out[c.label, budget + o] = RequestSpec.of(c.method, budget + o, window, **c.params).validate()
    return out


def _check_study(arms: Sequence[Arm], controls: Sequence[Control] | None, seeds: int, loop_tokens: int | None,
                 budget: int, window: int) -> Sequence[Control]:
    """The study's settings checked (ValueError naming the setting), and its controls (default: those of
    DEFAULT_CONTROLS whose arm is stochastic, with several seeds)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if loop_tokens is not None and loop_tokens < 0:
        raise ValueError(f"loop_tokens must be >= 0 (0 skips the free generation), got {loop_tokens}")
    stochastic = {a.label for a in arms if a.stochastic}
    if controls is None:
        controls = [c for c in DEFAULT_CONTROLS if c.versus in stochastic and seeds > 1]
    for c in controls:
        if c.versus not in stochastic:
            raise ValueError(f"control {c.label!r} compares with arm {c.versus!r}, which is not a stochastic arm "
                             f"of this study ({', '.join(sorted(stochastic)) or 'none'})")
        get_policy(c.method, **c.params).check(budget + min(c.offsets), window)
    return controls


def _measure_arm(model, prompt_ids: list[int], targets: list[int], ref: Trace, arm: Arm, n_seeds: int,
                 request: Request, seed: int, acc: dict[str, list], mixed: list, say: Callable[[str], None]) -> None:
    """One prompt through one arm at each of its `n_seeds` seeds: its measures appended to `acc`, and (several
    seeds) its mixture's (first scored row, KL [T'], mean single KL [T']) to `mixed`."""
    mix = Mixture()
    singles = []
    for s in range(n_seeds):
        say(f"{arm.label} seed {s}")
        tr = traced_forced(model, prompt_ids, targets, request=request, seed=seed + s, reference=ref.attn_out)
        t0 = tr.evict_targets[0]  # measure after the first eviction only
        kl = token_kl(ref.log_probs, tr.log_probs)
        singles.append(kl[t0:])
        mix.add(tr.log_probs[t0:])
        acc["kl"].append(float(kl[t0:].mean()))
        acc["top1"].append(float((ref.log_probs[t0:].argmax(-1) == tr.log_probs[t0:].argmax(-1))
                                 .double().mean()))
        err = tr.attn_err[:, t0 - 1:]  # error rows are fed targets 1..T-1
        acc["err_layer"].append(err.mean(1))
        acc["err_time"].append(tr.attn_err.mean(0))
        acc["coverage"].append(float(coverage(tr.kept, tr.candidates).mean()))
        acc["overlap"].append(float(consecutive_overlap(tr.kept).mean()) if len(tr.kept) > 1 else math.nan)
        acc["evictions"].append(len(tr.kept))
    if n_seeds > 1:
        mix_kl, single_kl = token_kl(ref.log_probs[t0:], mix.log_probs()), torch.stack(singles).mean(0)
        acc["kl_mix"].append(float(mix_kl.mean()))
        acc["kl_single"].append(float(single_kl.mean()))
        mixed.append((t0, mix_kl, single_kl))


def _measure_control(model, prompt_ids: list[int], targets: list[int], ref: Trace, ctl: Control, budget: int,
                     window: int, seed: int, requests: Mapping, say: Callable[[str], None]
                     ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One prompt through one control: its method's runs at each budget offset, mixed; (first scored row, mixture
    KL [T'], mean single KL [T'])."""
    from ..eval.metrics import first_evicted_target
    from ..generation.generate import forced_log_probs

    budgets = [budget + o for o in ctl.offsets]
    t0 = max(first_evicted_target(len(prompt_ids), budget=b, window=window, evicts=True) for b in budgets)
    mix, singles = Mixture(), []
    for b in budgets:
        say(f"control {ctl.label} at B = {b}")
        lp = forced_log_probs(model, prompt_ids, targets, request=requests[ctl.label, b], seed=seed)[t0:].cpu()
        mix.add(lp)
        singles.append(token_kl(ref.log_probs[t0:], lp))
    return t0, token_kl(ref.log_probs[t0:], mix.log_probs()), torch.stack(singles).mean(0)


def _free_generation(model, tokenizer, prompts: Sequence[str], arms: Sequence[Arm], requests: Mapping,
                     loop_tokens: int, seed: int, sampling: dict, say: Callable[[str], None]) -> dict[str, list]:
    """Loop onset: the full cache and each arm generate freely for `loop_tokens` tokens; per label, per prompt, the
    loop onset, the length and the failure class."""
    from ..eval.failures import classify_failure
    from ..generation.generate import generate
    from .loops import loop_onset

    loops: dict[str, list] = {}
    for label in ["full"] + [a.label for a in arms]:
        say(f"free generation: {label}, {loop_tokens} tokens")
        g = generate(model, tokenizer, list(prompts), request=requests[label], max_new_tokens=loop_tokens, seed=seed,
                     **sampling)
        decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
        loops[label] = [{"loop_onset": loop_onset(t, decode), "tokens": len(t),
                         "failure": classify_failure(decode(t), not fin)}
                        for t, fin in zip(g.token_ids, g.finished)]
    return loops


def _sums_from(rows: list[tuple[int, torch.Tensor, torch.Tensor]], start: Sequence[int]) -> tuple[list, list]:
    """Per problem, the mixture and single KL averaged over its rows from `start[p]` on."""
    num, den = [], []
    for (t0, mix_kl, single_kl), s in zip(rows, start):
        num.append(float(mix_kl[s - t0:].mean()))
        den.append(float(single_kl[s - t0:].mean()))
    return num, den


def _controls(mixed: dict, controls: Sequence[Control], budget: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Each control's mixture / single ratio with its bootstrap interval, and each control against its
    arm: both ratios on the same rows (after the later of their first evictions), their difference
    bootstrapped over problems with the same draws for both."""
    out, comparisons = [], []
    for ctl in controls:
        rows = mixed[ctl.label]
        entry = {"method": ctl.label, "registered": ctl.method, "params": ctl.params, "versus": ctl.versus,
                 "budgets": [budget + o for o in ctl.offsets], "problems": len(rows)}
        if rows:
            num, den = _sums_from(rows, [t for t, _, _ in rows])
            ratio, lo, hi = bootstrap_ratio(num, den, seed=seed)
            entry.update(ensemble_kl_mixture=sum(num) / len(num), ensemble_kl_single_mean=sum(den) / len(den),
                         ensemble_ratio=ratio, ensemble_ratio_lo=lo, ensemble_ratio_hi=hi)
        out.append(entry)
        arm_rows = mixed[ctl.versus]
        if rows and len(arm_rows) == len(rows):
            start = [max(a[0], c[0]) for a, c in zip(arm_rows, rows)]
            num_a, den_a = _sums_from(arm_rows, start)
            num_c, den_c = _sums_from(rows, start)
            diff, lo, hi = bootstrap_ratio_difference(num_a, den_a, num_c, den_c, seed=seed)
            comparisons.append({"arm": ctl.versus, "control": ctl.label, "problems": len(rows),
                                "arm_ratio": sum(num_a) / sum(den_a), "control_ratio": sum(num_c) / sum(den_c),
                                "difference": diff, "difference_lo": lo, "difference_hi": hi})
    return out, comparisons


def _summarise(per_arm: dict, arms: Sequence[Arm], loops: dict, problems: list, config: dict) -> dict:
    rows = []
    for arm in arms:
        acc = per_arm[arm.label]
        layer_err = torch.stack(acc["err_layer"]).mean(0) if acc["err_layer"] else None
        mix, single = _mean(acc["kl_mix"]), _mean(acc["kl_single"])
        lo = hi = None
        if acc["kl_mix"]:
            _, lo, hi = bootstrap_ratio(acc["kl_mix"], acc["kl_single"])
        onsets = [r["loop_onset"] for r in loops.get(arm.label, [])]
        rows.append({
            "method": arm.label, "registered": arm.method, "params": arm.params, "stochastic": arm.stochastic,
            "kl_after_eviction": _mean(acc["kl"]), "top1_agree": _mean(acc["top1"]),
            "attn_err_mean": float(layer_err.mean()) if layer_err is not None else None,
            "attn_err_per_layer": [round(float(x), 5) for x in layer_err] if layer_err is not None else [],
            "coverage": _mean(acc["coverage"]), "overlap": _mean(acc["overlap"]),
            "evictions": _mean(acc["evictions"]),
            "ensemble_kl_mixture": mix, "ensemble_kl_single_mean": single,
            "ensemble_ratio": mix / single if mix is not None and single else None,
            "ensemble_ratio_lo": lo, "ensemble_ratio_hi": hi,
            "loop_share": (sum(o is not None for o in onsets) / len(onsets)) if onsets else None,
            "loop_onsets": onsets,
        })
    return {"config": config, "problems": problems, "methods": rows, "free_generation": loops}
