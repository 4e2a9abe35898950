"""The machine's memory bandwidth as a decode step sees it: a matrix-vector product over a large matrix.

A decode step at batch 1 is a chain of matrix-vector products whose matrices (the weights) do not
fit in any cache, so the rate at which `torch.mv` streams a matrix much larger than the last-level
cache is the bandwidth the step can reach on this device, at the current thread count.

    bw = probe_bandwidth(torch.device("cpu"))     # bytes/s, best of `repeats`
"""

from __future__ import annotations

import time

import torch

__all__ = ["probe_bandwidth"]


def probe_bandwidth(device: torch.device | str = "cpu", mib: int = 256, repeats: int = 5,
                    clock=time.perf_counter) -> float:
    """Bytes per second `torch.mv` reads from a float32 matrix of `mib` MiB, best (fastest) of `repeats` runs.

    The fastest run is the one the machine's other load disturbed least. One untimed run first
    (page faults of the first touch). Runs at torch's current thread count."""
    if mib < 1 or repeats < 1:
        raise ValueError(f"mib and repeats must be >= 1, got {mib}, {repeats}")
    device = torch.device(device)
    cols = 4096
    rows = max(1, mib * (1 << 20) // (4 * cols))
    matrix = torch.ones(rows, cols, dtype=torch.float32, device=device)  # ones: no denormals, no NaN
    vec = torch.ones(cols, dtype=torch.float32, device=device)
    out = torch.empty(rows, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mv(matrix, vec, out=out)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        torch.mv(matrix, vec, out=out)
        sync()
        best = min(best, clock() - t)
    return matrix.numel() * matrix.element_size() / best if best > 0 else float("nan")
