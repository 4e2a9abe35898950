#!/usr/bin/env python
"""The serving claim on a GPU: N requests at once into one vLLM engine with a fixed KV pool, stock vLLM vs vase.

A Qwen3-4B-shaped model with random weights (vLLM's ``load_format="dummy"`` from a config-only folder;
nothing is downloaded, throughput does not depend on the weights) in bf16. 16 requests of 256 random
prompt tokens each generate 8,192 tokens (EOS ignored), submitted at once, in two regimes:

    ample   the KV pool holds all 16 requests at full length: the plugin's overhead (target: within 10%)
    tight   the pool holds 4 of them: stock vLLM queues and preempts, bounded requests all fit

for stock vLLM (``full``) and each method at each budget (default vase-attnv at B = 2048, w = 64).
Written to --out (else $OUT, else ./gpu-vllm-bench-results): vllm_bench.csv / .md, vllm_timeline.csv
(every engine step) and vllm_bench.png (requests running and KV blocks in use over time). Rows are
reported as each configuration finishes; one that fails (e.g. the plugin refusing the platform) is
logged and skipped, so stock vLLM's numbers survive.

    python benchmarks/gpu_vllm_bench.py                               # the GPU run (needs vllm==0.32.*)
    python benchmarks/gpu_vllm_bench.py --new-tokens 4096 --regimes tight
    python benchmarks/gpu_vllm_bench.py --shape smollm2-135m --num-layers 2 --requests 4 --new-tokens 64 \\
        --prompt 16 --budgets 40 --window 8 --block-size 32 --regimes tight        # CPU smoke test

On a CUDA platform the plugin runs its GPU worker (``vase.vllm.gpu_worker``: built and unit-tested
on CPU in the GPU layouts; see docs/vllm-gpu.md) on vLLM's V1 model runner, with piecewise CUDA
graphs (``--cudagraph-mode``, default PIECEWISE) and no async scheduling. Stock vLLM runs twice per
regime: ``full`` at its own defaults (V2 runner where vLLM picks it, full decode CUDA graphs, async
scheduling: the figure a user sees, and the baseline of every ``vs_full`` column) and
``full@vase-settings`` at the plugin's settings (V1, ``--cudagraph-mode``, synchronous), which
separates the cost of those settings from the cost of eviction. ``--model`` takes a Hugging Face model id or a local folder (real weights; the pool sizes
come from the model's shape).

    python benchmarks/gpu_vllm_bench.py --model Qwen/Qwen3-4B --new-tokens 4096      # a real model id

Time (not measured: no GPU run was possible when this was written): at 8k tokens, expect a few
minutes per configuration on one H100-class GPU, i.e. 10-20 minutes for both regimes with one method.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a clone without installing: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-4b", help="model shape name (vase.bench.shapes) or a config.json path")
    p.add_argument("--model", default=None,
                   help="a Hugging Face model id or local folder with weights, instead of random ones")
    p.add_argument("--num-layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=8192)
    p.add_argument("--methods", default="vase-attnv", help="comma-separated evicting methods (full is added)")
    p.add_argument("--budgets", default="2048", help="comma-separated budgets")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--regimes", default="ample,tight")
    p.add_argument("--block-size", type=int, default=None, help="default: vLLM's (16 on GPU, 128 on CPU)")
    p.add_argument("--cudagraph-mode", default="PIECEWISE",
                   help="CUDA graph mode of the vase engines and of the full@vase-settings row on a GPU (PIECEWISE "
                        "or NONE; vase refuses FULL modes); the full baseline keeps vLLM's default")
    p.add_argument("--out", default=None, help="output directory (default: $OUT, else ./gpu-vllm-bench-results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from vase.bench.shapes import resolve_shape
    from vase.bench.vllm_bench import run_vllm_bench, write_vllm_report

    out = Path(args.out or os.environ.get("OUT") or "gpu-vllm-bench-results")
    out.mkdir(parents=True, exist_ok=True)
    engine_kwargs: dict = {}
    if args.model is None:  # random weights of the shape: vLLM reads only config.json
        model_dir = out / "model"
        resolve_shape(args.shape, num_layers=args.num_layers).save_pretrained(model_dir)
        model = str(model_dir)
        engine_kwargs = {"load_format": "dummy", "skip_tokenizer_init": True}
    else:
        model = args.model
    vase_kwargs = None
    if torch.cuda.is_available():  # the plugin's engines and the second stock row; the baseline keeps vLLM's defaults
        vase_kwargs = {"compilation_config": {"cudagraph_mode": args.cudagraph_mode}, "async_scheduling": False}
    t0 = time.time()
    rows = run_vllm_bench(model, [m for m in args.methods.split(",") if m], [int(b) for b in args.budgets.split(",")],
                          n_requests=args.requests, new_tokens=args.new_tokens, prompt_len=args.prompt,
                          window=args.window, regimes=[r for r in args.regimes.split(",") if r], dtype=args.dtype,
                          block_size=args.block_size, engine_kwargs=engine_kwargs, vase_kwargs=vase_kwargs,
                          skip_errors=True,
                          in_process=not torch.cuda.is_available(), log=lambda m: print(m, flush=True))
    if not rows:
        print("no configuration finished", file=sys.stderr)
        return 1
    paths = write_vllm_report(rows, out)
    meta = {"argv": sys.argv[1:] if argv is None else argv, "seconds": time.time() - t0, "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version()}
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        pass
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
