"""Write a finished `vase eval` run's summary rows to a results file (the README's main table).

    python scripts/eval_results.py RUN_DIR docs/results/make-eval.json [--against METHOD:B]

The rows are rebuilt from the run's JSONL files (`vase summarize`, nothing rerun); the provenance is
this checkout's commit and machine, the `vase eval` command that the run's config stands for (from
`make eval` when not given), and the run's start and end times. `make docs` then renders the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from vase.eval.report import parse_reference, summarize
from vase.provenance import finish, provenance, write_results

MAKE_EVAL = ("vase --threads 1 eval --task recall-3 --limit 16 --samples 1 --greedy --methods "
             "streamingllm,snapkv,rkv,vase-attnv,vase-dkv --budgets 12,32 --window 4 --max-new-tokens 32 "
             "--batch-size 16 --fidelity")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("out")
    ap.add_argument("--against", default="full", help="pair every row with METHOD:B instead of full")
    ap.add_argument("--command", default=MAKE_EVAL + "   # make eval",
                    help="the command that made the run (default: make eval's)")
    ap.add_argument("--note", help="a sentence printed under the table (e.g. what a repeat of the run gave)")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    config = json.loads((run / "config.json").read_text())
    samples = sorted(run.glob("samples.rank*.jsonl"))
    ended = max(p.stat().st_mtime for p in samples) if samples else None
    record = provenance(command=args.command, run=config.get("name"), run_started=config.get("created"),
                        run_finished=(datetime.fromtimestamp(ended, timezone.utc).isoformat(timespec="seconds")
                                      if ended else None),
                        model_sha256=(config.get("identity") or {}).get("model_sha256"))
    if args.note:
        record["note"] = args.note
    rows = summarize(run, print_table=False, plots=False, reference=parse_reference(args.against))
    write_results(args.out, rows, finish(record), table={"render": "eval"})
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
