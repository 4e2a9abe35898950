"""Where a decode step's time goes: torch.profiler over steady-state steps, grouped by what the time is for.

    python benchmarks/profile_step.py --shape smollm2-135m --threads 1 --steps 32 \
        --results docs/results/profile-step-smollm2.json

Per configuration (full at `--full-length` stored tokens, dynamic likewise, each `--methods` at budget
B, window w after its first evictions), the steps are decoded greedily one by one under the profiler
and each op's self CPU time is put in one group:

- weights: the matrix products of the linear layers (aten::mm, addmm, ...; they read the weights);
- attention: the attention kernel (scaled_dot_product_attention's own ops, softmax, bmm);
- kv copies: copies of K/V (aten::cat of DynamicCache, copy_/index/expand copies of repeat_kv or masks);
- eviction: everything inside `EvictionLayer.evict` (recorded as one range);
- other: the rest (norms, RoPE, activations, Python-launched small ops).

Per group: ms per step and share of the step; with the traffic model's bytes of the step
(`vase.bench.traffic`) and the bandwidth probe, the time the memory alone would need.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GROUPS = ("weights", "attention", "kv copies", "eviction", "other")
_WEIGHTS = {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm_linear"}
_ATTN = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
         "aten::_scaled_dot_product_attention_math", "aten::_softmax", "aten::softmax", "aten::bmm", "aten::baddbmm"}
_COPIES = {"aten::cat", "aten::copy_", "aten::index", "aten::index_select", "aten::gather", "aten::expand",
           "aten::clone", "aten::contiguous", "aten::_unsafe_view", "aten::repeat_interleave", "aten::index_put_",
           "aten::slice_scatter", "aten::where", "aten::masked_fill"}


def group_of(name: str) -> str:
    if name in _WEIGHTS:
        return "weights"
    if name in _ATTN:
        return "attention"
    if name in _COPIES:
        return "kv copies"
    return "other"


def profile_config(model, method: str, budget: int | None, window: int, prompt: int, warm: int, steps: int,
                   batch: int = 1):
    """Decode `warm` untimed steps, then `steps` under the profiler, `batch` rows of the same random prompt;
    returns (ms per step by group, wall ms/step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from vase.hf.attention import uninstall
    from vase.caches.eager import EvictionCache, EvictionLayer
    from vase.hf.compat import cache_kwargs

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).expand(batch, prompt)
    if method == "dynamic":
        from transformers import DynamicCache

        uninstall(model)
        cache = DynamicCache(config=model.config)
    else:
        cache = EvictionCache(model, method, budget if budget else prompt + warm + steps + 1, window,
                              max_length=prompt + warm + steps + 1)
        for layer in cache.layers:  # one profiler range around each eviction (instance attribute only)
            def timed(due, _evict=layer.evict):
                with record_function("vase::evict"):
                    _evict(due)
            layer.evict = timed
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                    position_ids=torch.arange(prompt)[None].expand(batch, prompt),
                    use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)

        def step(i: int):
            nonlocal token
            out = model(input_ids=token, position_ids=torch.full((batch, 1), prompt + i), use_cache=True,
                        logits_to_keep=1,
                        **cache_kwargs(cache))
            token = out.logits[:, -1].argmax(-1, keepdim=True)

        for i in range(warm):
            step(i)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for i in range(warm, warm + steps):
                step(i)
            wall = (time.perf_counter() - start) / steps * 1000
    by_group = dict.fromkeys(GROUPS, 0.0)
    evict_total = 0.0
    for evt in prof.key_averages():
        if evt.key == "vase::evict":
            evict_total = evt.cpu_time_total / 1000  # everything inside the range, children included
            continue
        by_group[group_of(evt.key)] += evt.self_cpu_time_total / 1000
    if evict_total:  # move the eviction's children out of the other groups, proportionally
        inside = sum(by_group.values())
        for g in list(by_group):
            by_group[g] -= evict_total * by_group[g] / inside if inside else 0
        by_group["eviction"] = evict_total
    return {g: v / steps for g, v in by_group.items()}, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default="vase-attnv")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--full-length", type=int, default=1024, help="tokens the full/dynamic caches hold when profiled")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (the same prompt in each)")
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args()
    if args.batch < 1:
        sys.exit(f"profile_step: --batch must be >= 1 (rows decoded together), got {args.batch}")

    import torch

    torch.set_num_threads(args.threads)
    from vase.bench.bandwidth import probe_bandwidth
    from vase.bench.shapes import build_random_model
    from vase.bench.traffic import ModelBytes, decode_traffic
    from vase.files.provenance import finish, provenance, write_results

    record = provenance(threads=args.threads)
    model = build_random_model(args.shape)
    sizes = ModelBytes.from_model(model)
    bw = probe_bandwidth("cpu")
    print(f"bandwidth probe: {bw / 1e9:.2f} GB/s at {args.threads} thread(s)")
    original = model.config._attn_implementation
    configs = [("full", None), ("dynamic", None)] + [(m, args.budget) for m in args.methods.split(",") if m]
    rows = []
    for method, budget in configs:
        if method in ("full", "dynamic"):
            prompt, warm = args.full_length, 0  # a prompt as long as the cache to profile: no decoding to get there
            traffic = decode_traffic(sizes, method, prompt, args.steps + 1, args.batch)
        else:
            prompt, warm = args.prompt_length, budget + 2 * args.window  # past the first evictions
            traffic = decode_traffic(sizes, "evicting", prompt, warm + args.steps + 1, args.batch, budget, args.window)
        groups, wall = profile_config(model, method, budget, args.window, prompt, warm, args.steps, args.batch)
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)
        memory_ms = traffic.total / bw * 1000
        row = {"method": method, "budget": budget, "window": args.window if budget else None,
               "stored_tokens_at_start": prompt + warm if budget is None else None, "steps": args.steps,
               "batch": args.batch, "wall_ms_step": wall, "profiled_ms_step": sum(groups.values()),
               **{f"{g.replace(' ', '_')}_ms": groups[g] for g in GROUPS},
               "bytes_step": traffic.total, "memory_bound_ms": memory_ms, "bandwidth_gbs": bw / 1e9,
               "threads": args.threads, "model": f"random:{args.shape}"}
        rows.append(row)
        total = sum(groups.values())
        print(f"{method:>12} B={budget or '-':>4}: {wall:6.1f} ms/step wall; memory alone {memory_ms:5.1f} ms "
              f"({traffic.total / 1e6:.1f} MB); " + ", ".join(f"{g} {groups[g]:.1f} ms ({100 * groups[g] / total:.0f}%)"
                                                          for g in GROUPS), flush=True)
    if args.results:
        print(f"wrote {write_results(args.results, rows, finish(record))}")


if __name__ == "__main__":
    main()
