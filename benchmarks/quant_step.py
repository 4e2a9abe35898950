"""What a decode step costs with quantized K/V storage: ratios within one run.

    .venv/bin/python benchmarks/quant_step.py --new-tokens 96 --prompt 384 --rounds 2

Random weights with SmolLM2-135M's shapes (fp32, batch 1). Configurations run interleaved,
`rounds` times each; the median ms per decode step is reported with its ratio to the
full-precision cache of the same method, and the share of the step spent in the quantized
layer's own work (dequantizing into a fresh K/V tensor, storing new tokens, flushing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vase.bench.shapes import build_random_model
from vase.caches.eager import EvictionCache
from vase.hf.compat import cache_kwargs
from vase.storage.quantized import QuantLayer

CONFIGS = [("full", 16), ("full", 8), ("full", 4), ("full", 2), ("vase-attnv", 16), ("vase-attnv", 4)]


def timed_methods() -> dict[str, float]:
    """Wrap QuantLayer's storage work with timers (seconds accumulated per method name)."""
    spent: dict[str, float] = {}
    for name in ("_materialize", "_ingest", "_compact"):
        fn = getattr(QuantLayer, name)

        def wrap(self, *a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(self, *a, **k)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t

        setattr(QuantLayer, name, wrap)
    return spent


@torch.inference_mode()
def run(model, method: str, bits: int, prompt: torch.Tensor, new_tokens: int, budget: int, window: int,
        spent: dict) -> tuple[float, float, int]:
    kw = {"kv_bits": bits} if bits != 16 else {}
    cache = EvictionCache(model, method, budget, window, max_length=prompt.shape[1] + new_tokens + 1, **kw)
    out = model(input_ids=prompt, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    pos = prompt.shape[1]
    spent.clear()
    t = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=tok, position_ids=torch.tensor([[pos]]), **cache_kwargs(cache), use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        pos += 1
    total = time.perf_counter() - t
    return total / new_tokens * 1e3, sum(spent.values()) / total, cache.stats()["kv_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=384)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_random_model("smollm2-135m")
    prompt = torch.randint(0, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    spent = timed_methods()
    ms: dict = {c: [] for c in CONFIGS}
    share: dict = {c: [] for c in CONFIGS}
    held: dict = {}
    for _ in range(args.rounds):
        for method, bits in CONFIGS:
            step, frac, nbytes = run(model, method, bits, prompt, args.new_tokens, args.budget, args.window, spent)
            ms[(method, bits)].append(step)
            share[(method, bits)].append(frac)
            held[(method, bits)] = nbytes
    print(f"SmolLM2-135M shapes, fp32, batch 1, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"B = {args.budget}, w = {args.window}, {args.threads} thread(s), median of {args.rounds}")
    print("| method | kv_bits | ms/step | vs same method at 16 bits | quantized-storage share of the step | KV held |")
    print("|---|---|---|---|---|---|")
    for method, bits in CONFIGS:
        m = statistics.median(ms[(method, bits)])
        base = statistics.median(ms[(method, 16)])
        print(f"| {method} | {bits} | {m:.1f} | {m / base:.2f} | {statistics.median(share[(method, bits)]):.0%} | "
              f"{held[(method, bits)] / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()
