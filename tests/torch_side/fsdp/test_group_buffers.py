"""GroupBuffers: a group's persistent buffers, their layout, pieces and refresh through a codec.

In-process. Sizes, dtypes and pieces are checked for every strategy at world 2 with a stand-in
communicator (``_Ranked``: only ``rank`` / ``world_size`` are read until a collective runs);
``refresh`` and the full values run on the real ``Communicator`` of an in-process gloo group of
one rank (``single_rank_world``). The codec sees the buffers only through a ``CodecContext``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from common.formats import Plane, WeightFormat
from tests.oracle import mxfp8_ref
from torch_side.comm.collectives import Collective, Communicator, Phase
from torch_side.fsdp.flat_layout import ALIGN_ELEMENTS, FlatLayout, OwnedPiece
from torch_side.fsdp.group_buffers import GroupBuffers
from torch_side.fsdp.strategy import STRATEGY_FACTS, ShardingStrategy
from torch_side.fsdp.weight_codecs import CodecContext, MXFP8Codec, codec_for

SHAPES = [(64, 96), (32, 64), (32, 32)]  # MXFP8 weights: (M, K), multiples of 32
NAMES = ["a", "b", "c"]
MX = WeightFormat.MXFP8_E4M3


@dataclasses.dataclass
class _Ranked:
    rank: int
    world_size: int


def _values(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _buffers(strategy, fmt=MX, comm=None, grads=torch.float32, device="cpu"):
    comm = _Ranked(0, 2) if comm is None else comm
    layout = FlatLayout.build(NAMES, SHAPES, comm.world_size)
    facts = STRATEGY_FACTS[ShardingStrategy(strategy)]
    return GroupBuffers("u/g", layout, facts, codec_for(fmt), comm, grads, torch.device(device))


@pytest.mark.parametrize("strategy", list(ShardingStrategy))
def test_buffer_sizes_and_dtypes_follow_the_strategy(strategy):
    b = _buffers(strategy)
    f, lay = b.facts, b.layout
    assert lay.padded_numel == 2 * lay.shard_numel
    assert b.main.dtype == torch.float32
    assert b.main.numel() == (lay.shard_numel if f.main_weights_sharded else lay.padded_numel)
    assert set(b.model) == {Plane.ROWWISE, Plane.COLWISE}  # MXFP8: rowwise and transpose bytes
    for buf in b.model.values():
        assert buf.dtype == torch.uint8
        assert buf.numel() == (lay.shard_numel if f.model_weights_sharded else lay.padded_numel)
    assert b.main_grad.numel() == (lay.shard_numel if f.grads_sharded else lay.padded_numel)


def test_a_group_without_grads_has_no_main_grad_and_unscaled_formats_no_scales():
    b = _buffers("no_shard", fmt=WeightFormat.BF16, grads=None)
    assert b.main_grad is None
    assert set(b.model) == {Plane.ROWWISE} and b.model[Plane.ROWWISE].dtype == torch.bfloat16
    assert b.scales == {} and b.scale_buffers == {} and b.scale_offsets == []


def test_every_parameter_and_scale_starts_aligned_in_every_buffer():
    b = _buffers("optim_grads_params")
    for s in b.layout.slots:
        assert s.start % ALIGN_ELEMENTS == 0, s  # >= 256 bytes in uint8, bf16 and fp32
    for plane, views in b.scales.items():
        for off, view, shape in zip(b.scale_offsets, views, SHAPES, strict=True):
            assert off % 256 == 0
            assert view.data_ptr() - b.scale_buffers[plane].data_ptr() == off
            assert view.numel() == shape[0] * shape[1] // 32
    assert tuple(b.scales[Plane.ROWWISE][0].shape) == (64, 3)
    assert tuple(b.scales[Plane.COLWISE][0].shape) == (2, 96)


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_the_pieces_of_all_ranks_hold_every_element_once(strategy):
    owned = {i: torch.zeros(s, dtype=torch.int64).reshape(-1) for i, s in enumerate(SHAPES)}
    for rank in (0, 1):
        b = _buffers(strategy, comm=_Ranked(rank, 2))
        b.load_main(_values())
        for p in b.pieces():
            owned[p.slot_index][p.param_offset : p.param_offset + p.numel] += 1
            got = b.main[p.shard_offset : p.shard_offset + p.numel]
            want = _values()[p.slot_index].reshape(-1)[p.param_offset : p.param_offset + p.numel]
            assert torch.equal(got, want)
    copies = 2 if strategy == "no_shard" else 1  # no_shard: each rank holds everything
    assert all(bool((c == copies).all()) for c in owned.values())


def test_the_optimizer_reads_the_main_grad_part_matching_main():
    b = _buffers("optim", comm=_Ranked(1, 2), grads=torch.bfloat16)  # ZeRO-1: full grads
    b.main_grad.copy_(torch.arange(b.layout.padded_numel).to(torch.bfloat16))
    got = b.grad_for_optimizer()
    lo, hi = b.layout.shard_range(1)
    assert got.dtype == torch.float32 and torch.equal(got, b.main_grad[lo:hi].float())
    full = _buffers("no_shard", grads=torch.float32)
    assert full.grad_for_optimizer() is full.main_grad  # a view, no copy


def test_codec_context_holds_exactly_what_a_codec_needs():
    b = _buffers("optim_grads_params", comm=_Ranked(1, 2))
    ctx = b.codec_context()
    assert isinstance(ctx, CodecContext)
    assert ctx.main is b.main and ctx.scales is b.scales and ctx.comm is b.comm
    assert ctx.shapes == SHAPES and ctx.owned == b.pieces() and ctx.main_sharded
    assert ctx.label == "u/g" and ctx.kernels is None


class _CountingComm(_Ranked):
    def __init__(self) -> None:
        super().__init__(0, 1)
        self.ops = []

    def all_reduce(self, t, op, phase, label):
        self.ops.append((op, phase, label))


@pytest.mark.parametrize("main_sharded", [True, False])
def test_mxfp8_fill_reduces_the_amax_only_when_main_is_sharded(main_sharded):
    shape = (32, 64)
    main = _values()[1].reshape(-1).clone()
    comm = _CountingComm()
    codec = codec_for(MX)
    scales = codec.make_scales([shape], torch.device("cpu"))
    whole = [OwnedPiece(0, 0, 0, main.numel())]  # main holds the whole parameter
    ctx = CodecContext("u/g", main, [shape], whole, scales.views, comm, main_sharded, None,
                       scale_buffers=scales.buffers, scale_offsets=scales.offsets)
    targets = {p: torch.zeros(main.numel(), dtype=torch.uint8) for p in codec.planes}
    codec.fill(ctx, targets, Phase.OPTIMIZER)
    want = [(Collective.ALL_REDUCE_MAX, Phase.OPTIMIZER, "u/g/amax")] if main_sharded else []
    assert comm.ops == want
    ref = mxfp8_ref.quantize(main.view(shape).to(torch.bfloat16).float().numpy())
    assert np.array_equal(targets[Plane.ROWWISE][: main.numel()].view(shape).numpy(),
                          ref["rowwise_data"])
    assert np.array_equal(scales.views[Plane.COLWISE][0].numpy(), ref["colwise_scale"])


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_refresh_writes_the_planes_of_bf16_main_and_full_values_round_trip(
    single_rank_world, strategy
):
    comm = Communicator(dist.group.WORLD, "dp")
    b = _buffers(strategy, comm=comm)
    values = _values(3)
    b.load_main(values)
    b.refresh(Phase.STATE)
    for i, s in enumerate(b.layout.slots):
        ref = mxfp8_ref.quantize(values[i].to(torch.bfloat16).float().numpy())
        for plane, field in ((Plane.ROWWISE, "rowwise"), (Plane.COLWISE, "colwise")):
            data = b.model[plane][s.start : s.end].view(s.shape).numpy()
            assert np.array_equal(data, ref[f"{field}_data"]), (s.name, plane)
            assert np.array_equal(b.scales[plane][i].numpy(), ref[f"{field}_scale"])
    full = b.full_main()
    for v, s in zip(values, b.layout.slots, strict=True):
        assert torch.equal(full[s.start : s.end].view(s.shape), v)
    b.main_grad.fill_(0.5)
    assert torch.equal(b.full_main_grad(), torch.full((b.layout.padded_numel,), 0.5))


def test_refresh_of_a_cast_format_is_the_cast_of_main(single_rank_world):
    comm = Communicator(dist.group.WORLD, "dp")
    b = _buffers("no_shard", fmt=WeightFormat.BF16, comm=comm)
    b.load_main(_values(4))
    b.refresh(Phase.OPTIMIZER)
    assert torch.equal(b.model[Plane.ROWWISE], b.main.to(torch.bfloat16))
    assert [r.op for r in comm.records] == []  # replicated main: no collective


class _CopyingMXFP8(MXFP8Codec):
    fresh_images = False  # the images copied into the buffers, as a reusing codec has them


def _spied_images(monkeypatch) -> list:
    """Each refresh's GroupImages, as MXFP8Codec.quantize_images returned them."""
    made, real = [], MXFP8Codec.quantize_images

    def spy(self, *args, **kw):
        out = real(self, *args, **kw)
        made.append(out.images[0])
        return out

    monkeypatch.setattr(MXFP8Codec, "quantize_images", spy)
    return made


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("strategy", list(ShardingStrategy))
def test_a_refresh_keeps_the_images_where_only_gathers_read_them(
    single_rank_world, monkeypatch, strategy, device
):
    """ZeRO-3: the images become the model shards (data pointers, no copy); ZeRO-1/2: they are
    what the staged gather sends; replicated buffers are written in place. The bytes are those
    of a codec whose images are copied, refresh after refresh (on the GPU: JAX's result handed
    to Torch, the first images freed while the second are made)."""
    comm = Communicator(dist.group.WORLD, "dp")
    b, copied = (_buffers(strategy, comm=comm, device=device) for _ in range(2))
    copied.codec = _CopyingMXFP8(MX)
    made, sent = _spied_images(monkeypatch), []
    real_gather = Communicator.all_gather

    def gather(self, out, shard, *args, **kw):
        sent.append(shard.data_ptr())
        return real_gather(self, out, shard, *args, **kw)

    monkeypatch.setattr(Communicator, "all_gather", gather)
    first = {p: t.data_ptr() for p, t in b.model.items()}
    for seed in (5, 6):
        for g in (b, copied):
            g.load_main([v.to(device) for v in _values(seed)])
        sent.clear()
        b.refresh(Phase.OPTIMIZER)
        images = {Plane.ROWWISE: made[-1].rowwise, Plane.COLWISE: made[-1].colwise}
        kept = {p: t.data_ptr() for p, t in images.items()}
        if b.facts.model_weights_sharded:
            assert {p: t.data_ptr() for p, t in b.model.items()} == kept
        else:
            assert {p: t.data_ptr() for p, t in b.model.items()} == first
        assert sent == ([kept[Plane.ROWWISE], kept[Plane.COLWISE]] if b._staged() else [])
        copied.refresh(Phase.OPTIMIZER)
        for p in b.model:
            assert torch.equal(b.model[p], copied.model[p]), (seed, p)
            assert torch.equal(b.scale_buffers[p], copied.scale_buffers[p]), (seed, p)


def test_images_unlike_the_buffers_are_refused_naming_the_group_and_the_fix(
    single_rank_world, monkeypatch
):
    """A codec that declares fresh images must return them laid out like the main weights."""
    real = MXFP8Codec.quantize_images

    def short(self, *args, **kw):
        out = real(self, *args, **kw)
        img = out.images[0]
        return out._replace(images=[img._replace(colwise=img.colwise[:-1])])

    monkeypatch.setattr(MXFP8Codec, "quantize_images", short)
    b = _buffers("optim_grads_params", comm=Communicator(dist.group.WORLD, "dp"))
    b.load_main(_values(7))
    with pytest.raises(RuntimeError, match=r"group 'u/g': MXFP8Codec.quantize_images returned "
                       r"a colwise image of shape .*fresh_images = False"):
        b.refresh(Phase.OPTIMIZER)
