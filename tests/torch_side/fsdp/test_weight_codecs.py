"""``torch_side.fsdp.weight_codecs``: the codec of each format FSDP implements, and what it writes.

In process. ``CODECS`` and ``codec_for`` are checked as tables (which codec, planes, dtypes and
parameter storage per format and gather mode); ``fill`` writes model weights from fp32 main
weights through a ``CodecContext`` only: a cast for fp32/bf16, and for MXFP8 the bytes and scales
of the numpy oracle (``tests/oracle/mxfp8_ref``) of bf16(main) -- also when main holds one shard
of two ranks, whose partial amax a stand-in communicator reduces in this process. The multi-rank
distributed quantization itself runs in the spawned worlds (``test_distributed_quantize``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from common.formats import Plane, WeightFormat
from common.modes import GatherMode
from tests.oracle import mxfp8_ref
from torch_side.comm.collectives import Collective, Communicator, Phase
from torch_side.fsdp.flat_layout import FlatLayout
from torch_side.fsdp.weight_codecs import (
    CODECS,
    BF16GatherCodec,
    BlockScaledCodec,
    CastCodec,
    CodecContext,
    MXFP8Codec,
    ParamStorage,
    codec_for,
)

MX, BF16, FP32 = WeightFormat.MXFP8_E4M3, WeightFormat.BF16, WeightFormat.FP32
SHAPES = [(64, 96), (32, 64)]  # (M, K), multiples of the 32-element block
BOTH = (Plane.ROWWISE, Plane.COLWISE)


def _values(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * (i + 1) for i, s in enumerate(SHAPES)]


def _oracle(v: torch.Tensor) -> dict[str, np.ndarray]:
    """The MXFP8 planes of bf16(v) (DESIGN.md 3: quantized from bf16(main))."""
    return mxfp8_ref.quantize(v.to(torch.bfloat16).float().numpy())


def _context(codec, main, layout, rank, comm, sharded, observer=None):
    scales = codec.make_scales(SHAPES, torch.device("cpu"))
    ctx = CodecContext("g", main, SHAPES, layout.owned(rank), scales.views, comm, sharded, None,
                       amax_observer=observer, scale_buffers=scales.buffers,
                       scale_offsets=scales.offsets)
    targets = {p: torch.zeros(main.numel(), dtype=codec.buffer_dtype) for p in codec.planes}
    return ctx, targets


def _flat(values, layout) -> torch.Tensor:
    full = torch.zeros(layout.padded_numel)
    for v, s in zip(values, layout.slots, strict=True):
        full[s.start : s.end] = v.reshape(-1)
    return full


def test_codecs_holds_one_codec_class_per_format_fsdp_implements():
    assert CODECS == {FP32: CastCodec, BF16: CastCodec, MX: MXFP8Codec}
    assert issubclass(MXFP8Codec, BlockScaledCodec)


@pytest.mark.parametrize(
    "fmt,cls,storage,planes,buffer_dtype,source_dtype",
    [
        (FP32, CastCodec, ParamStorage.BUFFER_VIEW, (Plane.ROWWISE,), torch.float32,
         torch.float32),
        (BF16, CastCodec, ParamStorage.BUFFER_VIEW, (Plane.ROWWISE,), torch.bfloat16,
         torch.bfloat16),
        (MX, MXFP8Codec, ParamStorage.PLACEHOLDER, BOTH, torch.uint8, torch.bfloat16),
    ],
)
def test_codec_for_chooses_the_codec_and_facts_of_each_format(
    fmt, cls, storage, planes, buffer_dtype, source_dtype
):
    c = codec_for(fmt)
    assert type(c) is cls and c.format == fmt
    assert c.param_storage is storage and c.planes == planes and c.compute_planes == planes
    assert c.buffer_dtype == buffer_dtype and c.source_dtype == source_dtype
    assert not c.quantizes_after_gather
    assert c.spec.forward_plane is Plane.ROWWISE and c.spec.backward_plane is planes[-1]


def test_bf16_gathers_store_one_bf16_plane_and_compute_with_the_formats_planes():
    c = codec_for(MX, GatherMode.BF16)
    assert type(c) is BF16GatherCodec and c.format == MX and c.quantizes_after_gather
    assert c.planes == (Plane.ROWWISE,) and c.buffer_dtype == torch.bfloat16
    assert c.compute_planes == BOTH and c.param_storage is ParamStorage.PLACEHOLDER
    assert c.stored_plane(Plane.COLWISE) is Plane.ROWWISE  # colwise is made from the bf16 gather
    assert type(codec_for(FP32, GatherMode.BF16)) is CastCodec  # unscaled: gathered as it is
    with pytest.raises(ValueError, match="'fp32' is not block-scaled"):
        BF16GatherCodec(FP32)


def test_unimplemented_formats_are_refused_naming_the_supported_ones():
    want = (r"'nvfp4' \(block-scaled, 16-element blocks of float4_e2m1fn\) has no FSDP "
            r"implementation in torch_side; supported: \['fp32', 'bf16', 'mxfp8_e4m3'\]")
    with pytest.raises(ValueError, match=want):
        codec_for(WeightFormat.NVFP4)


def test_only_block_scaled_codecs_batch_and_they_batch_together():
    assert codec_for(FP32).batch_key() is None and codec_for(BF16).batch_key() is None
    assert codec_for(MX).batch_key() == codec_for(MX).batch_key() is not None


def test_block_scaled_scales_are_per_plane_buffers_with_aligned_views_per_parameter():
    assert codec_for(FP32).make_scales(SHAPES, "cpu").buffers == {}
    s = codec_for(MX).make_scales(SHAPES, torch.device("cpu"))
    assert s.offsets == [0, 256]  # 64 * 96 / 32 = 192 scales, rounded up to 256 bytes
    for plane in BOTH:
        buf = s.buffers[plane]
        assert buf.dtype == torch.uint8 and buf.numel() == 512 and not buf.any()
        for view, off in zip(s.views[plane], s.offsets, strict=True):
            assert view.data_ptr() - buf.data_ptr() == off
    assert [tuple(v.shape) for v in s.views[Plane.ROWWISE]] == [(64, 3), (32, 2)]
    assert [tuple(v.shape) for v in s.views[Plane.COLWISE]] == [(2, 96), (1, 64)]


@pytest.mark.parametrize("fmt", [FP32, BF16])
def test_a_cast_codec_fills_its_plane_with_the_cast_of_main(single_rank_world, fmt):
    codec = codec_for(fmt)
    layout = FlatLayout.build(["a", "b"], SHAPES, 1)
    main = _flat(_values(1), layout)
    comm = Communicator(dist.group.WORLD, "dp")
    ctx, targets = _context(codec, main, layout, 0, comm, sharded=False)
    codec.fill(ctx, targets, Phase.OPTIMIZER)
    assert torch.equal(targets[Plane.ROWWISE], main.to(codec.buffer_dtype))
    assert list(comm.records) == []


def test_mxfp8_fill_writes_the_oracles_bytes_and_scales_and_shows_the_amax(single_rank_world):
    codec = codec_for(MX)
    layout = FlatLayout.build(["a", "b"], SHAPES, 1)
    values = _values(2)
    comm = Communicator(dist.group.WORLD, "dp")
    seen = []
    ctx, targets = _context(codec, _flat(values, layout), layout, 0, comm, sharded=True,
                            observer=seen.append)
    codec.fill(ctx, targets, Phase.OPTIMIZER)
    # main is a shard: ONE all-reduce MAX of the packed block amax, named after the group
    assert [(r.op, r.phase, r.label) for r in comm.records] == [
        (Collective.ALL_REDUCE_MAX, Phase.OPTIMIZER, "g/amax")]
    packed = []
    for i, (v, s) in enumerate(zip(values, layout.slots, strict=True)):
        ref = _oracle(v)
        for plane in BOTH:
            got = targets[plane][s.start : s.end].view(s.shape).numpy()
            assert np.array_equal(got, ref[f"{plane.value}_data"]), (s.name, plane)
            assert np.array_equal(ctx.scales[plane][i].numpy(), ref[f"{plane.value}_scale"])
        row, col = mxfp8_ref.block_amax(v.to(torch.bfloat16).float().numpy())
        packed += [row.reshape(-1), col.reshape(-1)]
    assert len(seen) == 1 and np.array_equal(seen[0].numpy(), np.concatenate(packed))


class _TwoRankAmax:
    """Rank ``rank`` of two, in one process: the all-reduce MAX of the packed amax takes the
    maximum with the other rank's partial amax, recorded by a first pass (``partial``)."""

    world_size = 2

    def __init__(self, rank: int, partial: dict[int, torch.Tensor]):
        self.rank, self.partial = rank, partial

    def all_reduce(self, t, op, phase, label):
        assert op is Collective.ALL_REDUCE_MAX
        other = self.partial.get(1 - self.rank)
        self.partial.setdefault(self.rank, t.clone())
        if other is not None:
            t.copy_(torch.maximum(t, other))


def test_mxfp8_fill_of_one_shard_of_two_writes_that_shard_of_the_whole_tensors_bytes():
    codec = codec_for(MX)
    layout = FlatLayout.build(["a", "b"], SHAPES, 2)
    values = _values(3)
    full = _flat(values, layout)
    partial: dict[int, torch.Tensor] = {}
    for rank in (0, 1):  # first pass: each rank's partial amax
        lo, hi = layout.shard_range(rank)
        ctx, targets = _context(codec, full[lo:hi].clone(), layout, rank,
                                _TwoRankAmax(rank, partial), sharded=True)
        codec.fill(ctx, targets, Phase.STATE)
    shards, scales = {p: [] for p in BOTH}, []
    for rank in (0, 1):  # second pass: reduced with the other rank's partial
        lo, hi = layout.shard_range(rank)
        ctx, targets = _context(codec, full[lo:hi].clone(), layout, rank,
                                _TwoRankAmax(rank, dict(partial)), sharded=True)
        codec.fill(ctx, targets, Phase.STATE)
        for p in BOTH:
            shards[p].append(targets[p])
        scales.append(ctx.scales)
    for i, (v, s) in enumerate(zip(values, layout.slots, strict=True)):
        ref = _oracle(v)
        for plane in BOTH:
            got = torch.cat(shards[plane])[s.start : s.end].view(s.shape).numpy()
            assert np.array_equal(got, ref[f"{plane.value}_data"]), (s.name, plane)
            for rank in (0, 1):  # every rank holds the full scales
                assert np.array_equal(scales[rank][plane][i].numpy(),
                                      ref[f"{plane.value}_scale"])


@pytest.mark.parametrize("runs", ["one array", "an array per group"])
def test_a_batch_of_groups_reduces_once_and_writes_each_groups_own_bytes(single_rank_world, runs,
                                                                        monkeypatch):
    """Also with the images in one array per group (``bridge.mxfp8_slices.runs``: what a batch
    of more than 2**31 bytes of images comes back as)."""
    if runs != "one array":
        monkeypatch.setattr("bridge.mxfp8_slices.RUN_LIMIT", 1)
    codec = codec_for(MX)
    layout = FlatLayout.build(["a", "b"], SHAPES, 1)
    comm = Communicator(dist.group.WORLD, "dp")
    groups = [(_values(seed), *_context(codec, _flat(_values(seed), layout), layout, 0, comm,
                                         sharded=True)) for seed in (4, 5)]
    made = codec.quantize_batch([ctx for _, ctx, _ in groups], Phase.OPTIMIZER, "*/amax")
    assert [(r.op, r.label) for r in comm.records] == [(Collective.ALL_REDUCE_MAX, "*/amax")]
    for (values, ctx, targets), images, amax in zip(groups, made.images, made.amax, strict=True):
        codec.write_images(ctx, images, amax, targets, Phase.OPTIMIZER)
        for i, (v, s) in enumerate(zip(values, layout.slots, strict=True)):
            ref = _oracle(v)
            got = targets[Plane.COLWISE][s.start : s.end].view(s.shape).numpy()
            assert np.array_equal(got, ref["colwise_data"]), s.name
            assert np.array_equal(ctx.scales[Plane.ROWWISE][i].numpy(), ref["rowwise_scale"])


def test_bf16_gathers_quantize_the_gathered_weights_into_the_formats_bytes(single_rank_world):
    codec = codec_for(MX, GatherMode.BF16)
    layout = FlatLayout.build(["a", "b"], SHAPES, 1)
    values = _values(6)
    main = _flat(values, layout)
    comm = Communicator(dist.group.WORLD, "dp")
    ctx, stored = _context(codec, main, layout, 0, comm, sharded=False)
    codec.fill(ctx, stored, Phase.OPTIMIZER)  # what is stored and gathered: bf16(main)
    gathered = stored[Plane.ROWWISE]
    assert torch.equal(gathered, main.to(torch.bfloat16))
    ctx = ctx._replace(main=gathered)
    planes = {p: torch.zeros(main.numel(), dtype=torch.uint8) for p in codec.compute_planes}
    codec.quantize_gathered(ctx, planes)
    assert list(comm.records) == []  # every rank quantizes whole tensors: no collective
    for i, (v, s) in enumerate(zip(values, layout.slots, strict=True)):
        ref = _oracle(v)
        for plane in BOTH:
            got = planes[plane][s.start : s.end].view(s.shape).numpy()
            assert np.array_equal(got, ref[f"{plane.value}_data"]), (s.name, plane)
            assert np.array_equal(ctx.scales[plane][i].numpy(), ref[f"{plane.value}_scale"])


class _Comm:
    """A communicator of ``world_size`` ranks whose all-reduce changes nothing (the test looks at
    which program the codec runs, not at the values of other ranks)."""

    def __init__(self, world_size: int):
        self.world_size, self.reduced = world_size, 0

    def all_reduce(self, t, op, phase, label):
        self.reduced += 1


@pytest.mark.parametrize(("world", "sharded", "own_blocks", "one_pass"), [
    (1, True, False, True),  # one rank: its amax is every rank's
    (2, False, False, True),  # every rank holds whole parameters
    (2, True, True, True),  # block-atomic owners: the scales are gathered from them
    (2, True, False, False),  # blocks cut between ranks: reduce first, then cast
])
def test_the_refresh_reads_main_once_where_no_reduction_changes_an_amax(
    monkeypatch, world, sharded, own_blocks, one_pass
):
    """``BlockScaledCodec.quantize_batch`` tells the codec (``AmaxReduction.identity``) when
    the reduction cannot change a value; MXFP8 then makes the packed amax and the bytes in ONE
    program (no partial-amax program), still calling the reduction once, with the bytes of the
    whole tensors (the oracle's: this rank's view is the whole tensor)."""
    import torch_side.fsdp.distributed_quantize as dq

    codec, seen, programs = codec_for(MX), [], []
    real_images = MXFP8Codec.quantize_images
    monkeypatch.setattr(MXFP8Codec, "quantize_images", lambda self, mains, pieces, reduce, *a:
                        seen.append(reduce.identity) or real_images(self, mains, pieces, reduce,
                                                                    *a))
    def counted(real):
        return lambda *a, **k: programs.append("amax") or real(*a, **k)

    for name in ("batched_partial_amax", "packed_partial_amax"):  # a batch's, a group's alone
        monkeypatch.setattr(dq, name, counted(getattr(dq, name)))
    layout = FlatLayout.build(["a", "b"], SHAPES, 1)
    values = _values(8)
    comm = _Comm(world)
    ctx, _ = _context(codec, _flat(values, layout), layout, 0, comm, sharded)
    ctx = ctx._replace(scale_shard=(0, 1) if own_blocks else None)
    made = codec.quantize_batch([ctx], Phase.OPTIMIZER, "g/amax")
    assert seen == [one_pass] and programs == ([] if one_pass else ["amax"])
    assert comm.reduced == int(sharded and not own_blocks)
    for v, s in zip(values, layout.slots, strict=True):
        for plane in BOTH:
            got = getattr(made.images[0], plane.value)[s.start:s.end].view(s.shape).numpy()
            assert np.array_equal(got, _oracle(v)[f"{plane.value}_data"]), (s.name, plane)
    packed = [a.reshape(-1) for v in values
              for a in mxfp8_ref.block_amax(v.to(torch.bfloat16).float().numpy())]
    assert np.array_equal(made.amax[0].numpy(), np.concatenate(packed))
