"""`vase methods`: every method with its parameters, defaults and what it does."""

from __future__ import annotations

from rich.table import Table

from .common import console

__all__ = ["methods"]


def methods() -> None:
    """List every method with its parameters, defaults and what it does."""
    from ..core.policies import POLICIES, get_policy

    table = Table(title="vase methods")
    table.add_column("method", style="bold")
    table.add_column("what it does")
    table.add_column("parameters (defaults)")
    for name, cls in POLICIES.items():
        params = get_policy(name).params()
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        table.add_row(name, cls.summary, shown if cls.evicts or cls.selects else "-")
    console.print(table)
    console.print("Modifiers compose with any method: -p value_guard=0.25 (or n_large=N), -p sample=true, "
                  "-p protect_sinks=true.")
