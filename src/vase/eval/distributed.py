"""A run over several processes (torchrun / accelerate): each rank's place from the environment, and the one
wait for every rank at the end (a gloo group; $VASE_DIST_TIMEOUT_S bounds it)."""

from __future__ import annotations

import math
import os
import warnings
from datetime import timedelta

from vase.eval.config import ConfigError

__all__ = ["dist_env", "dist_timeout", "Dist"]

_DIST_TIMEOUT_ENV = "VASE_DIST_TIMEOUT_S"


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun / accelerate environment (0, 1, 0 alone)."""
    def env_int(name: str, default: str) -> int:
        text = os.environ.get(name, default) or default
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"the environment variable {name}={text!r} is not an integer: unset it, or let torchrun "
                              f"set it") from None

    world = env_int("WORLD_SIZE", "1")
    local = os.environ.get("LOCAL_RANK")
    rank = env_int("RANK", local if local is not None else "0")
    local_rank = env_int("LOCAL_RANK", "0") if local is not None else rank
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"bad distributed environment: RANK={rank} WORLD_SIZE={world}")
    if world > 1:
        dist_timeout()  # read at the end of the run: refused at its start
    return rank, world, local_rank


def dist_timeout() -> float:
    """Seconds the ranks wait for each other at the end: $VASE_DIST_TIMEOUT_S (default a day); ConfigError naming the
    variable when it is no positive number."""
    text = os.environ.get(_DIST_TIMEOUT_ENV)
    if text is None or not text.strip():
        return 24 * 3600.0
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"the environment variable {_DIST_TIMEOUT_ENV}={text!r} is not a positive number of seconds: "
                          f"set it to e.g. 3600, or unset it (default: a day)")
    return seconds


class Dist:
    """A gloo group used only to wait for every rank at the end."""

    def __init__(self, world: int, rank: int):
        self.dist = None
        self.group = None
        self.created = False
        if world <= 1:
            return
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover
            dist = None
        if dist is None or not dist.is_available():
            warnings.warn("torch.distributed is unavailable: ranks will not wait for each other; run "
                          "`vase summarize` when every rank has finished", stacklevel=3)
            return
        timeout = timedelta(seconds=dist_timeout())
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
            self.created = True
        elif dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.dist = dist

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier(group=self.group)

    def close(self) -> None:
        if self.dist is not None and self.created and self.dist.is_initialized():
            self.dist.destroy_process_group()
        self.dist = None
