"""benchmarks/gpu_check.py runs at toy size on a CPU (aot_eager backend): both parts, every file written, kept sets
agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_toy_runs_on_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--toy", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checked = [r for r in report["check"] if r["compiled_same_kept"] is not None]
    assert len(checked) >= 2 and all(r["compiled_same_kept"] for r in checked)
    assert all(r["evictions"] >= 5 for r in report["check"])
    kinds = {r["kind"]: r for r in report["speed"]}
    assert set(kinds) == {"vase-compiled", "static-compiled", "vase-eager", "dynamic"}
    assert all(r["tok_s"] > 0 for r in kinds.values())
    md = (tmp_path / "gpu_check.md").read_text()
    assert "(a) kept sets" in md and "vase-compiled" in md and "Paper anchor" in md
