"""The only place that moves bytes: collectives over a process group, with a wire log.

Every collective goes through a :class:`Communicator`, which records what it sent
(:class:`WireRecord`: operation, phase, group label, dtype, element count, bytes per rank) so
tests can assert what goes over the wire -- e.g. that a forward all-gather of an MXFP8 group moves
1 byte per element and no scales. torch 2.13 renamed ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` to ``all_gather_single`` / ``reduce_scatter_single``; both spellings are
supported so the same code runs on the GPU machine's torch 2.11.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

import torch
import torch.distributed as dist

__all__ = ["Collective", "Communicator", "Phase", "WireRecord"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collective(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE_SUM = "all_reduce_sum"
    ALL_REDUCE_MAX = "all_reduce_max"


class Phase(enum.Enum):
    """Why a collective ran (the training phase that asked for it)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    GRAD_REDUCE = "grad_reduce"
    OPTIMIZER = "optimizer"
    STATE = "state"


@dataclasses.dataclass(frozen=True)
class WireRecord:
    op: Collective
    phase: Phase
    label: str  # e.g. "blocks.0/mxfp8_e4m3/rowwise"
    dtype: torch.dtype
    numel: int  # elements of the full (gathered / reduced) tensor
    bytes_sent: int  # bytes this rank contributes


WIRE_LOG_LIMIT = 4096  # records kept per communicator (oldest dropped): bounded in long runs


class Communicator:
    """Collectives on one process group; ``records`` is the wire log (the most recent
    ``WIRE_LOG_LIMIT`` collectives; cleared by the caller)."""

    def __init__(self, group: dist.ProcessGroup | None, name: str):
        self.group = group
        self.name = name
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.records: collections.deque[WireRecord] = collections.deque(maxlen=WIRE_LOG_LIMIT)

    def _log(self, op, phase, label, t: torch.Tensor, bytes_sent: int) -> None:
        self.records.append(WireRecord(op, phase, label, t.dtype, t.numel(), bytes_sent))

    def all_gather(
        self,
        out: torch.Tensor,
        shard: torch.Tensor,
        phase: Phase,
        label: str,
        async_op: bool = False,
    ):
        """out (world * n,) <- concatenation of every rank's shard (n,).

        Returns the async work handle when async_op (``.wait()`` before reading out), else None.
        """
        assert out.numel() == shard.numel() * self.world_size, (out.shape, shard.shape)
        self._log(Collective.ALL_GATHER, phase, label, out, shard.numel() * shard.element_size())
        if self.world_size == 1:
            out.copy_(shard)
            return None
        return _all_gather(out, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, phase: Phase, label: str):
        """out (n,) <- sum over ranks of this rank's slice of full (world * n,)."""
        assert full.numel() == out.numel() * self.world_size, (out.shape, full.shape)
        self._log(Collective.REDUCE_SCATTER, phase, label, full, full.numel() * full.element_size())
        if self.world_size == 1:
            out.copy_(full)
        else:
            _reduce_scatter(out, full, group=self.group)

    def all_reduce(self, t: torch.Tensor, op: Collective, phase: Phase, label: str) -> None:
        """In place; op is ALL_REDUCE_SUM or ALL_REDUCE_MAX."""
        self._log(op, phase, label, t, t.numel() * t.element_size())
        if self.world_size > 1:
            red = dist.ReduceOp.SUM if op is Collective.ALL_REDUCE_SUM else dist.ReduceOp.MAX
            dist.all_reduce(t, op=red, group=self.group)
