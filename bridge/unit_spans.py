"""One program for several blocks (an FSDP unit of several registered blocks): which output each
block returns, and the checks that the model calls the blocks as the program applied them.

A ``UnitSpan`` is such a unit: its blocks in order and its last program run. FSDP makes one per
unit of several modules and binds it to each of them (``bridge.unit_bindings.bind_span``).
``bridge.units`` runs a span's program (``jax_side.unit_program.SpanFn``) when the span's first
block is called; the program returns every block's output (h_1, ..., h_n), and a ``SpanRun``
holds them: block 1 returns h_1; block k (k > 1) must be called on h_{k-1} -- the very tensor
block k-1 returned -- and returns h_k. So every block returns its own output, as with one unit
per block, and a model may read any of them (a residual across blocks, an auxiliary loss, the
collected hidden states); in backward the span's program takes a cotangent for each output that
got one. With or without gradients alike: evaluation gives the bits of training.

Refused by name, never run twice or skipped silently: a later block called without the first
before it, out of order, a second time, on another tensor than the previous block's output, or
in another grad mode than the first; a block the model did not call after the program applied it
is reported at backward (``check_done``), or when the first block is called again while the
previous forward's outputs are still alive (under ``no_grad`` a skipped block changes nothing).

Memory: a run holds the outputs it has not handed out yet; one handed out is referenced weakly
(for the next block's check), so after its last block returns a run holds no activation. Where a
run lives: ``UnitSpan.run``, until the next run of the span or until FSDP drops it
(``FSDPUnit.abort``, or a new span bound by ``install_plane_hooks``).

Why the blocks, not a wrapper module, are what the model calls: the model's own code calls each
block (``x = block(x)``, as a block loop does), FSDP's hooks sit on the unit's first and last
block, and state-dict names, ``unit_modules`` and ``model.blocks`` name the blocks; a wrapper
in the module tree would change all of them. So the span stays beside the tree: the first
block's call runs the span's program, and every block returns its own output from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["SpanRun", "UnitSpan"]

_ADVICE = ("Call a unit's blocks in order, each once and on the previous one's output (as a block "
           "loop does), make the block a unit of its own in unit_modules, or run with "
           "Compute.OP")


class SpanRun:
    """One call of a span's program: its blocks' outputs, handed out in order (module
    docstring). ``grad``: whether the program ran with gradients."""

    def __init__(self, names: tuple[str, ...], grad: bool):
        self.names, self.grad = names, grad  # the blocks' class names, in order
        self._outs: list = []  # an output not handed out yet, or a weakref to one handed out
        self.next = 0  # the place of the block to be called next

    def start(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Hold the program's outputs (one per block); return the first block's."""
        if len(outputs) != len(self.names):
            raise AssertionError(f"{len(outputs)} outputs for a span of {len(self.names)}")
        self._outs = list(outputs)
        return self._hand(0)

    def _hand(self, i: int) -> torch.Tensor:
        out = self._outs[i]
        self._outs[i] = weakref.ref(out)
        self.next = i + 1
        return out

    def take(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The output of block ``i`` (> 0), called on ``x``; raises unless it is the next block,
        ``x`` is the previous block's output and the grad mode is the program's."""
        if i != self.next:
            how = ("a second time since the unit program ran" if i < self.next
                   else f"before block {self.next} of the unit")
            raise _misuse(self, i, how)
        if self._outs[i - 1]() is not x:
            raise _misuse(self, i, "on another tensor than that program's output for block "
                                   f"{i - 1}")
        if torch.is_grad_enabled() != self.grad:
            raise _misuse(self, i, f"with gradients {'on' if not self.grad else 'off'}, the "
                                   f"first block with them {'on' if self.grad else 'off'}")
        return self._hand(i)

    @property
    def done(self) -> bool:
        return self.next == len(self.names)

    def check_done(self) -> None:
        """Raise when a block of the unit was not called on the program's output (only for a
        program run with gradients: their backward would run through the skipped block)."""
        if self.grad and not self.done:
            waiting = len(self.names) - self.next
            raise RuntimeError(
                f"unit compute: a unit program ran the {len(self.names)} blocks of one FSDP "
                f"unit ({' -> '.join(self.names)}) when its first block was called, but "
                f"{waiting} of the others were not called on its output before this backward, "
                f"so the forward applied blocks the model did not call. {_ADVICE} (list blocks "
                f"the model may skip as units of their own)"
            )

    def check_previous(self) -> None:
        """At the next run: ``check_done`` while this run's first output is still alive (its
        forward may still be differentiated)."""
        first = self._outs[0] if self._outs else None
        if isinstance(first, weakref.ref) and first() is not None:
            self.check_done()


class UnitSpan:
    """An FSDP unit of several blocks run as one program per direction: ``members``, its blocks
    in order, and ``run``, the ``SpanRun`` of its last program call (None before the first and
    after FSDP drops it)."""

    def __init__(self, members: tuple[nn.Module, ...]):
        if len(members) < 2:
            raise AssertionError(f"a span holds several blocks, got {len(members)}")
        self.members = tuple(members)
        self.names = tuple(type(m).__name__ for m in members)
        self.run: SpanRun | None = None

    def begin(self, grad: bool) -> SpanRun:
        """A new run, before its program runs; first the previous one is checked
        (``SpanRun.check_previous``: did its forward skip one of the blocks?). FSDP drops the run
        of a forward an exception aborted (``FSDPUnit.abort``)."""
        if self.run is not None:
            self.run.check_previous()
        return SpanRun(self.names, grad)

    def start(self, run: SpanRun, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Make ``run`` (its program just returned ``outputs``) the span's run; return the first
        block's output."""
        self.run = run
        return run.start(outputs)

    def output_of(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What ``block``, a later block of the span, returns when called on ``x``: its output
        from the span's last program run (``SpanRun.take``), or a clear error."""
        i = next(k for k, m in enumerate(self.members) if m is block)
        if self.run is None or self.run.done:
            raise _misuse(self, i, "without the unit's first block called before it")
        return self.run.take(i, x)

    def drop(self) -> None:
        """Forget the last run (FSDP, after a forward an exception aborted)."""
        self.run = None


def _misuse(span: SpanRun | UnitSpan, i: int, how: str) -> RuntimeError:
    names = span.names
    return RuntimeError(
        f"unit compute: this {names[i]} is block {i} of an FSDP unit of {len(names)} blocks, "
        f"whose one unit program runs them all when the first is called; it was called {how}. "
        f"{_ADVICE}"
    )
