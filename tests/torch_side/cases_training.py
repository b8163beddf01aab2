"""Spawned-rank cases: sharded training vs a replicated single-process reference.

The reference is the same ``ToyNet`` trained by plain Torch on the whole global batch: its
``MXFP8Linear`` layers quantize ``bf16(weight)`` on the fly, which is exactly what the FSDP model
reads from its planes (quantized from bf16 of the fp32 main weights). Rank r's micro-batch is rows
``[r * T, (r + 1) * T)`` of the global batch (T = 32 tokens, whole MXFP8 token blocks), its loss is
the mean over its rows, and FSDP averages gradients over ranks, so both sides follow the same
gradient. World size 1 runs the same arithmetic in the same order: losses and main weights are
compared for exact equality. With more ranks the gradient sums run in another order, so they
agree to ``RTOL``/``ATOL`` (fp32 reduction order, amplified a little by bf16/MXFP8 rounding of
weights that land near a rounding boundary).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.torch_side.toy_models import Recompute, make_batch, make_net, mse
from torch_side import FSDPOptimizer, MixedPrecisionPolicy, ShardingStrategy, fully_shard

T = 32  # tokens per rank per micro-batch
STEPS = 2
RTOL, ATOL = 1e-3, 1e-5


def _lr_opt(params):
    return torch.optim.Adam(params, lr=1e-2, foreach=False)


def _train_and_compare(ctx, strategy, recompute=Recompute.NONE, micro_batches=1) -> None:
    net = make_net(0, recompute=recompute, device=ctx.device)
    ref = copy.deepcopy(net)
    model = fully_shard(
        net, unit_modules=(type(net.blocks[0]),), strategy=strategy, policy=MixedPrecisionPolicy()
    )
    opt = FSDPOptimizer(model, torch.optim.Adam, lr=1e-2, foreach=False)
    ref_opt = _lr_opt(ref.parameters())
    w, r = ctx.world_size, ctx.rank
    for step in range(STEPS):
        losses = torch.zeros(1, device=ctx.device)
        ref_losses = torch.zeros(1, device=ctx.device)
        for mb in range(micro_batches):
            x, y = make_batch(
                100 * step + mb, T * w, ctx.device
            )  # (w*T, 16), (w*T, 8): global batch
            mine = slice(r * T, (r + 1) * T)
            loss = mse(model(x[mine]), y[mine]) / micro_batches
            loss.backward()
            losses += loss.detach()
            ref_loss = mse(ref(x), y) / micro_batches
            ref_loss.backward()
            ref_losses += ref_loss.detach()
        dist.all_reduce(losses)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        _assert_close(f"loss step {step}", losses / w, ref_losses, exact=w == 1)
    state = model.full_state_dict()
    for name, p in ref.named_parameters():
        _assert_close(name, state[name], p.detach(), exact=w == 1)
    assert model.allocator.live_keys() == [], model.allocator.live_keys()


def _assert_close(what, got, want, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def case_no_shard(ctx):
    _train_and_compare(ctx, ShardingStrategy.NO_SHARD)


def case_optim(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM)


def case_optim_grads(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS)


def case_optim_grads_params(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS)


def case_zero3_recompute_unit(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, recompute=Recompute.UNIT)


def case_zero3_recompute_submodule(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, recompute=Recompute.SUBMODULE)


def case_zero3_grad_accumulation(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, micro_batches=2)


def case_zero1_grad_accumulation_recompute(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM, recompute=Recompute.UNIT, micro_batches=2)


_M = "tests.torch_side.cases_training"
ALL = (1, 2, 4)
CASES = {
    f"{_M}:case_no_shard": ALL,
    f"{_M}:case_optim": ALL,
    f"{_M}:case_optim_grads": ALL,
    f"{_M}:case_optim_grads_params": ALL,
    # Recompute and accumulation change no collective pattern that world 4 adds over world 2;
    # leaving them out of the 4-rank spawn keeps the module inside the CI time budget.
    f"{_M}:case_zero3_recompute_unit": (1, 2),
    f"{_M}:case_zero3_recompute_submodule": (1, 2),
    f"{_M}:case_zero3_grad_accumulation": (1, 2),
    f"{_M}:case_zero1_grad_accumulation_recompute": (2,),
}
