"""``torch_side.comm.collectives``: a ``Communicator``'s collectives and its wire log.

In process, on a one-rank gloo group (``single_rank_world``): at world size 1 an all-gather and a
reduce-scatter are copies and an all-reduce leaves its tensor as it is. Each collective is
recorded once in the communicator's wire log (``WireRecord``: operation, phase, label, dtype,
elements of the full tensor, bytes this rank contributes), synchronous or not; the log keeps the
most recent ``WIRE_LOG_LIMIT`` records. The multi-rank values are checked in in-process worlds
(``test_wire_and_errors``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torch_side.comm.collectives import (
    WIRE_LOG_LIMIT,
    Collective,
    Communicator,
    Handle,
    Phase,
    WireRecord,
)

pytestmark = pytest.mark.usefixtures("single_rank_world")


def _comm(name: str = "dp") -> Communicator:
    return Communicator(dist.group.WORLD, name)


def test_a_communicator_of_a_one_rank_group_is_rank_0_of_1_with_an_empty_log():
    c = _comm()
    assert (c.rank, c.world_size, c.name) == (0, 1, "dp")
    assert list(c.records) == [] and c.seq == 0


def test_all_gather_at_world_1_copies_the_shard_and_logs_its_bytes():
    c = _comm()
    shard = torch.arange(24, dtype=torch.uint8)
    out = torch.zeros(24, dtype=torch.uint8)
    assert c.all_gather(out, shard, Phase.FORWARD, "u/mxfp8_e4m3/dp/rowwise") is None
    assert torch.equal(out, shard) and out.data_ptr() != shard.data_ptr()
    assert list(c.records) == [WireRecord(Collective.ALL_GATHER, Phase.FORWARD,
                                          "u/mxfp8_e4m3/dp/rowwise", torch.uint8, 24, 24)]
    assert c.seq == 1


def test_reduce_scatter_at_world_1_copies_the_full_tensor_and_logs_what_it_sends():
    c = _comm()
    full = torch.linspace(-1.0, 1.0, 16, dtype=torch.bfloat16)
    out = torch.zeros(16, dtype=torch.bfloat16)
    c.reduce_scatter(out, full, Phase.GRAD_REDUCE, "u/fp32/dp/grad")
    assert torch.equal(out, full)
    # a reduce-scatter sends the whole (world * n) tensor: 16 bf16 values, 2 bytes each
    assert list(c.records) == [WireRecord(Collective.REDUCE_SCATTER, Phase.GRAD_REDUCE,
                                          "u/fp32/dp/grad", torch.bfloat16, 16, 32)]


@pytest.mark.parametrize("op", [Collective.ALL_REDUCE_SUM, Collective.ALL_REDUCE_MAX])
def test_all_reduce_at_world_1_leaves_the_tensor_and_logs_it(op):
    c = _comm()
    t = torch.tensor([3.0, -2.0, 0.5], dtype=torch.float64)
    c.all_reduce(t, op, Phase.OPTIMIZER, "grad_norm")
    assert t.tolist() == [3.0, -2.0, 0.5]
    assert list(c.records) == [WireRecord(op, Phase.OPTIMIZER, "grad_norm", torch.float64, 3, 24)]


def test_an_async_collective_returns_a_handle_that_waits_once_and_logs_once():
    c = _comm()
    shard, out = torch.arange(8.0), torch.zeros(8)
    h = c.all_gather(out, shard, Phase.BACKWARD, "u/fp32/dp/rowwise", async_op=True)
    assert isinstance(h, Handle)
    h.wait()
    h.wait()  # idempotent
    assert h.done and torch.equal(out, shard)
    assert [(r.op, r.phase) for r in c.records] == [(Collective.ALL_GATHER, Phase.BACKWARD)]


def test_a_gather_into_a_tensor_of_the_wrong_size_is_refused_before_it_is_logged():
    c = _comm()
    with pytest.raises(AssertionError):
        c.all_gather(torch.zeros(9), torch.zeros(8), Phase.FORWARD, "bad")
    with pytest.raises(AssertionError):
        c.reduce_scatter(torch.zeros(8), torch.zeros(9), Phase.GRAD_REDUCE, "bad")
    assert list(c.records) == []


def test_the_wire_log_keeps_the_most_recent_records_and_each_communicator_its_own():
    c, other = _comm(), _comm("expert_dp")
    t = torch.zeros(1)
    for i in range(WIRE_LOG_LIMIT + 5):
        c.all_reduce(t, Collective.ALL_REDUCE_SUM, Phase.STATE, f"r{i}")
    assert len(c.records) == WIRE_LOG_LIMIT
    assert c.records[0].label == "r5" and c.records[-1].label == f"r{WIRE_LOG_LIMIT + 4}"
    assert c.seq == WIRE_LOG_LIMIT + 5  # every collective counted, logged or dropped
    assert list(other.records) == []
    c.records.clear()  # the caller clears the log (FSDPModel.clear_wire_log)
    assert list(c.records) == []
