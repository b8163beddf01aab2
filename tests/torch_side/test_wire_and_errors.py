"""What goes over the wire, bad input, the NaN check and expert-DP groups: cases ``case_*(ctx)``
run on every rank of an in-process world (``threaded_world.py``) by the tests, and on NCCL ranks
by ``benchmarks/bench_fsdp.py`` (``CASES``)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

import bridge
from bridge import MXFP8Linear, TorchMXFP8Tensor
from common import Plane
from tests.oracle import mxfp8_ref
from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import (
    Block,
    ExpertMLP,
    Recompute,
    make_batch,
    make_net,
    mse,
    seeded,
)
from torch_side import (
    Collective,
    FSDPOptimizer,
    GradCheck,
    MixedPrecisionPolicy,
    Phase,
    PlaneState,
    ShardingStrategy,
    UnalignedLinear,
    WeightFormat,
    fully_shard,
)

T = 32
ZERO3 = ShardingStrategy.OPTIM_GRADS_PARAMS


def _gathers(records, group):
    return [r for r in records if r.op is Collective.ALL_GATHER and r.label.startswith(group.label)]


def _check_mxfp8_gather(rec, group, phase: Phase, plane: str) -> None:
    assert rec.phase is phase and rec.label == f"{group.label}/{plane}", rec
    assert rec.dtype == torch.uint8, rec  # 1 byte per element ...
    assert rec.numel == group.layout.padded_numel, (rec, group.layout)
    assert rec.bytes_sent == group.layout.shard_numel, rec  # ... and nothing else (no scales)


def case_wire_forward_rowwise_backward_colwise(ctx):
    model = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ZERO3)
    mx = [g for g in model.param_groups if g.format is WeightFormat.MXFP8_E4M3]
    assert len(mx) == 2, [g.label for g in model.param_groups]
    x, y = make_batch(0, T, ctx.device)
    model.clear_wire_log()
    out = model(x)
    fwd = model.wire_log()
    assert not any("scale" in r.label for r in fwd), fwd
    for g in mx:
        (rec,) = _gathers(fwd, g)
        _check_mxfp8_gather(rec, g, Phase.FORWARD, "rowwise")
    model.clear_wire_log()
    mse(out, y).backward()
    bwd = model.wire_log()
    for g in mx:
        (rec,) = _gathers(bwd, g)
        _check_mxfp8_gather(rec, g, Phase.BACKWARD, "colwise")
        (red,) = [
            r for r in bwd if r.op is Collective.REDUCE_SCATTER and r.label.startswith(g.label)
        ]
        assert red.dtype == torch.float32 and red.numel == g.layout.padded_numel, red
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    model.clear_wire_log()
    opt.step()
    step = model.wire_log()
    # ONE amax all-reduce for the communicator's whole batch of MXFP8 groups (both planes of
    # every group packed; torch_side.fsdp.batched_refresh), nothing per group, no gathers
    assert not [r for g in mx for r in step if r.label.startswith(g.label)], step
    (amax,) = step
    assert amax.op is Collective.ALL_REDUCE_MAX and amax.dtype == torch.float32, amax
    assert amax.label == "*/mxfp8_e4m3/dp/amax" and amax.phase is Phase.OPTIMIZER, amax
    assert amax.numel == sum(2 * s.numel // 32 for g in mx for s in g.layout.slots), amax


def case_bridge_crossings_per_step(ctx):
    """Weights cross the bridge once per pooled bucket, not per layer or gather: a ZeRO-3 step
    of ToyNet (2 MXFP8 groups of 2 linears) crosses activations once per linear and direction,
    each group's scale buffer once per plane and the one pooled bucket once; the batched
    requantization crosses each group's main shard once, and the batch's packed amax and bytes
    once each way."""
    model = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ZERO3)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    x, y = make_batch(0, T, ctx.device)
    # every rank is done with its set-up before any counts: a rank's block counts its own
    # thread's crossings, and those of ranks with no block open (bridge.crossings)
    dist.barrier()
    with bridge.count_crossings() as c:
        mse(model(x), y).backward()
    linears, groups = 4, 2
    # to_jax: x and dy per linear; each group's scale buffer once per plane; the gathered data
    # once in all: the blocks' planes have one size, so one pooled bucket serves all four
    # gathers and its JAX share goes with it (BucketAllocator.shared)
    assert c.to_jax == 2 * linears + groups * 2 + 1, c
    assert c.to_torch == 2 * linears, c  # y per linear; dx and dW together per linear
    with bridge.count_crossings() as c:
        opt.step()
    assert (c.to_jax, c.to_torch) == (groups + 1, 2), c


def case_wire_recompute_gathers_both_planes_once(ctx):
    model = fully_shard(
        make_net(0, recompute=Recompute.UNIT, device=ctx.device),
        unit_modules=(Block,),
        strategy=ZERO3,
    )
    x, y = make_batch(0, T, ctx.device)
    out = model(x)
    model.clear_wire_log()
    mse(out, y).backward()
    bwd = model.wire_log()
    for g in (g for g in model.param_groups if g.format is WeightFormat.MXFP8_E4M3):
        got = sorted((r.phase.value, r.label.rsplit("/", 1)[1]) for r in _gathers(bwd, g))
        # colwise is gathered once (pre-backward); the recompute forward adds rowwise only.
        assert got == [("backward", "colwise"), ("recompute", "rowwise")], got


def case_wire_no_shard_forward_is_silent(ctx):
    model = fully_shard(
        make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ShardingStrategy.NO_SHARD
    )
    model.clear_wire_log()
    model(make_batch(0, T, ctx.device)[0])
    assert model.wire_log() == [], model.wire_log()


class _Unaligned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = MXFP8Linear(64, 64)
        self.odd = MXFP8Linear(64, 40)


def case_bad_input_errors(ctx):
    with seeded(0):  # (modules built: draws from the generator the ranks share)
        unaligned, unaligned_too = _Unaligned().to(ctx.device), _Unaligned().to(ctx.device)
        tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(ctx.device)
    try:
        fully_shard(unaligned, policy=MixedPrecisionPolicy())
    except ValueError as e:
        assert "odd.weight" in str(e) and "(40, 64)" in str(e) and "FALLBACK" in str(e), str(e)
    else:
        raise AssertionError("an unaligned MXFP8 weight was accepted under UnalignedLinear.RAISE")
    model = fully_shard(
        unaligned_too,
        policy=MixedPrecisionPolicy(unaligned_linear=UnalignedLinear.FALLBACK),
    )
    formats = {s.name: g.format for g in model.param_groups for s in g.layout.slots}
    assert formats["ok.weight"] is WeightFormat.MXFP8_E4M3, formats
    assert formats["odd.weight"] is WeightFormat.FP32, formats
    try:
        fully_shard(make_net(0, device=ctx.device), strategy="zero4")
    except ValueError as e:
        assert "unknown sharding strategy 'zero4'" in str(e), str(e)
    else:
        raise AssertionError("strategy 'zero4' was accepted")
    tied[1].weight = tied[0].weight
    try:
        fully_shard(tied)
    except ValueError as e:
        assert "'1.weight' is the same tensor as '0.weight'" in str(e), str(e)
    else:
        raise AssertionError("tied parameters were accepted")
    try:
        fully_shard(
            make_net(0, device=ctx.device),
            policy=MixedPrecisionPolicy(linear_weight_format=WeightFormat.NVFP4),
        )
    except ValueError as e:
        assert "'nvfp4'" in str(e) and "no FSDP implementation" in str(e), str(e)
    else:
        raise AssertionError("a format FSDP does not implement was accepted")
    only_rank0 = dist.new_group([0])  # collective: every rank creates it
    if ctx.rank == 1:
        try:
            fully_shard(make_net(0, device=ctx.device), group=only_rank0)
        except ValueError as e:
            assert "not a member" in str(e), str(e)
        else:
            raise AssertionError("a group without this rank was accepted")


def case_nan_grad_check_names_param_and_rank(ctx):
    model = fully_shard(
        make_net(0, device=ctx.device), unit_modules=(Block,), grad_check=GradCheck.FINITE
    )
    x, y = make_batch(0, T, ctx.device)
    y[0, 0] = float("nan")  # every rank: a NaN loss, so every rank raises (none hangs)
    try:
        mse(model(x), y).backward()
    except FloatingPointError as e:
        assert f"rank {ctx.rank}:" in str(e) and "'head." in str(e), str(e)
    else:
        raise AssertionError("a NaN gradient passed GradCheck.FINITE")


def case_expert_dp_groups(ctx):
    """World 4, expert-DP groups {0,1} and {2,3}, each holding a different expert."""
    egroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = ctx.rank // 2
    net = make_net(0, expert_block=True, device=ctx.device)
    with seeded(10 + mine):
        net.blocks[1].mlp = ExpertMLP().to(ctx.device)
    ref = copy.deepcopy(net)
    model = fully_shard(
        net,
        unit_modules=(Block,),
        strategy=ZERO3,
        expert_modules=(ExpertMLP,),
        expert_group=egroups[mine],
    )
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.5)
    x, y = make_batch(7, 4 * T, ctx.device)
    rows = slice(ctx.rank * T, (ctx.rank + 1) * T)
    model.clear_wire_log()
    mse(model(x[rows]), y[rows]).backward()
    opt.step()
    amax = [r.label for r in model.wire_log() if r.op is Collective.ALL_REDUCE_MAX]
    assert any(lbl.endswith("/expert_dp/amax") for lbl in amax), amax
    # Reference: the gradient of the mean loss over all 4 ranks. Dense grads sum over the world,
    # expert grads over the expert-DP group that shares the expert; both are divided by DP = 4.
    mse(ref(x[rows]), y[rows]).backward()
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        assert torch.isfinite(p.grad).all(), name
        expert = name.startswith("blocks.1.mlp.")
        dist.all_reduce(p.grad, group=egroups[mine] if expert else None)
        p.data -= 0.5 * p.grad / 4
    state = model.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name], p.detach(), rtol=1e-3, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def case_plane_states_are_explicit_and_checked(ctx):
    """ZeRO-3 planes go sharded -> unsharded -> sharded; reading a sharded plane is an internal
    error that names the rank, the group and the plane."""
    model = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ZERO3)
    g = next(g for g in model.param_groups if g.format is WeightFormat.MXFP8_E4M3)
    assert g.state == {Plane.ROWWISE: PlaneState.SHARDED, Plane.COLWISE: PlaneState.SHARDED}
    try:
        g.full_buffer(Plane.COLWISE)
    except AssertionError as e:
        want = f"rank {ctx.rank}: group {g.label!r} plane colwise is sharded, expected unsharded"
        assert want in str(e), str(e)
    else:
        raise AssertionError("a sharded plane was read")
    g.unshard([Plane.COLWISE], Phase.BACKWARD)
    assert g.state[Plane.COLWISE] is PlaneState.UNSHARDED
    assert g.state[Plane.ROWWISE] is PlaneState.SHARDED
    g.reshard()
    assert set(g.state.values()) == {PlaneState.SHARDED}
    replicated = fully_shard(
        make_net(0, device=ctx.device), strategy=ShardingStrategy.NO_SHARD
    ).param_groups[0]
    assert set(replicated.state.values()) == {PlaneState.REPLICATED}


def case_gathered_weights_and_state_dict(ctx):
    """gathered_weights() gives full planes equal to quantizing bf16(full main) on one rank, and
    load_full_state_dict() round-trips through the shards and requantizes."""
    model = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ZERO3)
    state = model.full_state_dict()
    new = {k: v * 1.5 + 0.01 for k, v in state.items()}
    model.load_full_state_dict(new)
    back = model.full_state_dict()
    assert all(torch.equal(back[k], new[k]) for k in new), "state dict did not round-trip"
    with model.gathered_weights() as w:
        for name, value in w.items():
            if isinstance(value, TorchMXFP8Tensor):
                ref = mxfp8_ref.quantize(new[name].to(torch.bfloat16).float().cpu().numpy())
                for field in ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale"):
                    got = getattr(value, field).cpu().numpy()
                    assert (got == ref[field]).all(), f"{name}.{field}"
            else:
                assert torch.equal(value, new[name].to(value.dtype)), name
    assert model.allocator.live_keys() == [], model.allocator.live_keys()


def case_bucket_outlives_reshard_while_jax_reads(ctx):
    """Reshard drops FSDP's reference to a bucket; a JAX array aliasing it (zero-copy, through the
    bridge) keeps the bytes alive and unchanged while new buckets are allocated and scribbled."""
    model = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), strategy=ZERO3)
    g = next(g for g in model.param_groups if g.format is WeightFormat.MXFP8_E4M3)
    g.unshard([Plane.ROWWISE], Phase.FORWARD)
    data, _ = g.plane_views(0, Plane.ROWWISE)
    expect = data.cpu().clone()
    alias = bridge.to_jax(data)
    assert alias.unsafe_buffer_pointer() == data.data_ptr()  # zero-copy
    del data
    g.reshard()
    assert model.allocator.live_keys() == [], model.allocator.live_keys()
    junk = [  # noqa: F841 -- held so the allocator cannot hand the same memory back out
        torch.full((g.layout.padded_numel,), 0xAB, dtype=torch.uint8, device=ctx.device)
        for _ in range(4)
    ]
    assert (np.asarray(alias) == expect.numpy()).all(), "bucket bytes changed under JAX"


def _planes_and_scales(model) -> dict[str, bytes]:
    return {f"{g.label}/{k}/{p.value}": t.cpu().numpy().tobytes()
            for g in model.param_groups
            for k, d in (("model", g.model), ("scale", g.scale_buffers)) for p, t in d.items()}


def _clear(model) -> None:
    for g in model.param_groups:
        for t in (*g.model.values(), *g.scale_buffers.values()):
            t.zero_()


def case_batched_refresh_matches_per_group(ctx):
    """Every strategy: the batched refresh of 3 MXFP8 groups (FSDPModel.refresh_model_weights)
    writes the same model-buffer and scale bytes as each group's own refresh, with one amax
    all-reduce for the batch (when main is sharded) instead of one per group."""
    for strategy in ShardingStrategy:
        model = fully_shard(make_net(0, device=ctx.device, n_blocks=3), unit_modules=(Block,),
                            strategy=strategy)
        mx = [g for g in model.param_groups if g.format is WeightFormat.MXFP8_E4M3]
        assert len(mx) == 3, [g.label for g in model.param_groups]
        gen = torch.Generator().manual_seed(1 + ctx.rank)
        for g in model.param_groups:  # new main values, different per rank (unlike training)
            noise = torch.randn(g.main.shape, generator=gen) * 4.0 ** torch.randint(
                -6, 6, g.main.shape, generator=gen)
            g.main.copy_(noise.to(ctx.device))
        _clear(model)
        model.clear_wire_log()
        model.refresh_model_weights()
        batched, log = _planes_and_scales(model), model.wire_log()
        amax = [r for r in log if r.op is Collective.ALL_REDUCE_MAX]
        sharded = mx[0].facts.main_weights_sharded
        assert [(r.label, r.numel) for r in amax] == ([(
            "*/mxfp8_e4m3/dp/amax", sum(2 * s.numel // 32 for g in mx for s in g.layout.slots))]
            if sharded else []), (strategy, log)
        _clear(model)
        for g in model.param_groups:
            g.refresh(Phase.OPTIMIZER)  # the per-group path
        alone = _planes_and_scales(model)
        assert alone.keys() == batched.keys()
        differ = [k for k in alone if alone[k] != batched[k]]
        assert not differ, (strategy, differ)
        assert any(any(v) for k, v in alone.items() if "scale" in k), "nothing was written"


def test_forward_gathers_rowwise_bytes_backward_colwise_only():
    """MXFP8 all-gather: 1 byte per element, no scales; forward rowwise, backward colwise; the
    optimizer step sends ONE packed amax all-reduce for all the MXFP8 groups of the communicator
    (the batched refresh), none per group."""
    run_world(2, case_wire_forward_rowwise_backward_colwise)


def test_weights_cross_the_bridge_once_per_bucket_not_per_layer():
    run_world(2, case_bridge_crossings_per_step)


def test_batched_refresh_writes_the_bytes_of_the_per_group_refresh():
    """Every strategy, one rank: the batched MXFP8 refresh of 3 groups equals each group's own
    refresh byte for byte (model buffers and scales), with one amax all-reduce for the batch."""
    run_world(1, case_batched_refresh_matches_per_group)


def test_batched_refresh_writes_the_bytes_of_the_per_group_refresh_two_ranks():
    """The same with main weights sharded over two ranks (each rank its own main values)."""
    run_world(2, case_batched_refresh_matches_per_group)


def test_recompute_forward_gathers_both_planes_once():
    run_world(2, case_wire_recompute_gathers_both_planes_once)


def test_no_shard_forward_sends_nothing():
    run_world(2, case_wire_no_shard_forward_is_silent)


def test_bad_input_gives_clear_errors():
    """Unaligned MXFP8 weight (raise or fallback by policy), a format FSDP does not implement,
    unknown strategy, tied weights, a process group without this rank."""
    run_world(2, case_bad_input_errors)


def test_nan_gradient_check_names_parameter_and_rank():
    run_world(2, case_nan_grad_check_names_param_and_rank)


@pytest.mark.slow
def test_expert_parameters_use_their_own_dp_group():
    run_world(4, case_expert_dp_groups)


def test_plane_states_are_explicit_and_checked():
    run_world(2, case_plane_states_are_explicit_and_checked)


def test_gathered_weights_and_full_state_dict_round_trip():
    run_world(2, case_gathered_weights_and_state_dict)


def test_resharded_bucket_stays_alive_while_jax_reads_it():
    run_world(2, case_bucket_outlives_reshard_while_jax_reads)


# The cases bench_fsdp.py's parity pass runs on NCCL, in spawned ranks (one GPU each); the
# tests above run them in in-process worlds.
_M = "tests.torch_side.test_wire_and_errors"
CASES = {
    f"{_M}:case_wire_forward_rowwise_backward_colwise": (2,),
    f"{_M}:case_wire_recompute_gathers_both_planes_once": (2,),
    f"{_M}:case_bridge_crossings_per_step": (2,),
    f"{_M}:case_wire_no_shard_forward_is_silent": (2,),
    f"{_M}:case_bad_input_errors": (2,),
    f"{_M}:case_nan_grad_check_names_param_and_rank": (2,),
    f"{_M}:case_expert_dp_groups": (4,),
    f"{_M}:case_plane_states_are_explicit_and_checked": (2,),
    f"{_M}:case_gathered_weights_and_state_dict": (2,),
    f"{_M}:case_bucket_outlives_reshard_while_jax_reads": (2,),
    f"{_M}:case_batched_refresh_matches_per_group": (1, 2),
}
