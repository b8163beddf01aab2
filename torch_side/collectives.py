"""The only place that moves bytes: collectives over a process group, with a wire log.

Every collective goes through a :class:`Communicator`, which records what it sent
(:class:`WireRecord`: operation, phase, group label, dtype, element count, bytes per rank) so
tests can assert what goes over the wire -- e.g. that a forward all-gather of an MXFP8 group moves
1 byte per element and no scales. torch 2.13 renamed ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` to ``all_gather_single`` / ``reduce_scatter_single``; both spellings are
supported so the same code runs on the GPU machine's torch 2.11.

With ``check=True`` every collective is preceded by the collective-consistency check
(``torch_side.collective_check``): the ranks all-gather a fixed-size descriptor of what they are
about to run and raise ``CollectiveMismatchError``, naming each rank's unit, when they disagree.
Without it, a failing collective (a timeout, a closed connection) gets a note pointing at the
switch.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

import torch
import torch.distributed as dist

from torch_side.collective_check import (
    CHECK_ENV,
    DESCRIPTOR_INTS,
    CollectiveMismatchError,
    Descriptor,
    mismatch_message,
)

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

_VERB = {
    Collective.ALL_GATHER: "all-gather",
    Collective.REDUCE_SCATTER: "reduce-scatter",
    Collective.ALL_REDUCE_SUM: "all-reduce (sum)",
    Collective.ALL_REDUCE_MAX: "all-reduce (max)",
}

# Communicators built so far per process group (None: the default group), in construction order;
# the same on every rank because building one is collective (the switch is all-reduced).
_ORDINALS: dict[object, int] = {}


class _NotedWork:
    """An async work handle whose ``wait()`` failure carries the communicator's note."""

    def __init__(self, work, comm: Communicator, op: Collective, phase: Phase, label: str):
        self._work, self._comm, self._what = work, comm, (op, phase, label)

    def wait(self):
        try:
            return self._work.wait()
        except RuntimeError as e:
            e.add_note(self._comm._failure_note(*self._what, checking=False))
            raise


class Communicator:
    """Collectives on one process group; ``records`` is the wire log (the most recent
    ``WIRE_LOG_LIMIT`` collectives; cleared by the caller). ``check``: run the
    collective-consistency check before each collective (module note). The ranks agree on it
    before the first collective (one rank asking turns it on for all), on that collective's
    device, so building a communicator moves nothing."""

    def __init__(self, group: dist.ProcessGroup | None, name: str, check: bool = False):
        self.group = group
        self.name = name
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.records: collections.deque[WireRecord] = collections.deque(maxlen=WIRE_LOG_LIMIT)
        self.check = bool(check)
        self._agreed = self.world_size == 1
        self.ordinal = _ORDINALS.get(group, 0)
        _ORDINALS[group] = self.ordinal + 1
        self.seq = 0  # collectives issued so far (the check compares it across ranks)

    def _agree(self, device: torch.device) -> None:
        """Once, before the first collective: the switch is on if any rank asked for it."""
        flag = torch.tensor([int(self.check)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.check, self._agreed = bool(flag.item()), True

    def _log(self, op, phase, label, t: torch.Tensor, bytes_sent: int) -> None:
        self.records.append(WireRecord(op, phase, label, t.dtype, t.numel(), bytes_sent))

    def _before(self, op: Collective, phase: Phase, label: str, t: torch.Tensor) -> None:
        """Count the collective and, with the check on, compare it across ranks first."""
        seq, self.seq = self.seq, self.seq + 1
        if not self._agreed:
            self._run(op, phase, label, lambda: self._agree(t.device))
        if not self.check or self.world_size == 1:
            return
        mine = Descriptor(
            self.ordinal, seq, _VERB[op], phase.value, label,
            str(t.dtype).removeprefix("torch."), t.numel(),
        ).encode().to(t.device)
        rows = torch.empty(self.world_size * DESCRIPTOR_INTS, dtype=torch.int64, device=t.device)
        self._run(op, phase, label, lambda: _all_gather(rows, mine, group=self.group), True)
        message = mismatch_message(rows.view(self.world_size, -1).cpu(), self.rank, self.name)
        if message is not None:
            raise CollectiveMismatchError(message)

    def _failure_note(self, op: Collective, phase: Phase, label: str, checking: bool) -> str:
        what = f"the FSDP {_VERB[op]} of {label!r} ({phase.value}) on process group {self.name!r}"
        if checking:
            return (
                f"rank {self.rank}: this failed in check_collectives' descriptor all-gather "
                f"before {what}: some rank did not reach another FSDP collective on this group "
                f"(it failed, stalled, or finished while this rank still had collectives to run, "
                f"e.g. a unit that ran on this rank only at the end of the step)."
            )
        head = f"rank {self.rank}: this failed in {what}. "
        if self.check and self._agreed:
            return head + (
                "Every rank was about to run this same collective (check_collectives), so the "
                "failure is not a mismatch of FSDP collectives: look for a rank that died, "
                "stalled or ran a collective of its own on this group."
            )
        return head + (
            "If the ranks issued different collectives (an FSDP unit that ran on some ranks "
            f"only), rerun with {CHECK_ENV}=1 (or fully_shard(..., check_collectives=True)) to "
            "get an error naming what each rank was about to run."
        )

    def _run(self, op: Collective, phase: Phase, label: str, call, checking: bool = False):
        """call(), adding a note that names the collective (and the switch) to its failure."""
        try:
            return call()
        except RuntimeError as e:
            e.add_note(self._failure_note(op, phase, label, checking))
            raise

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
        op = Collective.ALL_GATHER
        self._before(op, phase, label, out)
        self._log(op, phase, label, out, shard.numel() * shard.element_size())
        if self.world_size == 1:
            out.copy_(shard)
            return None
        work = self._run(
            op, phase, label,
            lambda: _all_gather(out, shard, group=self.group, async_op=async_op),
        )
        return None if work is None else _NotedWork(work, self, op, phase, label)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, phase: Phase, label: str):
        """out (n,) <- sum over ranks of this rank's slice of full (world * n,)."""
        assert full.numel() == out.numel() * self.world_size, (out.shape, full.shape)
        op = Collective.REDUCE_SCATTER
        self._before(op, phase, label, full)
        self._log(op, phase, label, full, full.numel() * full.element_size())
        if self.world_size == 1:
            out.copy_(full)
        else:
            self._run(op, phase, label, lambda: _reduce_scatter(out, full, group=self.group))

    def all_reduce(self, t: torch.Tensor, op: Collective, phase: Phase, label: str) -> None:
        """In place; op is ALL_REDUCE_SUM or ALL_REDUCE_MAX."""
        self._before(op, phase, label, t)
        self._log(op, phase, label, t, t.numel() * t.element_size())
        if self.world_size > 1:
            red = dist.ReduceOp.SUM if op is Collective.ALL_REDUCE_SUM else dist.ReduceOp.MAX
            self._run(op, phase, label, lambda: dist.all_reduce(t, op=red, group=self.group))
