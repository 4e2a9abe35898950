"""What the parallel-degree tests share (tests/test_vllm_tp.py, test_vllm_pp.py, test_vllm_dp.py) and their run
scripts (tests/vllm_tp_run.py, vllm_pp_run.py, vllm_dp_run.py).

Test side: `launch` and `run` start a run script in a subprocess; `single_engine` is the run every degree is compared
with, one engine with no parallelism (tests/vllm_pp_run.py at degree 1: every parallel test's methods), made once a
session and shared by the test files, also across pytest-xdist workers (a file lock in xdist's shared temp folder).
Script side: `worker_env` sets what a script's engine needs, `request_entry` is one request's record in the
scripts' common output format (read by `vllm_tp_run.compare`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def launch(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python tests/<script> *args` with this checkout's src first on PYTHONPATH and vLLM's engine processes on
    (the test process may have turned them off for its in-process engines)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(TESTS / script), *args], capture_output=True, text=True, timeout=900,
                          env=env)


def check(proc: subprocess.CompletedProcess, out: Path) -> dict:
    """The run `proc` wrote to `out`; AssertionError with the script's last output if it failed."""
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def run(script: str, model: str, degree: int, out: Path) -> dict:
    """Run `script` on `model` at `degree` and return what it wrote to `out`."""
    return check(launch(script, model, str(degree), str(out)), out)


def single_engine(tmp_path_factory) -> tuple[str, dict]:
    """(the tiny random Llama's folder, its run at degree 1 by tests/vllm_pp_run.py), made by the first test file of
    the session that asks and read from disk by the others (the lock serialises pytest-xdist workers)."""
    from filelock import FileLock

    from tests.vllm_tiny import save_tiny_llama

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the session's workers
    out = root / "vllm-parallel-degree-1.json"
    with FileLock(str(root / "vllm-parallel.lock")):
        model = save_tiny_llama(str(root / "vllm-parallel-tiny-llama"))
        if not out.exists():
            tmp = root / "vllm-parallel-degree-1.partial.json"
            run("vllm_pp_run.py", model, 1, tmp)
            tmp.rename(out)
    return model, json.loads(out.read_text())


def worker_env(bind_ranks: int | None) -> None:
    """A run script's environment, before vLLM is imported: one OpenMP thread; the policy swap sent to the workers
    as a function (`collective_rpc`: vLLM pickles callables only when asked); with `bind_ranks`, that many worker
    processes bound by hand (vLLM's CPU autobind wants one NUMA node per worker; cores wrap on small machines) and
    the engine core in the script's process (each process imports vLLM: about 10 s here)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if bind_ranks is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(bind_ranks)))


def request_entry(output, kept: dict) -> dict:
    """One request's record: its generated tokens, vLLM's top-5 log-probs per step ({token id: log-prob}, ids as
    strings) and `kept` ({tokens seen at the eviction: per layer, per KV head, the kept logical positions})."""
    return {"tokens": list(output.outputs[0].token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in output.outputs[0].logprobs],
            "kept": kept}
