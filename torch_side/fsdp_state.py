"""``FSDPState``: the iteration lifecycle shared by all units of one wrapped model.

- ``backward_active``: set by the first pre-backward hook of a backward (which also records that
  backward's autograd graph task); a forward that runs while it is set, inside that backward, is
  an activation-recompute forward (``torch.utils.checkpoint``).
- ``on_pre_backward`` queues ``finish_backward`` as an autograd final callback: it reduces, in the
  fixed order ``reversed(units)`` (the same on every rank), the gradients of units not reduced
  yet, reshards everything, freezes the prefetch order and clears ``backward_active``.
- **Aborted backward.** Autograd drops the final callback when an exception escapes backward
  (e.g. ``GradCheck.FINITE``), which would leave ``backward_active`` set for good: every later
  forward would run as a recompute forward (no reshard, both planes gathered, stale buckets). The
  state knows a backward is running only while autograd is inside the graph task it recorded, so
  the next forward, backward, ``zero_grad`` or optimizer step (``recover``) finds the flag stale
  and resets every unit: buckets resharded, staged gradients dropped, stray ``param.grad``
  cleared. Main gradients reduced before the exception are partial, so ``grads_incomplete`` stays
  set until ``zero_grad`` and ``FSDPOptimizer.step`` refuses to run on them.
- ``weights_version``: counts model-weight refreshes (optimizer steps, state loads). A forward
  passes the version it read to its backward hook, which refuses to run on different weights.
- prefetch (``prefetch_after`` / ``prefetch_before``): with the order recorded in the first
  iteration (``ExecutionOrder``), start the next unit's forward planes, or the previous unit's
  backward planes, as asynchronous all-gathers.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from torch_side.collectives import Phase
from torch_side.execution_order import ExecutionOrder

__all__ = ["FSDPState"]

_NO_GRAPH_TASK = -1  # torch._C._current_graph_task_id() outside any backward


def _graph_task() -> int:
    return torch._C._current_graph_task_id()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class FSDPState:
    def __init__(self) -> None:
        self.units: list = []
        self.order = ExecutionOrder()
        self.backward_active = False
        self._backward_task = _NO_GRAPH_TASK  # graph task of the backward that set the flag
        self.grads_incomplete = False  # an aborted backward left partial main grads
        self.weights_version = 0

    # ---- backward lifecycle ----------------------------------------------------------------
    def on_pre_backward(self) -> None:
        if self.backward_active and _graph_task() != self._backward_task:
            self._reset_aborted("a new backward")
        if not self.backward_active:
            self.backward_active = True
            self._backward_task = _graph_task()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        for unit in reversed(self.units):
            unit.finish_backward()
        self.backward_active = False
        self._backward_task = _NO_GRAPH_TASK
        self.order.freeze()

    def in_backward(self) -> bool:
        """Whether a backward of this model is running now (a forward now is a recompute);
        resets the state first if the flag was left by an aborted backward."""
        self.recover("the next forward")
        return self.backward_active

    def recover(self, where: str, *, quiet: bool = False) -> None:
        """Reset the units if the last backward was aborted (no backward is running now)."""
        if self.backward_active and _graph_task() == _NO_GRAPH_TASK:
            self._reset_aborted(where, quiet=quiet)

    def _reset_aborted(self, where: str, *, quiet: bool = False) -> None:
        for unit in reversed(self.units):
            unit.abort_backward()
        self.backward_active = False
        self._backward_task = _NO_GRAPH_TASK
        self.grads_incomplete = True
        if not quiet:
            warnings.warn(
                f"rank {_rank()}: FSDP: the previous backward did not finish (an exception "
                f"escaped it, so autograd dropped FSDP's end-of-backward callback); {where} "
                f"reset the FSDP state: buckets resharded, gradients staged in that backward "
                f"dropped. Main gradients reduced before the exception are partial: call "
                f"zero_grad() before the next optimizer step (FSDPOptimizer.step() refuses "
                f"until then)",
                RuntimeWarning,
                stacklevel=3,
            )

    def weights_changed(self) -> None:
        """The model weights were refreshed (a step or a state load): a new version."""
        self.weights_version += 1

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
