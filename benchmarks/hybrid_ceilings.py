"""The traffic ceiling of bounded vs full decode for the hybrid shapes, including those too large to run here.

    python benchmarks/hybrid_ceilings.py --results docs/results/hybrid-ceilings.json
    python benchmarks/hybrid_ceilings.py --set mla --results docs/results/mla-ceilings.json

Nothing is timed: each shape is built on the meta device (shapes, no memory) and the traffic model
(`vase.bench.traffic`, docs/bench.md) gives the mean bytes of a batch-1 decode step with the full cache
and with an evicting cache at budget B, window w, after a prompt of P, for each output length. Their
ratio is the largest speed-up over the full cache that eviction can give where the step is bound by
memory: in a hybrid model only the full-attention layers' K/V shrink; the weights (of an MoE, the
routed experts only), the sliding layers and the recurrent states cost both caches the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

#: (shape, decoder layers or None for all, dtype): the hybrid shapes as deployed (bfloat16), and the
#: configurations measured on the development CPU (docs/bench.md), to read their shares against
SHAPES = (
    ("qwen3.5-0.8b", None, "bfloat16"), ("qwen3.5-27b", None, "bfloat16"), ("qwen3.5-35b-a3b", None, "bfloat16"),
    ("qwen3-next-80b-a3b", None, "bfloat16"),
    ("gpt-oss-20b", None, "bfloat16"), ("gemma3-1b", None, "bfloat16"), ("gemma3-270m", None, "bfloat16"),
    ("qwen3.5-0.8b", None, "float32"), ("gemma3-270m", None, "float32"), ("gpt-oss-20b", 4, "bfloat16"),
    ("qwen3.5-35b-a3b", 4, "bfloat16"),
)

#: multi-head latent attention shapes (issue 42): the K/V is the latent cache, kv_lora_rank + qk_rope_head_dim
#: per token and layer (`vase.hf.hybrid.kv_bytes_per_layer_token`)
MLA_SHAPES = (("deepseek-r1", None, "bfloat16"), ("deepseek-v2-lite", None, "bfloat16"), ("kimi-k2", None, "bfloat16"))
SETS = {"hybrid": SHAPES, "mla": MLA_SHAPES}


def ceiling_rows(lengths: list[int], budget: int, window: int, prompt: int,
                 shapes: tuple = SHAPES) -> list[dict]:
    """One row per entry of SHAPES: bytes per step and the ceiling vs full at each length (batch 1)."""
    from vase.bench.shapes import build_random_model
    from vase.bench.traffic import ModelBytes, decode_traffic
    from vase.hf.hybrid import full_attention_layers, layer_types

    rows = []
    for name, layers, dtype in shapes:
        model = build_random_model(name, dtype=dtype, device="meta", num_layers=layers,
                                   attn_implementation="eager")
        sizes = ModelBytes.from_model(model)
        types = layer_types(model.config)
        row = {"shape": name if layers is None else f"{name}, first {layers} layers", "dtype": dtype,
               "full_attention": f"{len(full_attention_layers(model.config))} of {len(types)}",
               "weights_gb": sizes.weights_read(1) / 1e9}
        for n in lengths:
            full = decode_traffic(sizes, "full", prompt, n, 1)
            bounded = decode_traffic(sizes, "evicting", prompt, n, 1, budget, window)
            row[f"kv_full_mb_{n}"] = full.kv / 1e6
            row[f"kv_bounded_mb_{n}"] = bounded.kv / 1e6
            row[f"ceiling_{n}"] = full.total / bounded.total
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=sorted(SETS), default="hybrid", help="which shapes (default: hybrid)")
    ap.add_argument("--lengths", default="4096,32768", help="comma-separated output lengths")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--results", type=Path, required=True, help="results file (JSON, with provenance)")
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if not lengths or min(lengths) < 2 or args.budget < 1 or args.window < 1 or args.prompt_length < 1:
        ap.error("--lengths must be >= 2 tokens each; --budget, --window and --prompt-length >= 1")

    from vase.files.provenance import finish, provenance, write_results

    record = provenance(note="computed by the traffic model, nothing timed")
    rows = ceiling_rows(lengths, args.budget, args.window, args.prompt_length, SETS[args.set])
    keys = ["shape", "dtype", "full_attention", "weights_gb"]
    columns = ["shape", "dtype", "full-attention layers", "weights read a step (GB)"]
    formats = {"weights_gb": ".2f"}
    for n in lengths:
        keys += [f"kv_full_mb_{n}", f"kv_bounded_mb_{n}", f"ceiling_{n}"]
        columns += [f"K/V and states a step at {n:,} tokens, full (MB)", "bounded (MB)", f"ceiling at {n:,}"]
        formats.update({f"kv_full_mb_{n}": ".0f", f"kv_bounded_mb_{n}": ".0f", f"ceiling_{n}": ".3f"})
    table = {"columns": columns, "keys": keys, "align": "lll" + "r" * (len(columns) - 3), "formats": formats}
    for row in rows:
        print("  ".join(f"{row[k]:{formats.get(k, '')}}" for k in keys))
    print(f"wrote {write_results(args.results, rows, finish(record), table=table)}")


if __name__ == "__main__":
    main()
