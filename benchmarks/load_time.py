"""Time a cold load of the default model against a warm one.

Cold: a fresh, empty cache directory, so ``load_model`` dequantises the embedded GGUF and saves a
float32 copy (plus its manifest). Warm: the same call again, which verifies the cached copy's
manifest and loads it. Both run in this process after the imports, so neither pays for importing
torch or transformers.

    python benchmarks/load_time.py [--warm-repeats 3] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from vase.models import DEFAULT_MODEL, load_model


def _timed_load(cache_dir: Path) -> float:
    start = time.perf_counter()
    model, tokenizer = load_model(None, cache_dir=cache_dir)
    elapsed = time.perf_counter() - start
    del model, tokenizer
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-repeats", type=int, default=3, help="warm loads to take the median of")
    parser.add_argument("--keep", action="store_true", help="keep the temporary cache directory")
    args = parser.parse_args()

    cache_dir = Path(tempfile.mkdtemp(prefix="vase-load-time-"))
    try:
        cold = _timed_load(cache_dir)
        warm_runs = [_timed_load(cache_dir) for _ in range(max(1, args.warm_repeats))]
    finally:
        if not args.keep:
            shutil.rmtree(cache_dir, ignore_errors=True)
    warm = statistics.median(warm_runs)

    print(f"model:       {DEFAULT_MODEL}")
    print(f"cold load:   {cold:7.2f} s  (dequantise GGUF + save float32 copy + manifest)")
    print(f"warm load:   {warm:7.2f} s  (median of {len(warm_runs)}: {', '.join(f'{t:.2f}' for t in warm_runs)})")
    print(f"cold / warm: {cold / warm:7.1f}x")
    if args.keep:
        print(f"cache kept:  {cache_dir}")


if __name__ == "__main__":
    main()
