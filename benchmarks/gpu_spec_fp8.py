#!/usr/bin/env python
"""Speculative decoding and fp8 K/V with eviction, timed in transformers on one GPU.

    python benchmarks/gpu_spec_fp8.py --out DIR            # one GPU (about 3 minutes on an H200)
    python benchmarks/gpu_spec_fp8.py --toy --out DIR      # tiny sizes on a CPU (tests/test_gpu_spec_fp8.py)

Needs only torch and transformers (no network, no weights, no vLLM): a random-init model with the shape of
--shape (`vase.bench.shapes`), batch 1 (transformers' assisted generation is batch 1), greedy, EOS ignored, on a
repetitive prompt (a random block of --block tokens repeated): random weights repeat themselves anyway, so prompt
lookup finds drafts; what it accepts is measured, not assumed.

Runs, each as soon as it is timed (a warm-up generate first):
    full DynamicCache           plain greedy | prompt lookup (--lookup drafts)
    vase-attnv B, w             plain greedy | prompt lookup
    full, kv_dtype=fp8          plain greedy (EvictionCache method=full: the fp8 storage without eviction)
    vase-attnv, kv_dtype=fp8    plain greedy | prompt lookup
Each row: tok/s (new tokens / wall time), target forwards, accepted tokens per forward (new tokens / forwards),
K/V bytes held at the end, peak memory, evictions, and whether the tokens equal the plain run of the same cache.

Writes gpu_spec_fp8.json (`vase.files.provenance.write_results`) and gpu_spec_fp8.md into --out, rewritten after every
run; --deadline-s stops starting new runs past that many seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROWS = (("dynamic", "plain"), ("dynamic", "lookup"), ("vase-attnv", "plain"), ("vase-attnv", "lookup"),
        ("full-fp8", "plain"), ("vase-attnv-fp8", "plain"), ("vase-attnv-fp8", "lookup"))
COLUMNS = ("cache", "decoding", "tok_s", "forwards", "tokens_per_forward", "kv_mib", "peak_gib", "evictions",
           "same_tokens")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--device", default=None, help="default: cuda when available (else cpu)")
    p.add_argument("--shape", default="qwen3-0.6b", help="a vase.bench.shapes name (e.g. qwen3-8b)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--prompt-tokens", type=int, default=448, help="<= budget - lookup: see docs/speculative.md")
    p.add_argument("--block", type=int, default=32, help="the repeated block of the prompt")
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--lookup", type=int, default=8, help="prompt_lookup_num_tokens (<= window)")
    p.add_argument("--deadline-s", type=float, default=240.0)
    p.add_argument("--out", default=None, help="default: $OUT, else ./gpu-spec-fp8-results")
    p.add_argument("--source-commit", default=None, help="the commit whose clean tree was copied to this machine: "
                   "recorded instead of this checkout's git state (a lent GPU machine's copy has a stale .git)")
    args = p.parse_args(argv)
    if args.toy:
        args.shape, args.dtype, args.prompt_tokens, args.block = "tiny", "fp32", 12, 6
        args.new_tokens, args.budget, args.window, args.lookup = 48, 16, 4, 3
        args.device = args.device or "cpu"
    if args.lookup > args.window:
        p.error(f"--lookup ({args.lookup}) must be <= --window ({args.window}): one verification forward fits one "
                f"eviction point")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache(model, kind: str, args):
    """The cache of one run: None (transformers' DynamicCache) or an EvictionCache."""
    from vase.caches.eager import EvictionCache

    if kind == "dynamic":
        return None
    if kind == "full-fp8":
        return EvictionCache(model, "full", budget=None, window=args.window, kv_dtype="fp8",
                             max_length=args.prompt_tokens + args.new_tokens + args.lookup + 1)
    return EvictionCache(model, "vase-attnv", budget=args.budget, window=args.window, seed=0,
                         **({"kv_dtype": "fp8"} if kind.endswith("fp8") else {}))


def _kv_bytes(cache) -> int:
    if hasattr(cache, "stats"):
        return int(cache.stats()["kv_bytes"])
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def run_one(model, prompt: torch.Tensor, kind: str, decoding: str, args, device: torch.device,
            new_tokens: int) -> dict:
    """One timed generate; returns its row (tokens under "_tokens")."""
    from transformers import DynamicCache

    from vase.hf.compat import cache_kwargs

    cache = _cache(model, kind, args)
    cache = DynamicCache() if cache is None else cache
    forwards = [0]
    hook = model.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    spec = {"prompt_lookup_num_tokens": args.lookup} if decoding == "lookup" else {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, **spec)
        _sync(device)
        wall = time.perf_counter() - t0
    finally:
        hook.remove()
    new = out.shape[1] - prompt.shape[1]
    stats = cache.stats() if hasattr(cache, "stats") else {}
    return {"cache": kind, "decoding": decoding, "new_tokens": new, "wall_s": round(wall, 3),
            "tok_s": round(new / wall, 2), "forwards": forwards[0],
            "tokens_per_forward": round(new / max(forwards[0], 1), 3),
            "kv_mib": round(_kv_bytes(cache) / 2**20, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
            "evictions": stats.get("evictions", 0), "_tokens": out[0, prompt.shape[1]:].tolist()}


def to_markdown(rows: list[dict], args) -> str:
    lines = [f"# Speculative decoding and fp8 K/V with eviction ({args.shape}, {args.dtype}, batch 1, "
             f"prompt {args.prompt_tokens} repetitive, {args.new_tokens} new tokens, B={args.budget}, w={args.window}, "
             f"prompt lookup {args.lookup})", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], record: dict, out: Path, args) -> None:
    from vase.files.provenance import write_results

    # rows skipped past the deadline are named in the provenance: a results table holds measured rows only
    record = {**record, "skipped": [f"{r['cache']} {r['decoding']}" for r in rows if r.get("skipped")]}
    write_results(out / "gpu_spec_fp8.json", [r for r in rows if not r.get("skipped")], record,
                  table={"columns": list(COLUMNS), "formats": {"tok_s": ".2f", "tokens_per_forward": ".2f",
                                                               "kv_mib": ".1f", "peak_gib": ".2f"}})
    (out / "gpu_spec_fp8.md").write_text(to_markdown(rows, args))


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out or os.environ.get("OUT") or "gpu-spec-fp8-results")
    out.mkdir(parents=True, exist_ok=True)
    from vase.bench.shapes import build_random_model
    from vase.files.provenance import provenance

    record = provenance(settings={k: v for k, v in vars(args).items()}, device=str(device))
    if args.source_commit:
        record.update(commit=args.source_commit, dirty=False, commit_from="--source-commit")

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    model = build_random_model(args.shape, dtype=args.dtype, device=device)
    model.generation_config.eos_token_id = None  # EOS ignored: every run decodes --new-tokens
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    block = torch.randint(0, vocab, (args.block,), generator=gen)
    prompt = block.repeat(-(-args.prompt_tokens // args.block))[: args.prompt_tokens][None].to(device)
    log(f"{args.shape} {args.dtype} on {device}; warm-up")
    run_one(model, prompt, "vase-attnv", "lookup", args, device, min(16, args.new_tokens))
    rows: list[dict] = []
    plain_tokens: dict[str, list[int]] = {}
    for kind, decoding in ROWS:
        if time.perf_counter() - start > args.deadline_s:
            log(f"{kind} {decoding}: skipped, past --deadline-s {args.deadline_s:.0f}")
            rows.append({"cache": kind, "decoding": decoding, "skipped": "deadline"})
            continue
        row = run_one(model, prompt, kind, decoding, args, device, args.new_tokens)
        tokens = row.pop("_tokens")
        if decoding == "plain":
            plain_tokens[kind] = tokens
        row["same_tokens"] = tokens == plain_tokens[kind] if kind in plain_tokens else None
        rows.append(row)
        log(" ".join(f"{k}={row[k]}" for k in COLUMNS))
        write(rows, record, out, args)
    write(rows, record, out, args)
    log(f"done in {time.perf_counter() - start:.1f} s; wrote {out / 'gpu_spec_fp8.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
