"""``Overlap``: how far FSDP's communication runs ahead of (and behind) the compute.

- ``prefetch``: how many units ahead the weight all-gathers are issued, in the execution order
  recorded in the first iteration (``ExecutionOrder``): a unit's pre-forward starts the forward
  planes of the next ``prefetch`` units, its pre-backward the backward planes of the ``prefetch``
  units backward reaches next. 0 gathers each unit's planes only when it runs (no overlap).
  Costs memory: up to ``prefetch + 1`` units' planes are gathered at once.
- ``async_reduce``: gradient reductions are issued without waiting and settled where their
  result is read (``grad_reducer``); ``reductions_in_flight`` bounds how many are in flight (each
  holds its unit's gradient bucket), the oldest settled first. With ``async_reduce=False`` each
  reduction completes before backward moves on.
- ``freed_grad_buckets`` (CUDA): a grad bucket a unit program handed over (JAX's memory,
  ``BucketAllocator.adopt``) is kept after its reduction until the work queued on its readers'
  stream has run; at most this many are kept at once -- beyond it the host waits for the oldest
  (``BucketAllocator``'s module note). 2 by default: on one H200 at 1.3B with 4 blocks per unit,
  1 made the step 4-10% slower (the host waited on work it had just queued) and 2 and 3 cost
  nothing against no bound, which held all six units' buckets (4.5 GiB) to the end of backward.

The numbers never change results: a gather is waited for before its planes are read and a
reduction settled before its gradient is read, in the same order on every rank
(``tests/torch_side/cases_overlap.py`` checks the bytes against ``prefetch=0, async_reduce=False``).
See docs/fsdp.md, "Overlap".

``Schedule`` carries it out for one wrapped model (``FSDPState.schedule``): the execution order,
the prefetches it starts, and the asynchronous reductions in flight.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Protocol

from torch_side.comm.collectives import Phase
from torch_side.fsdp.execution_order import ExecutionOrder
from torch_side.fsdp.param_group import ParamGroup


class _Unit(Protocol):
    """What the schedule reads of an ``FSDPUnit``."""

    @property
    def groups(self) -> Sequence[ParamGroup]: ...


class _Settles(Protocol):
    """A reduction in flight (``GradReducer``)."""

    def settle(self) -> None: ...

__all__ = ["Overlap", "Schedule"]


@dataclasses.dataclass(frozen=True)
class Overlap:
    prefetch: int = 1
    async_reduce: bool = True
    reductions_in_flight: int = 1
    # CUDA copies at world size 1 through the communication streams too
    # (torch_side.comm.collectives; the applications' MXFP8_FSDP_COMM_STREAMS=1): how one GPU tests
    # the stream ordering
    streams_at_world_1: bool = False
    freed_grad_buckets: int = 2  # (last: the fields before keep their positions)

    def __post_init__(self) -> None:
        for name, low in (("prefetch", 0), ("reductions_in_flight", 1),
                          ("freed_grad_buckets", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(
                    f"Overlap: {name} must be an int >= {low}, got {v!r} (prefetch: units "
                    f"gathered ahead, 0 for none; reductions_in_flight: at least 1; "
                    f"freed_grad_buckets: handed-over grad buckets kept after their reduction "
                    f"until their readers ran, 0 to wait for each)"
                )
        for name in ("async_reduce", "streams_at_world_1"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Overlap: {name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def none(cls) -> Overlap:
        """No overlap: gather on demand, reduce synchronously (the reference schedule)."""
        return cls(prefetch=0, async_reduce=False)


class Schedule:
    """One model's communication schedule: the unit order recorded in the first iteration
    (``order``), prefetch along it, and the gradient reductions in flight, oldest first."""

    def __init__(self, overlap: Overlap):
        self.overlap = overlap
        self.order: ExecutionOrder[_Unit] = ExecutionOrder()
        self._reductions: collections.deque[_Settles] = collections.deque()  # GradReducers

    def forget_order(self) -> None:
        """An order still being recorded is dropped (the next forward records it again)."""
        if not self.order.frozen:
            self.order = ExecutionOrder()

    def prefetch_after(self, unit: _Unit) -> None:
        """Forward prefetch: start the forward-plane all-gathers of the next
        ``overlap.prefetch`` units now (async); each unit's pre-forward waits for its own."""
        for nxt in self.order.ahead(unit, self.overlap.prefetch, +1):
            for g in nxt.groups:
                g.unshard([g.forward_plane], Phase.FORWARD, async_op=True)

    def prefetch_before(self, unit: _Unit) -> None:
        """Backward prefetch: start the backward planes of the ``overlap.prefetch`` units that
        ran before ``unit`` in forward (the next ones backward reaches); their pre-backward
        waits for them."""
        for prev in self.order.ahead(unit, self.overlap.prefetch, -1):
            for g in prev.groups:
                g.unshard([g.backward_plane], Phase.BACKWARD, async_op=True)

    def track_reduction(self, reducer: _Settles) -> None:
        """A gradient reduction was issued asynchronously: keep at most
        ``overlap.reductions_in_flight`` in flight (the oldest is settled first)."""
        if reducer in self._reductions:  # settled by its own next reduce: now the newest
            self._reductions.remove(reducer)
        self._reductions.append(reducer)
        while len(self._reductions) > self.overlap.reductions_in_flight:
            self._reductions.popleft().settle()

    def settle_reductions(self) -> None:
        """Settle every reduction in flight, oldest first."""
        while self._reductions:
            self._reductions.popleft().settle()
