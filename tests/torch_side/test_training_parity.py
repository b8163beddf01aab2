"""Sharded training matches a replicated single-process reference: cases ``case_*(ctx)`` run on
every rank of an in-process world (``threaded_world.py``) by the tests, and on NCCL ranks by
``benchmarks/bench_fsdp.py`` (``CASES``).

Every strategy at world sizes 1 and 2 (ZeRO-3 also at 4, slow) trains ``ToyNet`` (MXFP8 linears
+ fp32 layers + a frozen parameter) for 2 Adam steps (the second with forward prefetch); losses
and main weights agree exactly at world size 1 and to a stated fp32 tolerance otherwise. Activation
recompute (whole unit, submodule inside a unit) and gradient accumulation over micro-batches are
covered under ZeRO-3 at world sizes 1 and 2, and once under ZeRO-1. Both weight gather modes
(MXFP8 planes, bf16) at world sizes 1 and 2 for every strategy (4: ZeRO-3), all slow: wire bytes
per element, the reference, and bit-identity between the modes.

The reference is the same ``ToyNet`` trained by plain Torch on the whole global batch: its
``MXFP8Linear`` layers quantize ``bf16(weight)`` on the fly, which is exactly what the FSDP model
reads from its planes (quantized from bf16 of the fp32 main weights). Rank r's micro-batch is rows
``[r * T, (r + 1) * T)`` of the global batch (T = 32 tokens, whole MXFP8 token blocks), its loss is
the mean over its rows, and FSDP averages gradients over ranks, so both sides follow the same
gradient. World size 1 runs the same arithmetic in the same order: losses and main weights are
compared for exact equality. With more ranks the gradient sums run in another order, so they
agree to ``RTOL``/``ATOL`` (fp32 reduction order, amplified a little by bf16/MXFP8 rounding of
weights that land near a rounding boundary). ``Precision.BF16`` runs the model in bf16 (MXFP8 +
BF16 formats, bf16 gradients and gradient communication) against a reference that keeps fp32
master weights and a bf16 compute copy; it is exact at world size 1 too.

The gather-mode cases (``_gather_modes``) train the same net twice, with MXFP8 and with bf16 weight
all-gathers (``GatherMode``), beside the reference: each all-gather of an MXFP8 group carries 1 byte
(uint8 planes) or 2 bytes (bf16) per element, the bf16 run matches the reference like the MXFP8
one (exactly at world size 1), and the two runs' losses, reduced gradients and weights are bit
for bit the same at every world size (every rank quantizes the same full bf16 weight into the
bytes the distributed quantization writes, and dW stays fp32 in both).
"""

from __future__ import annotations

import copy
import dataclasses
import enum

import jax
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import Recompute, make_batch, make_net, mse
from torch_side import (
    Collective,
    FSDPOptimizer,
    GatherMode,
    MixedPrecisionPolicy,
    ShardingStrategy,
    ShardLayout,
    WeightFormat,
    fully_shard,
)

T = 32  # tokens per rank per micro-batch
STEPS = 2
RTOL, ATOL = 1e-4, 1e-6  # observed on CPU (gloo, world 2 and 4): <= 7.5e-8 abs, exact losses


# bf16 activations and gradient sums in another order; observed on CPU: <= 6.5e-5 abs.
BF16_RTOL, BF16_ATOL = 2e-2, 5e-4


class Precision(enum.Enum):
    """FP32: fp32 model with MXFP8 linears. BF16: bf16 model weights, activations, gradients and
    gradient communication (mixed formats MXFP8 + BF16), fp32 main weights on both sides."""

    FP32 = "fp32"
    BF16 = "bf16"


POLICIES = {
    Precision.FP32: MixedPrecisionPolicy(),
    Precision.BF16: MixedPrecisionPolicy(
        other_format=WeightFormat.BF16,
        main_grad_dtype=torch.bfloat16,
        grad_comm_dtype=torch.bfloat16,
    ),
}


# Adam turns a near-zero gradient into a +-lr step, so one bf16 rounding difference in a summed
# gradient can move a weight by 2 lr; SGD keeps weight differences proportional to gradient
# differences, which is what the bf16 tolerance can state.
OPTIMIZERS = {
    Precision.FP32: (torch.optim.Adam, {"lr": 1e-2, "foreach": False}),
    Precision.BF16: (torch.optim.SGD, {"lr": 0.1, "foreach": False}),
}


class _Reference:
    """Replicated single-process training: fp32 master parameters, a compute copy in the model's
    dtype (bf16(master) for BF16), gradients cast to fp32 for the optimizer."""

    def __init__(self, net, precision: Precision):
        self.master = copy.deepcopy(net).float()
        self.compute = copy.deepcopy(net)
        self.precision = precision
        cls, kwargs = OPTIMIZERS[precision]
        self.opt = cls(self.master.parameters(), **kwargs)

    def begin_step(self) -> None:
        with torch.no_grad():
            for c, m in zip(self.compute.parameters(), self.master.parameters(), strict=True):
                c.copy_(m)

    def end_step(self) -> None:
        for c, m in zip(self.compute.parameters(), self.master.parameters(), strict=True):
            m.grad = None if c.grad is None else c.grad.float()
            c.grad = None
        self.opt.step()
        self.opt.zero_grad()


def _train_and_compare(
    ctx, strategy, recompute=Recompute.NONE, micro_batches=1, precision=Precision.FP32,
    tokens: int = T, precompiled: bool = False, gather: GatherMode = GatherMode.MXFP8,
    replicas: int = 1, shard_layout: ShardLayout = ShardLayout.LCM,
):
    """precompiled: ``torch_side.precompile`` runs first (a dry micro-batch); the comparison with
    the reference then shows it changed nothing, and the steps after it compile nothing.
    replicas > 1: HSDP over a (replicas, world / replicas) mesh (tests/torch_side/fsdp/
    test_hsdp.py). shard_layout: block-atomic shards (test_block_atomic.py). Returns the model
    (its wire log holds the steps' collectives)."""
    dtype = torch.bfloat16 if precision is Precision.BF16 else torch.float32
    net = make_net(0, recompute=recompute, device=ctx.device).to(dtype)
    ref = _Reference(net, precision)
    policy = dataclasses.replace(POLICIES[precision], gather=gather, shard_layout=shard_layout)
    mesh = None if replicas == 1 else init_device_mesh(
        "cpu", (replicas, ctx.world_size // replicas), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(net, unit_modules=(type(net.blocks[0]),), strategy=strategy,
                        policy=policy, mesh=mesh)
    cls, kwargs = OPTIMIZERS[precision]
    opt = FSDPOptimizer(model, cls, **kwargs)
    w, r = ctx.world_size, ctx.rank
    T = tokens  # noqa: N806 -- tokens per rank per micro-batch, as the module constant
    exact = w == 1
    if precompiled:
        _precompile(model, ctx, T, dtype)
        _settle_counts(ctx)
    compiled = 0  # programs compiled by the FSDP model's steps (not the reference's)
    for step in range(STEPS):
        losses = torch.zeros(1, device=ctx.device)
        ref_losses = torch.zeros(1, device=ctx.device)
        ref.begin_step()
        for mb in range(micro_batches):
            x, y = make_batch(100 * step + mb, T * w, ctx.device)  # global batch (w*T, 16|8)
            x = x.to(dtype)
            mine = slice(r * T, (r + 1) * T)  # this rank's micro-batch
            before = _compiles()
            loss = mse(model(x[mine]).float(), y[mine]) / micro_batches
            loss.backward()
            compiled += _compiles() - before
            if precompiled:
                _settle_counts(ctx)  # the reference compiles its programs at step 0
            losses += loss.detach()
            ref_loss = mse(ref.compute(x).float(), y) / micro_batches
            ref_loss.backward()
            ref_losses += ref_loss.detach()
        dist.all_reduce(losses)
        before = _compiles()
        opt.step()
        opt.zero_grad()
        compiled += _compiles() - before
        ref.end_step()
        _assert_close(f"loss step {step}", losses / w, ref_losses, exact, precision)
    if precompiled:
        assert compiled == 0, f"{compiled} programs compiled in the steps after precompile"
        before = _compiles()
        with torch.no_grad():  # an evaluation forward: precompiled too (no_grad_forward)
            model(make_batch(7, T, ctx.device)[0].to(dtype))
        assert _compiles() == before, "the no-grad forward compiled after precompile"
        _settle_counts(ctx)
    state = model.full_state_dict()
    for name, p in ref.master.named_parameters():
        _assert_close(name, state[name], p.detach(), exact, precision)
    assert model.allocator.live_keys() == [], model.allocator.live_keys()
    return model


def _compiles() -> int:
    """XLA compilations so far in this rank's process (tests.compiles, loaded on first use); in
    an in-process world, those of every rank (``_settle_counts``)."""
    from tests.compiles import COMPILES

    return COMPILES.count


def _settle_counts(ctx) -> None:
    """The ranks of an in-process world share one compilation counter (and JAX's caches): a
    barrier after each counted stretch of the precompiled runs, so that no rank's compiles (its
    precompile pool finishing late, the reference's first forward) land in the stretch another
    rank counts. (A spawned rank counts its own process's compiles; there it only waits.)"""
    if ctx.world_size > 1:
        dist.barrier()


def _precompile(model, ctx, tokens: int, dtype) -> None:
    from torch_side import precompile

    before = _compiles()
    x, y = make_batch(999, tokens, ctx.device)  # a dry batch of the training shapes
    log = model.wire_log()
    report = precompile(model, lambda: mse(model(x.to(dtype)).float(), y), no_grad_forward=True)
    # ToyNet: fc1 (96, 64) and fc2 (64, 96), each with a no-grad forward, a forward and a backward
    # program, shared by both blocks; new to this process (no other case uses these token counts,
    # and the tests clear JAX's caches before an in-process world runs this). In an in-process
    # world the count is every rank's: each program compiled by some rank after this rank's
    # `before` (ZeRO-3's first gather, which every rank joins after reading it, comes before any
    # linear) and before this rank's wait returned (its own compile, or the one its cache hit).
    assert report.programs == 6 and _compiles() - before >= 6, (report, _compiles())
    assert model.wire_log() == log, "precompile left records in the wire log"


def _assert_close(what, got, want, exact: bool, precision: Precision) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item()}"
        return
    rtol, atol = (BF16_RTOL, BF16_ATOL) if precision is Precision.BF16 else (RTOL, ATOL)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _train_gathered(ctx, strategy, gather: GatherMode, steps: int = STEPS):
    """(losses, full grads per step, full main weights, wire log of every step) of ToyNet with
    MXFP8 linears trained under ``gather``."""
    net = make_net(0, device=ctx.device)
    model = fully_shard(net, unit_modules=(type(net.blocks[0]),), strategy=strategy,
                        policy=MixedPrecisionPolicy(gather=gather))
    cls, kwargs = OPTIMIZERS[Precision.FP32]
    opt = FSDPOptimizer(model, cls, **kwargs)
    w, r = ctx.world_size, ctx.rank
    losses, grads, wire = [], [], []
    for step in range(steps):
        x, y = make_batch(100 * step, T * w, ctx.device)
        model.clear_wire_log()
        loss = mse(model(x[r * T:(r + 1) * T]), y[r * T:(r + 1) * T])
        loss.backward()
        grads.append(model.full_grads())
        opt.step()
        opt.zero_grad()
        wire.append(model.wire_log())
        losses.append(float(loss.detach()))
    mx = [g for g in model.param_groups if g.format is WeightFormat.MXFP8_E4M3]
    assert model.allocator.live_keys() == [], model.allocator.live_keys()
    return losses, grads, model.full_state_dict(), wire, mx


def _check_gather_bytes(wire, groups, gather: GatherMode) -> None:
    """Every all-gather of an MXFP8 group (forward, backward or after the optimizer step) moves
    1 byte (MXFP8 planes) or 2 bytes (bf16) per element; no scales ever travel; a bf16
    gather needs no amax all-reduce (each rank quantizes whole weights); dW is reduced in fp32."""
    want = {GatherMode.MXFP8: torch.uint8, GatherMode.BF16: torch.bfloat16}[gather]
    seen = 0
    for rec in (r for step in wire for r in step):
        assert "scale" not in rec.label, rec
        g = next((g for g in groups if rec.label.startswith(g.label + "/")), None)
        if g is None or "main" in rec.label:  # another group, or full_grads()
            continue
        if gather is GatherMode.BF16:
            assert rec.op is not Collective.ALL_REDUCE_MAX, rec
        if rec.label.endswith("/grad"):
            assert rec.dtype == torch.float32, rec
        elif rec.op is Collective.ALL_GATHER:
            assert rec.dtype == want and rec.numel == g.layout.padded_numel, rec
            assert rec.bytes_sent == want.itemsize * g.layout.shard_numel, rec
            seen += 1
    # no_shard gathers no weights; every other strategy does (world 1 logs them too)
    assert seen or not groups[0].facts.main_weights_sharded, "no MXFP8 all-gather was logged"


def _gather_modes(ctx, strategy) -> None:
    mx = _train_gathered(ctx, strategy, GatherMode.MXFP8)
    bf = _train_gathered(ctx, strategy, GatherMode.BF16)
    _check_gather_bytes(mx[3], mx[4], GatherMode.MXFP8)
    _check_gather_bytes(bf[3], bf[4], GatherMode.BF16)
    assert mx[0] == bf[0], (mx[0], bf[0])  # losses, bit for bit
    for step, (a, b) in enumerate(zip(mx[1], bf[1], strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step} grad {name}"
    for name in mx[2]:
        assert torch.equal(mx[2][name], bf[2][name]), f"weight {name}"
    _train_and_compare(ctx, strategy, gather=GatherMode.BF16)  # and the replicated reference


def case_gather_modes_no_shard(ctx):
    _gather_modes(ctx, ShardingStrategy.NO_SHARD)


def case_gather_modes_optim(ctx):
    _gather_modes(ctx, ShardingStrategy.OPTIM)


def case_gather_modes_optim_grads(ctx):
    _gather_modes(ctx, ShardingStrategy.OPTIM_GRADS)


def case_gather_modes_optim_grads_params(ctx):
    _gather_modes(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS)


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


def case_zero3_bf16_mixed_formats(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, precision=Precision.BF16)


def case_zero2_bf16_mixed_formats(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS, precision=Precision.BF16)


def case_zero3_precompiled(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, tokens=64, precompiled=True)


def case_zero2_recompute_precompiled(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS, recompute=Recompute.UNIT, tokens=96,
                       precompiled=True)


def case_zero1_grad_accumulation_recompute(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM, recompute=Recompute.UNIT, micro_batches=2)


# World 4 only for ZeRO-3: the other strategies' collectives are the same at 2 ranks.
@pytest.mark.parametrize(
    ("case", "world_size"),
    [(c, w) for c in (case_no_shard, case_optim, case_optim_grads, case_optim_grads_params)
     for w in (1, 2)]
    + [pytest.param(case_optim_grads_params, 4, marks=pytest.mark.slow)],
    ids=lambda v: f"w{v}" if isinstance(v, int) else v.__name__.removeprefix("case_"),
)
def test_strategy_matches_reference(case, world_size):
    run_world(world_size, case)


# Recompute and accumulation change no collective pattern that world 4 adds over world 2.
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "case",
    [case_zero3_recompute_unit, case_zero3_recompute_submodule, case_zero3_grad_accumulation],
    ids=lambda f: f.__name__.removeprefix("case_"),
)
def test_recompute_and_accumulation_match_reference(case, world_size):
    run_world(world_size, case)


@pytest.mark.slow
def test_zero1_accumulation_with_recompute():
    run_world(2, case_zero1_grad_accumulation_recompute)


@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        (case_zero3_bf16_mixed_formats, 1),
        pytest.param(case_zero3_bf16_mixed_formats, 2, marks=pytest.mark.slow),
        pytest.param(case_zero2_bf16_mixed_formats, 2, marks=pytest.mark.slow),
    ],
    ids=["zero3-w1", "zero3-w2", "zero2-w2"],
)
def test_bf16_mixed_formats_match_reference(case, world_size):
    """MXFP8 linears + bf16 everything else (weights, activations, grads, grad communication)."""
    run_world(world_size, case)


@pytest.mark.parametrize(
    ("case", "world_size"),
    [(case_zero3_precompiled, 1),
     pytest.param(case_zero3_precompiled, 2, marks=pytest.mark.slow),
     (case_zero2_recompute_precompiled, 1)],
    ids=["zero3-w1", "zero3-w2", "zero2-recompute-w1"],
)
def test_precompiled_training_matches_reference(case, world_size):
    """torch_side.precompile before training: the same losses and weights as the reference
    (exactly at world size 1), nothing compiled in the steps after it, wire log untouched."""
    # the programs precompile must compile are new to the process, as they were to a freshly
    # spawned rank: an earlier test (or world size) of this process compiled them already
    jax.clear_caches()
    run_world(world_size, case)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "world_size"),
    [(case_gather_modes_no_shard, 1), (case_gather_modes_no_shard, 2),
     (case_gather_modes_optim, 1), (case_gather_modes_optim, 2),
     (case_gather_modes_optim_grads, 1), (case_gather_modes_optim_grads, 2),
     (case_gather_modes_optim_grads_params, 1), (case_gather_modes_optim_grads_params, 2),
     (case_gather_modes_optim_grads_params, 4)],
    ids=lambda v: v if isinstance(v, int) else v.__name__.removeprefix("case_gather_modes_"),
)
def test_bf16_and_mxfp8_weight_gathers_train_bit_identically(case, world_size):
    """GatherMode.BF16 moves 2 bytes per element where MXFP8 moves 1, matches the replicated
    reference like it, and gives the same losses, gradients and weights bit for bit."""
    run_world(world_size, case)


# The cases bench_fsdp.py's parity pass runs on NCCL, in spawned ranks (one GPU each); the
# tests above run them (and the slow ones) in in-process worlds.
_M = "tests.torch_side.test_training_parity"
CASES = {
    f"{_M}:case_no_shard": (1, 2),
    f"{_M}:case_optim": (1, 2),
    f"{_M}:case_optim_grads": (1, 2),
    f"{_M}:case_optim_grads_params": (1, 2, 4),
    f"{_M}:case_zero3_recompute_unit": (1,),
    f"{_M}:case_zero3_recompute_submodule": (1,),
    f"{_M}:case_zero3_grad_accumulation": (1,),
    f"{_M}:case_zero3_bf16_mixed_formats": (1,),
    f"{_M}:case_zero3_precompiled": (1,),
    f"{_M}:case_zero2_recompute_precompiled": (1,),
}
