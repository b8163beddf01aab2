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
FSDP one object per group. The parts are private (``_buffers``, ``_buckets``, ``_quantized``,
``_grads``); the rest of FSDP, the state dicts, telemetry and applications use this **public
surface** only:

- facts, fixed at construction: ``label``, ``key``, ``format``, ``device``, ``codec``, ``comm``
  (the DP communicator), ``kernels``, ``facts`` (``StrategyFacts``), ``planes``,
  ``forward_plane``, ``backward_plane``, ``blocks``, ``layout`` (the ``FlatLayout``, a frozen
  value; its ``layout_stats``) and ``slots`` (its parameters, in layout order), ``entries`` (the
  module parameters);
- the ``GroupBuffers`` tensors themselves (never rebound, read-only to callers): ``main`` (the
  optimizer's parameter, updated in place), ``model``, ``scales``, ``scale_buffers``,
  ``scale_offsets``;
- the planes (this file): ``state``, ``unshard``, ``reshard``, ``live_buckets``,
  ``install_params``, ``expect_refreshable``, ``drop_quantized``, ``full_buffer``,
  ``plane_views``, ``shared_plane``, ``shared_full_buffer``;
- main weights and refresh (``GroupWeights``, ``torch_side.fsdp.group_weights``);
- gradients (``GroupGrads``, ``torch_side.fsdp.group_grads``): ``main_grad`` (a property that first
  settles a gradient reduction still in flight), staging, reduction.

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
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from bridge.shared import SharedBuffer, SharedPlane
from common.formats import FormatKey, Plane, ScaleBlocks, format_spec
from common.kernels import KernelConfig
from torch_side.comm.collectives import Communicator, Phase
from torch_side.fsdp.bucket_allocator import BucketAllocator
from torch_side.fsdp.flat_layout import (
    FlatLayout,
    OwnedPiece,
    ParamSlot,
    ShardLayout,
    check_layout,
)
from torch_side.fsdp.grad_reducer import GradReducer
from torch_side.fsdp.group_buffers import GroupBuffers
from torch_side.fsdp.group_grads import GroupGrads
from torch_side.fsdp.group_weights import GroupWeights
from torch_side.fsdp.plane_bucket import PlaneBucket, PlaneState, QuantizedPlanes
from torch_side.fsdp.policy import MixedPrecisionPolicy
from torch_side.fsdp.strategy import STRATEGY_FACTS, ShardingStrategy
from torch_side.fsdp.weight_codecs import BF16GatherCodec, CodecContext, ParamStorage, WeightCodec

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


def _point_params_at(
    entries: list[ParamEntry], slots: Sequence[ParamSlot], full: torch.Tensor
) -> None:
    """Each parameter becomes a view of its slot in a full buffer."""
    for e, s in zip(entries, slots, strict=True):
        e.param.data = full[s.start : s.end].view(s.shape)


def _empty_params(entries: list[ParamEntry], dtype: torch.dtype, device: torch.device) -> None:
    """Each parameter holds an empty tensor (its plane is sharded: no full values here)."""
    for e in entries:
        e.param.data = torch.empty(0, dtype=dtype, device=device)


class ParamGroup(GroupWeights, GroupGrads):
    """One parameter group; its public surface is in the module docstring."""

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
        replicate: Communicator | None = None,
    ):
        self.label, self.key, self.entries = label, key, entries
        self.facts = STRATEGY_FACTS[strategy]
        self.comm, self._allocator = comm, allocator
        self.replicate = replicate  # HSDP's replicate group (torch_side.fsdp.hybrid_mesh)
        self.format, self.codec, self.kernels = key.weight_format, codec, kernels
        self.planes = codec.planes
        # The block-scaled facts of the planes the layers read (None: unscaled weights)
        self.blocks: ScaleBlocks | None = format_spec(key.weight_format).blocks
        self.forward_plane: Plane = codec.spec.forward_plane
        # The plane backward reads: columnwise for MXFP8, the (only) weights otherwise.
        self.backward_plane: Plane = codec.spec.backward_plane
        self.device = key.device
        # block-atomic shards: no boundary inside a scale block's rows (flat_layout's note)
        row_block = (self.blocks.block_size if self.blocks is not None
                     and policy.shard_layout is ShardLayout.BLOCK_ATOMIC else 1)
        self.layout = FlatLayout.build(
            [e.name for e in entries], [e.shape for e in entries], comm.world_size, row_block
        )
        self.slots: tuple[ParamSlot, ...] = self.layout.slots
        self.layout_stats = check_layout(self.layout, label)
        grad_dtype = policy.main_grad_dtype if key.requires_grad else None
        self._buffers = b = GroupBuffers(
            label, self.layout, self.facts, codec, comm, grad_dtype, self.device, kernels
        )
        self.main, self.model = b.main, b.model
        self.scales, self.scale_buffers, self.scale_offsets = (
            b.scales, b.scale_buffers, b.scale_offsets
        )
        self._buckets: dict[Plane, PlaneBucket] = {
            p: PlaneBucket(
                label, p, b.model, self.facts.model_weights_sharded,
                self.layout.padded_numel, comm, allocator,
            )
            for p in self.planes
        }
        # BF16GatherCodec: the MXFP8 planes quantized from the gathered bf16 buffer (module note)
        self._quantized = QuantizedPlanes(label, codec.compute_planes, allocator)
        self._grads: GradReducer | None = None
        if b.main_grad is not None:
            self._grads = GradReducer(
                label, self.layout, b.main_grad, policy.grad_comm_dtype,
                self.facts.grads_sharded, grad_divisor, comm, allocator, replicate,
            )

    @property
    def state(self) -> dict[Plane, PlaneState]:
        """Each plane's ``PlaneState`` (a snapshot)."""
        return {p: b.state for p, b in self._buckets.items()}

    def _bucket(self, plane: Plane) -> PlaneBucket:
        bucket = self._buckets.get(plane)
        if bucket is None:
            raise AssertionError(
                f"rank {_rank()}: group {self.label!r} ({self.format.value}) has no "
                f"{plane.value} plane; its planes are {[p.value for p in self.planes]}"
            )
        return bucket

    # ---- refresh ----------------------------------------------------------------------------
    def expect_refreshable(self) -> None:
        """Refuse a refresh of the model weights (``torch_side.fsdp.batched_refresh``, which checks
        every group before it changes any) while a plane is in its bucket: a gathered plane would
        keep the old values."""
        for bucket in self._buckets.values():
            bucket.expect(PlaneState.REPLICATED, PlaneState.SHARDED)

    def drop_quantized(self) -> None:
        """Free the planes quantized locally after a bf16 gather (``BF16GatherCodec``): a
        refresh rewrites the weights they were made from."""
        self._quantized.drop()

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
                _point_params_at(self.entries, self.slots, bucket)  # valid once waited

    def reshard(self) -> None:
        """Free every unsharded bucket of this group (ZeRO-3 only)."""
        for bucket in self._buckets.values():
            bucket.reshard()
        self._quantized.drop()
        if self.facts.model_weights_sharded and (
            self.codec.param_storage is ParamStorage.BUFFER_VIEW
        ):
            _empty_params(self.entries, self.codec.buffer_dtype, self.device)

    def live_buckets(self) -> list[str]:
        """What this group holds beyond its shards: planes gathered or gathering, and a grad
        bucket of staged gradients not reduced yet. Empty between iterations."""
        live = [p.value for p, b in self._buckets.items() if b.live]
        if self._quantized.live:
            live.append("quantized")
        if self._grads is not None and self._grads.staged:
            live.append("grad")
        if self._grads is not None and self._grads.in_flight:
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
            _point_params_at(self.entries, self.slots, self.model[self.forward_plane])

    # ---- MXFP8 planes quantized after a bf16 gather (BF16GatherCodec) ----------------------
    def _compute_buffer(self, plane: Plane) -> torch.Tensor:
        """The full (padded) buffer of compute plane ``plane``: the stored plane's full buffer,
        or (BF16GatherCodec) the planes this rank quantizes from the gathered bf16 weights, made
        on first read after a gather and kept until reshard."""
        codec = self.codec
        if not isinstance(codec, BF16GatherCodec):
            return self.full_buffer(plane)
        if not self._quantized.live:
            full = self.full_buffer(codec.stored_plane(plane))
            targets = self._quantized.allocate(self.layout.padded_numel, self.device)
            ctx = CodecContext(
                label=self.label, main=full, shapes=[s.shape for s in self.slots],
                owned=[OwnedPiece(i, 0, s.start, s.numel) for i, s in enumerate(self.slots)],
                scales=self.scales, comm=self.comm, main_sharded=False, kernels=self.kernels,
                scale_buffers=self.scale_buffers, scale_offsets=self.scale_offsets,
            )
            codec.quantize_gathered(ctx, targets)
            self._quantized.keep(targets)
        return self._quantized.buffer(plane)

    def plane_views(self, index: int, plane: Plane) -> tuple[torch.Tensor, torch.Tensor]:
        """(data (M, K) uint8, scale uint8) of block-scaled parameter ``index``'s compute plane
        ``plane``."""
        s = self.slots[index]
        data = self._compute_buffer(plane)[s.start : s.end].view(s.shape)
        return data, self.scales[plane][index]

    def shared_plane(self, index: int, plane: Plane) -> SharedPlane:
        """Block-scaled parameter ``index``'s compute plane inside this group's buffers, shared
        with JAX once per buffer lifetime (the plane must be unsharded or replicated)."""
        self._compute_buffer(plane)  # the plane must exist and be readable (checked first)
        if self._quantized.live:
            data, scale = self._quantized.shared(plane, self.scale_buffers[plane])
        else:
            data, scale = self._bucket(plane).shared(self.scale_buffers[plane])
        s = self.slots[index]
        assert self.blocks is not None, self.label  # a plane with scales is block-scaled
        m, k = s.shape
        return SharedPlane(data, s.start, scale, self.scale_offsets[index], (m, k), plane,
                           self.blocks)

    def shared_full_buffer(self, plane: Plane) -> SharedBuffer:
        """The full buffer of stored plane ``plane`` shared with JAX, made once per buffer
        lifetime (the unit programs read high-precision parameters from it by offset)."""
        return self._bucket(plane).shared_data()
