"""``InitSync``: every rank's wrapped model starts from one set of values (DESIGN.md 10).

``fully_shard`` makes each rank's main-weight shard from that rank's own module values. Ranks that
initialised differently (a seed per rank, a rank that loaded another checkpoint) would therefore
end with a model made of pieces of every rank's init, silently. So, before anything is sharded,
each parameter group's full values come from rank 0 of the group's data-parallel group -- the
expert-DP group for expert parameters, so that each expert group keeps its own experts -- as
Megatron-FSDP broadcasts its parameters at wrap time:

- ``InitSync.BROADCAST`` (the default): per group, one broadcast of a flat fp32 buffer in the
  group's ``FlatLayout`` (the values the fp32 main weights are made from; a parameter's own dtype
  converts to fp32 exactly, as ``ParamGroup.load_main_from`` does), from the group's rank 0;
- ``InitSync.VERIFY``: the same broadcast, then every rank compares rank 0's values with its own
  bit for bit (``-0.0`` differs from ``0.0``, a NaN equals the same NaN), and one small
  all-reduce tells every rank which ranks differ where, so that all ranks raise the same error
  naming the first differing parameter (in group order) together -- none is left waiting in a
  collective for a rank that raised. Nothing is broadcast into the model then: a model that passes
  holds exactly what each rank built.

Under HSDP (``torch_side.fsdp.hybrid_mesh``) the broadcast runs over the shard group, then over
the replicate group, so every rank starts from global rank 0's values; VERIFY compares every rank
with them and its all-reduce runs over both groups, so every rank of the mesh raises together.

Cost: one collective per group (two with VERIFY), moving one fp32 copy of the group; a rank holds
that copy (two with VERIFY) next to the module's values while it is wrapped. Module buffers are
not FSDP's (it neither shards nor replicates them): they stay what each rank built.
The collectives run once, at wrap time, through the group's ``Communicator`` (phase ``STATE``,
label ``<group>/init``), so they are in the wire log and under the collective check.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.distributed as dist

from common.enums import Parseable
from torch_side.comm.collectives import Collective, Communicator, Phase
from torch_side.fsdp.param_group import ParamGroup

__all__ = ["InitSync", "initial_values"]


class InitSync(Parseable, enum.Enum, what="init_sync mode"):
    """How ``fully_shard`` makes every rank start from the same module values."""

    BROADCAST = "broadcast"  # rank 0's values replace every rank's
    VERIFY = "verify"  # refuse, naming the first differing parameter, if a rank differs


def initial_values(group: ParamGroup, mode: InitSync) -> list[torch.Tensor]:
    """The full initial value of each of ``group``'s parameters (one per layout slot, in slot
    order): rank 0's of the group's process group (collective over it), fp32 views of one flat
    buffer; the module's own values when the group has one rank."""
    values = [e.param.detach() for e in group.entries]
    comms, slots = _comms(group), group.slots
    if all(c.world_size == 1 for c in comms):
        return values
    flat = torch.zeros(group.layout.padded_numel, dtype=torch.float32, device=group.device)
    if all(c.rank == 0 for c in comms) or mode is InitSync.VERIFY:
        for v, s in zip(values, slots, strict=True):
            flat[s.start : s.end].copy_(v.reshape(-1))
    mine = flat.clone() if mode is InitSync.VERIFY else None
    for c in comms:  # HSDP: the shard group's rank 0 holds global rank 0's values after the first
        c.broadcast(flat, Phase.STATE, f"{group.label}/init")
    if mine is None:
        return [flat[s.start : s.end].view(s.shape) for s in slots]
    _verify(group, mine, flat)
    return values


def _comms(group: ParamGroup) -> list[Communicator]:
    """The group's data-parallel communicator, then (HSDP) its replicate one."""
    return [group.comm] + ([group.replicate] if group.replicate is not None else [])


def _first_difference(group: ParamGroup, mine: torch.Tensor, rank0: torch.Tensor) -> int:
    """Index of the first slot whose bits differ from rank 0's (len(slots) if none)."""
    a, b = mine.view(torch.int32), rank0.view(torch.int32)
    for i, s in enumerate(group.slots):
        if not torch.equal(a[s.start : s.end], b[s.start : s.end]):
            return i
    return len(group.slots)


def _verify(group: ParamGroup, mine: torch.Tensor, rank0: torch.Tensor) -> None:
    comms, slots = _comms(group), group.slots
    # one entry per rank, indexed (replica, shard rank) under HSDP; the SUM over each
    # communicator in turn gives every rank every rank's first difference
    # (and each rank's global rank, to name it)
    table = torch.zeros(2, math.prod(c.world_size for c in comms), dtype=torch.int64,
                        device=group.device)
    position = group.comm.rank + (0 if len(comms) == 1 else comms[1].rank * group.comm.world_size)
    table[0, position] = _first_difference(group, mine, rank0)
    table[1, position] = dist.get_rank()
    for c in comms:
        c.all_reduce(table, Collective.ALL_REDUCE_SUM, Phase.STATE, f"{group.label}/init")
    firsts, ranks = table.tolist()
    first = min(firsts)
    if first == len(slots):
        return
    names = " and ".join(repr(c.name) for c in comms) + (
        " process groups" if len(comms) > 1 else " process group")
    at = [ranks[r] for r, f in enumerate(firsts) if f == first]
    elsewhere = [ranks[r] for r, f in enumerate(firsts) if first < f < len(slots)]
    also = f" (ranks {elsewhere} differ in a later parameter)" if elsewhere else ""
    raise ValueError(
        f"rank {dist.get_rank()}: fully_shard(init_sync=InitSync.VERIFY): parameter "
        f"{slots[first].name!r} (group {group.label!r}) on ranks {at} differs from its value on "
        f"rank {ranks[0]}, rank 0 of its {names}{also}; the ranks "
        f"built different models. Seed every rank the same before building the model "
        f"(torch.manual_seed), load the same checkpoint on every rank, or let fully_shard "
        f"broadcast rank 0's values (init_sync=InitSync.BROADCAST, the default)"
    )
