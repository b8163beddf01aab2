"""``ParamGroup``: one parameter group, a thin composition of the nouns that hold its state.

A group is the parameters of one unit that share a ``GroupKey`` (device, weight format,
requires_grad, DP group), laid out by one ``FlatLayout``. Its parts, one noun per file:

- ``GroupBuffers`` (``group_buffers``): the persistent buffers -- fp32 main weights (``main``),
  model weight buffers per plane (``model``), scales, main grad -- their pieces, and the refresh
  of the model weights from ``main`` through the format's ``WeightCodec``;
- ``PlaneBucket`` (``plane_bucket``), one per plane: the plane's ``PlaneState`` and its
  temporary all-gathered bucket (unshard / reshard), and its shares with JAX;
- ``GradReducer`` (``grad_reducer``): the grad bucket of the micro-batch and its reduction into
  ``main_grad`` (``grads``; None for a group that takes no gradients).

``ParamGroup`` owns no tensor itself: it wires those parts together, keeps the module
parameters' working storage in step with the planes (views of the full buffer, empty while
sharded, or storage-free placeholders: the codec's ``ParamStorage``), and gives the rest of
FSDP one object per group. ``main``, ``model``, ``scales``, ``scale_buffers`` and
``scale_offsets`` are the ``GroupBuffers`` tensors themselves (never rebound); ``main_grad`` is
too, read through a property that first settles a gradient reduction still in flight.

Under ``GatherMode.BF16`` (``BF16GatherCodec``) the group stores and gathers bf16 weights and
its layers read MXFP8 planes that every rank quantizes from the full bf16 buffer on first read
after a gather (``compute_buffer``): the **quantized buffers** (rowwise and columnwise, laid out
like the gathered buffer, from the ``BucketAllocator``, keys ``(label, "quantized_<plane>")``),
freed on every ``reshard`` and at a refresh, so they live exactly as long as a ZeRO-3 bucket
(under the replicated strategies too: each forward and backward quantizes again, as Transformer
Engine does without an FP8 weight cache).

Sharing with JAX (``shared_plane``): a plane's full buffer (the unsharded bucket, or the
replicated model buffer) and the plane's scale buffer cross the bridge once per lifetime as
``bridge.shared.SharedBuffer``; every layer of the group reads its weight from them by offset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from bridge.shared import SharedPlane
from common.formats import FormatKey, Plane, ScaleBlocks, format_spec
from common.kernels import KernelConfig
from torch_side.bucket_allocator import BucketAllocator
from torch_side.collectives import Communicator, Phase
from torch_side.flat_layout import FlatLayout, OwnedPiece, ParamSlot, check_layout
from torch_side.grad_reducer import GradReducer
from torch_side.group_buffers import GroupBuffers
from torch_side.plane_bucket import PlaneBucket, PlaneState, QuantizedPlanes
from torch_side.policy import MixedPrecisionPolicy
from torch_side.strategy import STRATEGY_FACTS, ShardingStrategy
from torch_side.weight_codecs import CodecContext, ParamStorage, WeightCodec

__all__ = ["GROUP_LABEL", "ROOT_UNIT", "UNIT_JOIN", "GroupKey", "ParamEntry", "ParamGroup",
           "PlaneState"]

ROOT_UNIT = "<root>"  # the name of the root module's unit
UNIT_JOIN = "+"  # a unit of several modules is named by their names joined by this
_MODULE = r"[A-Za-z0-9_.]+"
# Every ParamGroup.label (GroupKey.label) matches this: a checkpoint's schema allows exactly these.
GROUP_LABEL = (rf"(<root>|{_MODULE}(\{UNIT_JOIN}{_MODULE})*)"  # the unit
               r"/[a-z0-9_]+/[a-z_]+(/frozen)?")  # / weight format / dp group [/ frozen]


@dataclasses.dataclass(frozen=True)
class GroupKey:
    device: torch.device
    weight_format: FormatKey
    requires_grad: bool
    dp_group: str  # "dp" or "expert_dp"

    def label(self, unit: str) -> str:
        """The group's label in ``unit`` (its name; "" for the root): matches ``GROUP_LABEL``."""
        label = f"{unit or ROOT_UNIT}/{self.weight_format.value}/{self.dp_group}"
        return label if self.requires_grad else f"{label}/frozen"


@dataclasses.dataclass
class ParamEntry:
    name: str  # qualified name in the wrapped model
    module: nn.Module
    param: nn.Parameter
    shape: tuple[int, ...]
    dtype: torch.dtype  # the parameter's original dtype (grads arrive in it)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _point_params_at(entries: list[ParamEntry], slots: list[ParamSlot], full: torch.Tensor):
    """Each parameter becomes a view of its slot in a full buffer."""
    for e, s in zip(entries, slots, strict=True):
        e.param.data = full[s.start : s.end].view(s.shape)


def _empty_params(entries: list[ParamEntry], dtype: torch.dtype, device: torch.device) -> None:
    """Each parameter holds an empty tensor (its plane is sharded: no full values here)."""
    for e in entries:
        e.param.data = torch.empty(0, dtype=dtype, device=device)


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
        self.grad_divisor = grad_divisor  # the dense DP size (grad_reducer's note)
        self.policy, self.strategy, self.facts = policy, strategy, STRATEGY_FACTS[strategy]
        self.comm, self.allocator = comm, allocator
        self.format, self.codec, self.kernels = key.weight_format, codec, kernels
        self.planes = codec.planes
        # The block-scaled facts of the planes the layers read (None: unscaled weights)
        self.blocks: ScaleBlocks | None = format_spec(key.weight_format).blocks
        self.forward_plane: Plane = codec.spec.forward_plane
        # The plane backward reads: columnwise for MXFP8, the (only) weights otherwise.
        self.backward_plane: Plane = codec.spec.backward_plane
        self.device = key.device
        self.layout = FlatLayout.build(
            [e.name for e in entries], [e.shape for e in entries], comm.world_size
        )
        self.layout_stats = check_layout(self.layout, label)
        grad_dtype = policy.main_grad_dtype if key.requires_grad else None
        self.buffers = b = GroupBuffers(
            label, self.layout, self.facts, codec, comm, grad_dtype, self.device, kernels
        )
        self.main, self.model = b.main, b.model
        self.scales, self.scale_buffers, self.scale_offsets = (
            b.scales, b.scale_buffers, b.scale_offsets
        )
        self.buckets: dict[Plane, PlaneBucket] = {
            p: PlaneBucket(
                label, p, b.model[p], self.facts.model_weights_sharded,
                self.layout.padded_numel, comm, allocator,
            )
            for p in self.planes
        }
        # BF16GatherCodec: the MXFP8 planes quantized from the gathered bf16 buffer (module note)
        self.quantized = QuantizedPlanes(label, codec.compute_planes, allocator)
        self.grads: GradReducer | None = None
        if key.requires_grad:
            self.grads = GradReducer(
                label, self.layout, b.main_grad, policy.grad_comm_dtype,
                self.facts.grads_sharded, grad_divisor, comm, allocator,
            )

    @property
    def main_grad(self) -> torch.Tensor | None:
        """``GroupBuffers.main_grad``, with a reduction still in flight added into it first
        (``GradReducer.settle``): every reader sees the finished gradient."""
        if self.grads is not None:
            self.grads.settle()
        return self.buffers.main_grad

    @property
    def state(self) -> dict[Plane, PlaneState]:
        """Each plane's ``PlaneState`` (a snapshot)."""
        return {p: b.state for p, b in self.buckets.items()}

    def _bucket(self, plane: Plane) -> PlaneBucket:
        bucket = self.buckets.get(plane)
        if bucket is None:
            raise AssertionError(
                f"rank {_rank()}: group {self.label!r} ({self.format.value}) has no "
                f"{plane.value} plane; its planes are {[p.value for p in self.planes]}"
            )
        return bucket

    # ---- main weights and gradients (GroupBuffers) ----------------------------------------
    def main_pieces(self) -> list[OwnedPiece]:
        """Pieces of parameters held in ``main`` (offsets into ``main``)."""
        return self.buffers.pieces()

    def main_grad_for_optimizer(self) -> torch.Tensor:
        """The part of ``main_grad`` that matches ``main`` (fp32 view or copy)."""
        if self.grads is not None:
            self.grads.settle()
        return self.buffers.grad_for_optimizer()

    def load_main_from(self, full_values: list[torch.Tensor]) -> None:
        """main <- fp32 of the owned parts of each parameter's full value (one per slot)."""
        self.buffers.load_main(full_values)

    def expect_refreshable(self) -> None:
        """Refuse a refresh of the model weights (``torch_side.batched_refresh``, which checks
        every group before it changes any) while a plane is in its bucket: a gathered plane would
        keep the old values."""
        for bucket in self.buckets.values():
            bucket.expect(PlaneState.REPLICATED, PlaneState.SHARDED)

    # ---- unshard / reshard (PlaneBucket) --------------------------------------------------
    def full_buffer(self, plane: Plane) -> torch.Tensor:
        """The full (padded) buffer of a plane: the replicated buffer, or the unsharded bucket."""
        return self._bucket(plane).full()

    def unshard(self, planes: Iterable[Plane], phase: Phase, async_op: bool = False) -> None:
        """All-gather planes into temporary buckets (ZeRO-3; a no-op for a plane already
        unsharded, except that a gather still in flight is waited for unless async_op). A
        compute plane the group does not store gathers the stored plane it is made from."""
        for plane in dict.fromkeys(self.codec.stored_plane(p) for p in planes):
            bucket = self._bucket(plane).unshard(phase, async_op)
            if bucket is not None and self.codec.param_storage is ParamStorage.BUFFER_VIEW:
                _point_params_at(self.entries, self.layout.slots, bucket)  # valid once waited

    def reshard(self) -> None:
        """Free every unsharded bucket of this group (ZeRO-3 only)."""
        for bucket in self.buckets.values():
            bucket.reshard()
        self.quantized.drop()
        if self.facts.model_weights_sharded and (
            self.codec.param_storage is ParamStorage.BUFFER_VIEW
        ):
            _empty_params(self.entries, self.codec.buffer_dtype, self.device)

    def live_buckets(self) -> list[str]:
        """What this group holds beyond its shards: planes gathered or gathering, and a grad
        bucket of staged gradients not reduced yet. Empty between iterations."""
        live = [p.value for p, b in self.buckets.items() if b.live]
        if self.quantized.live:
            live.append("quantized")
        if self.grads is not None and self.grads.staged:
            live.append("grad")
        if self.grads is not None and self.grads.in_flight:
            live.append("grad_reducing")
        return live

    # ---- module parameters and views -------------------------------------------------------
    def install_params(self) -> None:
        """Give each module parameter its working storage (after buffers are filled).

        BUFFER_VIEW: a view of the replicated weights buffer, or an empty tensor until unshard
        (ZeRO-3). PLACEHOLDER: a storage-free (N, K) tensor that only receives dW through autograd
        (``bridge.mxfp8_linear`` never reads it when planes are given).
        """
        if self.codec.param_storage is ParamStorage.PLACEHOLDER:
            for e in self.entries:
                e.param.data = torch.zeros(1, dtype=e.dtype, device=self.device).as_strided(
                    e.shape, (0,) * len(e.shape)
                )
        elif self.facts.model_weights_sharded:
            _empty_params(self.entries, self.codec.buffer_dtype, self.device)
        else:
            _point_params_at(self.entries, self.layout.slots, self.model[self.forward_plane])

    # ---- MXFP8 planes quantized after a bf16 gather (BF16GatherCodec) ----------------------
    def compute_buffer(self, plane: Plane) -> torch.Tensor:
        """The full (padded) buffer of compute plane ``plane``: the stored plane's full buffer,
        or (BF16GatherCodec) the planes this rank quantizes from the gathered bf16 weights, made
        on first read after a gather and kept until reshard."""
        if not self.codec.quantizes_after_gather:
            return self.full_buffer(plane)
        if not self.quantized.live:
            full = self.full_buffer(self.codec.stored_plane(plane))
            targets = self.quantized.allocate(self.layout.padded_numel, self.device)
            ctx = CodecContext(
                label=self.label, main=full, shapes=[s.shape for s in self.layout.slots],
                owned=[OwnedPiece(i, 0, s.start, s.numel) for i, s in
                       enumerate(self.layout.slots)],
                scales=self.scales, comm=self.comm, main_sharded=False, kernels=self.kernels,
                scale_buffers=self.scale_buffers, scale_offsets=self.scale_offsets,
            )
            self.codec.quantize_gathered(ctx, targets)
            self.quantized.buffers = targets
        return self.quantized.buffers[plane]

    def plane_views(self, index: int, plane: Plane) -> tuple[torch.Tensor, torch.Tensor]:
        """(data (M, K) uint8, scale uint8) of block-scaled parameter ``index``'s compute plane
        ``plane``."""
        s = self.layout.slots[index]
        data = self.compute_buffer(plane)[s.start : s.end].view(s.shape)
        return data, self.scales[plane][index]

    def shared_plane(self, index: int, plane: Plane) -> SharedPlane:
        """Block-scaled parameter ``index``'s compute plane inside this group's buffers, shared
        with JAX once per buffer lifetime (the plane must be unsharded or replicated)."""
        self.compute_buffer(plane)  # the plane must exist and be readable (checked first)
        if self.codec.quantizes_after_gather:
            data, scale = self.quantized.shared(plane, self.scale_buffers[plane])
        else:
            data, scale = self._bucket(plane).shared(self.scale_buffers[plane])
        s = self.layout.slots[index]
        return SharedPlane(data, s.start, scale, self.scale_offsets[index], s.shape, plane,
                           self.blocks)
