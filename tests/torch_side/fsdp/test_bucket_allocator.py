"""``BucketAllocator``: pooled buckets and adopted ones (a unit program's gradient group).

The pool's reuse rules are exercised through the plane buckets (``test_plane_bucket.py``) and the
overlap tests; here: what ``adopt`` promises -- the tensor itself becomes the live bucket, it is
counted while held, never pooled, refused when it is not a whole 1-D buffer or its key is live,
and on CUDA kept until the work queued before its free has run, at most ``retiring_limit`` of
them at once (the host waits for the oldest).
"""

from __future__ import annotations

import pytest
import torch

from torch_side.fsdp.bucket_allocator import BucketAllocator


def test_an_adopted_bucket_is_the_tensor_counted_while_held_and_never_pooled():
    alloc = BucketAllocator()
    t = torch.arange(64, dtype=torch.float32)
    assert alloc.adopt("u", "grad", t) is t
    assert alloc.get("u", "grad") is t and alloc.adopted == 1
    assert alloc.live_bytes == alloc.reserved_bytes == alloc.peak_reserved_bytes == 256
    alloc.free("u", "grad")
    assert alloc.live_keys() == [] and alloc.live_bytes == alloc.reserved_bytes == 0
    assert alloc.held_bytes == 0 and alloc.peak_reserved_bytes == 256
    # the next bucket of that size is new memory, not the adopted tensor
    fresh = alloc.allocate("u", "grad", 64, torch.float32, t.device)
    assert fresh.data_ptr() != t.data_ptr() and alloc.made == 1 and alloc.reused == 0


def test_adopt_refuses_a_live_key_and_what_is_not_a_whole_flat_buffer():
    alloc = BucketAllocator()
    alloc.allocate("u", "grad", 8, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"bucket \('u', 'grad'\) is still live"):
        alloc.adopt("u", "grad", torch.zeros(8))
    base = torch.zeros(16)
    for bad in (torch.zeros(2, 4), base[::2], base[8:]):
        with pytest.raises(ValueError, match=r"adopt \('v', 'grad'\): expected a whole "
                                             r"contiguous 1-D tensor"):
            alloc.adopt("v", "grad", bad)
    assert alloc.live_keys() == [("u", "grad")] and alloc.adopted == 0


class _Event:
    """A CUDA event's part the allocator uses: not complete until waited for."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.done = True


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_at_most_retiring_limit_freed_adopted_buckets_wait_the_oldest_is_waited_for(
        limit, monkeypatch):
    """Freed adopted buckets whose readers may still run (their events not complete) are kept,
    at most ``retiring_limit`` of them: a further free makes the host wait for the oldest's
    event and release it; one whose event completed goes without a wait. (Events that complete
    only when waited for, on the CPU; the real ones: the GPU test below.)"""
    alloc = BucketAllocator(retiring_limit=limit)
    waited: list = []
    for i in range(4):
        monkeypatch.setattr(alloc, "_readers_event", lambda t, n=f"b{i}": _Event(waited, n))
        alloc.adopt(f"b{i}", "grad", torch.zeros(16))
        alloc.free(f"b{i}", "grad")
        assert alloc.held_bytes == alloc.reserved_bytes == 64 * min(i + 1, limit)
    assert waited == [f"b{i}" for i in range(4 - limit)] and alloc.retire_waits == 4 - limit
    if limit:
        alloc._retiring[0].ready.done = True  # its readers ran: released at the next check
        assert alloc.held_bytes == 64 * (limit - 1) and alloc.retire_waits == 4 - limit


def test_on_the_cpu_a_freed_adopted_bucket_is_released_at_once_whatever_the_limit():
    alloc = BucketAllocator(retiring_limit=0)
    alloc.adopt("u", "grad", torch.zeros(16))
    alloc.free("u", "grad")
    assert alloc.held_bytes == alloc.reserved_bytes == 0 and alloc.retire_waits == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_retiring_limit_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"retiring_limit must be an int >= 0 .* got "):
        BucketAllocator(retiring_limit=bad)


@pytest.mark.gpu
def test_on_cuda_a_second_freed_adopted_bucket_waits_for_the_first_ones_readers():
    """With a limit of 1, freeing a second adopted bucket while the first one's readers are
    still queued makes the host wait for them: afterwards the first is released (its event
    complete) and only the second is held."""
    alloc = BucketAllocator(retiring_limit=1)
    a, b = torch.zeros(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    alloc.adopt("a", "grad", a)
    torch.cuda._sleep(200_000_000)  # queued work that may still read bucket a
    alloc.free("a", "grad")
    first = alloc._retiring[0].ready
    alloc.adopt("b", "grad", b)
    torch.cuda._sleep(200_000_000)
    alloc.free("b", "grad")
    assert first.query() and alloc.retire_waits == 1
    assert alloc.held_bytes == b.numel() * 4
    torch.cuda.synchronize()
    assert alloc.held_bytes == 0 and alloc.reserved_bytes == 0


@pytest.mark.gpu
def test_on_cuda_a_freed_adopted_bucket_is_held_until_the_queued_work_ran():
    alloc = BucketAllocator()
    t = torch.zeros(1 << 20, device="cuda")
    alloc.adopt("u", "grad", t)
    torch.cuda._sleep(200_000_000)  # queued work that may still read the bucket
    alloc.free("u", "grad")
    held = alloc.held_bytes
    torch.cuda.synchronize()
    assert held == t.numel() * 4, "freed while the stream's work had not run"
    assert alloc.held_bytes == 0 and alloc.reserved_bytes == 0
