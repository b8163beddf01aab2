"""Crossing statistics: how many ``to_jax`` / ``to_torch`` calls a block made, and their host time.

``bench_train_step`` reports them per step (docs/bridge.md, "Crossings"). A block counts the
crossings of the thread that opened it, and those of threads with no block of their own open
(autograd's device threads run a CUDA backward): where several threads each count their own
(the ranks of an in-process world, in the tests), each block sees its own thread's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
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


_COUNTING: list[tuple[CrossingStats, int]] = []  # the open blocks, with their threads
_BLOCKS = threading.Lock()  # (opening and closing blocks; counting reads a copy)


@contextlib.contextmanager
def count_crossings() -> Iterator[CrossingStats]:
    """Count every ``to_jax`` / ``to_torch`` call (and its host time) inside the block."""
    stats = CrossingStats()
    block = (stats, threading.get_ident())
    with _BLOCKS:
        _COUNTING.append(block)
    try:
        yield stats
    finally:
        with _BLOCKS:  # this block, not an equal one (stats compare by value)
            del _COUNTING[next(i for i, b in enumerate(_COUNTING) if b is block)]


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
        me, blocks = threading.get_ident(), list(_COUNTING)
        for stats, _ in [b for b in blocks if b[1] == me] or blocks:
            stats.add(direction, seconds)
