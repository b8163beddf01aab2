"""Spawned-rank cases: ``FSDPOptimizer.grad_norm()`` against the replicated reference.

The reference is the norm (float64) of the full gradients of the unsharded model trained by plain
Torch on the whole global batch (as in ``cases_training``): every strategy must count each
gradient element once -- ``no_shard`` holds replicated full gradients (not counted DP times),
the sharded strategies 1/DP shards (summed over the DP group), and expert groups their own
experts' gradients over the expert-DP group (``MoENet``: dense + expert groups; at world 4 two
expert-DP groups with different experts). The norms agree to fp32 summation order (RTOL) and are
bit-identical on every rank.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from tests.torch_side.cases_reliability import _expert_groups, _moe_net, _routes
from tests.torch_side.toy_models import Block, ExpertMLP, MoEBlock, make_batch, make_net, mse
from torch_side import FSDPOptimizer, ShardingStrategy, fully_shard

T = 32  # tokens per rank and micro-batch
RTOL = 1e-5  # fp32 gradient sums in another order; observed <= 2e-7 at world 2


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))


def _check(ctx, what: str, got: torch.Tensor, want: float) -> None:
    assert got.dtype == torch.float64 and got.dim() == 0, (got.dtype, got.shape)
    every = [None] * ctx.world_size
    dist.all_gather_object(every, float(got))
    assert len(set(every)) == 1, f"{what}: ranks disagree: {every}"
    assert math.isclose(float(got), want, rel_tol=RTOL), f"{what}: {float(got)} vs {want}"


def _dense_case(ctx, strategy: ShardingStrategy) -> None:
    w, r = ctx.world_size, ctx.rank
    net = make_net(0, device=ctx.device)
    ref = copy.deepcopy(net)
    model = fully_shard(net, unit_modules=(type(net.blocks[0]),), strategy=strategy)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    for micro_batch in range(2):  # two micro-batches accumulate into the main grads
        x, y = make_batch(40 + micro_batch, T * w, ctx.device)
        (mse(model(x[r * T:(r + 1) * T]), y[r * T:(r + 1) * T]) / 2).backward()
        (mse(ref(x), y) / 2).backward()
    want = _norm(p.grad for p in ref.parameters())
    _check(ctx, f"{strategy.value} world {w}", opt.grad_norm(), want)
    full = model.full_grads()  # the same, from the gathered full gradients
    assert math.isclose(_norm(full.values()), want, rel_tol=RTOL)
    opt.step()
    opt.zero_grad()
    assert float(opt.grad_norm()) == 0.0


def _expert_case(ctx, strategy: ShardingStrategy) -> None:
    w, r = ctx.world_size, ctx.rank
    egroups, gsize = _expert_groups(w)
    mine = r // gsize
    model = fully_shard(
        _moe_net(ctx.device, mine), unit_modules=(Block, MoEBlock), strategy=strategy,
        expert_modules=(ExpertMLP,), expert_group=egroups[mine],
    )
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    routes = _routes(w)
    x, y = make_batch(60, T * w, ctx.device)
    rows = slice(r * T, (r + 1) * T)
    mse(model(x[rows], routes[r].to(ctx.device)), y[rows]).backward()
    # Replicated reference: one dense net and every expert-DP group's experts, the mean loss
    # over all ranks' micro-batches.
    ref = _moe_net("cpu", 0)
    experts = [_moe_net("cpu", g).moe.experts for g in range(len(egroups))]
    dense = [p for n, p in ref.named_parameters() if not n.startswith("moe.experts.")]
    for rr in range(w):
        ref.moe.experts = experts[rr // gsize]
        rows_rr = slice(rr * T, (rr + 1) * T)
        (mse(ref(x[rows_rr].cpu(), routes[rr]), y[rows_rr].cpu()) / w).backward()
    want = _norm([p.grad for p in dense] + [p.grad for e in experts for p in e.parameters()])
    _check(ctx, f"experts {strategy.value} world {w}", opt.grad_norm(), want)


def case_grad_norm_no_shard(ctx):
    _dense_case(ctx, ShardingStrategy.NO_SHARD)


def case_grad_norm_optim(ctx):
    _dense_case(ctx, ShardingStrategy.OPTIM)


def case_grad_norm_optim_grads(ctx):
    _dense_case(ctx, ShardingStrategy.OPTIM_GRADS)


def case_grad_norm_optim_grads_params(ctx):
    _dense_case(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS)


def case_grad_norm_experts_no_shard(ctx):
    _expert_case(ctx, ShardingStrategy.NO_SHARD)


def case_grad_norm_experts_optim(ctx):
    _expert_case(ctx, ShardingStrategy.OPTIM)


def case_grad_norm_experts_zero3(ctx):
    _expert_case(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS)


_M = "tests.torch_side.cases_grad_norm"
DENSE = ("no_shard", "optim", "optim_grads", "optim_grads_params")
EXPERTS = ("experts_no_shard", "experts_optim", "experts_zero3")
CASES = {f"{_M}:case_grad_norm_{s}": (1, 2) for s in DENSE}
CASES.update({f"{_M}:case_grad_norm_{s}": (2,) for s in EXPERTS})
# World 4: dense groups only under ZeRO-3 (the other strategies' reductions are the same at 2
# ranks); expert groups under every strategy, as only world 4 has two expert-DP groups.
SLOW_CASES = {f"{_M}:case_grad_norm_{s}": (4,) for s in ("optim_grads_params",) + EXPERTS}
