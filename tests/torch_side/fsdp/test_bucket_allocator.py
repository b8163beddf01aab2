"""``BucketAllocator``: pooled buckets and adopted ones (a unit program's gradient group).

The pool's reuse rules are exercised through the plane buckets (``test_plane_bucket.py``) and the
overlap tests; here: what ``adopt`` promises -- the tensor itself becomes the live bucket, it is
counted while held, never pooled, refused when it is not a whole 1-D buffer or its key is live,
and on CUDA kept until the work queued before its free has run.
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
