"""Looking inside a run: value magnitudes, which tokens each head kept, where a loop began."""

from .kept import kept_map, plot_kept_map
from .loops import loop_onset
from .values import value_statistics

__all__ = ["kept_map", "loop_onset", "plot_kept_map", "value_statistics"]
