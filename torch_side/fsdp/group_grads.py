"""``GroupGrads``: the gradient side of ``ParamGroup``'s public surface (a base class of it).

What FSDP's hooks and the optimizer ask of a group's gradients, answered from its private
``GradReducer`` (``_grads``; None for a group that takes no gradients) and the ``main_grad``
buffer of its ``GroupBuffers`` (``_buffers``):

- the per-parameter hooks ``stage_grad``; a unit program ``stage_grads`` (one flat add) at the
  place ``grad_target`` names;
- the unit's post-backward ``reduce_grads`` (returning the reduction left in flight, for the
  schedule to settle), an aborted backward ``drop_grads``;
- the readers: ``main_grad`` (a reduction in flight settled first, zeros that ``zero_main_grad``
  left pending written), ``main_grad_for_optimizer``, ``full_main_grad``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torch_side.comm.collectives import Phase
from torch_side.fsdp.flat_layout import FlatLayout
from torch_side.fsdp.grad_reducer import GradReducer
from torch_side.fsdp.group_buffers import GroupBuffers

__all__ = ["GradSlot", "GroupGrads"]


class GradSlot(NamedTuple):
    """Where parameter ``index``'s gradient goes in the group's grad bucket: ``numel`` elements
    of ``dtype`` (the whole bucket), the parameter's own at ``start``."""

    numel: int
    dtype: torch.dtype
    start: int


class GroupGrads:
    label: str
    layout: FlatLayout
    _buffers: GroupBuffers
    _grads: GradReducer | None

    @property
    def takes_grads(self) -> bool:
        """Whether the group's parameters take gradients (``requires_grad``)."""
        return self._grads is not None

    def _reducer(self) -> GradReducer:
        if self._grads is None:
            raise AssertionError(f"group {self.label!r} takes no gradients (requires_grad=False)")
        return self._grads

    @property
    def main_grad(self) -> torch.Tensor | None:
        """``GroupBuffers.main_grad``, with a reduction still in flight added into it first
        (``GradReducer.settle``) and pending zeros written (into new storage if ``zero_grad``
        released it): every reader sees the finished gradient. None for a group that takes no
        gradients."""
        if self._grads is not None:
            self._grads.ready()
        return self._buffers.main_grad

    def zero_main_grad(self, release: bool = False) -> None:
        """Zero ``main_grad`` (``GradReducer.clear``: written lazily; with ``release`` its memory
        given back until the next reduction or read); a no-op without grads."""
        if self._grads is not None:
            self._grads.clear(release)

    @property
    def grads_cleared(self) -> bool:
        """Whether ``main_grad`` holds nothing since ``zero_main_grad`` (or takes no gradients):
        answered without filling in or allocating the pending zeros."""
        return self._grads is None or self._grads.holds_zeros

    @property
    def main_grad_released(self) -> bool:
        """Whether ``main_grad``'s memory is given back now (``zero_main_grad(release=True)``)."""
        return self._grads is not None and self._grads.released

    def main_grad_for_optimizer(self) -> torch.Tensor:
        """The part of ``main_grad`` that matches ``main`` (fp32 view or copy)."""
        self._reducer().ready()
        return self._buffers.grad_for_optimizer()

    def full_main_grad(self, phase: Phase = Phase.STATE) -> torch.Tensor:
        """The full padded reduced gradient (all-gathered when sharded), in its policy dtype."""
        self._reducer().ready()
        return self._buffers.full_main_grad(phase)

    def grad_slot(self, index: int) -> GradSlot | None:
        """Where parameter ``index``'s gradient goes in the grad bucket (None: no gradients)."""
        if self._grads is None:
            return None
        return GradSlot(self.layout.padded_numel, self._grads.comm_dtype,
                        self.layout.slots[index].start)

    def stage_grad(self, index: int, grad: torch.Tensor) -> None:
        """Add parameter ``index``'s local gradient into this micro-batch's grad bucket."""
        self._reducer().stage(index, grad)

    def stage_grads(self, flat: torch.Tensor) -> None:
        """Add gradients laid out as the grad bucket (``grad_slot``) in one add."""
        self._reducer().stage_flat(flat)

    def reduce_grads(self, async_op: bool = False) -> GradReducer | None:
        """Reduce the staged gradients into ``main_grad`` (``GradReducer.reduce``); the reducer
        when its reduction is still in flight (to be settled: ``Schedule.track_reduction``)."""
        if self._grads is None:
            return None
        self._grads.reduce(async_op)
        return self._grads if self._grads.in_flight else None

    def drop_grads(self) -> None:
        """Free the staged gradients unreduced (an aborted backward); a no-op without grads."""
        if self._grads is not None:
            self._grads.drop()
