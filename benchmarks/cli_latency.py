"""Wall time of CLI commands that need no model: `vase methods` and a refused `-p` value (issue 16).

    .venv/bin/python benchmarks/cli_latency.py            # 5 runs each, prints min and median seconds

Each run is a fresh interpreter (`python -m vase.cli ...`), as a user's shell starts it. The target is
under 1.5 s on an idle machine; on a loaded one the numbers grow with the load, so note the load
average printed with them.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "vase methods": ["methods"],
    "vase generate hi -p sinks=abc (refused)": ["generate", "hi", "-p", "sinks=abc"],
    "vase --help": ["--help"],
}


def wall_times(args: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + system) seconds of each run; CPU time depends less on the machine's load."""
    wall, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "vase.cli", *args], capture_output=True, check=False)
        wall.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return wall, cpu


def main(runs: int = 5) -> None:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs; {runs} runs each")
    for label, args in COMMANDS.items():
        wall, cpu = wall_times(args, runs)
        print(f"{label:42s} wall min {min(wall):5.2f} s median {statistics.median(wall):5.2f} s | "
              f"cpu min {min(cpu):5.2f} s median {statistics.median(cpu):5.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
