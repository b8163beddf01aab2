"""A weight format registered from the tests alone trains through FSDP (issue 31, items 1 and 7).

This is the walkthrough of docs/extending.md ("A weight format"), performed: ``block16_format``
registers ``MXFP8_B16`` (MXFP8 with 16-element blocks, numerics emulated by the numpy oracle)
with the two steps the guide names -- its row of ``common.formats.FORMATS`` and its codec in
``torch_side.fsdp.weight_codecs.CODECS`` -- and no library file knows it. It then goes through
FSDP's buffers, gathers, distributed quantization, batched refresh, state dicts, sharded
checkpoints, the bf16 gathers, the telemetry and the linear op's and unit programs' GEMMs, and
trains a step at world size 1 (in process) and 2 (spawned, ``cases_formats``) against a replicated
reference.
"""

from __future__ import annotations

import pytest
import torch

from common.formats import FORMATS, WeightFormat
from common.model_config import GPTConfig
from jax_side import block_scaled
from models.torch_gpt import Block as GPTBlock
from models.torch_gpt import TorchGPT
from tests.torch_side import block16_format as b16
from tests.torch_side import cases_formats as cf
from tests.torch_side.conftest import check_case
from tests.torch_side.multiprocess import WorkerContext
from tests.torch_side.toy_models import make_batch, mse
from torch_side import GatherMode, MixedPrecisionPolicy, ShardingStrategy, fully_shard
from torch_side.fsdp.weight_codecs import CODECS, BlockScaledCodec, codec_for
from torch_side.instruments.numerics_telemetry import NumericsTelemetry

WORLD_1 = WorkerContext(0, 1, "cpu")


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
    cf.train_and_compare(WORLD_1, fmt)


def test_one_step_at_world_2_matches_the_replicated_reference(spawned):
    check_case(spawned, cf, cf.case_block16_zero3_step, 2)


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
    planes, planes_opt, _ = cf.wrap(fmt, "cpu")
    bf16, bf16_opt, _ = cf.wrap(fmt, "cpu", gather=GatherMode.BF16)
    assert torch.equal(_one_step(planes, planes_opt, x, y), _one_step(bf16, bf16_opt, x, y))
    a, b = planes.full_state_dict(), bf16.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert cf.check_planes(bf16, fmt) == 4


def test_telemetry_counts_the_blocks_of_the_format(fmt):
    model, opt, _ = cf.wrap(fmt, "cpu")
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
