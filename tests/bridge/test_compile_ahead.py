"""bridge.compile_ahead is scoped to the code inside the block: its thread (context) and the
backward it starts, not the whole process. (Programs, dedupe, errors: tests/torch_side/
test_precompile.py.)"""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import bridge.linear
from bridge import compile_ahead, mxfp8_linear
from bridge.compile_ahead import active
from tests.bridge.conftest import DEVICES

K, N = 64, 96
_WAIT_S = 120  # generous: the machine is shared; a hang fails instead of blocking the suite


def _inputs(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 40, K, generator=g) * 3).to(device).requires_grad_()
    w = (torch.randn(N, K, generator=g) / 8).to(device).requires_grad_()
    dy = torch.randn(2, 40, N, generator=g).to(device)
    return x, w, dy


def _run(x, w, dy):
    """y, dx, dW of one mxfp8_linear forward + backward on fresh leaves."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = mxfp8_linear(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


class _DryThread(threading.Thread):
    """Opens a compile_ahead block, says so, waits to be released, then runs a dry pass in it."""

    def __init__(self, x, w, dy):
        super().__init__(daemon=True)
        self.args, self.opened, self.release = (x, w, dy), threading.Event(), threading.Event()
        self.out, self.report, self.error = None, None, None

    def run(self):
        try:
            with compile_ahead(max_workers=1) as ahead:
                self.opened.set()
                assert self.release.wait(_WAIT_S)
                self.out = _run(*self.args)
            self.report = ahead.wait()
        except BaseException as e:  # noqa: BLE001 -- handed to the test thread
            self.error = e
            self.opened.set()


def _while_a_block_is_open_elsewhere(fn, *args):
    """``fn(*args)`` in this thread while another thread holds an open compile_ahead block; then
    that thread's dry pass. Returns (fn's result, the dry thread)."""
    dry = _DryThread(*_inputs(seed=1))
    dry.start()
    try:
        assert dry.opened.wait(_WAIT_S) and dry.error is None, dry.error
        return fn(*args), dry
    finally:
        dry.release.set()
        dry.join(_WAIT_S)
        assert not dry.is_alive() and dry.error is None, dry.error


def test_other_threads_compute_normally_while_a_block_is_open():
    x, w, dy = _inputs()
    want = _run(x, w, dy)

    def here():
        return _run(x, w, dy), active()

    (got, seen), dry = _while_a_block_is_open_elsewhere(here)
    for g, ref, what in zip(got, want, ("y", "dx", "dW"), strict=True):
        assert bool(g.abs().sum() > 0), f"{what} is zero: this thread's linear ran dry"
        torch.testing.assert_close(g, ref, rtol=0, atol=0, msg=what)
    assert seen is None
    # the dry thread's own pass was intercepted: zeros, and its forward + backward programs
    assert all(not bool(t.any()) for t in dry.out)
    assert dry.report.calls == 3, dry.report  # quantize W, forward, backward


def test_each_thread_may_hold_a_block_of_its_own():
    def here():
        with compile_ahead(max_workers=1) as ahead:
            y = mxfp8_linear(*_inputs()[:2])
        return y, ahead.wait()

    (y, report), _ = _while_a_block_is_open_elsewhere(here)
    assert not bool(y.any()) and report.calls == 2, report  # quantize W, forward


def test_a_backward_started_in_the_block_sees_it_outside_the_blocks_context():
    # Torch runs CUDA backward nodes on its own threads, which do not share the caller's
    # contextvars (the op's autograd context carries the block); an empty context on this thread
    # stands in for one (the CUDA case: below).
    x, w, dy = _inputs()
    with compile_ahead(max_workers=1) as ahead:
        y = mxfp8_linear(x, w)
        contextvars.Context().run(y.backward, dy)
    assert ahead.wait().calls == 3
    assert not bool(x.grad.any()) and not bool(w.grad.any())


@pytest.mark.gpu
def test_a_cuda_backward_on_torchs_device_thread_compiles_too(monkeypatch):
    threads = []
    real = bridge.linear.run_in  # what the op's backward calls (its forward: run_or_compile)

    def spy(ahead, fn, *args, **static):
        threads.append((threading.get_ident(), ahead))
        return real(ahead, fn, *args, **static)

    monkeypatch.setattr(bridge.linear, "run_in", spy)
    x, w, dy = _inputs("cuda")
    with compile_ahead(max_workers=1) as ahead:
        mxfp8_linear(x, w).backward(dy)
    assert ahead.wait().calls == 3
    (thread, seen), = threads  # one backward call, given the block
    assert seen is ahead
    assert thread != threading.get_ident(), "backward ran on this thread: nothing tested"
    assert not bool(x.grad.any()) and not bool(w.grad.any())


@pytest.mark.parametrize("device", DEVICES)
def test_the_block_ends_for_its_thread_and_for_later_backwards(device):
    x, w, dy = _inputs(device)
    with compile_ahead(max_workers=1):
        assert active() is not None
    assert active() is None
    y, dx, dw = _run(x, w, dy)  # runs for real: nothing of the block is left behind
    assert bool(y.abs().sum() > 0) and bool(dx.abs().sum() > 0) and bool(dw.abs().sum() > 0)
