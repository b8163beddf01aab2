"""A finished gloo collective lets go of its bucket before ``wait()`` returns.

gloo marks a collective complete before its worker thread drops the work, which holds the
bucket (the tensor, and views of it). ``Handle.wait()`` and the synchronous path wait for those
references to go (``collectives._await_release``), so the bucket pool's reuse check sees the
bucket free at once: the memory bound of a step does not depend on thread timing (a case of
cases_overlap.py failed on some runs before). Played here with a holder released by another
thread after the wait returned, as gloo's worker does.
"""

from __future__ import annotations

import threading
import time

import torch
from torch.utils.dlpack import to_dlpack

from torch_side import collectives as C
from torch_side.collectives import Collective, Handle, Phase


class _DoneWork:
    """A work that has completed: ``wait()`` returns at once."""

    def wait(self) -> bool:
        return True


def _issue_with_late_holder(t: torch.Tensor, release_after_s: float | None):
    """A Handle whose work, like gloo's, holds ``t`` (a DLPack export: a TensorImpl
    reference, and a view: a storage reference) until another thread lets go."""
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
    return handle, before, holder


def test_wait_returns_once_the_collective_let_go_of_the_bucket():
    t = torch.zeros(64)
    handle, before, _ = _issue_with_late_holder(t, release_after_s=0.05)
    handle.wait()
    assert C._counts([t]) == before  # the late holder is gone: the pool may reuse the bucket


def test_a_holder_that_never_lets_go_ends_the_wait_after_the_bound(monkeypatch):
    monkeypatch.setattr(C, "RELEASE_WAIT_S", 0.02)
    t = torch.zeros(64)
    handle, before, holder = _issue_with_late_holder(t, release_after_s=None)
    start = time.perf_counter()
    handle.wait()
    assert time.perf_counter() - start < 5.0  # bounded (the pool keeps such a bucket held)
    assert C._counts([t]) != before and holder  # still held: nothing was forced


def test_references_held_elsewhere_before_the_issue_are_not_waited_for():
    t = torch.zeros(64)
    view_kept_by_the_caller = t[2:]  # e.g. a parameter viewing the bucket (not gloo's)
    handle, before, _ = _issue_with_late_holder(t, release_after_s=0.01)
    handle.wait()
    assert C._counts([t]) == before and view_kept_by_the_caller.numel() == 62
