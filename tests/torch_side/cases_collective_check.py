"""Spawned-rank cases: the collective-consistency check (``torch_side.comm.collective_check``).

A unit that runs on some ranks only made gloo abort the process ("Received data size doesn't
match expected size"), or pair same-size buffers of different units silently (NCCL: hang or
corrupt). With the check on, every rank raises ``CollectiveMismatchError`` naming what each rank
was about to run; with it off, training is unchanged, bit for bit. An expert unit declared in
``expert_modules`` is the exception: skipped on one rank, it stays in step (no mismatch).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tests.torch_side.toy_models import (
    N_EXPERTS,
    Block,
    ExpertMLP,
    MoEBlock,
    MoENet,
    ToyNet,
    make_batch,
    make_net,
    mse,
)
from torch_side import Collective, FSDPOptimizer, Phase, ShardingStrategy, fully_shard
from torch_side.comm.collective_check import CHECK_ENV, CollectiveMismatchError
from torch_side.comm.collectives import Communicator

T = 32
ZERO3 = ShardingStrategy.OPTIM_GRADS_PARAMS



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


def case_undeclared_expert_unit_skipped_on_one_rank_is_named(ctx):
    """An MXFP8 expert wrapped as its own unit but not declared an expert (a dense unit); the
    router sends it no tokens on rank 1, which skips its call. Without the check, rank 0's
    all-gather of expert 0 pairs with rank 1's of expert 1 (same size: silently mixed shards),
    and a later one aborts gloo. With check_collectives=True both ranks raise at the first
    divergent collective, and the error says to declare it."""
    torch.manual_seed(0)
    model = fully_shard(
        MoENet().to(ctx.device), unit_modules=(Block, ExpertMLP), strategy=ZERO3,
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


def case_declared_expert_unit_skipped_on_one_rank_trains(ctx):
    """The same expert units declared (expert_modules) and hosted by their MoE layer's unit:
    rank 1 still skips expert 0, and with the check on both ranks train in step (the host passes
    the skipped expert: the same collectives on both ranks)."""
    torch.manual_seed(0)
    model = fully_shard(
        MoENet().to(ctx.device), unit_modules=(Block, MoEBlock, ExpertMLP), strategy=ZERO3,
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


def case_block_unit_skipped_on_one_rank_is_named(ctx):
    """Rank 1 skips the unit blocks.1 in forward: rank 0 is gathering blocks.1 for forward while
    rank 1 is already gathering the root for backward (check_collectives=True)."""
    torch.manual_seed(0)
    model = fully_shard(
        _SkipNet().to(ctx.device), unit_modules=(Block,), strategy=ZERO3, check_collectives=True
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


def case_check_on_trains_bit_identically(ctx):
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


def case_ranks_in_different_models_are_named(ctx):
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


_M = __name__
CASES = {
    f"{_M}:case_undeclared_expert_unit_skipped_on_one_rank_is_named": (2,),
    f"{_M}:case_declared_expert_unit_skipped_on_one_rank_trains": (2,),
    f"{_M}:case_block_unit_skipped_on_one_rank_is_named": (2,),
    f"{_M}:case_ranks_in_different_models_are_named": (2,),
    f"{_M}:case_failed_collective_names_the_switch": (2,),
}
SLOW_CASES = {f"{_M}:case_check_on_trains_bit_identically": (2,)}  # ~15 s: two models, 3 steps
