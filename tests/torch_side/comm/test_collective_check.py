"""The collective-consistency check (``torch_side.comm.collective_check``): a unit that runs on
some ranks only is an error naming each rank's collective instead of a gloo abort or an NCCL hang
(a declared expert unit stays in step and trains); the check does not change training.

A unit that runs on some ranks only made gloo abort the process ("Received data size doesn't
match expected size"), or pair same-size buffers of different units silently (NCCL: hang or
corrupt). With the check on, every rank raises ``CollectiveMismatchError`` naming what each rank
was about to run; with it off, training is unchanged, bit for bit. An expert unit declared in
``expert_modules`` is the exception: skipped on one rank, it stays in step (no mismatch).

Multi-rank cases run in in-process worlds (``threaded_world.py``); the one whose collective
fails by a real gloo timeout stays spawned (cases_collective_check.py says why).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.torch_side import cases_collective_check as cc
from tests.torch_side.conftest import check_case
from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import (
    N_EXPERTS,
    ZERO3,
    Block,
    ExpertMLP,
    MoEBlock,
    MoENet,
    T,
    ToyNet,
    make_batch,
    make_net,
    mse,
    seeded,
)
from torch_side import Collective, FSDPOptimizer, Phase, fully_shard
from torch_side.comm.collective_check import (
    CHECK_ENV,
    DESCRIPTOR_INTS,
    CollectiveMismatchError,
    Descriptor,
    mismatch_message,
)
from torch_side.comm.collectives import Communicator

GATHER = Descriptor(0, 7, "all-gather", "forward", "blocks.1/mxfp8_e4m3/dp/rowwise", "uint8", 6144)


def _rows(*descriptors: Descriptor) -> torch.Tensor:
    return torch.stack([d.encode() for d in descriptors])


# ---- in-process worlds ----------------------------------------------------------------------
def _expect_mismatch(ctx, fn) -> str:
    try:
        fn()
    except CollectiveMismatchError as e:
        msg = str(e)
        head = f"rank {ctx.rank}: FSDP collective mismatch on process group 'dp'"
        assert msg.startswith(head), msg
        assert "rank 0: " in msg and "rank 1: " in msg, msg
        return msg
    raise AssertionError("the ranks ran different collectives and no CollectiveMismatchError")


def _expert_route(ctx) -> torch.Tensor:
    t = torch.arange(T, device=ctx.device)
    return t % N_EXPERTS if ctx.rank == 0 else 1 + t % 2  # rank 1: expert 0 gets no tokens


def _undeclared_expert_unit_skipped_on_one_rank_is_named(ctx):
    """An MXFP8 expert wrapped as its own unit but not declared an expert (a dense unit); the
    router sends it no tokens on rank 1, which skips its call. Without the check, rank 0's
    all-gather of expert 0 pairs with rank 1's of expert 1 (same size: silently mixed shards),
    and a later one aborts gloo. With check_collectives=True both ranks raise at the first
    divergent collective, and the error says to declare it."""
    with seeded(0):
        net = MoENet()
    model = fully_shard(
        net.to(ctx.device), unit_modules=(Block, ExpertMLP), strategy=ZERO3,
        check_collectives=True,
    )
    assert model.comms["dp"].check
    x, _ = make_batch(3, T, ctx.device)
    msg = _expect_mismatch(ctx, lambda: model(x, _expert_route(ctx)))
    assert "rank 0: all-gather of 'moe.experts.0/mxfp8_e4m3/dp/rowwise' (unit 'moe.experts.0', "\
        "forward;" in msg, msg
    assert "rank 1: all-gather of 'moe.experts.1/mxfp8_e4m3/dp/rowwise' (unit 'moe.experts.1', "\
        "forward;" in msg, msg
    assert "ran on some ranks only" in msg and "run every FSDP unit on every rank" in msg, msg
    assert "not declared an expert" in msg and "expert_modules=..." in msg, msg


def _declared_expert_unit_skipped_on_one_rank_trains(ctx):
    """The same expert units declared (expert_modules) and hosted by their MoE layer's unit:
    rank 1 still skips expert 0, and with the check on both ranks train in step (the host passes
    the skipped expert: the same collectives on both ranks)."""
    with seeded(0):
        net = MoENet()
    model = fully_shard(
        net.to(ctx.device), unit_modules=(Block, MoEBlock, ExpertMLP), strategy=ZERO3,
        expert_modules=(ExpertMLP,), check_collectives=True,
    )
    assert model.comms["expert_dp"].check
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    x, y = make_batch(3, T, ctx.device)
    for _ in range(2):
        model.clear_wire_log()
        loss = mse(model(x, _expert_route(ctx)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
        wire = [(r.op.value, r.phase.value, r.label, r.numel) for r in model.wire_log()]
        every = [None] * ctx.world_size
        dist.all_gather_object(every, wire)
        assert all(w == wire for w in every), "the ranks issued different collectives"
        assert any(lbl.startswith("moe.experts.0/") for _, _, lbl, _ in wire)
    assert model.allocator.live_keys() == []


class _SkipNet(ToyNet):
    """ToyNet whose rank 1 skips ``blocks.1`` (e.g. layer drop decided per rank)."""

    def forward(self, x):
        h = self.inp(x + self.shift)
        for i, b in enumerate(self.blocks):
            if not (i == 1 and dist.get_rank() == 1):
                h = b(h)
        return self.head(h)


def _block_unit_skipped_on_one_rank_is_named(ctx):
    """Rank 1 skips the unit blocks.1 in forward: rank 0 is gathering blocks.1 for forward while
    rank 1 is already gathering the root for backward (check_collectives=True)."""
    with seeded(0):
        net = _SkipNet()
    model = fully_shard(
        net.to(ctx.device), unit_modules=(Block,), strategy=ZERO3, check_collectives=True
    )
    x, y = make_batch(4, T, ctx.device)
    msg = _expect_mismatch(ctx, lambda: mse(model(x), y).backward())
    assert "rank 0: all-gather of 'blocks.1/" in msg and "(unit 'blocks.1', forward;" in msg, msg
    assert "rank 1: all-gather of '<root>/" in msg and "backward;" in msg, msg


def _train(model, steps: int, ctx) -> list[torch.Tensor]:
    opt = FSDPOptimizer(model, torch.optim.Adam, lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        x, y = make_batch(20 + step, T * ctx.world_size, ctx.device)
        mine = slice(ctx.rank * T, (ctx.rank + 1) * T)
        loss = mse(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _check_on_trains_bit_identically(ctx):
    """Training with the check on is bit-identical to off (losses, main weights) and sends the
    same collectives (the descriptors are not FSDP collectives and stay out of the wire log).
    The switch is agreed: asked for on rank 1 only, it is on for both ranks."""
    off = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ZERO3)
    on = fully_shard(
        make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ZERO3,
        check_collectives=ctx.rank == 1,
    )
    for a, b in zip(_train(off, 3, ctx), _train(on, 3, ctx), strict=True):
        assert torch.equal(a, b), (a.item(), b.item())
    w_off, w_on = off.full_state_dict(), on.full_state_dict()
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off), "weights differ"
    wire = [[(r.op, r.phase, r.label, r.numel) for r in m.wire_log()] for m in (off, on)]
    assert wire[0] == wire[1] and wire[0], "the check changed the FSDP collectives"
    assert on.comms["dp"].seq == off.comms["dp"].seq > 0
    assert not off.comms["dp"].check and on.comms["dp"].check  # agreed at the first collective


def _ranks_in_different_models_are_named(ctx):
    """Two identically built models (same unit names and labels): rank 0 reads one's state,
    rank 1 the other's. Labels, sizes and phases agree; the communicators' ordinals and
    sequence numbers do not, and the error says so."""
    a = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), check_collectives=True)
    b = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), check_collectives=True)
    _train(a, 1, ctx)  # a's communicator is ahead of b's
    mine = a if ctx.rank == 0 else b
    msg = _expect_mismatch(ctx, mine.full_state_dict)
    oa, ob = a.comms["dp"].ordinal, b.comms["dp"].ordinal
    assert ob == oa + 1, (oa, ob)
    assert f"of FSDP communicator #{oa})" in msg and f"of FSDP communicator #{ob})" in msg, msg
    assert "call the same wrapped model on every rank" in msg, msg


def test_undeclared_expert_unit_skipped_on_one_rank_is_named_on_every_rank():
    run_world(2, _undeclared_expert_unit_skipped_on_one_rank_is_named)


def test_declared_expert_unit_skipped_on_one_rank_trains_in_step():
    run_world(2, _declared_expert_unit_skipped_on_one_rank_trains)


def test_block_unit_skipped_on_one_rank_is_named_on_every_rank():
    run_world(2, _block_unit_skipped_on_one_rank_is_named)


def test_ranks_in_different_models_are_named():
    run_world(2, _ranks_in_different_models_are_named)


@pytest.mark.slow
def test_check_on_trains_bit_identically():
    run_world(2, _check_on_trains_bit_identically)


# ---- a spawned world (a real gloo timeout) -----------------------------------------------------
def test_failed_collective_names_the_switch():
    check_case(cc, cc.case_failed_collective_names_the_switch, 2)


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
