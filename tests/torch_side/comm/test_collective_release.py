"""A finished gloo collective lets go of its bucket before ``wait()`` returns.

gloo marks a collective complete before its worker thread drops the work, which holds the
bucket (the tensor, and views of it). ``Handle.wait()`` and the synchronous path wait for those
references to go (``collectives._await_release``), so the bucket pool's reuse check sees the
bucket free at once: the memory bound of a step does not depend on thread timing. A case of
cases_overlap.py failed on some runs before the wait existed, and again (issue 30, item 13)
while it gave up after 0.1 s, spinning, on a loaded machine: the wait now sleeps between looks
and is bounded only by a safety net no scheduling delay reaches, with a warning. Played here
with a holder released by another thread after the wait began, as gloo's worker does.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from torch_side.comm import collectives as C
from torch_side.comm.collectives import Collective, Handle, Phase
from torch_side.fsdp.bucket_allocator import BucketAllocator

LATE_S = 0.3  # a gloo thread that was not scheduled for this long (the old 0.1 s bound gave up)


class _DoneWork:
    """A work that has completed: ``wait()`` returns at once."""

    def wait(self) -> bool:
        return True


def _issue_with_late_holder(t: torch.Tensor, release_after_s: float | None):
    """A Handle whose work, like gloo's, holds ``t`` (a DLPack export: a TensorImpl
    reference, and a view: a storage reference) until another thread lets go. (Compare
    ``C._counts`` taken in the same frame: it counts Python references too.)"""
    before = C._counts([t])
    holder = [to_dlpack(t), t[1:]]
    added = tuple(a - b for a, b in zip(C._counts([t]), before, strict=True))
    assert added[0] >= 1 and added[1] == 1, added
    handle = Handle(None, (Collective.ALL_GATHER, Phase.FORWARD, "x"), work=_DoneWork(),
                    held=([t], added))
    if release_after_s is not None:
        def release():
            time.sleep(release_after_s)
            holder.clear()

        threading.Thread(target=release, daemon=True).start()
    return handle, holder


def test_wait_returns_once_the_collective_let_go_of_the_bucket():
    t = torch.zeros(64)
    before = C._counts([t])
    handle, _ = _issue_with_late_holder(t, release_after_s=0.05)
    handle.wait()
    assert C._counts([t]) == before  # the late holder is gone: the pool may reuse the bucket


def test_a_release_later_than_a_scheduler_hiccup_is_still_waited_for():
    t = torch.zeros(64)
    before = C._counts([t])
    handle, _ = _issue_with_late_holder(t, release_after_s=LATE_S)
    handle.wait()
    assert C._counts([t]) == before


def test_a_python_reference_dropped_after_the_cpp_ones_is_waited_for_too():
    """Torch drops a C++ holder's last extra reference first and the Python reference it kept
    alongside it afterwards (that takes the GIL); the pool counts both, so the wait does."""
    t = torch.zeros(64)
    refs = sys.getrefcount(t)
    before = C._counts([t])
    holder = [to_dlpack(t), t]  # a C++ reference, then a Python one
    added = tuple(a - b for a, b in zip(C._counts([t]), before, strict=True))
    handle = Handle(None, (Collective.ALL_GATHER, Phase.FORWARD, "x"), work=_DoneWork(),
                    held=([t], added))

    def release():
        time.sleep(0.02)
        holder.pop(0)
        time.sleep(0.05)
        holder.clear()

    threading.Thread(target=release, daemon=True).start()
    handle.wait()
    assert sys.getrefcount(t) == refs and not holder


def test_a_bucket_freed_after_a_late_release_is_reused():
    """The ordering of the flaky failure (issue 30, item 13): a gather's bucket whose work gloo's
    thread lets go of late, freed after the wait and asked for again. Reused, not made anew."""
    pool = BucketAllocator()
    t = pool.allocate("h_0", "colwise", 64, torch.uint8, torch.device("cpu"), zero=False)
    pool.shared("h_0", "colwise").jax()  # as a unit program reads it
    handle, _ = _issue_with_late_holder(t, release_after_s=LATE_S)
    handle.wait()
    pool.free("h_0", "colwise")
    del t
    pool.allocate("h_1", "colwise", 64, torch.uint8, torch.device("cpu"), zero=False)
    assert (pool.made, pool.reused, pool.held_bytes) == (1, 1, 0)
    assert pool.peak_reserved_bytes == 64


def test_the_wait_leaves_the_cpu_to_the_thread_it_waits_for():
    """A wait that spun would compete with gloo's thread for the core it needs to let go."""
    t = torch.zeros(64)
    handle, _ = _issue_with_late_holder(t, release_after_s=LATE_S)
    wall, cpu = time.perf_counter(), time.process_time()
    handle.wait()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= LATE_S * 0.9 and cpu < 0.5 * wall, (wall, cpu)


def test_a_holder_that_never_lets_go_ends_the_wait_after_the_bound_with_a_warning(monkeypatch):
    monkeypatch.setattr(C, "RELEASE_WAIT_S", 0.02)
    t = torch.zeros(64)
    before = C._counts([t])
    handle, holder = _issue_with_late_holder(t, release_after_s=None)
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="still held the tensors of the finished all-gather"):
        handle.wait()
    assert time.perf_counter() - start < 5.0  # bounded (the pool keeps such a bucket held)
    assert C._counts([t]) != before and holder  # still held: nothing was forced


def test_references_held_elsewhere_before_the_issue_are_not_waited_for():
    t = torch.zeros(64)
    view_kept_by_the_caller = t[2:]  # e.g. a parameter viewing the bucket (not gloo's)
    before = C._counts([t])
    handle, _ = _issue_with_late_holder(t, release_after_s=0.01)
    handle.wait()
    assert C._counts([t]) == before and view_kept_by_the_caller.numel() == 62
