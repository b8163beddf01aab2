"""``torch_side.fsdp.fsdp_unit``: what a unit's hooks gather, reshard and reduce, and when.

In process, world size 1 (``single_rank_world``), ``ToyNet`` wrapped with one unit per block
under ZeRO-3 and no overlap (``Overlap.none()``: a unit's planes are gathered only when it runs,
so the states seen from inside the model are exactly what its own hooks did). Forward gathers
the running unit's rowwise plane and reshards after it; backward gathers its colwise plane,
reduces its gradients into the main grads and reshards; an activation-recompute forward inside
backward gathers the rowwise plane it reads besides. A unit refuses a backward against weights
an optimizer step replaced, and ``GradCheck.FINITE`` names a parameter whose gradient is not
finite.
"""

from __future__ import annotations

import pytest
import torch

from common.formats import Plane
from tests.torch_side.toy_models import Block, Recompute, make_batch, make_net, mse
from torch_side import Collective, FSDPOptimizer, GradCheck, Overlap, Phase, fully_shard
from torch_side.fsdp.fsdp_unit import TrainingState, check_finite
from torch_side.fsdp.param_group import PlaneState

pytestmark = pytest.mark.usefixtures("single_rank_world")

SH, UN = PlaneState.SHARDED, PlaneState.UNSHARDED


def _wrap(**kw):
    return fully_shard(make_net(0, **kw), unit_modules=(Block,), overlap=Overlap.none())


def _mx_states(model) -> dict[str, tuple[PlaneState, PlaneState]]:
    """{unit name: (rowwise, colwise) state of its MXFP8 group}."""
    out = {}
    for u in model.units:
        for g in u.groups:
            if Plane.COLWISE in g.planes:
                out[u.name] = (g.state[Plane.ROWWISE], g.state[Plane.COLWISE])
    return out


def _gathers(model, phase: Phase) -> list[str]:
    return [r.label for r in model.wire_log()
            if r.op is Collective.ALL_GATHER and r.phase is phase and "mxfp8" in r.label]


def test_forward_gathers_the_running_units_rowwise_plane_and_reshards_after_it():
    model = _wrap()
    net = model.module
    seen = {}
    def snapshot(i):
        def hook(module, args, output) -> None:
            seen[f"fwd{i}"] = _mx_states(model)
        return hook

    for i in (0, 1):
        net.blocks[i].mlp.register_forward_hook(snapshot(i))
    x, _ = make_batch(0, 32)
    assert _mx_states(model) == {"blocks.0": (SH, SH), "blocks.1": (SH, SH)}
    model(x)
    assert seen == {"fwd0": {"blocks.0": (UN, SH), "blocks.1": (SH, SH)},
                    "fwd1": {"blocks.0": (SH, SH), "blocks.1": (UN, SH)}}
    assert _mx_states(model) == {"blocks.0": (SH, SH), "blocks.1": (SH, SH)}
    assert [u.state for u in model.units] == [TrainingState.FORWARD] * 3
    assert _gathers(model, Phase.FORWARD) == [
        "blocks.0/mxfp8_e4m3/dp/rowwise", "blocks.1/mxfp8_e4m3/dp/rowwise"]
    model.zero_grad()  # an unfinished iteration is reset (the units go back to IDLE)
    assert [u.state for u in model.units] == [TrainingState.IDLE] * 3


def test_backward_gathers_colwise_reduces_each_unit_once_and_reshards():
    model = _wrap()
    net = model.module
    seen = {}

    def grad_hook(i):  # the gradient of block i's LayerNorm output: inside its backward
        def snapshot(grad) -> None:
            seen[f"bwd{i}"] = _mx_states(model)

        def hook(module, args, output) -> None:
            output.register_hook(snapshot)
        return hook

    for i in (0, 1):
        net.blocks[i].ln.register_forward_hook(grad_hook(i))
    x, y = make_batch(1, 32)
    mse(model(x), y).backward()
    assert seen == {"bwd1": {"blocks.0": (SH, SH), "blocks.1": (SH, UN)},
                    "bwd0": {"blocks.0": (SH, UN), "blocks.1": (SH, SH)}}
    assert [u.state for u in model.units] == [TrainingState.IDLE] * 3
    assert all(g.live_buckets() == [] for g in model.param_groups)
    assert _gathers(model, Phase.BACKWARD) == [
        "blocks.1/mxfp8_e4m3/dp/colwise", "blocks.0/mxfp8_e4m3/dp/colwise"]
    reduced = [r.label for r in model.wire_log() if r.op is Collective.REDUCE_SCATTER]
    assert sorted(reduced) == sorted(f"{g.label}/grad" for g in model.param_groups
                                     if g.key.requires_grad)  # every group once
    assert all(bool(g.any()) for g in model.full_grads().values())  # (test_fsdp_model: exact)


def test_a_recompute_forward_in_backward_gathers_the_plane_backward_did_not():
    """A checkpointed unit's backward gathers colwise (its output's gradient arrives first),
    then its recompute forward gathers rowwise too: each plane once, both live until reduced."""
    model, plain = _wrap(recompute=Recompute.UNIT), _wrap()
    x, y = make_batch(2, 32)
    mse(model(x), y).backward()
    mse(plain(x), y).backward()
    assert _gathers(model, Phase.BACKWARD) == [
        "blocks.1/mxfp8_e4m3/dp/colwise", "blocks.0/mxfp8_e4m3/dp/colwise"]
    assert _gathers(model, Phase.RECOMPUTE) == [
        "blocks.1/mxfp8_e4m3/dp/rowwise", "blocks.0/mxfp8_e4m3/dp/rowwise"]
    grads, want = model.full_grads(), plain.full_grads()  # recomputing changes no bit
    assert all(torch.equal(grads[n], g) for n, g in want.items())
    assert all(g.live_buckets() == [] for g in model.param_groups)


def test_a_backward_against_weights_an_optimizer_step_replaced_is_refused():
    model = _wrap()
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    x, y = make_batch(3, 32)
    loss = mse(model(x), y)
    opt.step()  # between this forward and its backward
    with pytest.raises(RuntimeError, match="the model weights changed between this forward and "
                                           r"its backward \(weights version 0 at forward, 1 now"):
        loss.backward()
    model.zero_grad()


def test_grad_check_finite_names_the_parameter_with_a_non_finite_gradient():
    check_finite("w", torch.ones(3))  # finite: nothing happens
    with pytest.raises(FloatingPointError, match="gradient of parameter 'w' has 2 non-finite"):
        check_finite("w", torch.tensor([1.0, float("nan"), float("inf")]))
    model = fully_shard(make_net(0), unit_modules=(Block,), grad_check=GradCheck.FINITE)
    x, y = make_batch(4, 32)
    y[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"rank 0: gradient of parameter 'head\.\w+'"):
        mse(model(x), y).backward()
    model.zero_grad()
    assert all(g.live_buckets() == [] for g in model.param_groups)
