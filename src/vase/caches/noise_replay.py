"""Random draws made on the host, replayed inside the compiled step: a stochastic policy's noise
(`vase.core.policies.base.uniform_noise`) is recorded once (`Recorder`: its kinds and shapes), drawn before
each evicting step with each row's own generator, in the eager cache's order (`fill`), into fixed buffers
the step hands the policy in order (`NoiseReplay`). Used by `vase.caches.static`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Recorder:
    """A noise source (see `vase.core.policies.base.uniform_noise`) that records what a policy draws."""

    def __init__(self, generator: torch.Generator) -> None:
        self.draws: list[tuple[str, tuple[int, ...]]] = []
        self.generator = generator

    def draw(self, kind: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        self.draws.append((kind, tuple(shape[1:])))
        fn = torch.rand if kind == "uniform" else torch.randn
        return fn(shape, device=device, generator=self.generator)


class NoiseReplay:
    """A noise source that hands out pre-drawn tensors [batch, ...] in order (built inside the step)."""

    def __init__(self, buffers: Sequence[torch.Tensor]):
        self.buffers = list(buffers)
        self.next = 0

    def draw(self, kind: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        buf = self.buffers[self.next]
        self.next += 1
        return buf


def fill(buffers: list[torch.Tensor], draws: list[tuple[str, tuple[int, ...]]], rows: list[int],
          generators: Sequence[torch.Generator]) -> None:
    """Draw each recorded (kind, shape) for `rows` with their generators, as the eager cache would."""
    for buf, (kind, shape) in zip(buffers, draws):
        for r in rows:
            fn = torch.rand if kind == "uniform" else torch.randn
            buf[r].copy_(fn(shape, generator=generators[r], device=buf.device))
