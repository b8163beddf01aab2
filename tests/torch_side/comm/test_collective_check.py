"""The collective-consistency check (``torch_side.comm.collective_check``; spawned cases in
cases_collective_check.py): a unit that runs on some ranks only is an error naming each rank's
collective instead of a gloo abort or an NCCL hang (a declared expert unit stays in step and
trains); the check does not change training."""

from __future__ import annotations

import pytest
import torch

from tests.torch_side import cases_collective_check as cc
from tests.torch_side.conftest import check_case
from torch_side import Collective, Phase
from torch_side.comm.collective_check import (
    CHECK_ENV,
    DESCRIPTOR_INTS,
    Descriptor,
    mismatch_message,
)
from torch_side.comm.collectives import Communicator

GATHER = Descriptor(0, 7, "all-gather", "forward", "blocks.1/mxfp8_e4m3/dp/rowwise", "uint8", 6144)


def _rows(*descriptors: Descriptor) -> torch.Tensor:
    return torch.stack([d.encode() for d in descriptors])


# ---- spawned worlds ------------------------------------------------------------------------------
def test_undeclared_expert_unit_skipped_on_one_rank_is_named_on_every_rank(spawned):
    check_case(spawned, cc, cc.case_undeclared_expert_unit_skipped_on_one_rank_is_named, 2)


def test_declared_expert_unit_skipped_on_one_rank_trains_in_step(spawned):
    check_case(spawned, cc, cc.case_declared_expert_unit_skipped_on_one_rank_trains, 2)


def test_block_unit_skipped_on_one_rank_is_named_on_every_rank(spawned):
    check_case(spawned, cc, cc.case_block_unit_skipped_on_one_rank_is_named, 2)


def test_ranks_in_different_models_are_named(spawned):
    check_case(spawned, cc, cc.case_ranks_in_different_models_are_named, 2)


def test_failed_collective_names_the_switch(spawned):
    check_case(spawned, cc, cc.case_failed_collective_names_the_switch, 2)


@pytest.mark.slow
def test_check_on_trains_bit_identically(spawned):
    check_case(spawned, cc, cc.case_check_on_trains_bit_identically, 2)


# ---- descriptors (in process) -----------------------------------------------------------------
def test_descriptor_round_trips_through_its_fixed_size_encoding():
    row = GATHER.encode()
    assert row.dtype == torch.int64 and row.shape == (DESCRIPTOR_INTS,)
    assert Descriptor.decode(row) == GATHER
    assert GATHER.unit == "blocks.1"
    assert Descriptor.decode(torch.zeros(DESCRIPTOR_INTS, dtype=torch.int64)) is None


def test_long_labels_keep_unit_and_plane_and_still_compare_exactly():
    unit = "model.decoder." + ".".join(f"stage{i}" for i in range(30))
    a = Descriptor(0, 1, "all-gather", "backward", f"{unit}.a/mxfp8_e4m3/dp/colwise", "uint8", 64)
    b = Descriptor(0, 1, "all-gather", "backward", f"{unit}.b/mxfp8_e4m3/dp/colwise", "uint8", 64)
    assert a.encode().shape == b.encode().shape == (DESCRIPTOR_INTS,)
    shown = Descriptor.decode(a.encode()).label
    assert shown.startswith("model.decoder.stage0") and shown.endswith("/dp/colwise"), shown
    assert "..." in shown
    msg = mismatch_message(_rows(a, b), 0, "dp")  # same shortened text, different full label
    assert msg is not None


def test_same_descriptors_pass():
    assert mismatch_message(_rows(GATHER, GATHER, GATHER), 1, "dp") is None


def test_a_sequence_mismatch_alone_is_caught():
    """Everything equal but the communicator's sequence number."""
    later = Descriptor(0, 8, GATHER.verb, GATHER.phase, GATHER.label, GATHER.dtype, GATHER.numel)
    msg = mismatch_message(_rows(GATHER, GATHER, later), 2, "dp")
    assert msg is not None and msg.startswith("rank 2: FSDP collective mismatch"), msg
    assert "ranks 0, 1: all-gather of 'blocks.1/mxfp8_e4m3/dp/rowwise'" in msg, msg
    assert "collective #7 of FSDP communicator #0" in msg, msg
    assert "rank 2: all-gather" in msg and "collective #8 of FSDP communicator #0" in msg, msg


def test_mismatch_names_each_ranks_unit_cause_fix_and_switch():
    reduce = Descriptor(0, 7, "reduce-scatter", "grad_reduce", "blocks.0/fp32/dp/grad", "float32",
                        512)
    msg = mismatch_message(_rows(GATHER, reduce), 1, "dp")
    assert "rank 0: all-gather of 'blocks.1/mxfp8_e4m3/dp/rowwise' (unit 'blocks.1', forward; " \
        "6144 x uint8;" in msg, msg
    assert "rank 1: reduce-scatter of 'blocks.0/fp32/dp/grad' (unit 'blocks.0', grad_reduce;" \
        in msg, msg
    assert "units involved: 'blocks.0', 'blocks.1'" in msg, msg
    assert "ran on some ranks only" in msg and "empty input" in msg and CHECK_ENV in msg, msg
    assert "different FSDP models" not in msg, msg


# ---- the switch (an argument; apps.environment reads CHECK_ENV: tests/apps/test_environment.py)
def test_single_rank_communicator_counts_and_moves_nothing_extra():
    comm = Communicator(None, "dp", check=True)  # torch.distributed not initialised: world 1
    t = torch.ones(4)
    comm.all_reduce(t, Collective.ALL_REDUCE_SUM, Phase.FORWARD, "<root>/fp32/dp/weights")
    out = torch.empty(4)
    comm.all_gather(out, t, Phase.FORWARD, "<root>/fp32/dp/rowwise")
    assert comm.check and comm.seq == 2 and torch.equal(out, t)
    assert [r.label for r in comm.records] == ["<root>/fp32/dp/weights", "<root>/fp32/dp/rowwise"]
