"""One program for several blocks (an FSDP unit of several registered blocks): which output each
block returns, and the checks that the model calls the blocks as the program applied them.

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
run lives: ``SPAN_PENDING`` on each of the span's modules, until the next run of the span or
until FSDP drops it (``FSDPUnit.abort``, ``install_plane_hooks``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from bridge.unit_targets import SPAN_PENDING

__all__ = ["SpanRun", "later_block_output"]

_ADVICE = ("Call a unit's blocks in order, each once and on the previous one's output (as a block "
           "loop does), make the block a unit of its own in unit_modules, or run with "
           "Compute.OP")


class SpanRun:
    """One call of a span's program: its blocks' outputs, handed out in order (module
    docstring). ``grad``: whether the program ran with gradients."""

    def __init__(self, members: tuple[nn.Module, ...], grad: bool):
        self.members, self.grad = members, grad
        self.names = tuple(type(m).__name__ for m in members)
        self._outs: list = []  # an output not handed out yet, or a weakref to one handed out
        self.next = 0  # the place of the block to be called next

    def start(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Hold the program's outputs (one per block); return the first block's."""
        if len(outputs) != len(self.members):
            raise AssertionError(f"{len(outputs)} outputs for a span of {len(self.members)}")
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
        return self.next == len(self.members)

    def check_done(self) -> None:
        """Raise when a block of the unit was not called on the program's output (only for a
        program run with gradients: their backward would run through the skipped block)."""
        if self.grad and not self.done:
            waiting = len(self.members) - self.next
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


def later_block_output(block: nn.Module, span: tuple[nn.Module, ...],
                       x: torch.Tensor) -> torch.Tensor:
    """What ``block``, a later block of ``span``, returns when called on ``x``: its output from
    the span's last program run (``SpanRun.take``), or a clear error."""
    i = next(k for k, m in enumerate(span) if m is block)
    run = block.__dict__.get(SPAN_PENDING)
    if run is None or run.done:
        raise _misuse(span, i, "without the unit's first block called before it")
    return run.take(i, x)


def _misuse(span: SpanRun | Sequence[nn.Module], i: int, how: str) -> RuntimeError:
    names = span.names if isinstance(span, SpanRun) else tuple(type(m).__name__ for m in span)
    return RuntimeError(
        f"unit compute: this {names[i]} is block {i} of an FSDP unit of {len(names)} blocks, "
        f"whose one unit program runs them all when the first is called; it was called {how}. "
        f"{_ADVICE}"
    )
