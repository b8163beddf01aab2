"""``ParamGroup``: the buffers of one parameter group and everything that moves them.

Tensors of a group (DESIGN.md 5 glossary; every buffer uses the group's ``FlatLayout``):

- **main weight** (``main``): fp32, the rank's shard (or the full buffer under ``no_shard``);
  the optimizer updates it.
- **model weight buffers** (``model[plane]``), one per plane of the group's format
  (``common.formats.FORMATS``): MXFP8 has a rowwise and a **columnwise** plane of uint8 bytes,
  fp32/bf16 one (rowwise) plane holding the weights. The rank's shard under ZeRO-3, else the full
  replicated buffer.
- **scale tensors** (``scales[plane][i]``, MXFP8: rowwise (M, K/32), columnwise (M/32, K), uint8):
  full and replicated, recomputed identically by every rank at each quantization; views of one
  flat buffer per plane (``scale_buffers``).
- **main grad** (``main_grad``): the reduced gradient, shard (ZeRO-2/3) or full, policy dtype.
- **unsharded bucket**: from the ``BucketAllocator``, one per plane, all-gathered on unshard and
  freed on reshard (ZeRO-3 only); **grad bucket**: full-size staging of this micro-batch's local
  gradients, reduced (scattered) and freed in post-backward.

What the weights are made of, and how, comes from the group's ``WeightCodec`` (a table keyed by
the format; ``torch_side.weight_codecs``), never from a derived boolean. Each plane's lifecycle is
a :class:`PlaneState`, checked by ``_expect_state`` whose error names the rank, group and plane.

Sharing with JAX (``shared_plane``): a plane's full buffer (the unsharded bucket, or the replicated
model buffer) and the plane's scale buffer cross the bridge once per lifetime as
``bridge.shared.SharedBuffer``; every layer of the group reads its weight from them by offset.
The shares are dropped when the bucket is freed (reshard) or the buffers are rewritten (refresh).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from bridge.shared import SharedBuffer, SharedPlane
from common.formats import Plane, WeightFormat
from common.kernels import KernelConfig
from torch_side.bucket_allocator import BucketAllocator
from torch_side.collectives import Collective, Communicator, Phase
from torch_side.flat_layout import FlatLayout, OwnedPiece, check_layout
from torch_side.policy import MixedPrecisionPolicy
from torch_side.strategy import STRATEGY_FACTS, ShardingStrategy
from torch_side.weight_codecs import ParamStorage, WeightCodec

__all__ = ["GroupKey", "ParamEntry", "ParamGroup", "PlaneState"]


@dataclasses.dataclass(frozen=True)
class GroupKey:
    device: torch.device
    weight_format: WeightFormat
    requires_grad: bool
    dp_group: str  # "dp" or "expert_dp"


@dataclasses.dataclass
class ParamEntry:
    name: str  # qualified name in the wrapped model
    module: nn.Module
    param: nn.Parameter
    shape: tuple[int, ...]
    dtype: torch.dtype  # the parameter's original dtype (grads arrive in it)


class PlaneState(enum.Enum):
    """Where one plane's full values are."""

    REPLICATED = "replicated"  # the model weight buffer holds them (no_shard, ZeRO-1/2)
    SHARDED = "sharded"  # only this rank's shard exists (ZeRO-3, no bucket)
    GATHERING = "gathering"  # an async all-gather into the bucket is in flight
    UNSHARDED = "unsharded"  # the bucket holds them


_IN_BUCKET = (PlaneState.GATHERING, PlaneState.UNSHARDED)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ParamGroup:
    def __init__(
        self,
        label: str,
        key: GroupKey,
        entries: list[ParamEntry],
        policy: MixedPrecisionPolicy,
        strategy: ShardingStrategy,
        comm: Communicator,
        allocator: BucketAllocator,
        grad_divisor: int,
        codec: WeightCodec,
        kernels: KernelConfig | None = None,
    ):
        self.label, self.key, self.entries = label, key, entries
        # Gradients are divided by the dense DP size for every group, expert groups included
        # (they reduce over the smaller expert-DP group): each rank's loss is its own mean, so
        # the gradient of the mean loss over all DP ranks is sum(local grads) / DP (Megatron's
        # expert gradient scaling is 1 / data-parallel size for the same reason).
        self.grad_divisor = grad_divisor
        self.policy, self.strategy, self.facts = policy, strategy, STRATEGY_FACTS[strategy]
        self.comm, self.allocator = comm, allocator
        self.format, self.codec, self.kernels = key.weight_format, codec, kernels
        self.planes = codec.planes
        self.layout = FlatLayout.build(
            [e.name for e in entries], [e.shape for e in entries], comm.world_size
        )
        self.layout_stats = check_layout(self.layout, label)
        self.device = key.device
        self._allocate_buffers()
        self._work: dict[Plane, object] = {}  # in-flight async all-gathers (prefetch)
        self._bucket: dict[Plane, torch.Tensor] = {}
        self._shared: dict[tuple[str, Plane], SharedBuffer] = {}  # ("data"|"scale", plane)
        start = PlaneState.SHARDED if self.facts.model_weights_sharded else PlaneState.REPLICATED
        self.state: dict[Plane, PlaneState] = {p: start for p in self.planes}

    # ---- state ---------------------------------------------------------------------------
    def _expect_state(self, plane: Plane, *expected: PlaneState) -> None:
        if self.state[plane] not in expected:
            raise AssertionError(
                f"rank {_rank()}: group {self.label!r} plane {plane.value} is "
                f"{self.state[plane].value}, expected {' or '.join(e.value for e in expected)}"
            )

    def _check_plane(self, plane: Plane) -> Plane:
        if plane not in self.planes:
            raise AssertionError(
                f"rank {_rank()}: group {self.label!r} ({self.format.value}) has no "
                f"{plane.value} plane; its planes are {[p.value for p in self.planes]}"
            )
        return plane

    @property
    def forward_plane(self) -> Plane:
        return self.codec.spec.forward_plane

    @property
    def backward_plane(self) -> Plane:
        """The plane backward reads: columnwise for MXFP8, the (only) weights otherwise."""
        return self.codec.spec.backward_plane

    # ---- buffers -------------------------------------------------------------------------
    def _local(self, sharded: bool) -> int:
        return self.layout.shard_numel if sharded else self.layout.padded_numel

    def _allocate_buffers(self) -> None:
        f, dev = self.facts, self.device
        self.main = torch.zeros(
            self._local(f.main_weights_sharded), dtype=torch.float32, device=dev
        )
        n = self._local(f.model_weights_sharded)
        self.model = {
            p: torch.zeros(n, dtype=self.codec.buffer_dtype, device=dev) for p in self.planes
        }
        self.main_grad = None
        if self.key.requires_grad:
            self.main_grad = torch.zeros(
                self._local(f.grads_sharded), dtype=self.policy.main_grad_dtype, device=dev
            )
        scales = self.codec.make_scales([s.shape for s in self.layout.slots], dev)
        self.scales, self.scale_buffers, self.scale_offsets = (
            scales.views, scales.buffers, scales.offsets
        )

    def main_pieces(self) -> list[OwnedPiece]:
        """Pieces of parameters held in ``main`` (offsets into ``main``)."""
        if self.facts.main_weights_sharded:
            return self.layout.owned(self.comm.rank)
        return [OwnedPiece(i, 0, s.start, s.numel) for i, s in enumerate(self.layout.slots)]

    def main_grad_for_optimizer(self) -> torch.Tensor:
        """The part of ``main_grad`` that matches ``main`` (fp32 view or copy)."""
        g = self.main_grad
        if self.facts.main_weights_sharded and not self.facts.grads_sharded:
            lo, hi = self.layout.shard_range(self.comm.rank)
            g = g[lo:hi]
        return g if g.dtype == torch.float32 else g.float()

    # ---- initialisation and refresh after a step ------------------------------------------
    def load_main_from(self, full_values: list[torch.Tensor]) -> None:
        """main <- fp32 of the owned parts of each parameter's full value (one per slot)."""
        for p in self.main_pieces():
            src = full_values[p.slot_index].detach().reshape(-1)
            self.main[p.shard_offset : p.shard_offset + p.numel].copy_(
                src[p.param_offset : p.param_offset + p.numel].to(torch.float32)
            )

    def refresh_model_weights(self, phase: Phase = Phase.OPTIMIZER) -> None:
        """Model weight buffers (and scales) from ``main``; all-gather where replicated."""
        for plane in self.planes:
            self._expect_state(plane, PlaneState.REPLICATED, PlaneState.SHARDED)
        self._shared.clear()  # scales (and replicated planes) are rewritten below
        f = self.facts
        staged = f.main_weights_sharded and not f.model_weights_sharded
        # Local targets: the model buffers themselves, or shard staging areas then gathered.
        targets = {
            p: torch.zeros_like(self.main, dtype=self.codec.buffer_dtype) if staged
            else self.model[p]
            for p in self.planes
        }
        self.codec.fill(self, targets, phase)
        if staged:
            for p in self.planes:
                label = f"{self.label}/{'model' if p is Plane.ROWWISE else p.value}"
                self.comm.all_gather(self.model[p], targets[p], phase, label)

    # ---- unshard / reshard ------------------------------------------------------------------
    def full_buffer(self, plane: Plane) -> torch.Tensor:
        """The full (padded) buffer of a plane: the replicated buffer, or the unsharded bucket."""
        plane = self._check_plane(plane)
        if self.state[plane] is PlaneState.REPLICATED:
            return self.model[plane]
        self._wait(plane)
        self._expect_state(plane, PlaneState.UNSHARDED)
        return self._bucket[plane]

    def _wait(self, plane: Plane) -> None:
        work = self._work.pop(plane, None)
        if work is not None:
            work.wait()
        if self.state[plane] is PlaneState.GATHERING:
            self.state[plane] = PlaneState.UNSHARDED

    def unshard(self, planes: Iterable[Plane], phase: Phase, async_op: bool = False) -> None:
        """All-gather planes into temporary buckets (ZeRO-3; a no-op for a plane already
        unsharded, except that a gather still in flight is waited for unless async_op)."""
        for plane in planes:
            plane = self._check_plane(plane)
            state = self.state[plane]
            if state is PlaneState.REPLICATED:
                continue
            if state in (PlaneState.GATHERING, PlaneState.UNSHARDED):
                if not async_op:
                    self._wait(plane)
                continue
            bucket = self.allocator.allocate(
                self.label, plane.value, self.layout.padded_numel, self.codec.buffer_dtype,
                self.device,
            )
            work = self.comm.all_gather(
                bucket, self.model[plane], phase, f"{self.label}/{plane.value}", async_op=async_op
            )
            self._bucket[plane] = bucket
            self.state[plane] = PlaneState.UNSHARDED
            if work is not None:
                self._work[plane] = work
                self.state[plane] = PlaneState.GATHERING
            if self.codec.param_storage is ParamStorage.BUFFER_VIEW:
                self._point_params_at(bucket)  # values valid once the gather is waited for

    def reshard(self) -> None:
        """Free every unsharded bucket of this group (ZeRO-3 only)."""
        for plane in self.planes:
            if self.state[plane] is PlaneState.REPLICATED:
                continue
            self._wait(plane)
            if self.state[plane] is PlaneState.UNSHARDED:
                self._shared.pop(("data", plane), None)
                del self._bucket[plane]
                self.allocator.free(self.label, plane.value)
                self.state[plane] = PlaneState.SHARDED
        if self.facts.model_weights_sharded and (
            self.codec.param_storage is ParamStorage.BUFFER_VIEW
        ):
            for e in self.entries:
                e.param.data = torch.empty(0, dtype=self.codec.buffer_dtype, device=self.device)

    def live_buckets(self) -> list[str]:
        """What this group holds beyond its shards: planes gathered or gathering, and a grad
        bucket of staged gradients not reduced yet. Empty between iterations."""
        live = [p.value for p in self.planes if self.state[p] in _IN_BUCKET]
        if self.allocator.get(self.label, "grad") is not None:
            live.append("grad")
        return live

    def _point_params_at(self, full: torch.Tensor) -> None:
        for e, s in zip(self.entries, self.layout.slots, strict=True):
            e.param.data = full[s.start : s.end].view(s.shape)

    def install_params(self) -> None:
        """Give each module parameter its working storage (after buffers are filled).

        BUFFER_VIEW: a view of the replicated weights buffer, or an empty tensor until unshard
        (ZeRO-3). PLACEHOLDER: a storage-free (N, K) tensor that only receives dW through autograd
        (``bridge.mxfp8_linear`` never reads it when planes are given).
        """
        for e in self.entries:
            if self.codec.param_storage is ParamStorage.PLACEHOLDER:
                e.param.data = torch.zeros(1, dtype=e.dtype, device=self.device).as_strided(
                    e.shape, (0,) * len(e.shape)
                )
            elif self.facts.model_weights_sharded:
                e.param.data = torch.empty(0, dtype=self.codec.buffer_dtype, device=self.device)
        if self.codec.param_storage is ParamStorage.BUFFER_VIEW and (
            not self.facts.model_weights_sharded
        ):
            self._point_params_at(self.model[self.forward_plane])

    def plane_views(self, index: int, plane: Plane) -> tuple[torch.Tensor, torch.Tensor]:
        """(data (M, K) uint8, scale uint8) of block-scaled parameter ``index`` from the full
        buffer of ``plane``."""
        s = self.layout.slots[index]
        data = self.full_buffer(plane)[s.start : s.end].view(s.shape)
        return data, self.scales[plane][index]

    def shared_plane(self, index: int, plane: Plane) -> SharedPlane:
        """Block-scaled parameter ``index``'s plane inside this group's buffers, shared with JAX
        once per buffer lifetime (the plane must be unsharded or replicated)."""
        full = self.full_buffer(plane)  # waits for an in-flight gather; checks the state
        data = self._shared.get(("data", plane))
        if data is None or data.tensor is not full:
            data = self._shared[("data", plane)] = SharedBuffer(full)
        scale = self._shared.get(("scale", plane))
        if scale is None:
            scale = self._shared[("scale", plane)] = SharedBuffer(self.scale_buffers[plane])
        s = self.layout.slots[index]
        return SharedPlane(data, s.start, scale, self.scale_offsets[index], s.shape, plane)

    def param_view(self, index: int) -> torch.Tensor:
        """The full weights of (unscaled) parameter ``index``, a view of the full buffer."""
        s = self.layout.slots[index]
        return self.full_buffer(self.forward_plane)[s.start : s.end].view(s.shape)

    # ---- gradients ----------------------------------------------------------------------------
    def _grad_bucket(self) -> torch.Tensor:
        """This micro-batch's grad bucket (padded group, grad-comm dtype); made on first use."""
        bucket = self.allocator.get(self.label, "grad")
        if bucket is None:
            bucket = self.allocator.allocate(
                self.label,
                "grad",
                self.layout.padded_numel,
                self.policy.grad_comm_dtype,
                self.device,
            )
        return bucket

    def stage_grad(self, index: int, grad: torch.Tensor) -> None:
        """Copy one parameter's local gradient into this micro-batch's grad bucket."""
        bucket = self._grad_bucket()
        s = self.layout.slots[index]
        bucket[s.start : s.end].add_(grad.detach().reshape(-1).to(bucket.dtype))

    def reduce_grads(self) -> None:
        """Average the staged gradients over the DP group into ``main_grad`` (accumulating).

        Zeros stand in for parameters that got no gradient, so every rank joins the collective.
        """
        bucket = self._grad_bucket()
        bucket.div_(self.grad_divisor)
        if self.facts.grads_sharded:
            out = torch.empty(self.layout.shard_numel, dtype=bucket.dtype, device=self.device)
            self.comm.reduce_scatter(out, bucket, Phase.GRAD_REDUCE, f"{self.label}/grad")
        else:
            self.comm.all_reduce(
                bucket, Collective.ALL_REDUCE_SUM, Phase.GRAD_REDUCE, f"{self.label}/grad"
            )
            out = bucket
        self.main_grad.add_(out.to(self.main_grad.dtype))
        self.allocator.free(self.label, "grad")

    def drop_staged_grads(self) -> None:
        """Free this micro-batch's grad bucket without reducing it (an aborted backward)."""
        self.allocator.free(self.label, "grad")

    # ---- full values (state dict, inspection) --------------------------------------------------
    def full_main(self, phase: Phase = Phase.STATE) -> torch.Tensor:
        """The full padded fp32 main weights (all-gathered when sharded)."""
        if not self.facts.main_weights_sharded:
            return self.main.clone()
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        self.comm.all_gather(full, self.main, phase, f"{self.label}/main")
        return full

    def full_main_grad(self, phase: Phase = Phase.STATE) -> torch.Tensor:
        """The full padded reduced gradient (all-gathered when sharded), in its policy dtype."""
        if not self.facts.grads_sharded:
            return self.main_grad.clone()
        full = torch.empty(
            self.layout.padded_numel, dtype=self.main_grad.dtype, device=self.device
        )
        self.comm.all_gather(full, self.main_grad, phase, f"{self.label}/main_grad")
        return full
