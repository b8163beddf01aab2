"""FSDPState's root lifecycle (RootState): IDLE -> BACKWARD -> IDLE, and an aborted backward.

In-process, no units and no collectives: a custom autograd function calls the root's
pre-backward hook the way a unit's output hook does, so the transitions (and their refusals)
are seen without wrapping a model. The spawned worlds (test_reliability,
test_exception_recovery) cover the same paths through real units.
"""

from __future__ import annotations

import pytest
import torch

from torch_side.fsdp.fsdp_state import FSDPState, RootState


class _Hook(torch.autograd.Function):
    """Identity whose backward runs the root's pre-backward hook, then ``then()``."""

    @staticmethod
    def forward(ctx, state, then, x):
        ctx.state, ctx.then = state, then
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.state.on_pre_backward()
        ctx.then()
        return None, None, grad


def _backward(state: FSDPState, then=lambda: None) -> None:
    x = torch.ones(2, requires_grad=True)
    _Hook.apply(state, then, x).sum().backward()


def test_a_backward_is_backward_inside_and_idle_after():
    state, seen = FSDPState(), []
    assert state.state is RootState.IDLE and not state.backward_active
    _backward(state, lambda: seen.append((state.state, state.in_backward())))
    assert seen == [(RootState.BACKWARD, True)]
    assert state.state is RootState.IDLE and state.schedule.order.frozen  # the end callback ran
    assert not state.grads_incomplete


def test_the_end_of_backward_outside_a_backward_is_refused_naming_the_expected_state():
    state = FSDPState()
    with pytest.raises(AssertionError, match="root state is idle at the end of backward, "
                                             "expected backward"):
        state.finish_backward()


def test_an_aborted_backward_is_found_stale_reset_once_and_leaves_grads_incomplete():
    state = FSDPState()

    def fail() -> None:
        raise FloatingPointError("bad gradient")

    with pytest.raises(FloatingPointError):
        _backward(state, fail)
    assert state.state is RootState.BACKWARD  # autograd dropped the end callback
    with pytest.warns(RuntimeWarning, match="the next forward reset the FSDP state"):
        assert not state.in_backward()
    assert state.state is RootState.IDLE and state.grads_incomplete
    state.recover("again")  # not stale any more: nothing to do, no warning
    _backward(state)  # a later backward does not make the gradients whole
    assert state.state is RootState.IDLE and state.grads_incomplete
    state.reset_iteration()  # zero_grad
    assert not state.grads_incomplete


def test_require_idle_refuses_while_a_backward_runs():
    state, errors = FSDPState(), []

    def step_inside() -> None:
        with pytest.raises(RuntimeError, match="a backward is running") as e:
            state.require_idle("FSDPOptimizer.step()")
        errors.append(str(e.value))

    _backward(state, step_inside)
    assert len(errors) == 1 and "Nothing was changed" in errors[0]
    state.require_idle("FSDPOptimizer.step()")  # idle again: accepted
