"""Numbers as people read them (no heavy imports: the CLI's summary line and the eval reports share it)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """Bytes with a binary unit: ``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.0 GiB`` (GiB is the largest unit)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
