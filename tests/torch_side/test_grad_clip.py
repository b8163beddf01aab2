"""``clip_grad_norm_`` on sharded gradients equals ``torch.nn.utils.clip_grad_norm_`` on the
unsharded model's full gradients, for every strategy at world sizes 1 and 2 (ZeRO-3 also at 4),
and leaves a non-finite norm's gradients untouched (in-process worlds, ``threaded_world.py``;
marked slow).

The reference is the unsharded model trained by plain Torch on the whole global batch (as in
``test_grad_norm``), clipped by ``torch.nn.utils.clip_grad_norm_`` on its full gradients. Every
strategy must return the same total norm (float64 here, fp32 in torch: RTOL) and leave the same
clipped gradients (``FSDPModel.full_grads()``): no_shard / ZeRO-1 replicated gradients counted
once, ZeRO-2/3 shards summed over ranks, padding adding nothing. A norm under ``max_norm``
leaves the gradients bit for bit; a non-finite norm leaves them untouched (or raises with
``error_if_nonfinite``) on every rank alike.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import make_batch, make_net, mse, seeded
from torch_side import FSDPOptimizer, ShardingStrategy, clip_grad_norm_, fully_shard

T = 32  # tokens per rank
RTOL = 1e-5  # fp32 gradient sums in another order (test_grad_norm: observed <= 2e-7)
ATOL = 1e-7  # elements near zero (world 4: 1.9e-9 off on a 4.7e-6 element; gradients ~1e-2)


def _wrapped_and_reference(ctx, strategy):
    w, r = ctx.world_size, ctx.rank
    net = make_net(0, device=ctx.device)
    ref = copy.deepcopy(net)
    model = fully_shard(net, unit_modules=(type(net.blocks[0]),), strategy=strategy)
    x, y = make_batch(70, T * w, ctx.device)
    mse(model(x[r * T:(r + 1) * T]), y[r * T:(r + 1) * T]).backward()
    mse(ref(x), y).backward()
    return model, ref


def _same_on_every_rank(ctx, value: float) -> None:
    every = [None] * ctx.world_size
    dist.all_gather_object(every, value)
    assert len(set(every)) == 1 or all(math.isnan(v) for v in every), every


def _clip_case(ctx, strategy: ShardingStrategy) -> None:
    model, ref = _wrapped_and_reference(ctx, strategy)
    want_norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ref.parameters()
                              if p.grad is not None))
    max_norm = want_norm / 3  # clips: every gradient scaled by ~1/3
    before = model.full_grads()
    got = clip_grad_norm_(FSDPOptimizer(model, torch.optim.SGD, lr=0.1), max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    assert got.dtype == torch.float64 and got.dim() == 0, got
    assert math.isclose(float(got), want_norm, rel_tol=RTOL), (float(got), want_norm)
    assert math.isclose(float(got), float(ref_norm), rel_tol=RTOL), (float(got), ref_norm)
    _same_on_every_rank(ctx, float(got))
    clipped = model.full_grads()
    coef = max_norm / (float(got) + 1e-6)  # torch's factor, from the norm returned
    for name, p in ref.named_parameters():
        if p.grad is not None:
            assert torch.equal(clipped[name], before[name] * coef), name  # scaled, exactly
            torch.testing.assert_close(clipped[name], p.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{strategy.value} {n}: {m}")
    # below max_norm: nothing changes, bit for bit, and the norm is the clipped one
    again = clip_grad_norm_(model, 10 * max_norm)
    assert math.isclose(float(again), max_norm, rel_tol=1e-5), (float(again), max_norm)
    after = model.full_grads()
    assert all(torch.equal(after[k], clipped[k]) for k in clipped)


def _nonfinite_case(ctx, strategy: ShardingStrategy) -> None:
    model, _ = _wrapped_and_reference(ctx, strategy)
    groups = [g for g in model.param_groups if g.main_grad is not None]
    replicated = strategy is ShardingStrategy.NO_SHARD  # every replica alike (all-reduced)
    if replicated or ctx.rank == ctx.world_size - 1:  # one rank's shard goes bad
        groups[-1].main_grad[0] = math.inf
    before = [g.main_grad.clone() for g in groups]
    norm = clip_grad_norm_(model, 1e-3)
    assert not math.isfinite(float(norm)), float(norm)  # every rank sees it (all-reduced)
    for g, b in zip(groups, before, strict=True):  # untouched, not scaled to NaN
        assert torch.equal(g.main_grad.nan_to_num(posinf=1.0), b.nan_to_num(posinf=1.0))
    with pytest.raises(RuntimeError, match="global gradient norm is (inf|nan)"):
        clip_grad_norm_(model, 1e-3, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_grad_norm_(model, 0)
    with pytest.raises(TypeError, match="expected the FSDPModel"):
        with seeded(0):  # (a module built: a draw from the generator the ranks share)
            linear = torch.nn.Linear(2, 2)
        clip_grad_norm_(linear, 1.0)


pytestmark = pytest.mark.slow

STRATEGIES = list(ShardingStrategy)


@pytest.mark.parametrize(
    ("strategy", "world_size"),
    [(s, w) for s in STRATEGIES for w in (1, 2)] + [(ShardingStrategy.OPTIM_GRADS_PARAMS, 4)],
    ids=lambda v: f"w{v}" if isinstance(v, int) else v.value,
)
def test_clip_matches_torch_on_the_unsharded_model(strategy, world_size):
    run_world(world_size, _clip_case, strategy)


@pytest.mark.parametrize(
    "strategy", [ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM_GRADS_PARAMS],
    ids=lambda s: s.value,
)
def test_a_nonfinite_norm_leaves_the_gradients_alone(strategy):
    run_world(2, _nonfinite_case, strategy)
