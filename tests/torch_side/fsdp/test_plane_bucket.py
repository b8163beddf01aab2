"""PlaneBucket: one plane's state machine (PlaneState), its bucket and its shares with JAX.

In-process, world 1: the all-gather of one rank is a copy of its shard. ``_DeferredComm`` plays
the communicator (the real one is covered by the spawned worlds): a synchronous gather copies at
once, an asynchronous one (prefetch) only when its work is waited for, so the GATHERING state can
be observed without a second process.
"""

from __future__ import annotations

import pytest
import torch

from common.formats import Plane
from torch_side.comm.collectives import Phase
from torch_side.fsdp.bucket_allocator import BucketAllocator
from torch_side.fsdp.plane_bucket import PlaneBucket, PlaneState

N = 512  # padded elements of the plane (world 1: shard == full)


class _Work:
    def __init__(self, out: torch.Tensor, shard: torch.Tensor):
        self.out, self.shard, self.waited = out, shard, 0

    def wait(self) -> None:
        self.waited += 1
        self.out.copy_(self.shard)


class _DeferredComm:
    """World 1, but an async all-gather lands only when its work is waited for."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.calls: list[tuple[Phase, str, bool]] = []
        self.works: list[_Work] = []

    def all_gather(self, out, shard, phase, label, async_op=False):
        self.calls.append((phase, label, async_op))
        if not async_op:
            out.copy_(shard)
            return None
        self.works.append(_Work(out, shard))
        return self.works[-1]


def _local() -> torch.Tensor:
    return torch.arange(N, dtype=torch.int64).remainder(251).to(torch.uint8)


def _bucket(sharded: bool = True, comm=None, plane: Plane = Plane.COLWISE):
    alloc = BucketAllocator()
    comm = _DeferredComm() if comm is None else comm
    return PlaneBucket("blk/mxfp8", plane, {plane: _local()}, sharded, N, comm, alloc), alloc


def test_a_replicated_plane_is_its_model_buffer_and_never_gathers():
    b, alloc = _bucket(sharded=False)
    assert b.state is PlaneState.REPLICATED and not b.live
    assert b.unshard(Phase.FORWARD) is None
    assert b.full() is b.local  # the replicated buffer itself, no copy
    b.reshard()
    assert b.state is PlaneState.REPLICATED and alloc.live_keys() == []


def test_sharded_unsharded_sharded_allocates_and_frees_one_bucket():
    comm = _DeferredComm()
    b, alloc = _bucket(comm=comm)
    assert b.state is PlaneState.SHARDED
    bucket = b.unshard(Phase.BACKWARD)
    assert b.state is PlaneState.UNSHARDED and b.live
    assert alloc.live_keys() == [("blk/mxfp8", "colwise")]
    assert bucket.dtype == torch.uint8 and bucket.numel() == N
    assert torch.equal(b.full(), _local()) and b.full() is bucket
    assert comm.calls == [(Phase.BACKWARD, "blk/mxfp8/colwise", False)]
    assert b.unshard(Phase.BACKWARD) is None  # already unsharded: no second gather
    assert len(comm.calls) == 1
    b.reshard()
    assert b.state is PlaneState.SHARDED and not b.live and alloc.live_keys() == []
    b.reshard()  # a sharded plane: nothing to free
    assert b.state is PlaneState.SHARDED


def test_reading_a_sharded_plane_is_refused_naming_rank_group_plane_and_expected_state():
    b, _ = _bucket()
    with pytest.raises(AssertionError) as e:
        b.full()
    assert str(e.value) == (
        "rank 0: group 'blk/mxfp8' plane colwise is sharded, expected unsharded"
    )


def test_expect_names_every_accepted_state():
    b, _ = _bucket()
    b.unshard(Phase.FORWARD)
    with pytest.raises(AssertionError, match="is unsharded, expected replicated or sharded"):
        b.expect(PlaneState.REPLICATED, PlaneState.SHARDED)
    b.expect(PlaneState.UNSHARDED)  # accepted: no error


def test_an_async_gather_is_gathering_until_waited_for():
    comm = _DeferredComm()
    b, alloc = _bucket(comm=comm)
    bucket = b.unshard(Phase.FORWARD, async_op=True)
    bucket.fill_(0)  # (a gathered bucket is not zero-filled: its old bytes are arbitrary)
    assert b.state is PlaneState.GATHERING and b.live
    assert comm.works[0].waited == 0 and not bucket.any()  # nothing landed yet
    assert b.unshard(Phase.FORWARD, async_op=True) is None  # prefetch again: no wait, no gather
    assert b.state is PlaneState.GATHERING and comm.works[0].waited == 0
    assert torch.equal(b.full(), _local())  # full() waits
    assert b.state is PlaneState.UNSHARDED and comm.works[0].waited == 1
    b.reshard()
    assert alloc.live_keys() == []


def test_a_sync_unshard_waits_for_a_gather_in_flight():
    comm = _DeferredComm()
    b, _ = _bucket(comm=comm)
    b.unshard(Phase.FORWARD, async_op=True)
    assert b.unshard(Phase.FORWARD) is None
    assert b.state is PlaneState.UNSHARDED and comm.works[0].waited == 1


def test_reshard_waits_for_a_gather_in_flight_before_freeing():
    comm = _DeferredComm()
    b, alloc = _bucket(comm=comm)
    b.unshard(Phase.FORWARD, async_op=True)
    b.reshard()
    assert comm.works[0].waited == 1
    assert b.state is PlaneState.SHARDED and alloc.live_keys() == []


def test_shares_are_made_once_per_buffer_lifetime():
    b, _ = _bucket()
    scales = torch.zeros(256, dtype=torch.uint8)
    b.unshard(Phase.BACKWARD)
    data, scale = b.shared(scales)
    assert data.tensor is b.full() and scale.tensor is scales
    assert b.shared(scales) == (data, scale)  # the same objects: one crossing per lifetime
    b.reshard()  # the bucket is freed: its share goes, the scale share stays
    b.unshard(Phase.BACKWARD)
    data2, scale2 = b.shared(scales)
    assert data2 is not data and data2.tensor is b.full() and scale2 is scale


def test_reshard_returns_a_shared_bucket_to_the_pool_which_reuses_it_once_jax_lets_go():
    """The share must not keep a freed bucket away from the pool, and the pool must not hand
    out a bucket that JAX (or a Torch view) still references."""
    b, alloc = _bucket()
    b.unshard(Phase.BACKWARD)
    data, _ = b.shared(torch.zeros(256, dtype=torch.uint8))
    first = data.tensor.data_ptr()
    held = data.jax()  # a JAX array still reading the bucket (a residual kept for backward)
    del data
    b.reshard()
    assert alloc.live_keys() == [] and alloc.held_bytes == b.padded_numel
    b.unshard(Phase.BACKWARD)  # the held bucket is not reused: a new one is made
    assert b.full().data_ptr() != first and alloc.made == 2 and alloc.reused == 0
    b.reshard()
    del held  # JAX lets go: both buckets are idle and reusable
    assert alloc.held_bytes == 0
    b.unshard(Phase.BACKWARD)
    assert alloc.reused == 1 and alloc.made == 2
    assert alloc.reserved_bytes == 2 * b.padded_numel
    b.reshard()
    assert alloc.trim() == 2 * b.padded_numel and alloc.reserved_bytes == 0


def test_a_bucket_share_follows_the_tensor_through_the_pool_to_the_next_owner():
    """Unit after unit takes the same pooled tensor and reads it through the same JAX array: no
    crossing per lifetime (bridge.count_crossings), and the values are the new owner's."""
    from bridge import count_crossings

    alloc = BucketAllocator()
    comm = _DeferredComm()
    first = PlaneBucket("a/mxfp8", Plane.ROWWISE, {Plane.ROWWISE: _local()}, True, N, comm,
                        alloc)
    second = PlaneBucket("b/mxfp8", Plane.ROWWISE, {Plane.ROWWISE: _local().flip(0)}, True,
                         N, comm, alloc)
    first.unshard(Phase.FORWARD)
    share = first.shared_data()
    jax_view = share.jax()
    share_id = id(share)  # (the pool keeps the object alive: the id stays its own)
    first.reshard()
    del jax_view, share  # a JAX array or share held elsewhere keeps the tensor out of the pool
    with count_crossings() as stats:
        second.unshard(Phase.FORWARD)
        again = second.shared_data()
        values = again.jax()
    assert id(again) == share_id and alloc.reused == 1 and alloc.made == 1
    assert stats.calls == 0, stats
    assert bytes(memoryview(values)) == bytes(_local().flip(0).numpy())
    second.reshard()


def test_gathered_buckets_are_not_zero_filled_but_grad_buckets_are():
    alloc = BucketAllocator()
    cpu = torch.device("cpu")
    t = alloc.allocate("u", "rowwise", 64, torch.uint8, cpu, zero=False)
    t.fill_(7)
    ptr = t.data_ptr()
    alloc.free("u", "rowwise")
    fresh = alloc.allocate("w", "rowwise", 64, torch.uint8, cpu, zero=False)
    assert fresh.data_ptr() != ptr  # `t` still references the freed bucket: not reused
    del t
    again = alloc.allocate("v", "rowwise", 64, torch.uint8, cpu, zero=False)
    assert again.data_ptr() == ptr and int(again[0]) == 7  # reused as is, not zero-filled
    del again
    alloc.free("v", "rowwise")
    grad = alloc.allocate("v", "grad", 64, torch.uint8, cpu)  # zero=True by default
    assert grad.data_ptr() == ptr and not grad.any()
    view = grad[8:]  # a Torch view (e.g. saved by autograd) also keeps it from the pool
    del grad
    alloc.free("v", "grad")
    assert alloc.held_bytes == 64
    del view
    assert alloc.held_bytes == 0


def test_sharing_a_sharded_plane_is_refused():
    b, _ = _bucket()
    with pytest.raises(AssertionError, match="is sharded, expected unsharded"):
        b.shared(torch.zeros(256, dtype=torch.uint8))


def test_a_refresh_keeps_the_scale_share(single_rank_world):
    """The scale buffers are rewritten in place at a refresh, and their JAX share stays (the
    ordering argument: bridge/shared.py); the next step reads them without a new crossing."""
    from tests.torch_side.toy_models import make_net
    from torch_side import fully_shard

    net = make_net(0)
    model = fully_shard(net, unit_modules=(type(net.blocks[0]),))
    g = next(g for g in model.param_groups if g.scale_buffers)
    g.unshard([g.forward_plane], Phase.FORWARD)
    before = g.shared_plane(0, g.forward_plane).scale
    scale_bytes = g.scale_buffers[g.forward_plane]
    g.reshard()
    with torch.no_grad():
        g.main.mul_(3.0)  # new values: new scales, written into the same buffer
    model.refresh_model_weights()
    assert g.scale_buffers[g.forward_plane] is scale_bytes
    g.unshard([g.forward_plane], Phase.FORWARD)
    after = g.shared_plane(0, g.forward_plane).scale
    g.reshard()
    assert after is before and g.live_buckets() == []
    assert after.tensor is scale_bytes


def test_a_gather_reads_the_shard_the_group_holds_now():
    """A refresh may put another tensor in the group's model buffers (GroupBuffers keeps the
    codec's images as ZeRO-3's shards): the next gather sends that one, not the first."""
    buffers = {Plane.COLWISE: _local()}
    b = PlaneBucket("blk/mxfp8", Plane.COLWISE, buffers, True, N, _DeferredComm(),
                    BucketAllocator())
    buffers[Plane.COLWISE] = kept = _local().flip(0)
    assert b.local is kept
    b.unshard(Phase.FORWARD)
    assert torch.equal(b.full(), kept)
