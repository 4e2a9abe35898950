#!/usr/bin/env python
"""One layer's decode attention over the compiled cache's 4-bit store, three ways (SmolLM2-135M shapes).

    python benchmarks/quant_attend.py --batch 1 --out docs/results/compiled-quant-attend-b1.json

- attend: `StaticQuant.attend` (what the compiled step runs): the codes dequantized plane by plane in entry
  order (no zero fill, no scatter into slot order), then two GEMMs;
- materialized: `StaticQuant.read()` (the whole dequantized [b, h, B + w, d] K/V in slot order), then SDPA;
- fp copy: SDPA over a dense [b, h, B + w, d] buffer, the attention a persistent dequantized copy updated
  at flush time would run (its upkeep at flushes and evictions is not counted: a lower bound for that design).

Each one `torch.compile`d (inductor) on its own, timed over `--calls` calls after a warm-up, per call, in
microseconds of this process's CPU time (one thread). The store comes from a real cache: a random
prompt of `--prompt` tokens prefilled into a 4-bit `EvictionCache` (B = 512, w = 64), then converted.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=500)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5, help="rounds; each times the three ways in turn")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from vase.bench.shapes import build_random_model
    from vase.caches.eager import EvictionCache
    from vase.generation.decoding import prefill
    from vase.files.provenance import finish, provenance, write_results
    from vase.caches.static import StaticEvictionCache

    record = provenance()
    model = build_random_model("smollm2-135m", dtype=torch.float32, device="cpu", attn_implementation="sdpa")
    ids = torch.randint(0, 1000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    cache = EvictionCache(model, "vase-attnv", 512, 64, seed=list(range(args.batch)), kv_bits=4)
    with torch.inference_mode():
        prefill(model, ids, torch.ones_like(ids), cache)
        static = StaticEvictionCache.from_eager(cache, model.config.num_attention_heads)
    layer = static.layers[0]
    store, length = layer.store, layer.length
    b, h, cap, d = store.keys.shape
    hq = model.config.num_attention_heads
    query = torch.randn(b, hq, 1, d, generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(cap)[None, :] < length[:, None])[:, None, None, :]
    dense_k, dense_v = (t.clone() for t in store.read())

    def fused(q):
        return store.attend(q, length, None)

    def materialized(q):
        k, v = store.read()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def fp_copy(q):
        return torch.nn.functional.scaled_dot_product_attention(q, dense_k, dense_v, attn_mask=mask, enable_gqa=True)

    ways = {name: torch.compile(fn, fullgraph=True, dynamic=False) for name, fn in
            (("attend", fused), ("materialized", materialized), ("fp copy", fp_copy))}
    with torch.inference_mode():
        ref = materialized(query)
        for name, fn in ways.items():  # compile, and check each against the uncompiled materialized one
            out = fn(query).reshape(ref.transpose(1, 2).shape) if name == "attend" else fn(query)
            err = (out - ref.transpose(1, 2) if name == "attend" else out - ref).abs().max().item()
            print(f"{name}: max |difference| from eager read()+SDPA {err:.2e}")
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                for _ in range(50):
                    fn(query)
                t = time.process_time()
                for _ in range(args.calls):
                    fn(query)
                times[name].append((time.process_time() - t) / args.calls * 1e6)
    rows = []
    for name, ts in times.items():
        ts = sorted(ts)
        rows.append({"attention": name, "batch": b, "stored tokens": int(length.max()),
                     "us per call (median)": round(ts[len(ts) // 2], 1), "min": round(ts[0], 1),
                     "max": round(ts[-1], 1)})
        print(rows[-1], flush=True)
    if args.out:
        write_results(args.out, rows, finish({**record, "settings": vars(args)}))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
