"""``ParamGroup``: the buffers of one parameter group and everything that moves them.

Tensors of a group (DESIGN.md 5 glossary; every buffer uses the group's ``FlatLayout``):

- **main weight** (``main``): fp32, the rank's shard (or the full buffer under ``no_shard``);
  the optimizer updates it.
- **model weight buffer** (``model``): rowwise MXFP8 bytes (uint8) or the bf16/fp32 weights; the
  rank's shard under ZeRO-3, else the full replicated buffer.
- **columnwise buffer** (``colwise``): the columnwise MXFP8 bytes, same sharding (MXFP8 only).
- **scale tensors** (``rowwise_scales[i]`` (M, K/32), ``colwise_scales[i]`` (M/32, K), uint8): full
  and replicated, recomputed identically by every rank at each quantization.
- **main grad** (``main_grad``): the reduced gradient, shard (ZeRO-2/3) or full, policy dtype.
- **unsharded bucket**: from the ``BucketAllocator``, one per plane, all-gathered on unshard and
  freed on reshard (ZeRO-3 only); **grad bucket**: full-size staging of this micro-batch's local
  gradients, reduced (scattered) and freed in post-backward.

"Plane" of a high-precision group: it has one, ``Plane.ROWWISE`` (its weights), needed in forward
and backward alike. MXFP8 groups need ROWWISE in forward and COLWISE in backward.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from jax_side.mxfp8 import BLOCK_SIZE, Plane
from torch_side.bucket_allocator import BucketAllocator
from torch_side.collectives import Collective, Communicator, Phase
from torch_side.distributed_quantize import quantize_with_reducer
from torch_side.flat_layout import FlatLayout, OwnedPiece, check_layout
from torch_side.policy import FORMAT_FACTS, MixedPrecisionPolicy, WeightFormat
from torch_side.strategy import STRATEGY_FACTS, ShardingStrategy

__all__ = ["GroupKey", "ParamEntry", "ParamGroup"]


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
    ):
        self.label, self.key, self.entries = label, key, entries
        # Gradients are divided by the dense DP size for every group, expert groups included
        # (they reduce over the smaller expert-DP group): each rank's loss is its own mean, so
        # the gradient of the mean loss over all DP ranks is sum(local grads) / DP (Megatron's
        # expert gradient scaling is 1 / data-parallel size for the same reason).
        self.grad_divisor = grad_divisor
        self.policy, self.strategy, self.facts = policy, strategy, STRATEGY_FACTS[strategy]
        self.comm, self.allocator = comm, allocator
        self.format = key.weight_format
        self.is_mxfp8 = FORMAT_FACTS[self.format].block_shape_multiple == BLOCK_SIZE
        self.layout = FlatLayout.build(
            [e.name for e in entries], [e.shape for e in entries], comm.world_size
        )
        check_layout(self.layout)
        self.device = key.device
        self._allocate_buffers()
        self._work: dict[Plane, object] = {}  # in-flight async all-gathers (prefetch)
        self.unsharded: dict[Plane, torch.Tensor | None] = {
            Plane.ROWWISE: None,
            Plane.COLWISE: None,
        }

    # ---- buffers -------------------------------------------------------------------------
    def _local(self, sharded: bool) -> int:
        return self.layout.shard_numel if sharded else self.layout.padded_numel

    def _allocate_buffers(self) -> None:
        f, lay, dev = self.facts, self.layout, self.device
        buf_dtype = MixedPrecisionPolicy.buffer_dtype(self.format)
        self.main = torch.zeros(
            self._local(f.main_weights_sharded), dtype=torch.float32, device=dev
        )
        self.model = torch.zeros(self._local(f.model_weights_sharded), dtype=buf_dtype, device=dev)
        self.colwise = torch.zeros_like(self.model) if self.is_mxfp8 else None
        self.main_grad = None
        if self.key.requires_grad:
            self.main_grad = torch.zeros(
                self._local(f.grads_sharded), dtype=self.policy.main_grad_dtype, device=dev
            )
        self.rowwise_scales, self.colwise_scales = [], []
        if self.is_mxfp8:
            for s in lay.slots:
                m, k = s.shape
                self.rowwise_scales.append(
                    torch.zeros(m, k // BLOCK_SIZE, dtype=torch.uint8, device=dev)
                )
                self.colwise_scales.append(
                    torch.zeros(m // BLOCK_SIZE, k, dtype=torch.uint8, device=dev)
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
        """Model weight buffers (and MXFP8 scales) from ``main``; all-gather where replicated."""
        f = self.facts
        staged = f.main_weights_sharded and not f.model_weights_sharded
        # Local target: the model buffer itself, or a shard staging area that is then gathered.
        row_t = torch.zeros_like(self.main, dtype=self.model.dtype) if staged else self.model
        col_t = None
        if self.is_mxfp8:
            col_t = torch.zeros_like(row_t) if staged else self.colwise
            self._quantize_into(row_t, col_t, phase)
        else:
            row_t.copy_(self.main.to(self.model.dtype))
        if staged:
            self.comm.all_gather(self.model, row_t, phase, f"{self.label}/model")
            if col_t is not None:
                self.comm.all_gather(self.colwise, col_t, phase, f"{self.label}/colwise")

    def _quantize_into(self, row_t: torch.Tensor, col_t: torch.Tensor, phase: Phase) -> None:
        pieces = {p.slot_index: p for p in self.main_pieces()}
        shards, starts = [], []
        for i in range(len(self.layout.slots)):
            p = pieces.get(i)
            shards.append(
                None if p is None else self.main[p.shard_offset : p.shard_offset + p.numel]
            )
            starts.append(0 if p is None else p.param_offset)

        def reduce_max(packed: torch.Tensor) -> None:
            if self.facts.main_weights_sharded:  # else every rank holds whole parameters
                self.comm.all_reduce(packed, Collective.ALL_REDUCE_MAX, phase, f"{self.label}/amax")

        shapes = [s.shape for s in self.layout.slots]
        results = quantize_with_reducer(shards, shapes, starts, reduce_max, self.device)
        for i, res in enumerate(results):
            self.rowwise_scales[i].copy_(res.rowwise_scale)
            self.colwise_scales[i].copy_(res.colwise_scale)
            p = pieces.get(i)
            if p is not None:
                row_t[p.shard_offset : p.shard_offset + p.numel].copy_(res.rowwise)
                col_t[p.shard_offset : p.shard_offset + p.numel].copy_(res.colwise)

    # ---- unshard / reshard ------------------------------------------------------------------
    @property
    def backward_plane(self) -> Plane:
        """The plane backward reads: columnwise for MXFP8, the (only) weights otherwise."""
        return Plane.COLWISE if self.is_mxfp8 else Plane.ROWWISE

    def full_buffer(self, plane: Plane) -> torch.Tensor:
        """The full (padded) buffer of a plane: the replicated buffer, or the unsharded bucket."""
        if not self.facts.model_weights_sharded:
            return self.model if plane is Plane.ROWWISE else self.colwise
        self._wait(plane)
        t = self.unsharded[plane]
        if t is None:
            raise RuntimeError(f"{self.label}: {plane.value} plane is not unsharded")
        return t

    def _wait(self, plane: Plane) -> None:
        work = self._work.pop(plane, None)
        if work is not None:
            work.wait()

    def unshard(self, plane: Plane, phase: Phase, async_op: bool = False) -> None:
        """All-gather one plane into a temporary bucket (ZeRO-3; a no-op when it is already
        unsharded, except that a prefetch still in flight is waited for unless async_op)."""
        if not self.is_mxfp8:
            plane = Plane.ROWWISE
        if not self.facts.model_weights_sharded:
            return
        if self.unsharded[plane] is not None:
            if not async_op:
                self._wait(plane)
            return
        shard = self.model if plane is Plane.ROWWISE else self.colwise
        bucket = self.allocator.allocate(
            self.label, plane.value, self.layout.padded_numel, shard.dtype, self.device
        )
        work = self.comm.all_gather(
            bucket, shard, phase, f"{self.label}/{plane.value}", async_op=async_op
        )
        if work is not None:
            self._work[plane] = work
        self.unsharded[plane] = bucket
        if not self.is_mxfp8:
            self._point_params_at(bucket)  # values valid once the gather is waited for

    def reshard(self) -> None:
        """Free every unsharded bucket of this group (ZeRO-3 only)."""
        if not self.facts.model_weights_sharded:
            return
        for plane in Plane:
            self._wait(plane)
            if self.unsharded[plane] is not None:
                self.unsharded[plane] = None
                self.allocator.free(self.label, plane.value)
        if not self.is_mxfp8:
            for e in self.entries:
                e.param.data = torch.empty(0, dtype=self.model.dtype, device=self.device)

    def _point_params_at(self, full: torch.Tensor) -> None:
        for e, s in zip(self.entries, self.layout.slots, strict=True):
            e.param.data = full[s.start : s.end].view(s.shape)

    def install_params(self) -> None:
        """Give each module parameter its working storage (after buffers are filled).

        High precision: a view of the replicated model buffer, or an empty tensor until unshard
        (ZeRO-3). MXFP8: a storage-free (N, K) placeholder that only receives dW through autograd
        (``bridge.mxfp8_linear`` never reads it when planes are given).
        """
        for e in self.entries:
            if self.is_mxfp8:
                e.param.data = torch.zeros(1, dtype=e.dtype, device=self.device).as_strided(
                    e.shape, (0,) * len(e.shape)
                )
            elif self.facts.model_weights_sharded:
                e.param.data = torch.empty(0, dtype=self.model.dtype, device=self.device)
        if not self.is_mxfp8 and not self.facts.model_weights_sharded:
            self._point_params_at(self.model)

    def plane_views(self, index: int, plane: Plane) -> tuple[torch.Tensor, torch.Tensor]:
        """(data (M, K) uint8, scale uint8) of MXFP8 parameter ``index`` from the full buffer."""
        s = self.layout.slots[index]
        data = self.full_buffer(plane)[s.start : s.end].view(s.shape)
        scales = self.rowwise_scales if plane is Plane.ROWWISE else self.colwise_scales
        return data, scales[index]

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

    # ---- full values (state dict, inspection) --------------------------------------------------
    def full_main(self, phase: Phase = Phase.STATE) -> torch.Tensor:
        """The full padded fp32 main weights (all-gathered when sharded)."""
        if not self.facts.main_weights_sharded:
            return self.main.clone()
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        self.comm.all_gather(full, self.main, phase, f"{self.label}/main")
        return full
