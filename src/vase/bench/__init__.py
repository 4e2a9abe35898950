"""`vase bench`: decode throughput and memory of the eviction methods against the full cache.

    from vase.bench import build_random_model, run_bench, write_report
    model = build_random_model("smollm2-135m")         # shapes of a real model, random weights
    rows = run_bench(model, ["vase-attnv", "vase-dkv"], budgets=[512], output_lengths=[1024, 4096],
                     batch_sizes=[1], repeats=1)
    write_report(rows, "bench-results/run1")           # table, bench.csv, bench.md, PNGs

`benchmarks/gpu_bench.py` is the standalone GPU run (Qwen3-4B shapes, bf16, batch 16).
"""

from .report import CSV_COLUMNS, plot, print_table, read_csv, to_markdown, write_csv, write_report
from .runner import BASELINES, add_ratios, expected_evictions, run_bench, run_one
from .shapes import SHAPES, build_random_model, resolve_shape, shape_names

__all__ = [
    "BASELINES", "CSV_COLUMNS", "SHAPES", "add_ratios", "build_random_model", "expected_evictions", "plot",
    "print_table", "read_csv", "resolve_shape", "run_bench", "run_one", "shape_names", "to_markdown", "write_csv",
    "write_report",
]
