"""Eviction x quantization at equal bytes, and the shared-outlier question (issue 12).

    .venv/bin/python benchmarks/quant_study.py --problems 3 --max-new 320 --out runs/quant-study

1. Decodes a trajectory per problem with the full cache (the embedded SmolLM2-135M-Instruct,
   GSM8K problems from --data-dir, paper sampling, stop at EOS); grades its answer.
2. Teacher-forces every trajectory through each compressed cache (chunks end where decoding
   would evict, as `vase.generation.generate.forced_log_probs`) and records per token KL(full || cache)
   and top-1 agreement (after the cache's first eviction), and the K/V bytes it holds at its
   steady-state peak (the largest after the first eviction; quantization alone: at the end).
3. Writes results.json, a markdown table per question to stdout and tables.md, and the
   bytes-vs-KL plot with the Pareto front.

Bytes are counted with 16-bit full precision (the deployment case: a bf16 model); this CPU
runs the model in float32, where every full-precision entry is twice as large (both are
saved). Byte targets are fractions of the full cache at each problem's own length.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vase.caches.eager import EvictionCache
from vase.eval.grading import is_correct
from vase.eval.prompts import build_prompt
from vase.eval.tasks import load_task
from vase.generation.generate import Sampler, decode, encode_prompts, eos_ids, forced_log_probs
from vase.models import load_model
from vase.storage.quantized import QuantStorage, entry_bytes

WINDOW = 8  # small runs (a few hundred tokens) need a small window to reach 1/16 of the full cache
FLUSH = 8
GROUP = 32
FRACTIONS = (4, 8, 16)


@dataclass
class Config:
    name: str  # the family shown in tables and the plot
    method: str
    bits: int = 16
    fraction: int | None = None  # 1/fraction of the full cache's bytes (None: quantization alone)
    params: dict = field(default_factory=dict)  # method parameters (e.g. value_guard=0)
    guard: int | None = None  # quant_guard (None: the method's reserve)
    select: str = "value"
    tag: str = ""  # the question it answers


def entry_units(bits: int, capacity: int, d: int = 64) -> tuple[float, float]:
    """Bytes of one (token, head) entry of a quantized cache, tags included, over one 16-bit K+V entry:
    (quantized, full precision)."""
    quant, full = entry_bytes(d, d, bits, GROUP, 2, capacity)
    return quant / (4 * d), full / (4 * d)


def budget_for(target: float, bits: int, guard_fraction: float, prompt_len: int, sinks: int = 4) -> int:
    """The largest B whose peak (B + w stored tokens) fits `target` 16-bit token-equivalents."""
    best = None
    for B in range(WINDOW + sinks + 1, 4096):
        stored = B + WINDOW
        if bits == 16:
            units = stored
        else:
            reserve = max(round(guard_fraction * B), sinks)
            fp = min(reserve + WINDOW + FLUSH - 1, stored)
            q_units, fp_units = entry_units(bits, max(prompt_len, B) + WINDOW)
            units = fp * fp_units + q_units * (stored - fp)
        if units > target:
            break
        best = B
    return best if best is not None else WINDOW + sinks + 1


def held_bytes(cache: EvictionCache, full_bytes: int) -> int:
    """K/V bytes the cache holds now with full-precision entries counted at `full_bytes` per element."""
    total = 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        b, h, _, d = layer.keys.shape
        store = layer.storage
        if isinstance(store, QuantStorage):  # entries with their slot tags (and reserve ranks), and key scales
            q_entry, fp_entry = entry_bytes(d, d, store.qcfg.bits, store.group, full_bytes, store.qslot.shape[2] - 1)
            scales = 0 if store.kscale is None else store.kscale.numel() * store.kscale.element_size()
            total += int(store.qn.sum()) * q_entry + int(store.fn.sum()) * fp_entry + scales
        else:
            total += sum(layer.length - p for p in (layer.pad or [0] * b)) * h * 2 * d * full_bytes
    return total


def forced(model, prompt: list[int], target: list[int], cfg: Config, budget: int, seed: int) -> dict:
    """Teacher-force `target` [T] through the configured cache (`vase.generation.generate.forced_log_probs`, observed
    chunk by chunk): log-probs [T, V], peak bytes, first eviction."""
    kw = dict(cfg.params)
    if cfg.bits != 16:
        kw.update(kv_bits=cfg.bits, quant_guard=cfg.guard, quant_group=GROUP, quant_select=cfg.select,
                  flush_every=FLUSH)
    seen: dict = {"cache": None, "peak16": 0, "peak32": 0, "first_evict": None, "steady": None}

    @contextmanager
    def observe(cache: EvictionCache, start: int, n: int):
        if seen["steady"] is None:
            seen["cache"], seen["steady"] = cache, not cache.policy.evicts
        if seen["steady"]:  # bytes once the cache is in its steady state (after the first eviction)
            seen["peak16"] = max(seen["peak16"], held_bytes(cache, 2))
            seen["peak32"] = max(seen["peak32"], held_bytes(cache, 4))
        yield
        if seen["first_evict"] is None and cache.layers[0].evictions:
            seen["first_evict"] = start + 1  # row start+1 of the log-probs is the first one predicted after it
            seen["steady"] = True

    logprobs = forced_log_probs(model, prompt, target, method=cfg.method, budget=budget, window=WINDOW, seed=seed,
                                on_chunk=observe, **kw)
    cache = seen["cache"]
    if cache is None:
        raise ValueError(f"a target of {len(target)} tokens feeds no chunk: the study needs at least 2")
    peak16, peak32 = max(seen["peak16"], held_bytes(cache, 2)), max(seen["peak32"], held_bytes(cache, 4))
    return {"logprobs": logprobs, "peak16": peak16, "peak32": peak32, "first_evict": seen["first_evict"],
            "evictions": cache.layers[0].evictions}


def configs() -> list[Config]:
    """Most important first (results are saved after each one)."""
    out: list[Config] = []
    for bits in (8, 4, 2):
        out.append(Config(f"quant alone kv{bits}", "full", bits, guard=4))
    for f in FRACTIONS:
        for bits in (16, 8, 4, 2):
            out.append(Config(f"vase-attnv kv{bits}", "vase-attnv", bits, f))
    # the shared-outlier question: the reserve's tokens quantized, kept (value ranking), random control
    for bits in (4, 2):
        out.append(Config(f"quant alone kv{bits}", "full", bits, guard=0, tag="outlier"))
        out.append(Config(f"quant alone kv{bits}", "full", bits, guard=32, tag="outlier"))
        out.append(Config(f"quant alone kv{bits}", "full", bits, guard=32, select="random", tag="outlier"))
    out.append(Config("vase-attnv kv2", "vase-attnv", 2, 8, guard=0, tag="outlier"))
    out.append(Config("vase-attnv kv2", "vase-attnv", 2, 8, select="random", tag="outlier"))
    # the value guard off in both axes (sinks only) at 8x and 16x
    for f in (8, 16):
        for bits in (16, 4):
            out.append(Config(f"vase-attnv kv{bits}", "vase-attnv", bits, f, params={"value_guard": 0.0},
                              tag="guard-off"))
    for f in FRACTIONS:
        for bits in (16, 4):
            out.append(Config(f"snapkv kv{bits}", "snapkv", bits, f))
    # keys divided by a per-channel scale before the per-token groups (quant_key_scale)
    ks = {"quant_key_scale": True}
    for bits in (4, 2):
        out.append(Config(f"quant alone kv{bits}", "full", bits, guard=4, params=ks, tag="key-scale"))
    for f, bits in ((8, 2), (8, 4), (16, 4), (16, 2)):
        out.append(Config(f"vase-attnv kv{bits}", "vase-attnv", bits, f, params=ks, tag="key-scale"))
    return out


def label(cfg: Config) -> str:
    parts = [cfg.name]
    if cfg.fraction:
        parts.append(f"1/{cfg.fraction}")
    if cfg.params.get("value_guard") == 0.0:
        parts.append("guard off")
    if cfg.guard is not None:
        parts.append(f"R={cfg.guard}")
    if cfg.select != "value":
        parts.append(cfg.select)
    if cfg.params.get("quant_key_scale"):
        parts.append("key scale")
    return " ".join(parts)


def trajectories(model, tok, n: int, max_new: int, data_dir: str, task: str, min_len: int, seed: int) -> list[dict]:
    problems = load_task(task, data_dir=data_dir, limit=4 * n)
    sampler = Sampler()
    out = []
    for prob in problems:
        if len(out) == n:
            break
        ids, mask = encode_prompts(tok, [build_prompt(tok, prob)], chat_template=False)
        cache = EvictionCache(model, "full", max_length=ids.shape[1] + max_new)
        gen, finished, _ = decode(model, ids, mask, cache, max_new_tokens=max_new, sampler=sampler, seeds=[seed],
                                  eos_token_ids=eos_ids(model, tok))
        text = tok.decode(gen[0], skip_special_tokens=True)
        print(f"  problem {prob.id}: {len(gen[0])} tokens, finished={finished[0]}", flush=True)
        if len(gen[0]) < min_len:
            continue
        values = [l.values[:, :, : l.length] for l in cache.layers]
        out.append({"id": prob.id, "prompt": ids[0].tolist(), "target": gen[0], "text": text,
                    "correct": is_correct(text, prob.answer), "values": values})
    return out


def value_stats(values: list[torch.Tensor]) -> dict:
    """Value-range statistics of one full cache: max/median per head, share of tokens over 5x/3x."""
    from vase.core.policies import value_magnitude

    ratios = []
    for v in values:
        mag = value_magnitude(v)[0]  # [h, n]
        ratios.append(mag / mag.median(-1, keepdim=True).values)
    r = torch.cat([x.flatten() for x in ratios])
    per_layer = [float(x.max()) for x in ratios]
    return {"max_over_median": float(r.max()), "median_layer_max_over_median": float(torch.tensor(per_layer).median()),
            "share_over_3x": float((r > 3).float().mean()), "share_over_5x": float((r > 5).float().mean()),
            "top_layer": int(torch.tensor(per_layer).argmax())}


def kl_top1(full: torch.Tensor, comp: torch.Tensor, start: int) -> tuple[float, float]:
    lf, lc = full[start:].double(), comp[start:].double()
    kl = (lf.exp() * (lf - lc)).sum(-1)
    return float(kl.mean()), float((lf.argmax(-1) == lc.argmax(-1)).double().mean())


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both bytes and KL (lower is better for both)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    main = [r for r in rows if r["tag"] in ("", "key-scale")]
    for r in main:
        r["family"] = r["name"] + (" key scale" if r["tag"] else "")
    families = sorted({r["family"] for r in main})
    markers = "osD^v<>ph*"
    for i, fam in enumerate(families):
        pts = sorted([(r["bytes_frac"], r["kl"]) for r in main if r["family"] == fam])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], label=fam, alpha=0.8,
                color=colormaps["tab20"](i % 20))
    front = pareto([(r["bytes_frac"], r["kl"]) for r in main])
    fp = sorted((main[i]["bytes_frac"], main[i]["kl"]) for i in front)
    ax.step([p[0] for p in fp], [p[1] for p in fp], where="post", color="black", lw=2, alpha=0.5,
            label="Pareto front")
    ax.scatter([p[0] for p in fp], [p[1] for p in fp], s=160, facecolors="none", edgecolors="black")
    for f in FRACTIONS:
        ax.axvline(1 / f, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("K/V bytes held (steady-state peak) / full cache, 16-bit accounting")
    ax.set_ylabel("mean KL(full || compressed) per token")
    ax.set_title("SmolLM2-135M: eviction x quantization at equal bytes (teacher-forced)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['kl']:.3g} / {r['top1']:.0%} ({r['bytes_frac']:.3f})"


def tables(rows: list[dict]) -> str:
    """The study's markdown tables: cells are KL / top-1 agreement (bytes held / full, 16-bit accounting)."""
    def find(name, fraction=None, tag="", **kw):
        for r in rows:
            if r["name"] == name and r["fraction"] == fraction and r["tag"] == tag and \
                    all(r.get(k) == v for k, v in kw.items()):
                return r
        return None

    out = ["Cells: mean KL(full || cache) per token / top-1 agreement (K/V bytes held / full cache).", "",
           "**Equal bytes** (vase-attnv; B chosen so the steady-state peak fits the target)", "",
           "| target | eviction alone | + 8-bit | + 4-bit | + 2-bit |", "|---|---|---|---|---|"]
    for f in FRACTIONS:
        cells = [_cell(find(f"vase-attnv kv{b}", f)) for b in (16, 8, 4, 2)]
        out.append(f"| 1/{f} | " + " | ".join(cells) + " |")
    out += ["", "**Quantization alone** (full cache, sinks and window in full precision)", "",
            "| kv_bits | result |", "|---|---|"]
    for b in (8, 4, 2):
        out.append(f"| {b} | {_cell(find(f'quant alone kv{b}', None, guard=4))} |")
    out += ["", "**Shared outliers**: R old tokens per KV head kept in full precision", "",
            "| configuration | R = 0 (all quantized) | R by value magnitude | R random (control) |", "|---|---|---|---|"]
    for b in (4, 2):
        out.append(f"| quantization alone, {b}-bit, R = 32 | "
                   + " | ".join(_cell(find(f"quant alone kv{b}", None, "outlier", guard=g, select=s))
                                for g, s in ((0, "value"), (32, "value"), (32, "random"))) + " |")
    out.append("| vase-attnv + 2-bit at 1/8, R = B/4 | " + " | ".join([
        _cell(find("vase-attnv kv2", 8, "outlier", guard=0)), _cell(find("vase-attnv kv2", 8)),
        _cell(find("vase-attnv kv2", 8, "outlier", select="random"))]) + " |")
    out += ["", "**Value guard on / off** (off: `value_guard=0`, the quantization reserve is the sinks only)", "",
            "| target | storage | guard on | guard off |", "|---|---|---|---|"]
    for f in (8, 16):
        for b in (16, 4):
            out.append(f"| 1/{f} | {'eviction alone' if b == 16 else f'+ {b}-bit'} | "
                       f"{_cell(find(f'vase-attnv kv{b}', f))} | {_cell(find(f'vase-attnv kv{b}', f, 'guard-off'))} |")
    if any(r["name"].startswith("snapkv") for r in rows):
        out += ["", "**SnapKV** (no value guard; the quantization reserve is the 4 sinks)", "",
                "| target | eviction alone | + 4-bit |", "|---|---|---|"]
        for f in FRACTIONS:
            out.append(f"| 1/{f} | {_cell(find('snapkv kv16', f))} | {_cell(find('snapkv kv4', f))} |")
    if any(r["tag"] == "key-scale" for r in rows):
        out += ["", "**Per-channel key scale** (`quant_key_scale=True`)", "",
                "| configuration | per-token keys | with key scale |", "|---|---|---|"]
        for b in (4, 2):
            out.append(f"| quantization alone, {b}-bit | {_cell(find(f'quant alone kv{b}', None, guard=4))} | "
                       f"{_cell(find(f'quant alone kv{b}', None, 'key-scale'))} |")
        for f, b in ((8, 4), (8, 2), (16, 4), (16, 2)):
            out.append(f"| vase-attnv + {b}-bit at 1/{f} | {_cell(find(f'vase-attnv kv{b}', f))} | "
                       f"{_cell(find(f'vase-attnv kv{b}', f, 'key-scale'))} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=150, help="skip trajectories shorter than this")
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/quant-study")
    ap.add_argument("--plot", default="docs/img/quant_pareto.png")
    ap.add_argument("--only", default="", help="comma-separated tags to run ('' = all, 'main', 'outlier', ...)")
    ap.add_argument("--report-only", action="store_true", help="rebuild tables.md and the plot from results.json")
    ap.add_argument("--part", default="", help="write results-PART.json and skip configurations already in the "
                    "out dir's results*.json (parts can run in parallel)")
    ap.add_argument("--reverse", action="store_true", help="run the configurations in reverse order")
    ap.add_argument("--start", type=int, default=0, help="skip the first N configurations (in run order)")
    ap.add_argument("--skip-unquantized", action="store_true",
                    help="skip the kv_bits 16 configurations (eviction alone: no quantized entry, so unchanged by "
                         "the quantized cache's code)")
    args = ap.parse_args()
    if args.report_only:
        rows = [r for f in sorted(Path(args.out).glob("results*.json")) for r in json.loads(f.read_text())["rows"]]
        (Path(args.out) / "tables.md").write_text(tables(rows))
        print(tables(rows))
        plot(rows, Path(args.plot))
        return
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model()
    t0 = time.time()
    saved = out_dir / "trajectories.pt"
    key = [args.problems, args.max_new, args.min_len, args.task, args.seed]
    if saved.exists() and torch.load(saved)["key"] == key:  # the full cache's trajectories, decoded once
        trajs = torch.load(saved)["trajs"]
    else:
        trajs = trajectories(model, tok, args.problems, args.max_new, args.data_dir, args.task, args.min_len,
                             args.seed)
        torch.save({"key": key, "trajs": trajs}, saved)
    print(f"trajectories: {len(trajs)} in {time.time() - t0:.0f}s, correct {sum(t['correct'] for t in trajs)}",
          flush=True)
    stats = [value_stats(t.pop("values")) for t in trajs]
    # the full cache's own log-probs on its trajectory (the reference)
    refs = [forced(model, t["prompt"], t["target"], Config("full", "full"), 512, args.seed)["logprobs"] for t in trajs]
    cfg_m = model.config.get_text_config()
    head_dim = getattr(cfg_m, "head_dim", None) or cfg_m.hidden_size // cfg_m.num_attention_heads
    token_bytes = cfg_m.num_hidden_layers * cfg_m.num_key_value_heads * 2 * head_dim  # x bytes per element
    rows = []
    wanted = set(filter(None, args.only.split(",")))
    todo = [c for c in configs() if (not wanted or (c.tag or "main") in wanted)
            and not (args.skip_unquantized and c.bits == 16)]
    for cfg in (todo[::-1] if args.reverse else todo)[args.start:]:
        if args.part:  # read before each configuration: parts running in parallel skip each other's results
            done = set()
            for f in out_dir.glob("results*.json"):
                try:
                    done |= {(r["label"], r["tag"]) for r in json.loads(f.read_text())["rows"]}
                except json.JSONDecodeError:  # being written by another part
                    pass
            if (label(cfg), cfg.tag) in done:
                continue
        t1 = time.time()
        per = []
        for t, ref in zip(trajs, refs):
            T = len(t["prompt"]) + len(t["target"])
            guard_frac = 0.0 if cfg.params.get("value_guard") == 0.0 or cfg.method != "vase-attnv" else 0.25
            budget = budget_for(T / cfg.fraction, cfg.bits, guard_frac, len(t["prompt"])) if cfg.fraction else 512
            r = forced(model, t["prompt"], t["target"], cfg, budget, args.seed)
            start = r["first_evict"] if r["first_evict"] is not None else 0
            kl, top1 = kl_top1(ref, r["logprobs"], start)
            per.append({"id": t["id"], "budget": budget, "kl": kl, "top1": top1, "n": ref.shape[0] - start,
                        "bytes_frac": r["peak16"] / (T * token_bytes * 2),
                        "bytes_frac32": r["peak32"] / (T * token_bytes * 4), "evictions": r["evictions"]})
        n = sum(p["n"] for p in per)
        row = {**asdict(cfg), "label": label(cfg),
               "kl": sum(p["kl"] * p["n"] for p in per) / n, "top1": sum(p["top1"] * p["n"] for p in per) / n,
               "bytes_frac": sum(p["bytes_frac"] for p in per) / len(per),
               "bytes_frac32": sum(p["bytes_frac32"] for p in per) / len(per),
               "budgets": [p["budget"] for p in per], "per_problem": per, "seconds": time.time() - t1}
        rows.append(row)
        print(f"{row['label']:42s} bytes {row['bytes_frac']:.3f} (fp32 {row['bytes_frac32']:.3f})  "
              f"KL {row['kl']:.4f}  top1 {row['top1']:.3f}  B {row['budgets']}  {row['seconds']:.0f}s", flush=True)
        suffix = args.part or args.only
        (out_dir / f"results{'-' + suffix if suffix else ''}.json").write_text(json.dumps(
            {"args": vars(args), "value_stats": stats, "problems": [
                {k: v for k, v in t.items() if k in ("id", "correct", "text")} | {"prompt_len": len(t["prompt"]),
                                                                                 "gen_len": len(t["target"])}
                for t in trajs], "rows": rows}, indent=1))
    if any(not r["tag"] for r in rows):
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, Path(args.plot))
    (out_dir / "tables.md").write_text(tables(rows))
    print(tables(rows))
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
