"""Spawned-rank case of the collective-consistency check (``torch_side.comm.collective_check``)
that stays in a spawned gloo world: a collective that fails by a real timeout. The threaded
process group of the in-process worlds (``threaded_world.py``, where the other cases run:
``comm/test_collective_check.py``) has no collective timeouts -- a rank waits in a collective
until its peers join -- and no gloo subgroups, so the RuntimeError whose notes this case reads is
only raised by gloo.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from torch_side import Collective, Phase
from torch_side.comm.collective_check import CHECK_ENV
from torch_side.comm.collectives import Communicator


def _failure_notes(comm, label: str) -> str:
    """The notes on the exception of an all-reduce that rank 1 never joins."""
    t = torch.zeros(8)
    try:
        comm.all_reduce(t, Collective.ALL_REDUCE_SUM, Phase.GRAD_REDUCE, label)
    except RuntimeError as e:
        return "\n".join(getattr(e, "__notes__", []))
    raise AssertionError("an all-reduce without its peer did not fail")


def case_failed_collective_names_the_switch(ctx):
    """A collective that fails (here: a timeout, rank 1 never joins) carries a note naming the
    collective: with the check off, the switch that would name each rank's collective; with it
    on, that a rank stopped issuing FSDP collectives (rank 1 ran one collective, rank 0 two)."""
    short = datetime.timedelta(seconds=1)
    groups = [dist.new_group([0, 1], timeout=short, backend="gloo") for _ in range(2)]
    off, on = Communicator(groups[0], "dp"), Communicator(groups[1], "dp", check=True)
    on.all_reduce(torch.ones(2), Collective.ALL_REDUCE_SUM, Phase.GRAD_REDUCE, "head/fp32/dp/grad")
    if ctx.rank == 0:
        notes = _failure_notes(off, "blocks.3/fp32/dp/grad")
        assert "rank 0: this failed in the FSDP all-reduce (sum) of 'blocks.3/fp32/dp/grad' " \
            "(grad_reduce)" in notes and "rerun with check_collectives=True " \
            f"({CHECK_ENV}=1 for mxfp8-train)" in notes, notes
        notes = _failure_notes(on, "blocks.3/fp32/dp/grad")
        assert "rank 0: this failed in check_collectives' descriptor all-gather before the " \
            "FSDP all-reduce (sum) of 'blocks.3/fp32/dp/grad'" in notes, notes
        assert "some rank did not reach another FSDP collective" in notes, notes
    dist.barrier()
