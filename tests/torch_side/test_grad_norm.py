"""``FSDPOptimizer.grad_norm()``: the global L2 norm of the reduced gradients equals the norm of
the full gradients of the unsharded model, for every strategy, dense and expert groups, at world
sizes 1 and 2 (dense: 4 for ZeRO-3; experts: 4 for every strategy, two expert-DP groups; slow), the
same on every rank (cases_grad_norm.py)."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_grad_norm as cg
from tests.torch_side.conftest import check_case

DENSE = [cg.case_grad_norm_no_shard, cg.case_grad_norm_optim, cg.case_grad_norm_optim_grads,
         cg.case_grad_norm_optim_grads_params]
EXPERTS = [cg.case_grad_norm_experts_no_shard, cg.case_grad_norm_experts_optim,
           cg.case_grad_norm_experts_zero3]


def _name(case) -> str:
    return case.__name__.removeprefix("case_grad_norm_")


@pytest.mark.parametrize(
    ("case", "world_size"),
    [(c, w) for c in DENSE for w in (1, 2)]
    + [pytest.param(cg.case_grad_norm_optim_grads_params, 4, marks=pytest.mark.slow)],
    ids=lambda v: f"w{v}" if isinstance(v, int) else _name(v),
)
def test_grad_norm_matches_the_unsharded_model(spawned, case, world_size):
    check_case(spawned, cg, case, world_size)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", EXPERTS, ids=_name)
def test_grad_norm_counts_every_expert_once(spawned, case, world_size):
    check_case(spawned, cg, case, world_size)
