"""A weight format registered from the tests alone trains through FSDP (issue 31, items 1 and 7).

This is the walkthrough of docs/extending.md ("A weight format"), performed: ``block16_format``
registers ``MXFP8_B16`` (MXFP8 with 16-element blocks, numerics emulated by the numpy oracle)
with the two steps the guide names -- its row of ``common.formats.FORMATS`` and its codec in
``torch_side.fsdp.weight_codecs.CODECS`` -- and no library file knows it. It then goes through
FSDP's buffers, gathers, distributed quantization, batched refresh, state dicts, sharded
checkpoints, the bf16 gathers, the telemetry and the linear op's and unit programs' GEMMs, and
trains a step at world sizes 1 and 2 against a replicated reference (``_train_and_compare``; world
size 2 on the ranks of an in-process world, ``threaded_world.py``).

``MXFP8_B16`` takes the linear weights of ``ToyNet`` (its blocks FSDP units, ZeRO-3), which
trains one step beside the replicated reference: the same ``ToyNet`` in plain Torch on the whole
global batch, whose ``MXFP8Linear`` layers read ``OraclePlanes`` -- the format quantized whole on
one rank from ``bf16(weight)``, which is what FSDP's planes must hold. Rank r's micro-batch is
rows ``[r * T, (r + 1) * T)``; FSDP averages the gradients over ranks, so both follow the same
gradient (exact at world size 1, to ``RTOL`` / ``ATOL`` at more ranks, as ``test_training_parity``).

``_train_and_compare`` checks, at every world size (1 in this process, 2 in an in-process world):

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

import pytest
import torch
import torch.distributed as dist

from common.formats import FORMATS, WeightFormat
from common.model_config import GPTConfig
from jax_side import block_scaled
from models.torch_gpt import Block as GPTBlock
from models.torch_gpt import TorchGPT
from tests.torch_side import block16_format as b16
from tests.torch_side.multiprocess import WorkerContext
from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import (
    Collective,
    FSDPOptimizer,
    GatherMode,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch_side.fsdp.sharded_state import load_parts, save_parts
from torch_side.fsdp.weight_codecs import CODECS, BlockScaledCodec, codec_for
from torch_side.instruments.numerics_telemetry import NumericsTelemetry

WORLD_1 = WorkerContext(0, 1, "cpu")
T = 32  # tokens per rank
LR = 0.1
RTOL, ATOL = 1e-4, 1e-6  # more ranks sum the gradients in another order (test_training_parity)


def _close(what: str, got, want, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item()}"
        return
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _wrap(fmt, device, **policy) -> tuple:
    """(FSDP model of ToyNet with ``fmt`` linear weights, its SGD optimizer, the plain net it
    wrapped, copied before wrapping)."""
    net = make_net(0, device=device)
    plain = copy.deepcopy(net)
    model = fully_shard(net, unit_modules=(Block,), strategy=ShardingStrategy.OPTIM_GRADS_PARAMS,
                        policy=MixedPrecisionPolicy(linear_weight_format=fmt, **policy))
    return model, FSDPOptimizer(model, torch.optim.SGD, lr=LR), plain


def _check_planes(model, fmt) -> int:
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
    fresh, fresh_opt, _ = _wrap(fmt, ctx.device)
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


def _train_and_compare(ctx, fmt) -> None:
    """One step of ``fmt`` (``MXFP8_B16``, registered) against the replicated reference."""
    model, opt, ref = _wrap(fmt, ctx.device)
    b16.read_planes_from_oracle(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    w, r, exact = ctx.world_size, ctx.rank, ctx.world_size == 1
    assert _check_planes(model, fmt) == 4  # two units of two linears
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
    _check_planes(model, fmt)  # requantized after the step
    with torch.no_grad():
        again = mse(model(x[mine]), y[mine]).reshape(1)
        dist.all_reduce(again)
        _close("loss after the step", again[0] / w, mse(ref(x), y), exact)
    _checkpoint_round_trip(ctx, fmt, model, opt)
    assert model.allocator.live_keys() == [], model.allocator.live_keys()


@pytest.fixture
def fmt(single_rank_world):
    with b16.registered() as f:
        yield f


def test_registering_a_format_fills_the_two_tables_the_guide_names_and_nothing_else(fmt):
    assert FORMATS[fmt] is b16.ROW and CODECS[fmt] is b16.Block16Codec
    assert isinstance(codec_for(fmt), BlockScaledCodec)
    assert MixedPrecisionPolicy(linear_weight_format=fmt).linear_weight_format == fmt
    assert set(FORMATS) == set(WeightFormat) | {fmt}


def test_one_step_at_world_1_matches_the_replicated_reference(fmt):
    _train_and_compare(WORLD_1, fmt)


def test_one_step_at_world_2_matches_the_replicated_reference():
    with b16.registered() as fmt:  # once for the process: the ranks share its tables
        run_world(2, _train_and_compare, fmt)


def _one_step(model, opt, x, y) -> torch.Tensor:
    loss = mse(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_bf16_gathers_train_the_format_bit_for_bit_like_its_planes(fmt):
    """``GatherMode.BF16`` wraps the format's own codec: each rank quantizes the gathered bf16
    weights into the bytes the distributed quantization writes."""
    x, y = make_batch(3, 32)
    planes, planes_opt, _ = _wrap(fmt, "cpu")
    bf16, bf16_opt, _ = _wrap(fmt, "cpu", gather=GatherMode.BF16)
    assert torch.equal(_one_step(planes, planes_opt, x, y), _one_step(bf16, bf16_opt, x, y))
    a, b = planes.full_state_dict(), bf16.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _check_planes(bf16, fmt) == 4


def test_telemetry_counts_the_blocks_of_the_format(fmt):
    model, opt, _ = _wrap(fmt, "cpu")
    telemetry = NumericsTelemetry(model)
    _one_step(model, opt, *make_batch(4, 32))
    stats = telemetry.collect()
    for g in (g for g in model.param_groups if g.format == fmt):
        blocks = sum(s.numel // b16.BLOCK for s in g.layout.slots)
        for plane in g.planes:
            got = stats[g.label][plane.value]
            assert got.blocks == blocks and got.headroom.blocks > 0, (g.label, plane, got)
    telemetry.close()


def test_unit_programs_read_the_format_as_the_op_does(fmt):
    """The GPT's blocks as one JAX program per direction give the loss and every linear
    weight's gradient of the per-linear op, bit for bit (the planes' blocks travel with them)."""
    cfg = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=64, d_ff=128)
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    out = {}
    for compute in ("op", "unit"):
        model = fully_shard(TorchGPT(cfg, seed=5, compute=compute), unit_modules=(GPTBlock,),
                            strategy=ShardingStrategy.OPTIM_GRADS_PARAMS,
                            policy=MixedPrecisionPolicy(linear_weight_format=fmt))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        linears = [s.name for g in model.param_groups if g.format == fmt for s in g.layout.slots]
        out[compute] = loss.detach(), model.full_grads(), linears
    (op_loss, op_grads, linears), (unit_loss, unit_grads, _) = out["op"], out["unit"]
    assert torch.equal(op_loss, unit_loss) and len(linears) == 9  # 4 per block, lm_head
    for name in linears:
        assert torch.equal(op_grads[name], unit_grads[name]), name
    for name, g in op_grads.items():  # the others go through Torch's ops in one, JAX's in the
        torch.testing.assert_close(unit_grads[name], g, rtol=1e-5, atol=1e-7)  # other


def test_formats_fsdp_cannot_store_are_refused_by_name(single_rank_world):
    """NVFP4's row is complete (two 4-bit elements per byte, E4M3 block scales, an fp32 tensor
    scale); FSDP's buffers and the JAX reader say why they cannot hold or read it."""
    nvfp4 = FORMATS[WeightFormat.NVFP4].blocks
    with pytest.raises(ValueError, match="'nvfp4' .*has no FSDP implementation"):
        codec_for(WeightFormat.NVFP4)
    with pytest.raises(ValueError, match="one byte per element and one scale per block"):
        BlockScaledCodec(WeightFormat.NVFP4)
    with pytest.raises(NotImplementedError, match="Add the format's dequantize"):
        block_scaled.check_readable(nvfp4)
