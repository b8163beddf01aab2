"""Experts as FSDP units of their own (``torch_side.fsdp.expert_units``), in process at world size
1: an expert the router skips still issues its collectives, in the order the others would, so the
sequence is the same whichever experts run; training matches the unwrapped model bit for bit;
misuse that would put ranks out of step is named. The multi-rank cases (worlds 2 and 4, against
the replicated reference, collectives compared across ranks) are in test_reliability.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from bridge import MXFP8Linear
from tests.torch_side.toy_models import (
    N_EXPERTS,
    Block,
    D,
    ExpertMLP,
    MoEBlock,
    MoENet,
    make_batch,
    mse,
)
from torch_side import Collective, FSDPOptimizer, ShardingStrategy, fully_shard

T = 32
UNITS = (Block, MoEBlock, ExpertMLP)
ALL = torch.arange(T) % N_EXPERTS  # every expert gets tokens
ONLY_1 = torch.full((T,), 1)  # experts 0 and 2 get none: not called (skip_when_empty)

pytestmark = pytest.mark.usefixtures("single_rank_world")


def _wrap(net: MoENet):
    return fully_shard(
        net, unit_modules=UNITS, strategy=ShardingStrategy.OPTIM_GRADS_PARAMS,
        expert_modules=(ExpertMLP,), expert_group=dist.group.WORLD,
    )


def _net(**kw) -> MoENet:
    torch.manual_seed(0)
    return MoENet(skip_when_empty=(0, 2), **kw)


def _steps(model, routes) -> list[list[tuple]]:
    """One SGD step per route; the wire log of each step."""
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.5, foreach=False)
    logs = []
    for step, route in enumerate(routes):
        x, y = make_batch(60 + step, T)
        model.clear_wire_log()
        mse(model(x, route), y).backward()
        opt.step()
        opt.zero_grad()
        logs.append([(r.op, r.phase, r.label, r.numel) for r in model.wire_log()])
    return logs


def test_skipped_experts_issue_the_collectives_of_experts_that_ran():
    """Experts 0 and 2 not called: the same collectives, in the same order, as when all three
    run -- in the first step (order being recorded, no prefetch) and the second (prefetch)."""
    ran, skipped = _wrap(_net()), _wrap(_net())
    want, got = _steps(ran, [ALL, ALL]), _steps(skipped, [ONLY_1, ONLY_1])
    assert got == want
    for log in got:
        for e in range(N_EXPERTS):
            unit = f"moe.experts.{e}/mxfp8_e4m3/expert_dp"
            mine = [(op, phase.value) for op, phase, label, _ in log if label.startswith(unit)]
            assert mine[:3] == [(Collective.ALL_GATHER, "forward"),
                                (Collective.ALL_GATHER, "backward"),
                                (Collective.REDUCE_SCATTER, "grad_reduce")], (e, mine)
    assert skipped.allocator.live_keys() == []


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_expert_units_train_like_the_unwrapped_model(recompute):
    """Two SGD steps with experts skipped (0, 2) and called empty (1, then 0 is skipped while 2
    runs): the same losses and weights as the unwrapped model, bit for bit."""
    net = _net(recompute=recompute)
    ref = copy.deepcopy(net)
    model = _wrap(net)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.5, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, foreach=False)
    for step, route in enumerate([ONLY_1, torch.where(ALL == 0, 2, ALL)]):
        x, y = make_batch(70 + step, T)
        loss, want = mse(model(x, route), y), mse(ref(x, route), y)
        loss.backward()
        want.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert torch.equal(loss, want), (step, loss.item(), want.item())
    state = model.full_state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(state[name], p.detach()), name
    assert model.allocator.live_keys() == []


class _CallsExpertTwice(MoEBlock):
    def forward(self, x, route):
        h = self.ln(x)
        return x + self.experts[1](h) + self.experts[0](h) + self.experts[0](h)


class _CheckpointsEachExpert(MoEBlock):
    def forward(self, x, route):
        h = self.ln(x)
        return x + sum(checkpoint(e, h, use_reentrant=False) for e in self.experts)


class _CheckpointsPartOfTheHost(MoEBlock):
    def forward(self, x, route):
        return checkpoint(self.proj, super().forward(x, route), use_reentrant=False)


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        (_CallsExpertTwice, "FSDP expert unit 'moe.experts.0' ran its forward after its host "
                            "unit 'moe' had passed it"),
        (_CheckpointsEachExpert, "FSDP expert unit 'moe.experts.2' ran a recompute forward "
                                 "that is not a recompute of its host unit 'moe'"),
        (_CheckpointsPartOfTheHost, r"FSDP unit 'moe' \(the host of expert units\) gathers "
                                    r"\['rowwise'\] of group 'moe/mxfp8_e4m3/dp' outside its "
                                    r"hooks \(a recompute of part of the unit"),
    ],
    ids=["out_of_order", "expert_checkpointed_alone", "part_of_host_checkpointed"],
)
def test_expert_units_out_of_their_hosts_order_are_named(layer, match):
    """What would put ranks out of step if some skipped an expert is refused by name (on every
    rank that does it)."""
    net = _net()
    net.moe.proj = MXFP8Linear(D, D)
    net.moe.__class__ = layer
    model = _wrap(net)
    x, y = make_batch(80, T)
    with pytest.raises(RuntimeError, match=match) as err:
        mse(model(x, ALL), y).backward()
    assert str(err.value).startswith("rank 0: FSDP ")
    assert "Other ranks may now hang" in str(err.value)
    model.zero_grad()
    assert model.allocator.live_keys() == []


def test_an_expert_unit_called_outside_its_host_is_named():
    model = _wrap(_net())
    with pytest.raises(RuntimeError, match="'moe.experts.1' ran its forward outside a forward "
                                           "of its host unit 'moe'"):
        model.module.moe.experts[1](torch.zeros(T, 64))
    model.zero_grad()
    assert model.allocator.live_keys() == []
