#!/usr/bin/env python
"""Squeeze-regime bench, before (the plugin at 290ec20: recompute in one prefill) and after (exact replay).

    git archive 290ec20 src | tar -x -C /tmp/before && cp src/vase/bench/vllm_bench.py /tmp/before/src/vase/bench/
    python benchmarks/vllm_squeeze_before_after.py        # writes docs/results/vllm-squeeze-preemption.json

The same `vase bench --engine vllm` command once per plugin version (PYTHONPATH), one after the other.
"""
import csv, os, subprocess, sys
sys.path.insert(0, "/work/wt/vllm/src")
from vase.files.provenance import provenance, finish, write_results

ARGS = ["bench", "--engine", "vllm", "--methods", "snapkv", "--budgets", "64", "--window", "16", "--lengths", "256",
        "--prompt-length", "64", "--requests", "8", "--regimes", "squeeze", "--block-size", "32"]
runs = [("after", "/work/wt/vllm/src"), ("before (plugin at 290ec20)", "/tmp/before/src")]
cmd = "VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 vase " + " ".join(ARGS) + "   # once per plugin version"
rec = provenance(command=cmd, versions_compared=[r[0] for r in runs])
rows = []
for label, src in runs:
    out = f"/tmp/sq/{label.split()[0]}"
    env = dict(os.environ, PYTHONPATH=src, VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="1")
    p = subprocess.run(["/work/main/.venv/bin/vase", *ARGS, "--out", out], env=env, cwd="/tmp/sq",
                       capture_output=True, text=True, timeout=1400)
    open(out + ".log", "w").write(p.stdout + p.stderr)
    if p.returncode != 0:
        rows.append({"plugin": label, "error": (p.stderr.strip().splitlines() or ["?"])[-1]})
        continue
    with open(os.path.join(out, "vllm_bench.csv")) as f:
        for r in csv.DictReader(f):
            rows.append({"plugin": label, **r})
finish(rec)
write_results("/work/wt/vllm/docs/results/vllm-squeeze-preemption.json", rows, rec)
print(rows)
