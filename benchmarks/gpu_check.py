#!/usr/bin/env python
"""One command for a GPU machine: is the compiled evicting step right there, and how fast is it?

    python benchmarks/gpu_check.py                 # on one GPU (target: under 8 minutes on an H200)
    python benchmarks/gpu_check.py --toy           # the same at toy size on a CPU (CI runs this)

Needs only torch and transformers (no network, no weights, no vLLM).

(a) correctness: a tiny random fp32 model, batch 2 (one row left-padded), teacher-forced through
    several evictions, for every evicting method:
    - compiled vs eager on the GPU: kept sets (sequence positions stored per row and KV head)
      and logits (max |diff|);
    - GPU eager vs CPU eager: kept sets of the deterministic methods (stochastic methods draw from
      device generators, whose streams differ between CPU and CUDA: not compared).
    Compiled here means dynamo's full graph with the aot_eager backend, and inductor for
    vase-attnv (compile time: inductor for every method would not fit the time); by default for
    the methods that cover every mechanism (COMPILED_CHECK: sampling, per-slot state, per-layer
    noise, query order, top-k), with --all-methods for all of them (tests/test_compile.py does all
    on CPU in CI).
(b) speed and memory in the paper's shape: a randomly initialised Qwen3-8B-shaped model in bf16,
    batch 16, 512-token random prompts, B = 2,048, w = 64, sampled as `vase.generate` samples
    (temperature 0.6, top-p 0.95, EOS ignored):
        full DynamicCache (eager)  |  full StaticCache (compiled)  |  vase-attnv eager  |  vase-attnv compiled
    compiled runs decode --new-tokens (8,192) tokens; eager runs --eager-tokens (2,048), because an
    eager step is launch-bound (tens of ms) and 8,192 of them twice would not fit 8 minutes. Every run
    reports tok/s over its first --eager-tokens tokens (like with like) and over all its tokens,
    the median step, and torch.cuda.max_memory_allocated (weights included).
    The first compiled run of each kind is preceded by an untimed warm-up (compilation).

Writes gpu_check.json and gpu_check.md to --out (default $OUT, else ./gpu-check-results), each
result as soon as it exists; --deadline-s stops starting new runs past that many seconds.
Paper anchor (Qwen3-14B, batch 16, 16k output, B = 4,096): full 133 tok/s at 68.7 GB, VaSE-AttnV
333 tok/s (2.5x) at 39.6 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

#: methods whose compiled step part (a) checks by default: each exercises one mechanism
COMPILED_CHECK = ("vase-attnv", "vase-attnv 4-bit", "vase-dkv", "curdkv", "h2o", "tova", "snapkv", "streamingllm")

PAPER = ("Paper anchor (Qwen3-14B, batch 16, 16k output, B=4096): full 133 tok/s / 68.7 GB, "
         "VaSE-AttnV 333 tok/s (2.5x) / 39.6 GB.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy", action="store_true", help="tiny sizes on the CPU (CI)")
    p.add_argument("--device", default=None, help="default: cuda when available (else cpu)")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=8192)
    p.add_argument("--eager-tokens", type=int, default=2048)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--skip-check", action="store_true", help="skip part (a)")
    p.add_argument("--all-methods", action="store_true", help="part (a): compile every evicting method")
    p.add_argument("--skip-speed", action="store_true", help="skip part (b)")
    p.add_argument("--deadline-s", type=float, default=450.0)
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the speed runs and of "
                   "vase-attnv's check (the other methods' checks use aot_eager)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode of the compiled runs (e.g. "
                   "reduce-overhead: CUDA graphs); default: inductor's default")
    p.add_argument("--out", default=None)
    p.add_argument("--source-commit", default=None, help="the commit whose clean tree was copied to this machine: "
                   "recorded instead of this checkout's git state (a lent GPU machine gets a copy of the working "
                   "tree whose .git, if any, is not the sender's)")
    args = p.parse_args(argv)
    if args.toy:
        args.device = args.device or "cpu"
        args.shape, args.batch, args.prompt = "tiny", 2, 16
        args.new_tokens, args.eager_tokens, args.budget, args.window = 48, 24, 24, 8
        args.backend = "aot_eager"  # seconds instead of minutes of compiling; tests/test_compile.py runs inductor
        args.check_methods = ("vase-attnv", "h2o")  # the 4-bit step's compile: tests/test_compile.py
        args.deadline_s = float("inf")  # CI checks both parts whatever the machine's speed
    else:
        args.check_methods = COMPILED_CHECK
    return args


# -- (a) correctness --------------------------------------------------------------------------------------
def _tiny(device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      attn_implementation="sdpa", eos_token_id=95, pad_token_id=94, bos_token_id=93)
    return Qwen3ForCausalLM(cfg).float().eval().to(device)


def check(device: str, log, methods_compiled: tuple[str, ...] | None = None, backend: str = "inductor") -> list[dict]:
    """Part (a): one dict per evicting method (and vase-attnv with 4-bit storage); the compiled step is checked for
    the labels in `methods_compiled` (all: None)."""
    from vase.generation.compiled import CompiledSteps, teacher_forced
    from vase.core.policies import POLICIES

    B, w, P, T = 16, 4, 10, 30
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 90, (2, P), generator=gen)
    mask = torch.ones(2, P, dtype=torch.long)
    mask[1, :3] = 0
    feed = torch.randint(0, 90, (2, T), generator=gen)
    cpu_model, dev_model = _tiny("cpu"), _tiny(device)
    results = []
    # (label, method, storage): every evicting method with dense K/V, and vase-attnv with 4-bit storage
    runs = [(n, n, {}) for n, c in POLICIES.items() if c.evicts and not getattr(c, "selects", False)]
    runs.append(("vase-attnv 4-bit", "vase-attnv", {"kv_bits": 4}))
    for label, method, storage in runs:
        t0 = time.perf_counter()
        stochastic = POLICIES[method]().stochastic
        on_dev = [t.to(device) for t in (ids, mask, feed)]
        le, ke, ee = teacher_forced(dev_model, method, *on_dev, B, w, **storage)
        method_backend = backend if method == "vase-attnv" else "aot_eager"
        row = {"method": label, "backend": None, "evictions": ee, "compiled_same_kept": None,
               "compiled_max_logit_diff": None}
        if methods_compiled is None or label in methods_compiled:
            torch._dynamo.reset()
            lc, kc, ec = teacher_forced(dev_model, method, *on_dev, B, w, steps=CompiledSteps(backend=method_backend),
                                        **storage)
            row.update(backend=method_backend, compiled_same_kept=ke == kc and ee == ec,
                       compiled_max_logit_diff=float((le - lc).abs().max()))
        if stochastic:
            row["cpu_same_kept"] = None  # device RNG streams differ
        else:
            _, kcpu, _ = teacher_forced(cpu_model, method, ids, mask, feed, B, w, **storage)
            row["cpu_same_kept"] = kcpu == ke
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(row)
        diff = row["compiled_max_logit_diff"]
        log(f"(a) {label:<16} compiled({row['backend']}) same kept: {row['compiled_same_kept']}, max |dlogit| "
            f"{'-' if diff is None else f'{diff:.2e}'}; CPU same kept: {row['cpu_same_kept']} ({row['seconds']} s)")
    return results


# -- (b) speed -------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speed_run(model, kind: str, args, new_tokens: int, device: torch.device, cache_tokens: int | None = None) -> dict:
    """One timed decode; kind: dynamic | static-compiled | vase-eager | vase-compiled."""
    from transformers import DynamicCache

    from vase.hf.attention import uninstall
    from vase.bench.runner import BENCH_SAMPLER
    from vase.caches.eager import EvictionCache
    from vase.generation.compiled import compile_cache, compiled_steps, config_key, decode_compiled
    from vase.generation.generate import decode

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=gen).to(device)
    mask = torch.ones_like(ids)
    seeds = list(range(args.batch))
    total = args.prompt + max(new_tokens, cache_tokens or 0)  # a warm-up compiles for the timed run's shapes
    if kind == "dynamic":
        uninstall(model)
        cache, run = DynamicCache(config=model.config), decode
    else:
        method = "full" if kind == "static-compiled" else "vase-attnv"
        cache = EvictionCache(model, method, args.budget if method != "full" else total, args.window, seed=seeds,
                              max_length=total)
        run = decode
        if kind.endswith("compiled"):
            cache = compile_cache(model, cache, args.batch, total)
            steps = compiled_steps(config_key(model, cache, args.batch), mode=args.compile_mode, backend=args.backend)

            def run(*a, **kw):
                return decode_compiled(*a, steps=steps, **kw)
    stamps: list[float] = []
    calls = [0]

    def on_token(row: int, token: int) -> None:
        if calls[0] % args.batch == 0:
            stamps.append(time.perf_counter())  # .tolist() in the loop already synchronised
        calls[0] += 1

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    run(model, ids, mask, cache, max_new_tokens=new_tokens, sampler=BENCH_SAMPLER, seeds=seeds, ignore_eos=True,
        on_token=on_token)
    _sync(device)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    k = min(args.eager_tokens, len(steps) + 1) - 1
    return {
        "kind": kind, "new_tokens": new_tokens,
        "tok_s": len(steps) * args.batch / sum(steps),
        "tok_s_first": k * args.batch / sum(steps[:k]) if k > 0 else None,
        "first_tokens": k + 1,
        "step_ms_median": 1000 * statistics.median(steps),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def speed(args, device: torch.device, log, start: float, out: Path, report: dict) -> list[dict]:
    from vase.bench.shapes import build_random_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random_model(args.shape, dtype=dtype, device=device, attn_implementation="sdpa")
    report["weights_gib"] = (torch.cuda.memory_allocated(device) / 2**30) if device.type == "cuda" else None
    original = model.config._attn_implementation
    rows = []
    plan = [("vase-compiled", args.new_tokens), ("static-compiled", args.new_tokens),
            ("vase-eager", args.eager_tokens), ("dynamic", args.eager_tokens)]
    for kind, n in plan:
        if time.perf_counter() - start > args.deadline_s:
            log(f"(b) {kind}: skipped, past --deadline-s {args.deadline_s:.0f}")
            rows.append({"kind": kind, "skipped": "deadline"})
            continue
        if kind.endswith("compiled"):  # compile (untimed) on a short run of the same shapes
            t0 = time.perf_counter()
            speed_run(model, kind, args, min(n, args.window * 2 + 2 + max(0, args.budget - args.prompt)), device,
                      cache_tokens=n)
            log(f"(b) {kind}: warm-up (compilation) {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        row = speed_run(model, kind, args, n, device)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)
        log(f"(b) {kind:<16} {n} tokens: {row['tok_s']:.1f} tok/s (first {row['first_tokens']}: "
            f"{row['tok_s_first']:.1f}), median step {row['step_ms_median']:.2f} ms, peak "
            f"{row['peak_gib'] if row['peak_gib'] is None else round(row['peak_gib'], 2)} GiB ({row['seconds']} s)")
        report["speed"] = rows
        write(report, out)
    return rows


def to_markdown(report: dict) -> str:
    lines = [f"# gpu_check {report['date']}", "", f"device: {report['device']}, torch {report['torch']}, "
             f"transformers {report['transformers']}, total {report.get('total_s')} s", ""]
    if report.get("check"):
        lines += ["## (a) kept sets", "", "| method | backend | evictions | compiled = eager | max abs dlogit | "
                  "GPU = CPU (eager) |", "|---|---|---|---|---|---|"]
        for r in report["check"]:
            diff = r["compiled_max_logit_diff"]
            cpu = "n/a (RNG)" if r["cpu_same_kept"] is None else r["cpu_same_kept"]
            lines.append(f"| {r['method']} | {r['backend'] or '-'} | {r['evictions']} | "
                         f"{'-' if r['compiled_same_kept'] is None else r['compiled_same_kept']} | "
                         f"{'-' if diff is None else f'{diff:.2e}'} | {cpu} |")
        lines.append("")
    if report.get("speed"):
        s = report["settings"]
        lines += [f"## (b) {s['shape']} (random weights), batch {s['batch']}, prompt {s['prompt']}, B {s['budget']}, "
                  f"w {s['window']}", "", "| run | new tokens | tok/s | tok/s (first tokens) | median step ms | "
                  "peak GiB |", "|---|---|---|---|---|---|"]
        for r in report["speed"]:
            if r.get("skipped"):
                lines.append(f"| {r['kind']} | skipped ({r['skipped']}) | | | | |")
                continue
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            lines.append(f"| {r['kind']} | {r['new_tokens']} | {r['tok_s']:.1f} | {r['tok_s_first']:.1f} "
                         f"({r['first_tokens']}) | {r['step_ms_median']:.2f} | {peak} |")
        lines += ["", PAPER, ""]
    return "\n".join(lines) + "\n"


KEPT_TABLE = {"columns": ["method", "backend", "evictions", "compiled_same_kept", "compiled_max_logit_diff",
                          "cpu_same_kept"], "align": "llrllr", "formats": {"compiled_max_logit_diff": ".2e"}}
SPEED_TABLE = {"columns": ["kind", "new_tokens", "tok_s", "tok_s_first", "first_tokens", "step_ms_median", "peak_gib"],
               "align": "lrrrrrr", "formats": {"tok_s": ".1f", "tok_s_first": ".1f", "step_ms_median": ".2f",
                                               "peak_gib": ".2f"}}


def write(report: dict, out: Path) -> None:
    """The raw report and its markdown, and one results file per part (vase.files.provenance) for docs/gpu.md."""
    from vase.files.provenance import write_results

    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_check.md").write_text(to_markdown(report))
    record = report["provenance"]
    if report.get("check"):
        write_results(out / "gpu-check-kept.json", report["check"], record, table=KEPT_TABLE)
    if report.get("speed"):
        settings = {k: report["settings"][k] for k in ("shape", "batch", "prompt", "budget", "window", "backend")}
        write_results(out / "gpu-check-speed.json", [r for r in report["speed"] if not r.get("skipped")],
                      {**record, "settings": settings, "weights_gib": report.get("weights_gib")},
                      table=SPEED_TABLE)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out or os.environ.get("OUT") or "gpu-check-results")
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "settings": vars(args)}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    from vase.files.provenance import provenance

    report["provenance"] = provenance()
    if args.source_commit:
        report["provenance"].update(commit=args.source_commit, dirty=False, commit_from="--source-commit")
    log(json.dumps({k: report[k] for k in ("device", "gpu", "torch", "transformers")}))
    if not args.skip_check:
        report["check"] = check(str(device), log, None if args.all_methods else args.check_methods, args.backend)
        write(report, out)
    if not args.skip_speed:
        speed(args, device, log, start, out, report)
    report["total_s"] = round(time.perf_counter() - start, 1)
    from vase.files.provenance import finish

    finish(report["provenance"])
    write(report, out)
    ok = all(r["compiled_same_kept"] is not False and r["cpu_same_kept"] is not False for r in report.get("check", []))
    log(f"done in {report['total_s']} s; kept sets {'agree' if ok else 'DIFFER'}; wrote {out / 'gpu_check.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
