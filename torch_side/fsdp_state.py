"""``FSDPState``: the iteration lifecycle shared by all units of one wrapped model.

- ``backward_active``: set by the first pre-backward hook of an iteration; a forward that runs
  while it is set is an activation-recompute forward (``torch.utils.checkpoint``).
- ``on_pre_backward`` queues ``finish_backward`` as an autograd final callback: it reduces the
  gradients of units that got none, reshards everything, freezes the prefetch order and clears
  ``backward_active``.
- prefetch (``prefetch_after`` / ``prefetch_before``): with the order recorded in the first
  iteration (``ExecutionOrder``), start the next unit's forward planes, or the previous unit's
  backward planes, as asynchronous all-gathers.
"""

from __future__ import annotations

import torch

from torch_side.collectives import Phase
from torch_side.execution_order import ExecutionOrder

__all__ = ["FSDPState"]


class FSDPState:
    def __init__(self) -> None:
        self.units: list = []
        self.order = ExecutionOrder()
        self.backward_active = False

    # ---- backward lifecycle ----------------------------------------------------------------
    def on_pre_backward(self) -> None:
        if not self.backward_active:
            self.backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        for unit in reversed(self.units):
            unit.finish_backward()
        self.backward_active = False
        self.order.freeze()

    # ---- prefetch ----------------------------------------------------------------------------
    def prefetch_after(self, unit) -> None:
        """Forward prefetch: start the next unit's forward-plane all-gathers now (async); the
        next unit's pre-forward waits for them."""
        nxt = self.order.neighbour(unit, +1)
        if nxt is not None:
            for g in nxt.groups:
                g.unshard([g.forward_plane], Phase.FORWARD, async_op=True)

    def prefetch_before(self, unit) -> None:
        """Backward prefetch: start the backward planes of the unit that ran before ``unit`` in
        forward (the next one backward reaches); its pre-backward waits for them."""
        prev = self.order.neighbour(unit, -1)
        if prev is not None:
            for g in prev.groups:
                g.unshard([g.backward_plane], Phase.BACKWARD, async_op=True)
