"""GradReducer: staging a micro-batch's gradients and reducing them into the main grad.

Checked against a replicated reference: the mean over DP ranks of every rank's local gradient,
laid out flat. World 1 runs the real ``Communicator`` on an in-process gloo group
(``single_rank_world``); a two-rank reduction is played by ``_PeerComm``, which adds a second
rank's staged bucket (what gloo would sum in), so the shard slicing of rank 1 is checked too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torch_side.comm.collectives import Collective, Communicator, Phase
from torch_side.fsdp.bucket_allocator import BucketAllocator
from torch_side.fsdp.flat_layout import FlatLayout
from torch_side.fsdp.grad_reducer import GradReducer

SHAPES = [(4, 64), (3,), (2, 32)]
NAMES = ["w", "b", "v"]


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _flat(layout: FlatLayout, grads: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(layout.padded_numel)
    for s, g in zip(layout.slots, grads, strict=True):
        out[s.start : s.end] = g.reshape(-1)
    return out


class _PeerComm:
    """Rank ``rank`` of two; the other rank staged ``peer`` (a full padded bucket)."""

    world_size = 2

    def __init__(self, rank: int, peer: torch.Tensor):
        self.rank, self.peer, self.ops = rank, peer, []

    def reduce_scatter(self, out, full, phase, label, async_op=False):
        self.ops.append((Collective.REDUCE_SCATTER, phase, label))
        n = out.numel()
        out.copy_((full + self.peer.to(full.dtype))[self.rank * n : (self.rank + 1) * n])

    def all_reduce(self, t, op, phase, label, async_op=False):
        self.ops.append((op, phase, label))
        t.add_(self.peer.to(t.dtype))


def _reducer(layout, comm, sharded: bool, dtype=torch.float32, divisor: int = 2):
    n = layout.shard_numel if sharded else layout.padded_numel
    main_grad = torch.zeros(n, dtype=torch.float32)
    alloc = BucketAllocator()
    return GradReducer("u/fp32", layout, main_grad, dtype, sharded, divisor, comm, alloc), alloc


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("sharded", [True, False], ids=["reduce_scatter", "all_reduce"])
def test_two_ranks_average_into_main_grad_like_the_replicated_mean(sharded, rank):
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    mine, theirs = _grads(rank), _grads(1 - rank)
    peer = _flat(layout, theirs) / 2  # the other rank divided its bucket too
    comm = _PeerComm(rank, peer)
    red, alloc = _reducer(layout, comm, sharded)
    for i, g in enumerate(mine):
        red.stage(i, g)
    red.reduce()
    want = (_flat(layout, mine) + _flat(layout, theirs)) / 2  # the replicated reference
    if sharded:
        lo, hi = layout.shard_range(rank)
        want = want[lo:hi]
    torch.testing.assert_close(red.main_grad, want, rtol=0, atol=1e-6)
    op = Collective.REDUCE_SCATTER if sharded else Collective.ALL_REDUCE_SUM
    assert comm.ops == [(op, Phase.GRAD_REDUCE, "u/fp32/grad")]
    assert alloc.live_keys() == [] and not red.staged


def test_missing_gradients_are_zeros_and_micro_batches_accumulate(single_rank_world):
    layout = FlatLayout.build(NAMES, SHAPES, 1)
    comm = Communicator(dist.group.WORLD, "dp")
    red, alloc = _reducer(layout, comm, sharded=True, divisor=4)
    assert not red.staged
    first = _grads(0)
    red.stage(0, first[0])  # parameters 1 and 2 got no gradient this micro-batch
    assert red.staged and alloc.live_keys() == [("u/fp32", "grad")]
    red.reduce()
    second = _grads(1)
    for i, g in enumerate(second):
        red.stage(i, g)
    red.stage(2, second[2])  # a gradient reaching the same parameter twice adds up
    red.reduce()
    want = _flat(layout, [first[0], torch.zeros(3), torch.zeros(2, 32)]) / 4
    want += _flat(layout, [second[0], second[1], 2 * second[2]]) / 4
    torch.testing.assert_close(red.main_grad, want, rtol=0, atol=1e-6)
    assert [(r.op, r.label) for r in comm.records] == [
        (Collective.REDUCE_SCATTER, "u/fp32/grad")
    ] * 2


def test_gradients_travel_in_the_grad_comm_dtype(single_rank_world):
    layout = FlatLayout.build(NAMES, SHAPES, 1)
    comm = Communicator(dist.group.WORLD, "dp")
    red, alloc = _reducer(layout, comm, sharded=False, dtype=torch.bfloat16, divisor=1)
    grads = _grads(2)
    for i, g in enumerate(grads):
        red.stage(i, g)
    assert alloc.get("u/fp32", "grad").dtype == torch.bfloat16
    red.reduce()
    want = _flat(layout, [g.to(torch.bfloat16).float() for g in grads])
    assert torch.equal(red.main_grad, want)
    assert comm.records[-1].dtype == torch.bfloat16


def test_drop_frees_the_staged_gradients_without_a_collective():
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    comm = _PeerComm(0, torch.zeros(layout.padded_numel))
    red, alloc = _reducer(layout, comm, sharded=True)
    red.stage(0, _grads(0)[0])
    red.drop()
    assert not red.staged and alloc.live_keys() == [] and comm.ops == []
    assert torch.count_nonzero(red.main_grad) == 0
    red.drop()  # nothing staged: a no-op


class _DeferredComm(_PeerComm):
    """A reduce-scatter that lands only when its handle is waited for (an async collective)."""

    def reduce_scatter(self, out, full, phase, label, async_op=False):
        snapshot = full.clone()  # what the collective reads at issue time
        test = self

        class _Handle:
            def wait(self):
                test.waits += 1
                _PeerComm.reduce_scatter(test, out, snapshot, phase, label)

        return _Handle() if async_op else _PeerComm.reduce_scatter(self, out, full, phase, label)


def test_async_reduction_lands_where_it_is_read_and_keeps_its_bucket_until_then():
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    comm = _DeferredComm(0, torch.zeros(layout.padded_numel))
    comm.waits = 0
    red, alloc = _reducer(layout, comm, sharded=True, divisor=1)
    first, second = _grads(0), _grads(1)
    for i, g in enumerate(first):
        red.stage(i, g)
    red.reduce(async_op=True)
    # issued, not landed: the bucket is held under its in-flight key, main_grad untouched
    assert red.in_flight and not red.staged and comm.waits == 0
    assert alloc.live_keys() == [("u/fp32", "grad_reducing")]
    assert torch.count_nonzero(red.main_grad) == 0
    for i, g in enumerate(second):  # the next micro-batch stages into a new bucket
        red.stage(i, g)
    assert alloc.live_keys() == [("u/fp32", "grad"), ("u/fp32", "grad_reducing")]
    red.reduce(async_op=True)  # settles the first reduction before issuing the second
    assert comm.waits == 1 and red.in_flight
    red.settle()
    red.settle()  # idempotent
    lo, hi = layout.shard_range(0)
    want = (_flat(layout, first) + _flat(layout, second))[lo:hi]
    torch.testing.assert_close(red.main_grad, want, rtol=0, atol=1e-6)
    assert comm.waits == 2 and not red.in_flight and alloc.live_keys() == []


class _RecordingComm(_PeerComm):
    """``_PeerComm`` that notes the address of each reduce-scatter's input."""

    def reduce_scatter(self, out, full, phase, label, async_op=False):
        self.inputs = [*getattr(self, "inputs", []), full.data_ptr()]
        return super().reduce_scatter(out, full, phase, label, async_op)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_flat_buffer_staged_first_becomes_the_bucket_the_reduce_scatter_reads(rank):
    """``stage_flat`` on an empty micro-batch adopts the buffer (no zero-fill, add or copy: the
    collective reads the unit program's own output) with the bytes of staging each gradient;
    a second buffer, or a gradient staged before it, adds into the bucket."""
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    mine, theirs = _grads(rank), _grads(1 - rank)
    peer = _flat(layout, theirs) / 2
    want_red, _ = _reducer(layout, _PeerComm(rank, peer), sharded=True)
    for i, g in enumerate(mine):
        want_red.stage(i, g)
    want_red.reduce()

    comm = _RecordingComm(rank, peer)
    red, alloc = _reducer(layout, comm, sharded=True)
    flat = _flat(layout, mine)
    red.stage_flat(flat)
    assert alloc.get("u/fp32", "grad").data_ptr() == flat.data_ptr() and alloc.adopted == 1
    red.reduce()
    assert comm.inputs == [flat.data_ptr()]
    assert torch.equal(red.main_grad.view(torch.int32), want_red.main_grad.view(torch.int32))
    # freed, an adopted bucket is not pooled (its memory was never the pool's)
    assert alloc.live_keys() == [] and alloc._idle == {} and alloc.reserved_bytes == 0

    # a gradient staged first: the flat buffer is added into the pool's bucket
    red2, alloc2 = _reducer(layout, _RecordingComm(rank, peer), sharded=True)
    red2.stage(1, mine[1])
    flat2 = _flat(layout, [mine[0], torch.zeros(3), mine[2]])
    red2.stage_flat(flat2)
    assert alloc2.get("u/fp32", "grad").data_ptr() != flat2.data_ptr() and alloc2.adopted == 0
    red2.reduce()
    assert torch.equal(red2.main_grad.view(torch.int32), want_red.main_grad.view(torch.int32))


def test_a_negative_zero_gradient_reads_as_positive_zero_in_main_grad():
    """An adopted bucket keeps a gradient's -0.0 (a zero-filled one turned it into +0.0);
    ``main_grad`` starts at +0.0, so it reads the same bytes either way (grad_reducer's note)."""
    layout = FlatLayout.build(NAMES, SHAPES, 1)
    flat = -torch.zeros(layout.padded_numel)
    red, _ = _reducer(layout, _PeerComm(0, -torch.zeros(layout.padded_numel)), sharded=True,
                      divisor=1)
    red.stage_flat(flat)
    red.reduce()
    assert torch.equal(red.main_grad.view(torch.int32), torch.zeros_like(red.main_grad.view(
        torch.int32)))


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_flat_buffer_that_is_not_the_bucket_is_refused_by_name(bad):
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    red, alloc = _reducer(layout, _PeerComm(0, torch.zeros(layout.padded_numel)), sharded=True)
    flat = (torch.zeros(layout.padded_numel + 1) if bad == "shape"
            else torch.zeros(layout.padded_numel, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"GradReducer 'u/fp32': a flat gradient buffer must "
                                         r"match the grad bucket"):
        red.stage_flat(flat)
    assert alloc.live_keys() == []


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_clear_zeroes_lazily_and_micro_batches_add_on_top(main_dtype, comm_dtype):
    """``clear`` writes nothing; the next reduction writes the reduced result (here the sum of
    the collective, whose add made a staged -0.0 +0.0: the bytes of adding into a zero-filled
    main grad, NaN/Inf kept) and a second micro-batch adds on top; a reader of a cleared group
    that no reduction wrote sees zeros."""
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    special = torch.tensor([-0.0, 0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -3.5,
                            -float("nan")] * 8)  # a NaN of either sign, spread over 64 lanes

    def run(lazy: bool) -> list[torch.Tensor]:
        comm = _PeerComm(0, torch.zeros(layout.padded_numel))
        red, _ = _reducer(layout, comm, sharded=False, dtype=comm_dtype, divisor=1)
        red.main_grad = torch.full_like(red.main_grad, 7.0, dtype=main_dtype)  # stale values
        if lazy:
            red.clear()
        else:
            red.main_grad.zero_()
        seen = []
        for mb in range(2):
            g = _grads(mb)
            g[0].view(-1)[: special.numel()] = special
            g[2].fill_(float("nan"))  # a whole parameter of NaN (vectorised lanes)
            for i, t in enumerate(g):
                red.stage(i, t)
            red.reduce()
            seen.append(red.ready().clone())
        return seen

    for lazy_bytes, eager_bytes in zip(run(True), run(False), strict=True):
        assert lazy_bytes.view(torch.uint8).equal(eager_bytes.view(torch.uint8))
    assert torch.signbit(run(True)[0][0]).item() is False  # -0.0 staged, +0.0 reduced

    comm = _PeerComm(0, torch.zeros(layout.padded_numel))
    red, _ = _reducer(layout, comm, sharded=False)
    red.main_grad.fill_(7.0)
    red.clear()
    assert red.main_grad.eq(7.0).all(), "clear writes nothing"
    assert red.ready().eq(0).all() and red.main_grad.eq(0).all()


class _SoloComm:
    """World 1: the all-reduce of one rank leaves the bucket as it is."""

    world_size = 1

    def all_reduce(self, t, op, phase, label, async_op=False):
        return None


class _SoloScatter(_SoloComm):
    """World 1 with sharded gradients: the reduce-scatter copies the bucket into its output (as
    the real communicator does at world size 1) and remembers that output."""

    def reduce_scatter(self, out, full, phase, label, async_op=False):
        out.copy_(full[: out.numel()])
        self.out = out


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
@pytest.mark.parametrize("sharded", [True, False], ids=["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_the_first_reduction_after_clear_writes_the_reduced_bytes(main_dtype, comm_dtype,
                                                                   sharded, release):
    """After ``clear`` the reduced gradient becomes ``main_grad`` as it is, cast to its dtype:
    -0.0 stays -0.0 (``0 + out`` would read +0.0), NaNs of either sign keep their bits, in
    every pair of bucket and main-grad dtypes, whether the storage was released or kept; a
    second micro-batch adds on top."""
    layout = FlatLayout.build(NAMES, SHAPES, 1)
    flat = torch.full((layout.padded_numel,), float("nan"), dtype=comm_dtype)
    flat[::3], flat[1::5], flat[2::7] = -float("inf"), -0.0, -float("nan")
    red, _ = _reducer(layout, _SoloScatter(), sharded, dtype=comm_dtype, divisor=1)
    red.main_grad = torch.full((layout.padded_numel,), 7.0, dtype=main_dtype)
    red.clear(release)
    red.stage_flat(flat.clone())
    red.reduce()
    want = flat.to(main_dtype)
    assert red.ready().view(torch.uint8).equal(want.view(torch.uint8))
    assert torch.signbit(red.main_grad[1]).item(), "a reduced -0.0 stays -0.0"
    red.stage_flat(flat.clone())
    red.reduce()
    assert red.ready().view(torch.uint8).equal(torch.add(want, want).view(torch.uint8))


@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_a_released_main_grad_takes_the_reduce_scatter_output_without_a_copy(comm_dtype):
    """Released, the first reduction hands ``main_grad`` the reduce-scatter's own output (fp32
    buckets) or the cast a bf16 one makes anyway: the tensor object stays, no second buffer is
    allocated and written. Kept, or after an all-reduce (the result is the bucket, which the
    allocator reuses), the bytes are copied into ``main_grad``'s own storage."""
    layout = FlatLayout.build(NAMES, SHAPES, 1)
    flat = torch.randn(layout.padded_numel).to(comm_dtype)
    for sharded, release in ((True, True), (True, False), (False, True)):
        comm = _SoloScatter()
        red, alloc = _reducer(layout, comm, sharded, dtype=comm_dtype, divisor=1)
        held = red.main_grad
        before = held.data_ptr()
        red.clear(release)
        red.stage_flat(flat.clone())
        bucket = alloc.get("u/fp32", "grad")
        red.reduce()
        assert red.main_grad is held and held.numel() == layout.padded_numel
        assert held.data_ptr() != bucket.data_ptr(), "never the bucket the allocator reuses"
        if sharded and release and comm_dtype == torch.float32:
            assert held.data_ptr() == comm.out.data_ptr(), "the reduce-scatter's output itself"
        elif not release:
            assert held.data_ptr() == before, "a kept storage is written in place"
        assert held.equal(flat.float()) and alloc.live_keys() == []


@pytest.mark.parametrize("sharded", [True, False], ids=["reduce_scatter", "all_reduce"])
def test_a_released_main_grad_holds_no_memory_and_comes_back_with_the_same_bytes(sharded):
    """``clear(release=True)`` (``zero_grad(set_to_none=True)``) gives ``main_grad``'s storage
    back, the tensor object kept; the next reduction takes a new one and writes the bytes the
    unreleased path writes (-0.0, NaN and Inf included), micro-batches accumulating on top."""
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    special = torch.tensor([-0.0, float("nan"), float("inf"), 1e-40] * 16)

    def run(release: bool) -> tuple[GradReducer, list[torch.Tensor]]:
        red, _ = _reducer(layout, _PeerComm(0, torch.zeros(layout.padded_numel)), sharded)
        held = red.main_grad
        red.main_grad.fill_(7.0)  # last step's gradient
        red.clear(release)
        assert red.released is release and red.holds_zeros
        if release:
            assert held.untyped_storage().nbytes() == 0 and held.numel() == 0
        seen = []
        for mb in range(2):
            g = _grads(mb)
            g[0].view(-1)[: special.numel()] = special
            for i, t in enumerate(g):
                red.stage(i, t)
            red.reduce()
            assert red.main_grad is held and not red.released and not red.holds_zeros
            seen.append(red.ready().clone())
        return red, seen

    for got, want in zip(run(True)[1], run(False)[1], strict=True):
        assert got.shape == want.shape and got.view(torch.uint8).equal(want.view(torch.uint8))


def test_a_released_main_grad_reads_as_zeros_and_a_stale_reference_keeps_its_values():
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    red, _ = _reducer(layout, _PeerComm(0, torch.zeros(layout.padded_numel)), sharded=True)
    red.main_grad.fill_(7.0)
    stale = red.main_grad[:5]  # a view taken before the release
    red.clear(release=True)
    red.clear(release=True)  # twice: still released, nothing else
    assert red.released and stale.eq(7.0).all(), "the old storage lives on in its holders"
    got = red.ready()  # a reader of a group no reduction wrote: zeros, in a new storage
    assert got is red.main_grad and got.numel() == layout.shard_numel and got.eq(0).all()
    assert not red.released and stale.eq(7.0).all()
    red.clear()  # without release the storage stays
    assert not red.released and red.main_grad.numel() == layout.shard_numel


def test_release_settles_a_reduction_in_flight_first():
    layout = FlatLayout.build(NAMES, SHAPES, 2)
    comm = _DeferredComm(0, torch.zeros(layout.padded_numel))
    comm.waits = 0
    red, alloc = _reducer(layout, comm, sharded=True, divisor=1)
    for i, g in enumerate(_grads(0)):
        red.stage(i, g)
    red.reduce(async_op=True)
    red.clear(release=True)
    assert comm.waits == 1 and not red.in_flight and red.released and alloc.live_keys() == []
    assert red.ready().eq(0).all()
