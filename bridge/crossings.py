"""Crossing statistics: how many ``to_jax`` / ``to_torch`` calls a block made, and their host time.

``bench_train_step`` reports them per step (docs/bridge.md, "Crossings").
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["CrossingStats", "Direction", "count_crossings", "counted"]


class Direction(Enum):
    """A crossing's direction; the value names its fields in ``CrossingStats``."""

    TO_JAX = "to_jax"
    TO_TORCH = "to_torch"


@dataclasses.dataclass
class CrossingStats:
    """Bridge crossings counted by ``count_crossings`` (calls and host seconds per direction)."""

    to_jax: int = 0
    to_torch: int = 0
    to_jax_s: float = 0.0
    to_torch_s: float = 0.0

    @property
    def calls(self) -> int:
        return self.to_jax + self.to_torch

    @property
    def seconds(self) -> float:
        return self.to_jax_s + self.to_torch_s

    def add(self, direction: Direction, seconds: float) -> None:
        name = direction.value
        setattr(self, name, getattr(self, name) + 1)
        setattr(self, name + "_s", getattr(self, name + "_s") + seconds)


_COUNTING: list[CrossingStats] = []


@contextlib.contextmanager
def count_crossings() -> Iterator[CrossingStats]:
    """Count every ``to_jax`` / ``to_torch`` call (and its host time) inside the block."""
    stats = CrossingStats()
    _COUNTING.append(stats)
    try:
        yield stats
    finally:
        _COUNTING.remove(stats)


def counted(direction: Direction, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; inside ``count_crossings()`` also its call and host time, under
    ``direction`` (outside, nothing but the call: crossings are on the hot path)."""
    if not _COUNTING:
        return fn(*args)
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        seconds = time.perf_counter() - t0
        for stats in _COUNTING:
            stats.add(direction, seconds)
