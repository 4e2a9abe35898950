#!/usr/bin/env python
"""Eager vs compiled decode on a CPU: full (transformers' StaticCache compiled; vase's owned full cache
eager) and vase-attnv (EvictionCache eager; StaticEvictionCache with the eviction inside the compiled
step), in one run, round-robin (`vase.bench.run_bench(compile="both")`).

    python benchmarks/compile_bench.py                                  # SmolLM2-135M (embedded), the full grid
    python benchmarks/compile_bench.py --batch-sizes 1 --lengths 1024   # smaller

Defaults: the embedded SmolLM2-135M-Instruct (fp32), batch 1 and 4, 2,048 and 4,096 new tokens,
prompt 128, B = 512, w = 64, one warm-up run per configuration (it compiles; untimed), median of
--repeats. Prints and writes (--out) a markdown table with, per row, tok/s, the compiled/eager ratio
of the same method and vase-attnv compiled vs full compiled. Target (issue 19): compiled vase-attnv
>= 1.2x eager vase-attnv and >= 1.2x compiled StaticCache full at batch 1, 4,096 tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--random-init", default=None, help="a vase.bench.shapes name instead of --model")
    p.add_argument("--num-layers", type=int, default=None, help="with --random-init: fewer layers (a loaded machine)")
    p.add_argument("--methods", default="vase-attnv", help="comma-separated evicting methods")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="new tokens of each warm-up run (default: enough to pass two evictions)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="compile-bench-out")
    return p.parse_args(argv)


def table(rows: list[dict]) -> str:
    key = {(r["method"], bool(r.get("compiled")), r["batch"], r["new_tokens"]): r for r in rows}
    lines = ["| batch | new tokens | method | step | tok/s | tok/s per quarter | compiled / eager | "
             "vs full (same step) |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["new_tokens"], r["method"] != "full", bool(r.get("compiled")))):
        comp = bool(r.get("compiled"))
        eager = key.get((r["method"], False, r["batch"], r["new_tokens"]))
        vs_eager = f"{r['tok_s'] / eager['tok_s']:.2f}x" if comp and eager else "-"
        vs_full = f"{r['vs_full']:.2f}x" if r.get("vs_full") else "-"
        step = ("StaticCache compiled" if comp else "owned, eager") if r["method"] == "full" else \
            ("compiled, eviction inside" if comp else "eager")
        quarters = " ".join(f"{float(v):.1f}" for v in str(r["seg_tok_s"]).split(";"))
        lines.append(f"| {r['batch']} | {r['new_tokens']} | {r['method']} | {step} | {r['tok_s']:.2f} | {quarters} | "
                     f"{vs_eager} | {vs_full} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vase.bench import run_bench, write_csv

    if args.random_init:
        from vase.bench.shapes import build_random_model

        model = build_random_model(args.random_init, dtype=torch.float32, device="cpu", attn_implementation="sdpa",
                                   num_layers=args.num_layers)
    else:
        from vase.models import load_model

        model, _ = load_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first_eviction = max(args.prompt, args.budget) + args.window - args.prompt
    # Past the first eviction and one more: a long prompt's first eviction runs eagerly, so the
    # evicting graph compiles only at the second one.
    warm = args.warmup_tokens or first_eviction + args.window + 2
    start = time.perf_counter()
    done: list[dict] = []

    def progress(row: dict) -> None:
        done.append(row)
        print(f"[{time.perf_counter() - start:7.1f}s] batch {row['batch']} N={row['new_tokens']} {row['method']}"
              f"{' compiled' if row.get('compiled') else ''}: {row['tok_s']:.2f} tok/s ({row['seg_tok_s']})",
              flush=True)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    rows = run_bench(model, methods, [args.budget], args.lengths, args.batch_sizes, prompt_length=args.prompt,
                     window=args.window, warmup=1, repeats=args.repeats, include_dynamic=False, segments=4,
                     warmup_tokens=warm, compile=False if args.no_compile else "both", progress=progress)
    write_csv(rows, out / "compile_bench.csv")
    name = (f"{args.random_init} (random weights{f', {args.num_layers} layers' if args.num_layers else ''})"
            if args.random_init else getattr(model.config, "name_or_path", ""))
    md = (f"Eager vs compiled decode, {name}, "
          f"{torch.get_num_threads()} thread(s), prompt {args.prompt}, B = {args.budget}, w = {args.window}, "
          f"median of {args.repeats}; total {time.perf_counter() - start:.0f} s\n\n" + table(rows))
    (out / "compile_bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
