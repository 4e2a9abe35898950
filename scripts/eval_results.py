"""Write a finished `vase eval` run's summary rows to a results file (the README's main table).

    python scripts/eval_results.py RUN_DIR docs/results/make-eval.json [--against METHOD:B]

The rows are rebuilt from the run's JSONL files (`vase summarize`, nothing rerun). The provenance is the
run's own: the commit (and dirty flag), machine, versions and load that `vase eval` recorded in the run's
provenance.jsonl when it started and ended (vase.eval.run_provenance), with the `vase eval` command that the
run's config stands for (from `make eval` when not given); this script's own time is added as `rendered`.
A run made before provenance.jsonl existed is refused: its commit is unknown. `make docs` then renders the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from vase.eval.report import parse_reference, summarize
from vase.eval.run_provenance import run_provenance
from vase.files.provenance import write_results

MAKE_EVAL = ("vase --threads 1 eval --task recall-3 --limit 16 --samples 1 --greedy --methods "
             "streamingllm,snapkv,rkv,vase-attnv,vase-dkv --budgets 12,32 --window 4 --max-new-tokens 32 "
             "--batch-size 16 --fidelity")


def run_record(run: Path, config: dict, command: str) -> dict:
    """The results file's provenance: the run's own (provenance.jsonl), the command, and when this script ran."""
    record = run_provenance(run)
    if record is None:
        raise SystemExit(f"{run}: no provenance.jsonl (a run made before vase eval recorded its commit and "
                         f"machine), so the commit it ran at is unknown: rerun it (`make eval`)")
    if "finished" not in record:
        raise SystemExit(f"{run}: provenance.jsonl has no end: the run has not finished (or was killed); "
                         f"finish it (run the same command again) first")
    started, recorded = record.pop("date"), record.pop("command", None)
    record = {"date": started, **record, "command": command, "run_command": recorded, "run": config.get("name"),
              "run_started": started, "run_finished": record.pop("finished"),
              "rendered": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    sha = (config.get("identity") or {}).get("model_sha256")
    if sha:
        record["model_sha256"] = sha
    return record


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
    record = run_record(run, config, args.command)
    if args.note:
        record["note"] = args.note
    rows = summarize(run, print_table=False, plots=False, reference=parse_reference(args.against))
    write_results(args.out, rows, record, table={"render": "eval"})
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
