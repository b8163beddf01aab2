"""``ExecutionOrder``: the order FSDP units ran in the first forward, for prefetching.

Recorded during the first iteration (the pre-forward hook of each unit calls ``record``) and
frozen when that iteration's backward ends; after that, the unit after (before) a given one in
forward order is the one whose planes forward (backward) prefetch starts gathering early.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["ExecutionOrder"]

U = TypeVar("U")  # a unit (``FSDPUnit``)


class ExecutionOrder(Generic[U]):
    def __init__(self) -> None:
        self._order: list[U] = []
        self.frozen = False

    def record(self, unit: U) -> None:
        if not self.frozen and unit not in self._order:
            self._order.append(unit)

    def freeze(self) -> None:
        self.frozen = True

    def ahead(self, unit: U, depth: int, direction: int) -> list[U]:
        """The next ``depth`` units after ``unit`` in forward order (direction +1) or before
        it (-1: backward order), nearest first; empty until the order is frozen."""
        if not self.frozen or unit not in self._order or depth <= 0:
            return []
        i = self._order.index(unit)
        if direction > 0:
            return self._order[i + 1 : i + 1 + depth]
        return self._order[max(i - depth, 0) : i][::-1]
