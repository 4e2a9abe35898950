"""The vLLM plugin's query ring on large GPUs: its bytes at max_num_seqs 256 and 1,024 against the ring sized
from the KV pool, for Qwen3-8B, Qwen3.5-27B and a Llama-3-70B shape (issue 39).

    python benchmarks/ring_memory.py --results docs/results/ring-memory.json

Nothing is timed or allocated: the shapes are built on the meta device (for the weights' bytes), and the rows
the plugin would give the ring come from its own code (`vase.vllm.ring_size`: `ring_reserve` taken from the KV
memory, then `ring_rows` of the pool left). The KV memory is an upper bound: `--util` of the GPU's memory less
the weights (per tensor-parallel rank), no activations or CUDA graphs; Qwen3.5-27B's per-request linear-attention
states are left out (they also come from the pool), so its pool holds fewer requests than shown and its ring
is smaller still. bf16 weights, K/V and queries; blocks of 16 tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GIB = 1 << 30
MIB = 1 << 20


def llama3_70b_config():
    """Llama-3-70B's published shape (80 layers, 64 query heads, 8 KV heads, head_dim 128)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                       tie_word_embeddings=False)


def shape_of(name: str) -> dict:
    """Evicted layers, query and KV heads, head_dim and the parameter count of a shape."""
    from vase.bench.shapes import build_random_model
    from vase.hf.hybrid import full_attention_layers

    config = llama3_70b_config() if name == "llama-3-70b" else name
    model = build_random_model(config, dtype="bfloat16", device="meta", attn_implementation="eager")
    cfg = model.config.get_text_config()
    return {"layers": len(full_attention_layers(model.config)), "q_heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "head_dim": getattr(cfg, "head_dim", None)
            or cfg.hidden_size // cfg.num_attention_heads, "params": sum(p.numel() for p in model.parameters())}


def ring_row(name: str, tp: int, budget: int, window: int, gpu_gib: float, util: float, block: int) -> dict:
    from vase.core.schedule import max_blocks
    from vase.vllm.ring_size import ring_bytes_per_request, ring_reserve, ring_rows

    s = shape_of(name)
    q, kv = s["q_heads"] // tp, s["kv_heads"] // tp
    ring_req = ring_bytes_per_request(s["layers"], q, window, s["head_dim"], 2)
    block_bytes = s["layers"] * 2 * kv * block * s["head_dim"] * 2
    kv_req = max_blocks(budget, window, block) * block_bytes
    available = int(util * gpu_gib * GIB - s["params"] * 2 / tp)
    row = {"shape": name, "tp": tp, "budget": budget, "window": window, "weights_gib_rank": s["params"] * 2 / tp / GIB,
           "ring_mib_request": ring_req / MIB, "ring_gib_256": 256 * ring_req / GIB, "ring_gib_1024": 1024 * ring_req / GIB}
    for seqs in (256, 1024):
        reserve = ring_reserve(available, kv_req, ring_req, seqs)
        rows = ring_rows((available - reserve) // block_bytes, block, budget, window, seqs)
        row[f"rows_{seqs}"] = rows
        row[f"pool_ring_gib_{seqs}"] = rows * ring_req / GIB
        row[f"share_{seqs}"] = 100.0 * rows * ring_req / available if available > 0 else None
    row["kv_gib_rank"] = available / GIB
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="512,4096", help="comma-separated budgets B")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--gpu-gib", type=float, default=139.8, help="memory of one GPU (H200: 139.8 GiB)")
    ap.add_argument("--util", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--results", type=Path, required=True, help="results file (JSON, with provenance)")
    args = ap.parse_args()
    try:
        budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--budgets takes comma-separated integers, got {args.budgets!r}")
    if not budgets or min(budgets) <= args.window or args.window < 1 or not 0 < args.util <= 1:
        ap.error("each budget must exceed --window >= 1, and --util must be in (0, 1]")

    from vase.files.provenance import finish, provenance, write_results

    record = provenance(note="computed from the shapes and vase.vllm.ring_size, nothing timed or allocated",
                        gpu_gib=args.gpu_gib, util=args.util, block_size=args.block_size)
    shapes = (("qwen3-8b", 1), ("qwen3.5-27b", 1), ("llama-3-70b", 2))
    rows = [ring_row(name, tp, b, args.window, args.gpu_gib, args.util, args.block_size)
            for name, tp in shapes for b in budgets]
    keys = ["shape", "tp", "budget", "ring_mib_request", "ring_gib_256", "ring_gib_1024", "kv_gib_rank",
            "rows_256", "pool_ring_gib_256", "rows_1024", "pool_ring_gib_1024", "share_1024"]
    columns = ["shape", "TP", "B", "ring per request (MiB)", "max_num_seqs ring, 256 (GiB)", "1,024 (GiB)",
               "KV memory per rank (GiB, at most)", "pool-sized rows (256)", "ring (GiB)", "pool-sized rows (1,024)",
               "ring (GiB)", "% of KV memory"]
    formats = {"ring_mib_request": ".1f", "ring_gib_256": ".1f", "ring_gib_1024": ".1f", "kv_gib_rank": ".1f",
               "pool_ring_gib_256": ".1f", "pool_ring_gib_1024": ".1f", "share_1024": ".1f"}
    table = {"columns": columns, "keys": keys, "align": "l" + "r" * (len(keys) - 1), "formats": formats}
    for row in rows:
        print("  ".join(f"{row[k]:{formats.get(k, '')}}" for k in keys))
    print(f"wrote {write_results(args.results, rows, finish(record), table=table)}")


if __name__ == "__main__":
    main()
