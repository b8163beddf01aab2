"""``FSDPState``: the iteration lifecycle shared by all units of one wrapped model.

The root lifecycle is a :class:`RootState`, checked by ``_expect`` (an internal error naming the
rank, the state found and the one expected)::

    IDLE --first pre-backward hook--> BACKWARD --end-of-backward callback--> IDLE
    BACKWARD --found stale (recover / a new backward)--> IDLE, grads_incomplete set

Forwards are tracked per unit (``fsdp_unit.TrainingState``): the root is IDLE during a forward.

- ``BACKWARD`` (``backward_active``): entered by the first pre-backward hook of a backward (which
  also records that backward's autograd graph task); a forward that runs in it, inside that
  backward, is an activation-recompute forward (``torch.utils.checkpoint``).
- ``on_pre_backward`` queues ``finish_backward`` as an autograd final callback: it reduces, in the
  fixed order ``reversed(units)`` (the same on every rank), the gradients of units not reduced
  yet, reshards everything, freezes the prefetch order and returns to ``IDLE``. Expert units of
  their own are finished by their host unit, after its reduction (``torch_side.fsdp.expert_units``).
- ``grads_incomplete`` is a fact about the main gradients, not a lifecycle state: it outlives
  iterations (a backward after an aborted one does not make the gradients whole) and only
  ``zero_grad`` clears it.
- **Aborted backward.** Autograd drops the final callback when an exception escapes backward
  (e.g. ``GradCheck.FINITE``), which would leave the state ``BACKWARD`` for good: every later
  forward would run as a recompute forward (no reshard, both planes gathered, stale buckets). The
  state knows a backward is running only while autograd is inside the graph task it recorded, so
  the next forward, backward, ``zero_grad`` or optimizer step (``recover``) finds the state stale
  and resets every unit: buckets resharded, staged gradients dropped, stray ``param.grad``
  cleared. Main gradients reduced before the exception are partial, so ``grads_incomplete`` stays
  set until ``zero_grad`` and ``FSDPOptimizer.step`` refuses to run on them.
- **Aborted forward.** An exception escaping a forward (a bad micro-batch, a failing evaluation
  forward under ``no_grad``) skips the post-forward hooks of the units it was in: their planes
  stay gathered, and a prefetched next unit's too. The old planes would then be read by the next
  forward (``unshard`` of a plane already unsharded is a no-op) after an optimizer step, and the
  step's own refresh would fail half-way, after the main weights moved. So ``FSDPModel.forward``
  calls ``abort_forward`` on the way out of an exception: every unit resharded (in-flight gathers
  waited for), a partly recorded execution order forgotten; main gradients are untouched (a
  forward adds none), so the next step is correct. An exception in a forward FSDP's root does
  not see (the wrapped module called directly) is caught by ``require_idle`` instead: the
  optimizer step and every model-weight refresh refuse, before changing anything, while a bucket
  is live or a backward runs; ``zero_grad`` (``reset_iteration``) resets every unit.
- ``weights_version``: counts model-weight refreshes (optimizer steps, state loads). A forward
  passes the version it read to its backward hook, which refuses to run on different weights.
- ``schedule`` (``torch_side.fsdp.overlap.Schedule``): the execution order recorded in the first
  iteration, prefetch along it, and the asynchronous gradient reductions in flight; they are all
  settled before the weights change (``require_idle``) and at every reset.
"""

from __future__ import annotations

import enum
import warnings

import torch
import torch.distributed as dist

from torch_side.fsdp.overlap import Overlap, Schedule

__all__ = ["FSDPState", "RootState"]

_NO_GRAPH_TASK = -1  # torch._C._current_graph_task_id() outside any backward


def _graph_task() -> int:
    return torch._C._current_graph_task_id()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RootState(enum.Enum):
    """Where the wrapped model is in its iteration (module note)."""

    IDLE = "idle"  # no backward of this model runs (between iterations, or in a forward)
    BACKWARD = "backward"  # a backward runs; its end-of-backward callback is queued


class FSDPState:
    def __init__(self, overlap: Overlap | None = None) -> None:
        self.schedule = Schedule(Overlap() if overlap is None else overlap)
        self.overlap = self.schedule.overlap
        self.units: list = []
        self.state = RootState.IDLE
        self._backward_task = _NO_GRAPH_TASK  # graph task of the backward that entered BACKWARD
        self.grads_incomplete = False  # an aborted backward left partial main grads
        self.weights_version = 0

    @property
    def backward_active(self) -> bool:
        """Whether the state is BACKWARD (possibly stale: ``recover`` checks that)."""
        return self.state is RootState.BACKWARD

    def _expect(self, expected: RootState, doing: str) -> None:
        """The one check of the root state: an internal error naming what was expected."""
        if self.state is not expected:
            raise AssertionError(
                f"rank {_rank()}: FSDP root state is {self.state.value} at {doing}, "
                f"expected {expected.value}"
            )

    def _enter(self, state: RootState, task: int) -> None:
        self.state, self._backward_task = state, task

    # ---- backward lifecycle ----------------------------------------------------------------
    def on_pre_backward(self) -> None:
        if self.backward_active and _graph_task() != self._backward_task:
            self._reset_aborted("a new backward")
        if not self.backward_active:
            self._enter(RootState.BACKWARD, _graph_task())
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """The end-of-backward callback, queued by the pre-backward hook that entered
        BACKWARD; autograd runs it only if that backward completes."""
        self._expect(RootState.BACKWARD, "the end of backward")
        for unit in reversed(self.units):
            if unit.host is None:  # an expert unit is finished by its host, after the host
                unit.finish_backward()
        self._enter(RootState.IDLE, _NO_GRAPH_TASK)
        self.schedule.order.freeze()

    def in_backward(self) -> bool:
        """Whether a backward of this model is running now (a forward now is a recompute);
        resets the state first if it was left by an aborted backward."""
        self.recover("the next forward")
        return self.backward_active

    def recover(self, where: str, *, quiet: bool = False) -> None:
        """Reset the units if the last backward was aborted (no backward is running now)."""
        if self.backward_active and _graph_task() == _NO_GRAPH_TASK:
            self._reset_aborted(where, quiet=quiet)

    def abort_forward(self) -> None:
        """An exception is escaping the root forward: reshard every unit (buckets freed, gathers
        in flight waited for) and forget an execution order still being recorded (the next
        forward records it again). A recompute forward inside a backward is left to that
        backward's abort (the exception escapes the backward too)."""
        if self.backward_active and _graph_task() != _NO_GRAPH_TASK:
            return
        self.recover("the aborted forward", quiet=True)
        self._abort_units()
        self.schedule.forget_order()

    def reset_iteration(self) -> None:
        """``zero_grad``: whatever the last forward or backward left (an exception that escaped
        a forward FSDP's root did not see, an aborted backward), every unit goes back to IDLE
        with its buckets freed. Between iterations this changes nothing."""
        self.recover("zero_grad()", quiet=True)
        self._abort_units()
        self.grads_incomplete = False

    def require_idle(self, where: str) -> None:
        """Refuse, before anything changes, to replace the model weights (an optimizer step, a
        refresh, a state load) while an iteration is unfinished: a gathered plane would keep the
        old values, and the refresh would stop half-way at it."""
        self.recover(where, quiet=True)
        self.schedule.settle_reductions()
        live = [f"{g.label}/{b}" for u in self.units for g in u.groups for b in g.live_buckets()]
        if not live and not self.backward_active:
            return
        more = f" and {len(live) - 3} more" if len(live) > 3 else ""
        what = f"buckets {live[:3]}{more} are live" if live else "a backward is running"
        raise RuntimeError(
            f"rank {_rank()}: {where}: FSDP is in the middle of an iteration ({what}): a forward "
            f"or backward did not finish -- an exception escaped a forward of the wrapped module "
            f"called directly rather than through the FSDPModel -- or this was called inside "
            f"gathered_weights() or a backward. Nothing was changed. Call zero_grad() (it "
            f"resets FSDP and drops the gradients of the unfinished iteration) and redo the "
            f"iteration's micro-batches"
        )

    def _abort_units(self) -> None:
        self.schedule.settle_reductions()
        for unit in reversed(self.units):
            unit.abort()

    def _reset_aborted(self, where: str, *, quiet: bool = False) -> None:
        self._expect(RootState.BACKWARD, f"the reset of an aborted backward ({where})")
        self._abort_units()
        self._enter(RootState.IDLE, _NO_GRAPH_TASK)
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
