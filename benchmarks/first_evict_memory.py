"""Peak extra memory of each method's first eviction after a long prompt, per attention layer (issue 39).

    python benchmarks/first_evict_memory.py --results docs/results/first-evict-memory.json

The first eviction after a prompt of P tokens scores all P - w candidates at once: the largest eviction a
request makes. Each row runs the vLLM plugin's eviction of one request in one layer (`vase.vllm.paged.evict_paged`:
gather the request's slots from its paged blocks, the policy's choice, the compaction) on random K/V in a paged
cache of the given shape (by default one attention layer of Qwen3-8B: 8 KV heads, 32 query heads, head_dim 128,
bfloat16), and reads the peak of the bytes torch's CPU allocator holds during the call, above what it held before
(`torch.profiler` memory events: exact allocation sizes, no sampling). The cache itself is not counted. Quest
never evicts: its row is one decode step's page selection (`attend_mask`, one query over P slots).
`rkv with the old n x n score` is R-KV's redundancy as it was before issue 39 (`k @ k^T`), run only where it fits.
Linear growth: the 32k -> 128k ratio is 4; an [n, n] term makes it 16.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

MIB = 1 << 20


def peak_extra_bytes(fn) -> int:
    """Peak bytes the CPU allocator holds while `fn()` runs, above what it held when it started."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def old_key_redundancy(keys: torch.Tensor) -> torch.Tensor:
    """R-KV's redundancy before issue 39: the [b, h, n, n] cosine matrix in float32."""
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    cos = torch.matmul(k, k.transpose(-1, -2))
    cos.diagonal(dim1=-2, dim2=-1).zero_()
    return cos.mean(-1).softmax(-1)


def one_row(name: str, prompts: list[int], shape: dict, budget: int, window: int, block_size: int,
            old_max: int) -> dict:
    from vase.core.policies import get_policy
    from vase.core.policies.scores import window_attention
    from vase.vllm.paged import RequestPolicyState, evict_paged

    dtype = getattr(torch, shape["dtype"])
    h_kv, h_q, d = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    row = {"method": name}
    for p in prompts:
        g = torch.Generator().manual_seed(p)
        queries = torch.randn(1, h_q, window, d, generator=g).to(dtype)
        if name == "rkv with the old n x n score":
            if p > old_max:
                row[f"mib_{p}"] = None
                continue
            keys = torch.randn(1, h_kv, p - window, d, generator=g).to(dtype)
            policy = get_policy("rkv")

            def run():
                policy.rkv_lambda * window_attention(keys, queries) - (1 - policy.rkv_lambda) * old_key_redundancy(keys)
        elif name == "quest":
            keys = torch.randn(1, h_kv, p, d, generator=g).to(dtype)
            q1 = queries[:, :, -1:]

            def run():
                get_policy("quest").attend_mask(keys, q1, p - 1, budget, window)
        else:
            policy = get_policy(name)
            n_blocks = -(-p // block_size)
            key_cache = torch.randn(n_blocks, h_kv, block_size, d, generator=g).to(dtype)
            value_cache = torch.randn(n_blocks, h_kv, block_size, d, generator=g).to(dtype)
            block_ids = torch.randperm(n_blocks, generator=g)
            state = RequestPolicyState(generator=torch.Generator().manual_seed(0))

            def run():
                evict_paged(key_cache, value_cache, block_ids, p, queries if policy.needs_queries else None, policy,
                            budget, window, state, layer=0)
        row[f"mib_{p}"] = peak_extra_bytes(run) / MIB
        print(f"{name:24s} P={p:>7,}  {row[f'mib_{p}']:10.1f} MiB", flush=True)
        del run
    big, small = prompts[-1], prompts[-2] if len(prompts) > 1 else None
    if small and row.get(f"mib_{big}") and row.get(f"mib_{small}"):
        row["growth"] = row[f"mib_{big}"] / row[f"mib_{small}"]
    else:
        row["growth"] = None
    row["kib_per_token"] = row[f"mib_{big}"] * 1024 / big if row.get(f"mib_{big}") else None
    return row


def main() -> None:
    from vase.core.policies import POLICIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="2048,8192,32768,131072", help="comma-separated prompt lengths")
    ap.add_argument("--methods", default=None, help="comma-separated methods (default: every evicting one and quest)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--old-max", type=int, default=8192, help="longest prompt the [n, n] R-KV row runs at")
    ap.add_argument("--results", type=Path, required=True, help="results file (JSON, with provenance)")
    args = ap.parse_args()
    try:
        prompts = sorted(int(x) for x in args.prompts.split(",") if x.strip())
    except ValueError:
        ap.error(f"--prompts takes comma-separated integers, got {args.prompts!r}")
    if not prompts or min(prompts) <= args.budget + args.window:
        ap.error(f"every prompt must be longer than budget + window ({args.budget + args.window})")
    if args.q_heads % args.kv_heads:
        ap.error("--q-heads must be a multiple of --kv-heads")
    names = [n for n, cls in POLICIES.items() if cls.evicts] + ["quest", "rkv with the old n x n score"]
    if args.methods:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
    torch.set_num_threads(1)

    from vase.files.provenance import finish, provenance, write_results

    shape = {"kv_heads": args.kv_heads, "q_heads": args.q_heads, "head_dim": args.head_dim, "dtype": args.dtype}
    record = provenance(shape=shape, budget=args.budget, window=args.window, block_size=args.block_size,
                        note="peak extra CPU allocator bytes of one layer's first eviction (torch.profiler)")
    rows = [one_row(name, prompts, shape, args.budget, args.window, args.block_size, args.old_max) for name in names]
    keys = ["method"] + [f"mib_{p}" for p in prompts] + ["growth", "kib_per_token"]
    columns = ["method"] + [f"P = {p:,} (MiB)" for p in prompts] + \
        [f"{prompts[-1] // 1024}k / {prompts[-2] // 1024}k" if len(prompts) > 1 else "growth",
         f"KiB per prompt token at {prompts[-1] // 1024}k"]
    formats = {k: ".1f" for k in keys[1:]}
    formats["growth"] = ".2f"
    table = {"columns": columns, "keys": keys, "align": "l" + "r" * (len(columns) - 1), "formats": formats}
    print(f"wrote {write_results(args.results, rows, finish(record), table=table)}")


if __name__ == "__main__":
    main()
