"""Ranks that initialise differently end with rank 0's model, not a silent mix (issue 17), on
every rank of an in-process world (``threaded_world.py``; world 4 marked slow).

Ranks build the model from different seeds (as a launcher that seeds by rank would); ``fully_shard``
broadcasts each group's values from rank 0 of its data-parallel group (expert parameters: of their
expert-DP group) before sharding, or, with ``InitSync.VERIFY``, refuses on every rank naming the
first differing parameter (``torch_side.fsdp.init_sync``): the wrapped model is rank 0's init bit
for bit and trains like the replicated reference started from it; expert parameters come from
rank 0 of their expert-DP group; ``InitSync.VERIFY`` refuses on every rank, naming the first
differing parameter."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import (
    ZERO3,
    Block,
    ExpertMLP,
    MoEBlock,
    T,
    check_close,
    expect_error,
    expert_groups,
    make_batch,
    make_net,
    moe_net,
    mse,
    train_step,
    wrap_net,
)
from torch_side import FSDPOptimizer, fully_shard
from torch_side.comm.collectives import Collective

WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


def _assert_planes_equal(got, want) -> None:
    """Gathered model weights, bit for bit: MXFP8 planes and scales, or the weights."""
    assert list(got) == list(want)
    for name, g in got.items():
        w = want[name]
        if isinstance(g, torch.Tensor):
            assert torch.equal(g, w), name
            continue
        for field in ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale"):
            assert torch.equal(getattr(g, field), getattr(w, field)), f"{name}.{field}"


def _ranks_that_initialise_differently(ctx) -> None:
    init = make_net(0, device=ctx.device)
    mixed = fully_shard(
        make_net(ctx.rank, device=ctx.device), unit_modules=(Block,), strategy=ZERO3
    )
    # one broadcast per group, in the wire log (torch_side.comm.collectives is the only caller)
    sent = [(r.label, r.bytes_sent) for r in mixed.wire_log() if r.op is Collective.BROADCAST]
    assert sent == [(f"{g.label}/init", 4 * g.layout.padded_numel * (ctx.rank == 0))
                    for g in mixed.param_groups], sent
    same = wrap_net(ctx)  # seed 0 on every rank: what the mixed model must be
    state = mixed.full_state_dict()
    for name, p in init.named_parameters():
        assert torch.equal(state[name], p.detach()), f"{name}: not rank 0's init"
    with mixed.gathered_weights() as got, same.gathered_weights() as want:
        _assert_planes_equal(got, want)
    ref = copy.deepcopy(init)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
    opts = [FSDPOptimizer(m, torch.optim.Adam, lr=1e-2, foreach=False) for m in (mixed, same)]
    for step in range(2):
        a, b = train_step(mixed, opts[0], step, ctx), train_step(same, opts[1], step, ctx)
        assert torch.equal(a, b), (step, a.item(), b.item())
        x, y = make_batch(100 + step, T * ctx.world_size, ctx.device)
        ref_loss = mse(ref(x), y)  # the mean over all ranks' rows = the mean of rank means
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        check_close(f"loss step {step}", a, ref_loss.detach(), exact=False)
    a, b = mixed.full_state_dict(), same.full_state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(a[name], b[name]), name
        check_close(name, a[name], p.detach(), exact=False)


@pytest.mark.parametrize("world_size", WORLDS)
def test_ranks_that_initialise_differently_start_from_rank0(world_size):
    """Every rank builds the model from its own seed: the wrapped model is rank 0's init (full
    main weights against the unwrapped init, gathered planes against a wrap of rank 0's init on
    every rank, both bit for bit), and it trains like that wrap (bit for bit) and like the
    replicated reference started from rank 0's init (to the fp32 reduction-order tolerance)."""
    run_world(world_size, _ranks_that_initialise_differently)


def _expert_parameters_from_their_group_rank0(ctx) -> None:
    egroups, gsize = expert_groups(ctx.world_size)
    mine = ctx.rank // gsize
    model = fully_shard(
        moe_net(ctx.device, ctx.rank, dense_seed=ctx.rank), unit_modules=(Block, MoEBlock),
        strategy=ZERO3, expert_modules=(ExpertMLP,), expert_group=egroups[mine],
    )
    want = moe_net(ctx.device, mine * gsize, dense_seed=0)
    state = model.full_state_dict()
    for name, p in want.named_parameters():
        assert torch.equal(state[name], p.detach()), f"{name}: not its group rank 0's init"


@pytest.mark.parametrize("world_size", WORLDS)
def test_expert_parameters_start_from_rank0_of_their_expert_group(world_size):
    """Dense parameters come from rank 0 of the data-parallel group, expert parameters from rank
    0 of their expert-DP group (at world 4, {0, 1} and {2, 3} each keep their own experts)."""
    run_world(world_size, _expert_parameters_from_their_group_rank0)


def _verify_names_the_first_differing_parameter(ctx) -> None:
    model = wrap_net(ctx, init_sync="verify")
    state, init = model.full_state_dict(), make_net(0, device=ctx.device)
    assert all(torch.equal(state[n], p.detach()) for n, p in init.named_parameters())
    net = make_net(0, device=ctx.device)
    last = ctx.world_size - 1
    if ctx.rank == last:
        with torch.no_grad():
            w = net.blocks[0].mlp.fc1.weight
            w[3, 7] = torch.nextafter(w[3, 7], torch.tensor(float("inf")))
    msg = expect_error(
        ValueError, "parameter 'blocks.0.mlp.fc1.weight' (group 'blocks.0/mxfp8_e4m3/dp') on "
        f"ranks [{last}] differs from its value on rank 0", fully_shard, net,
        unit_modules=(Block,), strategy=ZERO3, init_sync="verify",
    )
    assert msg.startswith(f"rank {ctx.rank}: fully_shard(init_sync=InitSync.VERIFY)"), msg


def test_init_sync_verify_names_the_first_differing_parameter():
    """InitSync.VERIFY: identical ranks wrap (and keep their values); one rank with a parameter
    one ulp off makes every rank raise together, naming that parameter and that rank."""
    run_world(2, _verify_names_the_first_differing_parameter)
