"""``PlaneBucket``: one plane of one group, and where its full values are (``PlaneState``).

Tensors owned:

- the **unsharded bucket** (ZeRO-3 only): the plane's full padded buffer, from the
  ``BucketAllocator`` (key ``(group label, plane)``), all-gathered from the rank's shard on
  ``unshard`` and freed on ``reshard``;
- the plane's **shares** with JAX (``shared``): the full buffer (the bucket, or the replicated
  model buffer) and the plane's scale buffer, each a ``bridge.shared.SharedBuffer``. A bucket's
  share belongs to the pooled tensor (``BucketAllocator.shared``) and goes back to the pool with
  it at reshard, so the next unit that takes the tensor reads the same JAX array. A refresh
  rewrites the scale buffer and a replicated plane in place, so their shares are kept (the
  ordering argument is in ``bridge/shared.py``, "Reuse across in-place rewrites").

The plane's shard (or replicated buffer) itself belongs to ``GroupBuffers.model[plane]``; the
bucket only reads it, looked up at each use (``local``): a refresh may put another tensor there
(``GroupBuffers.refresh_from`` keeps the codec's images as ZeRO-3's shards). Transitions, each
checked by ``expect`` (an internal error naming the rank, group and plane, and the states it
expected)::

    REPLICATED                                     (no_shard, ZeRO-1/2: unshard/reshard no-ops)
    SHARDED --unshard--> UNSHARDED --reshard--> SHARDED
    SHARDED --unshard(async)--> GATHERING --wait--> UNSHARDED
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import torch
import torch.distributed as dist

from bridge.shared import SharedBuffer
from common.formats import Plane
from torch_side.comm.collectives import Communicator, Handle, Phase
from torch_side.fsdp.bucket_allocator import BucketAllocator

__all__ = ["PlaneBucket", "PlaneState", "QuantizedPlanes"]


class PlaneState(enum.Enum):
    """Where one plane's full values are."""

    REPLICATED = "replicated"  # the model weight buffer holds them (no_shard, ZeRO-1/2)
    SHARDED = "sharded"  # only this rank's shard exists (ZeRO-3, no bucket)
    GATHERING = "gathering"  # an async all-gather into the bucket is in flight
    UNSHARDED = "unsharded"  # the bucket holds them


IN_BUCKET = (PlaneState.GATHERING, PlaneState.UNSHARDED)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class PlaneBucket:
    def __init__(
        self,
        label: str,
        plane: Plane,
        buffers: Mapping[Plane, torch.Tensor],
        sharded: bool,
        padded_numel: int,
        comm: Communicator,
        allocator: BucketAllocator,
    ):
        """buffers: the group's model buffers by plane (``GroupBuffers.model``; this plane's is
        the rank's shard when ``sharded``, else the full replicated buffer), read at each use;
        padded_numel: the full buffer's length."""
        self.label, self.plane, self._buffers = label, plane, buffers
        self.padded_numel, self.comm, self.allocator = padded_numel, comm, allocator
        self.state = PlaneState.SHARDED if sharded else PlaneState.REPLICATED
        self._bucket: torch.Tensor | None = None
        self._work: Handle | None = None  # the in-flight async all-gather (prefetch)
        self._data_share: SharedBuffer | None = None
        self._scale_share: SharedBuffer | None = None

    def expect(self, *expected: PlaneState) -> None:
        """The one check of this plane's state: an internal error naming what was expected."""
        if self.state not in expected:
            raise AssertionError(
                f"rank {_rank()}: group {self.label!r} plane {self.plane.value} is "
                f"{self.state.value}, expected {' or '.join(e.value for e in expected)}"
            )

    @property
    def local(self) -> torch.Tensor:
        """This plane's model buffer now (the shard, or the replicated buffer)."""
        return self._buffers[self.plane]

    @property
    def live(self) -> bool:
        """Whether a bucket is held (gathered or gathering)."""
        return self.state in IN_BUCKET

    def wait(self) -> None:
        """Wait for an in-flight gather: GATHERING becomes UNSHARDED."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
        if self.state is PlaneState.GATHERING:
            self.state = PlaneState.UNSHARDED

    def full(self) -> torch.Tensor:
        """The full (padded) buffer: the replicated buffer, or the bucket (waited for)."""
        if self.state is PlaneState.REPLICATED:
            return self.local
        self.wait()
        self.expect(PlaneState.UNSHARDED)
        return self._bucket

    def unshard(self, phase: Phase, async_op: bool = False) -> torch.Tensor | None:
        """All-gather the plane into a new bucket and return it (its values are valid once
        waited for); None when nothing was allocated: a replicated plane, or one already in a
        bucket (a gather still in flight is waited for unless async_op)."""
        if self.state is PlaneState.REPLICATED:
            return None
        if self.live:
            if not async_op:
                self.wait()
            return None
        self.expect(PlaneState.SHARDED)
        local = self.local
        bucket = self.allocator.allocate(  # written whole by the gather: no zero-fill
            self.label, self.plane.value, self.padded_numel, local.dtype, local.device,
            zero=False,
        )
        work = self.comm.all_gather(
            bucket, local, phase, f"{self.label}/{self.plane.value}", async_op=async_op
        )
        self._bucket, self.state = bucket, PlaneState.UNSHARDED
        if work is not None:
            self._work, self.state = work, PlaneState.GATHERING
        return bucket

    def reshard(self) -> None:
        """Free the bucket (waiting for a gather in flight); a no-op unless one is held."""
        if self.state is PlaneState.REPLICATED:
            return
        self.wait()
        if self.state is PlaneState.UNSHARDED:
            self._data_share = None
            self._bucket = None
            self.allocator.free(self.label, self.plane.value)
            self.state = PlaneState.SHARDED

    def shared_data(self) -> SharedBuffer:
        """The full buffer shared with JAX: the replicated buffer's share, made once, or the
        bucket's, which the pool keeps with the tensor (``BucketAllocator.shared``): a bucket
        that served another unit before crosses the bridge no more."""
        full = self.full()  # waits for an in-flight gather; checks the state
        share = self._data_share
        if share is None or share.tensor is not full:
            if self.state is PlaneState.REPLICATED:
                share = SharedBuffer(full)
            else:
                share = self.allocator.shared(self.label, self.plane.value)
            self._data_share = share
        return share

    def shared(self, scale_buffer: torch.Tensor) -> tuple[SharedBuffer, SharedBuffer]:
        """(full buffer, scale buffer) shared with JAX, made once per buffer lifetime."""
        data = self.shared_data()
        if self._scale_share is None:
            self._scale_share = SharedBuffer(scale_buffer)
        return data, self._scale_share


class QuantizedPlanes:
    """``GatherMode.BF16``: the MXFP8 planes a rank quantized from a group's gathered bf16
    buffer (``ParamGroup.plane_views``), from the ``BucketAllocator`` (keys ``(label,
    "quantized_<plane>")``), and their shares with JAX; held from the first read after a gather
    until ``drop`` (every reshard, and a refresh)."""

    def __init__(self, label: str, planes: tuple[Plane, ...], allocator: BucketAllocator):
        self.label, self.planes, self.allocator = label, planes, allocator
        self._buffers: dict[Plane, torch.Tensor] | None = None
        self._shares: dict[Plane, tuple[SharedBuffer, SharedBuffer]] = {}

    @property
    def live(self) -> bool:
        return self._buffers is not None

    def allocate(self, numel: int, device: torch.device) -> dict[Plane, torch.Tensor]:
        """Empty buffers for every plane (the caller fills them, then ``keep``s them)."""
        return {p: self.allocator.allocate(self.label, f"quantized_{p.value}", numel,
                                           torch.uint8, device) for p in self.planes}

    def keep(self, buffers: dict[Plane, torch.Tensor]) -> None:
        """Hold ``allocate``'s buffers, now filled, until ``drop``."""
        self._buffers = buffers

    def buffer(self, plane: Plane) -> torch.Tensor:
        """The kept buffer of ``plane`` (``live`` only)."""
        if self._buffers is None:
            raise AssertionError(f"group {self.label!r}: no quantized planes are held")
        return self._buffers[plane]

    def shared(self, plane: Plane, scale_buffer: torch.Tensor) -> tuple[SharedBuffer, SharedBuffer]:
        """(plane buffer, scale buffer) shared with JAX, made once per buffer lifetime."""
        if plane not in self._shares:
            self._shares[plane] = (SharedBuffer(self.buffer(plane)), SharedBuffer(scale_buffer))
        return self._shares[plane]

    def drop(self) -> None:
        if self._buffers is not None:
            self._buffers, self._shares = None, {}
            for p in self.planes:
                self.allocator.free(self.label, f"quantized_{p.value}")
