#!/usr/bin/env python
"""Decode throughput and memory on a GPU: the paper's throughput setting at Qwen3-4B size.

A Qwen3-4B-shaped model with random weights (throughput and memory do not depend on the
weights; nothing is downloaded) in bf16 with SDPA decodes 8,192 new tokens (greedy, EOS
ignored) after a 256-token random prompt, batch 16, with

    full        vase's owned cache without eviction (preallocated)
    dynamic     transformers' DynamicCache on the stock kernel (the full cache as users run it)
    rkv, vase-attnv, vase-dkv   at B = 2048, w = 64

and reports decode tokens/s (prefill excluded), `torch.cuda.max_memory_allocated()` and the
K/V bytes held, as bench.csv / bench.md / PNGs in the output directory (--out, else $OUT,
else ./gpu-bench-results). Each configuration's row is written as soon as it finishes, so
a run cut short keeps what it measured.

    python benchmarks/gpu_bench.py                                   # the GPU run (see the note on time below)
    python benchmarks/gpu_bench.py --new-tokens 4096 --methods vase-attnv
    python benchmarks/gpu_bench.py --tiny --device cpu --new-tokens 64 --budget 24 --window 8   # smoke test

Time: transformers' eager decode loop is launch-bound at this size, so expect roughly 15-30 ms
per step, i.e. 2-4 minutes per configuration at 8,192 tokens and 10-20 minutes for all five
(not measured here: the script was only run tiny on a CPU). For a shorter run use
--new-tokens 4096, --methods vase-attnv, --no-dynamic or --num-layers.

Paper reference (arXiv 2606.03928, its speed table; Qwen3-14B, batch 16, 16k output, B = 4096,
FlashAttention-2): Full 133 tok/s at 68.7 GB, VaSE-AttnV 333 tok/s (2.5x) at 39.6 GB,
VaSE-DKV 365 tok/s (2.7x) at 38.9 GB, R-KV 278 tok/s (2.1x) at 42.4 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

PAPER_NOTE = ("Paper (Qwen3-14B, batch 16, 16k output, B=4096, FA2): Full 133 tok/s / 68.7 GB; VaSE-AttnV 333 tok/s "
              "(2.5x) / 39.6 GB; VaSE-DKV 365 tok/s (2.7x) / 38.9 GB; R-KV 278 tok/s (2.1x) / 42.4 GB.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-4b", help="model shape name (vase.bench.shapes) or a config.json path")
    p.add_argument("--tiny", action="store_true", help="use the tiny test shape (smoke test)")
    p.add_argument("--num-layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[8192], help="output length(s)")
    p.add_argument("--methods", default="rkv,vase-attnv,vase-dkv", help="comma-separated evicting methods")
    p.add_argument("--budget", type=int, nargs="+", default=[2048])
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--no-full", action="store_true", help="skip the owned full cache")
    p.add_argument("--no-dynamic", action="store_true", help="skip transformers' DynamicCache")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--warmup-tokens", type=int, default=32, help="new tokens of each warm-up run")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadiest on a shared CPU)")
    p.add_argument("--out", default=None, help="output directory (default: $OUT, else ./gpu-bench-results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vase.bench import add_ratios, build_random_model, run_bench, write_csv, write_report
    from vase.bench.report import to_markdown

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    shape = "tiny" if args.tiny else args.shape
    out = Path(args.out or os.environ.get("OUT") or "gpu-bench-results")
    out.mkdir(parents=True, exist_ok=True)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]

    env = {
        "shape": shape, "num_layers": args.num_layers, "device": str(device), "dtype": dtype, "attn": args.attn,
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens, "methods": methods,
        "budgets": args.budget, "window": args.window, "warmup": args.warmup, "warmup_tokens": args.warmup_tokens,
        "repeats": args.repeats, "torch": torch.__version__, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(json.dumps(env), flush=True)

    start = time.perf_counter()
    model = build_random_model(shape, dtype=dtype, device=device, attn_implementation=args.attn,
                               num_layers=args.num_layers, seed=args.seed)
    env["build_s"] = round(time.perf_counter() - start, 2)
    env["params"] = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        env["weights_bytes"] = torch.cuda.memory_allocated(device)
    print(f"built {shape}: {env['params'] / 1e9:.2f}B parameters in {env['build_s']} s", flush=True)

    partial: list[dict] = []

    def progress(row: dict) -> None:
        partial.append(row)
        add_ratios(partial)
        write_csv(partial, out / "bench.csv")
        (out / "bench.md").write_text(to_markdown(partial))
        vs = f" ({row['vs_full']:.2f}x full)" if row.get("vs_full") else ""
        print(f"[{time.perf_counter() - start:7.1f}s] {row['method']:<11} B={row['budget']} N={row['new_tokens']}: "
              f"{row['tok_s']:.1f} tok/s{vs}, peak {row['peak_mem_bytes'] / 2**30:.2f} GiB, KV held "
              f"{row['kv_bytes'] / 2**30:.3f} GiB, evictions {row['evictions']}"
              f"{' ' + row['flag'] if row.get('flag') else ''}", flush=True)

    rows = run_bench(model, methods, args.budget, args.new_tokens, [args.batch], prompt_length=args.prompt,
                     window=args.window, warmup=args.warmup, repeats=args.repeats, segments=args.segments,
                     include_dynamic=not args.no_dynamic, include_full=not args.no_full, seed=args.seed,
                     warmup_tokens=args.warmup_tokens, progress=progress)
    env["total_s"] = round(time.perf_counter() - start, 1)
    paths = write_report(rows, out)
    md = paths["md"].read_text()
    header = (f"# vase GPU decode benchmark\n\n{shape} (random weights, {env['params'] / 1e9:.2f}B params), {dtype}, "
              f"{args.attn}, {env['gpu'] or device}; batch {args.batch}, prompt {args.prompt}, window {args.window}; "
              f"warm-up {args.warmup} x {args.warmup_tokens} tokens, median of {args.repeats}.\n"
              "tok/s = decode tokens per second over all rows (prefill excluded); peak = "
              "torch.cuda.max_memory_allocated (weights included) on CUDA.\n\n")
    peak_lines = "\n".join(f"- {r['method']}{' B=' + str(r['budget']) if r.get('budget') else ''} N={r['new_tokens']}: "
                           f"peak {r['peak_mem_bytes'] / 2**30:.2f} GiB, KV {r['kv_bytes'] / 2**30:.3f} GiB"
                           for r in rows)
    paths["md"].write_text(header + md + "\n" + peak_lines + "\n\n" + PAPER_NOTE + "\n")
    (out / "env.json").write_text(json.dumps(env, indent=2))
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {env['total_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
