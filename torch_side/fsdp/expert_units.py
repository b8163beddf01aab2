"""``ExpertUnits``: the expert units a host unit schedules, so that every rank issues their
collectives in the same order whether or not its router called them.

An expert module declared in ``fully_shard(..., expert_modules=...)`` may be an FSDP unit of its
own (listed in ``unit_modules``): then only one expert's gathered planes are held at a time (with
the prefetch, ``Overlap.prefetch + 1``), where an enclosing unit gathers all of its experts at
once. The router may send such an expert no tokens on some rank, and the model may then not call
it there: its hooks do not run, so by themselves its all-gathers and gradient reductions would run
on the other ranks only (gloo aborts, NCCL hangs, or two experts' shards get mixed).

Its **host** -- the nearest enclosing unit that is not an expert unit, which runs on every rank
(``unit_builder`` picks it, and refuses a host that holds another dense unit) -- keeps its expert
units in one declared order, the model's module order, and sweeps along it once per pass. When
an expert unit runs, the host first *passes* the units before it in the sweep that did not run
on this rank (``FSDPUnit.skip``): it issues exactly the collectives their hooks would have issued.

- forward (``Sweep.FORWARD``), in module order: an expert unit's pre-forward passes the skipped
  units before it (each: recorded in the execution order, forward plane gathered, the next units
  prefetched, resharded); the host's post-forward passes the rest.
- recompute (``Sweep.RECOMPUTE``: the host's module checkpointed, its forward run again inside
  backward): the same with the recompute gathers (every plane, kept for the backward). Torch may
  stop a recompute early (after the last tensor it needs), before the host's post-forward: the
  first backward event of the sweep passes what the recompute left.
- backward (``Sweep.BACKWARD``), in reverse module order: begun by the host's pre-backward; an
  expert unit's pre-backward passes the units after it that backward did not reach (each:
  backward plane gathered, the next units prefetched, a gradient of zeros reduced, resharded);
  the host passes the rest at its own reduction, which for a host is when backward leaves it (the
  gradient of its inputs, or the end of backward: ``FSDPUnit.reduce_on_exit``), before it
  reduces its own groups. An expert unit that ran is reduced when backward leaves it, as any unit
  holding expert parameters (``fsdp_unit``), at the latest when the sweep passes it.

An expert called on an empty tensor runs its hooks like any other; one not called is passed at
the point where the others run it, so the sequence is the same on every rank (and the
``ExecutionOrder`` recorded in the first iteration too, so prefetch stays in step). What this
asks of the model, refused by name on the rank that sees it otherwise: a host's expert units run
at most once per forward, in module order (a loop over the experts), and only inside the host's
forward; backward reaches them in the reverse order (autograd runs the latest-created branch
first); an expert unit is recomputed only with its whole host (checkpointing one expert on its
own would gather on the ranks that called it only).
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch.distributed as dist

__all__ = ["ExpertUnits", "Sweep"]


class Sweep(enum.Enum):
    """Where a host is in passing its expert units (module note)."""

    IDLE = "idle"  # no sweep (between iterations, or before this backward reached the host)
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    SWEPT = "swept"  # this backward passed every expert unit (the host reduced)


class _Named(Protocol):
    """An expert unit, as the errors name it (``FSDPUnit``)."""

    name: str


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ExpertUnits:
    """The expert units one host schedules (empty for a unit that hosts none), in module order,
    and where the current sweep is: the next unit forward, or one past the next unit backward."""

    def __init__(self, host_name: str):
        self.host_name = host_name
        self.units: list = []  # FSDPUnits, module order
        self.sweep = Sweep.IDLE
        self._cursor = 0
        self._outer = (Sweep.IDLE, 0)  # the sweep a recompute interrupted, resumed after it

    def begin(self, sweep: Sweep) -> None:
        """The host starts a forward, a recompute or a backward."""
        if not self.units:
            return
        if sweep is Sweep.RECOMPUTE:
            self._outer = (self.sweep, self._cursor)
        self.sweep = sweep
        self._cursor = len(self.units) if sweep is Sweep.BACKWARD else 0

    def reach(self, unit: _Named, sweep: Sweep) -> None:
        """Expert unit ``unit`` runs in ``sweep``: first pass the units before it in the sweep's
        order that did not run on this rank."""
        if sweep is Sweep.BACKWARD:
            self._end_recompute()
            if self.sweep is Sweep.IDLE:  # the host's pre-backward did not run (no output hook)
                self.begin(Sweep.BACKWARD)
            if self.sweep is Sweep.SWEPT:
                raise RuntimeError(self._out_of_order(unit, sweep))
        if self.sweep is not sweep:
            raise RuntimeError(self._outside(unit, sweep))
        i = self.units.index(unit)
        if sweep is Sweep.BACKWARD:
            if i >= self._cursor:
                raise RuntimeError(self._out_of_order(unit, sweep))
            skipped, self._cursor = range(self._cursor - 1, i, -1), i
        else:
            if i < self._cursor:
                raise RuntimeError(self._out_of_order(unit, sweep))
            skipped, self._cursor = range(self._cursor, i), i + 1
        for j in skipped:
            self.units[j].skip(sweep)

    def finish(self, sweep: Sweep) -> None:
        """The host's forward or recompute ends, or the host reduces (``sweep`` BACKWARD): pass
        every unit the sweep has not reached."""
        if sweep is Sweep.BACKWARD:
            self._end_recompute()
            if not self.units or self.sweep is Sweep.SWEPT:
                return
            if self.sweep is not Sweep.BACKWARD:  # the host's pre-backward did not run
                self.begin(Sweep.BACKWARD)
            rest, after = range(self._cursor - 1, -1, -1), (Sweep.SWEPT, 0)
        elif self.sweep is sweep:
            rest = range(self._cursor, len(self.units))
            after = self._outer if sweep is Sweep.RECOMPUTE else (Sweep.IDLE, 0)
        else:
            return
        self.sweep, self._cursor = after
        for j in rest:
            self.units[j].skip(sweep)

    def _end_recompute(self) -> None:
        """A recompute Torch stopped early (before the host's post-forward): pass the rest."""
        if self.sweep is Sweep.RECOMPUTE:
            self.finish(Sweep.RECOMPUTE)

    def finish_backward(self) -> None:
        """The end of backward, after the host's own: finish each expert unit (a gradient that
        came after the sweep passed it is reduced now), latest first."""
        if self.sweep in (Sweep.BACKWARD, Sweep.RECOMPUTE):
            self.finish(Sweep.BACKWARD)
        for unit in reversed(self.units):
            unit.finish_backward()
        self.reset()

    def reset(self) -> None:
        """No sweep (the end of backward, an aborted iteration)."""
        self.sweep, self._cursor, self._outer = Sweep.IDLE, 0, (Sweep.IDLE, 0)

    # ---- errors ---------------------------------------------------------------------------------
    def _outside(self, unit: _Named, sweep: Sweep) -> str:
        if sweep is Sweep.RECOMPUTE:
            return (
                f"rank {_rank()}: FSDP expert unit {unit.name!r} ran a recompute forward that is "
                f"not a recompute of its host unit {self.host_name!r} (activation checkpointing "
                f"of the expert, or of a module between it and the host): a rank whose router "
                f"sent it no tokens would not join that recompute's all-gathers. Checkpoint the "
                f"host's module as a whole (all of its experts are recomputed in one order), or "
                f"do not list the expert in unit_modules. Other ranks may now hang in a collective"
            )
        return (
            f"rank {_rank()}: FSDP expert unit {unit.name!r} ran its {sweep.value} outside a "
            f"{sweep.value} of its host unit {self.host_name!r} (host sweep: {self.sweep.value}); "
            f"its collectives are scheduled by the host, so call the expert only from inside the "
            f"host's forward (or list the module that calls it in unit_modules, making it the "
            f"host). Other ranks may now hang in a collective"
        )

    def _out_of_order(self, unit: _Named, sweep: Sweep) -> str:
        names = [u.name for u in self.units]
        order = "reverse module order" if sweep is Sweep.BACKWARD else "module order"
        return (
            f"rank {_rank()}: FSDP expert unit {unit.name!r} ran its {sweep.value} after its host "
            f"unit {self.host_name!r} had passed it: the host's expert units {names} must run "
            f"at most once per {sweep.value}, in {order} (experts the router skips are passed "
            f"in that order on every rank). Call the experts in a loop over the module list, "
            f"each at most once per forward (or keep them inside the host unit: do not list "
            f"them in unit_modules). Other ranks may now hang in a collective"
        )
