"""benchmarks/gpu_spec_fp8.py runs at toy size on a CPU, with gguf and math_verify unimportable (the GPU machine
has neither): every run written, prompt lookup accepts drafts and gives the plain run's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = ("import sys, runpy\n"
         "class _Block:\n"
         "    def find_spec(self, name, path=None, target=None):\n"
         "        if name.split('.')[0] in ('gguf', 'math_verify'):\n"
         "            raise ImportError(f'{name} is blocked (not on the GPU machine)')\n"
         "sys.meta_path.insert(0, _Block())\n"
         "sys.argv = sys.argv[1:]\n"
         "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def test_gpu_spec_fp8_toy_runs_on_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", BLOCK, str(ROOT / "benchmarks" / "gpu_spec_fp8.py"), "--toy",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_spec_fp8.json").read_text())
    assert data["provenance"]["command"]
    rows = {(r["cache"], r["decoding"]): r for r in data["rows"]}
    assert len(rows) == 7 and all(r["tok_s"] > 0 for r in rows.values())
    for kind in ("dynamic", "vase-attnv", "vase-attnv-fp8"):
        lookup = rows[(kind, "lookup")]
        assert lookup["same_tokens"] is True and lookup["forwards"] < rows[(kind, "plain")]["forwards"]
    assert rows[("vase-attnv", "plain")]["evictions"] >= 5
    assert rows[("vase-attnv-fp8", "plain")]["kv_mib"] < rows[("vase-attnv", "plain")]["kv_mib"] / 3  # 1 byte vs 4
    assert "| vase-attnv-fp8 | lookup |" in (tmp_path / "gpu_spec_fp8.md").read_text()
