"""Peak resident memory of a bench run: the process's high-water mark (VmHWM, reset where the kernel allows) or a
sampling thread, and the K/V bytes a transformers DynamicCache holds."""

from __future__ import annotations

import ctypes
import gc
import threading

import torch


# -- memory ----------------------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory of one run: see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ""
        self.base = 0
        self.peak = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda-max-allocated"
            return self
        _malloc_trim()
        if _reset_hwm() and _status_kb("VmHWM") is not None:
            self.method = "vmhwm"
            self.base = _status_kb("VmRSS") or 0
            return self
        self.base = _status_kb("VmRSS") or 0
        if not self.base:
            self.method = "unavailable"
            return self
        self.method = "rss-sampled"
        self.peak = self.base
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, _status_kb("VmRSS") or 0)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "cuda-max-allocated":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "vmhwm":
            self.peak = _status_kb("VmHWM") or 0
        elif self.method == "rss-sampled":
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _status_kb("VmRSS") or 0)

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.base)


def dynamic_kv_bytes(cache) -> int:
    """Bytes a transformers cache holds: every layer's K/V, and a hybrid model's linear-attention states."""
    from ..caches.eager import kept_layer_bytes

    return sum(kept_layer_bytes(layer) for layer in getattr(cache, "layers", []))
