"""Spawned-rank case: one training step of a weight format registered from the tests alone.

``MXFP8_B16`` (``block16_format``: MXFP8 with 16-element blocks, its numerics emulated by the
numpy oracle) takes the linear weights of ``ToyNet`` (its blocks FSDP units, ZeRO-3), which
trains one step beside the replicated reference: the same ``ToyNet`` in plain Torch on the whole
global batch, whose ``MXFP8Linear`` layers read ``OraclePlanes`` -- the format quantized whole on
one rank from ``bf16(weight)``, which is what FSDP's planes must hold. Rank r's micro-batch is
rows ``[r * T, (r + 1) * T)``; FSDP averages the gradients over ranks, so both follow the same
gradient (exact at world size 1, to ``RTOL`` / ``ATOL`` at more ranks, as ``cases_training``).

``train_and_compare`` checks, at every world size (``test_format_plugin`` runs it in process at
world size 1, this module at world size 2):

- FSDP's buffers and gathers hold the format: every gathered plane equals the oracle's whole
  quantization of ``bf16(main)`` byte for byte -- at the wrap and after the step, i.e. the
  distributed quantization (partial amax, one all-reduce MAX, cast of the owned elements) at this
  world's split -- with scales of shape (M, K/16) and (M/16, K);
- the forward and backward with its GEMMs: the loss, and the main weights after the step, equal
  the reference's; so does the loss of a second forward on the requantized planes;
- the batched refresh: each refresh is ONE amax all-reduce for both units' groups
  (``"*/mxfp8_b16/dp/amax"``), and the planes' all-gathers carry 1 byte per element;
- state dicts and sharded checkpoints: ``full_state_dict`` is the reference's weights, and
  ``save_parts`` / ``load_parts`` into a fresh model restores main weights, optimizer state,
  planes and scales bit for bit.
"""

from __future__ import annotations

import copy
import shutil
import tempfile

import torch
import torch.distributed as dist

from tests.torch_side import block16_format as b16
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import (
    Collective,
    FSDPOptimizer,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch_side.fsdp.sharded_state import load_parts, save_parts

T = 32  # tokens per rank
LR = 0.1
RTOL, ATOL = 1e-4, 1e-6  # the gradient sums of more ranks run in another order (cases_training)


def _close(what: str, got, want, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item()}"
        return
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def wrap(fmt, device, **policy) -> tuple:
    """(FSDP model of ToyNet with ``fmt`` linear weights, its SGD optimizer, the plain net it
    wrapped, copied before wrapping)."""
    net = make_net(0, device=device)
    plain = copy.deepcopy(net)
    model = fully_shard(net, unit_modules=(Block,), strategy=ShardingStrategy.OPTIM_GRADS_PARAMS,
                        policy=MixedPrecisionPolicy(linear_weight_format=fmt, **policy))
    return model, FSDPOptimizer(model, torch.optim.SGD, lr=LR), plain


def check_planes(model, fmt) -> int:
    """Every gathered plane of a ``fmt`` weight is the oracle's whole quantization of
    ``bf16(main)`` (returns how many weights were checked)."""
    main, checked = model.full_state_dict(), 0
    with model.gathered_weights() as weights:
        for g in (g for g in model.param_groups if g.format == fmt):
            for slot in g.layout.slots:
                got, want = weights[slot.name], b16.quantize_whole(main[slot.name])
                assert got.blocks == b16.ROW.blocks, got.blocks
                for plane, (data, scale) in want.items():
                    assert tuple(got.planes[plane].scale.shape) == b16.ROW.blocks.scale_shape(
                        slot.shape, plane)
                    assert torch.equal(got.planes[plane].data.cpu(), data), (slot.name, plane)
                    assert torch.equal(got.planes[plane].scale.cpu(), scale), (slot.name, plane)
                checked += 1
    return checked


def _check_wire(model, fmt) -> None:
    """One batched amax all-reduce per refresh for both units' groups; 1-byte gathers."""
    groups = [g for g in model.param_groups if g.format == fmt]
    assert len(groups) == 2, [g.label for g in model.param_groups]
    wire = model.wire_log()
    amax = [r for r in wire if r.op is Collective.ALL_REDUCE_MAX]
    assert [r.label for r in amax] == [f"*/{fmt.value}/dp/amax"], amax
    assert amax[0].numel == sum(2 * g.blocks.scale_numel(s.shape)
                                for g in groups for s in g.layout.slots), amax
    gathers = [r for r in wire if r.op is Collective.ALL_GATHER
               and any(r.label.startswith(g.label + "/") for g in groups)]
    assert gathers and all(r.dtype == torch.uint8 for r in gathers), gathers


def _checkpoint_round_trip(ctx, fmt, model, opt) -> None:
    path = [tempfile.mkdtemp(prefix="b16_ckpt_") if ctx.rank == 0 else None]
    if ctx.world_size > 1:
        dist.broadcast_object_list(path)
    parts = [model.sharded_state(), opt.sharded_state()]
    save_parts(f"{path[0]}/step_1", parts, run_id="b16", step=1)
    fresh, fresh_opt, _ = wrap(fmt, ctx.device)
    load_parts(f"{path[0]}/step_1", [fresh.sharded_state(), fresh_opt.sharded_state()])
    for a, b in zip(model.param_groups, fresh.param_groups, strict=True):
        assert torch.equal(a.main, b.main), a.label
        for plane in a.planes:
            assert torch.equal(a.model[plane], b.model[plane]), (a.label, plane)
        for plane, buf in a.scale_buffers.items():
            assert torch.equal(buf, b.scale_buffers[plane]), (a.label, plane)
        for k, v in opt.optimizer.state.get(a.main, {}).items():
            assert torch.equal(v, fresh_opt.optimizer.state[b.main][k]), (a.label, k)
    if ctx.world_size > 1:
        dist.barrier()  # every rank has read before rank 0 removes the files
    if ctx.rank == 0:
        shutil.rmtree(path[0])


def train_and_compare(ctx, fmt) -> None:
    """One step of ``fmt`` (``MXFP8_B16``, registered) against the replicated reference."""
    model, opt, ref = wrap(fmt, ctx.device)
    b16.read_planes_from_oracle(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    w, r, exact = ctx.world_size, ctx.rank, ctx.world_size == 1
    assert check_planes(model, fmt) == 4  # two units of two linears
    x, y = make_batch(1, T * w, ctx.device)  # the global batch (w*T, 16|8)
    mine = slice(r * T, (r + 1) * T)
    model.clear_wire_log()
    loss = mse(model(x[mine]), y[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()
    _check_wire(model, fmt)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    losses = loss.detach().reshape(1)
    dist.all_reduce(losses)
    _close("loss", losses[0] / w, ref_loss.detach(), exact)
    state = model.full_state_dict()
    for name, p in ref.named_parameters():
        _close(name, state[name], p.detach(), exact)
    check_planes(model, fmt)  # requantized after the step
    with torch.no_grad():
        again = mse(model(x[mine]), y[mine]).reshape(1)
        dist.all_reduce(again)
        _close("loss after the step", again[0] / w, mse(ref(x), y), exact)
    _checkpoint_round_trip(ctx, fmt, model, opt)
    assert model.allocator.live_keys() == [], model.allocator.live_keys()


def case_block16_zero3_step(ctx):
    with b16.registered() as fmt:
        train_and_compare(ctx, fmt)


_M = "tests.torch_side.cases_formats"
CASES = {f"{_M}:case_block16_zero3_step": (2,)}
