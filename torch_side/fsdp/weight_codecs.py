"""How FSDP makes a format's model weights from the fp32 main weights: one codec per format.

``CODECS`` maps every format FSDP implements (a ``common.formats.FormatKey``: a built-in
``WeightFormat`` or one added with ``common.formats.register_format``) to a
:class:`WeightCodec`; ``codec_for`` refuses any other format (e.g. ``NVFP4``, described in
``common.formats.FORMATS`` but not implemented here) with a clear error. A codec answers, from
the format's table row:

- which planes the model weights consist of and their buffer dtype (``spec``, ``buffer_dtype``);
- where module parameters live (:class:`ParamStorage`): views of the weights buffer (fp32/bf16:
  Torch modules compute with them directly), or storage-free placeholders that only receive
  gradients while the layer reads the planes FSDP injects (block-scaled formats:
  ``bridge.mxfp8_linear``);
- the scale tensors the format keeps (block-scaled: full, replicated scales per plane, shaped
  by the format's ``ScaleBlocks``);
- ``fill``: write this rank's part of every plane from ``main`` -- a cast, or the distributed
  quantization (DESIGN.md 5: partial amax, one all-reduce MAX, scales, cast of owned elements);
- ``batch_key``: which groups refresh together, with one amax all-reduce between them
  (``torch_side.fsdp.batched_refresh``).

Block-scaled formats share one recipe, :class:`BlockScaledCodec`: it owns the scale buffers,
the amax collective, the batching and the copies into the group's buffers; a format supplies
only its numerics, ``quantize_images`` (partial amax of the owned elements, then -- after the
injected reduction -- scales and cast). :class:`MXFP8Codec` runs ``jax_side.mxfp8``'s kernels
through ``bridge.mxfp8_slices``; a format of one's own subclasses ``BlockScaledCodec`` and
enters ``CODECS`` (docs/extending.md, "A weight format").

A codec's ``planes`` are what the model weight buffers store and all-gather; ``compute_planes``
what the layers read. They are the same planes except under ``GatherMode.BF16``
(:class:`BF16GatherCodec`): a block-scaled weight is then stored and gathered as bf16(main), one
plane of 2 bytes per element, and after each gather every rank quantizes the group's full bf16
weights itself (``quantize_gathered``, the format's own codec's ``fill`` on the whole tensor with
no amax reduction) into buffers laid out like the format's planes -- the same bytes the
distributed quantization writes (DESIGN.md 5), read by the same linear programs at the same
offsets.

``fill`` sees its group only through a :class:`CodecContext`: the main weights, which pieces of
which parameter shapes they hold, the scale tensors to write and the communicator for the amax
reduction -- exactly what a codec reads and writes, nothing else of the group.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from common.formats import (
    FormatKey,
    FormatSpec,
    Plane,
    ScaleBlocks,
    WeightFormat,
    format_spec,
    round_up,
)
from common.kernels import KernelConfig
from common.modes import GatherMode
from torch_side.comm.collectives import Collective, Communicator, Phase
from torch_side.fsdp.distributed_quantize import (
    AmaxReduction,
    BatchImages,
    GroupImages,
    Piece,
    ScaleLayout,
    quantize_batch_into_images,
    quantize_into_images,
)
from torch_side.fsdp.flat_layout import OwnedPiece
from torch_side.fsdp.policy import MixedPrecisionPolicy, torch_dtype

__all__ = [
    "CODECS",
    "BF16GatherCodec",
    "BlockScaledCodec",
    "CastCodec",
    "CodecContext",
    "MXFP8Codec",
    "ParamStorage",
    "Scales",
    "WeightCodec",
    "codec_for",
]


class ParamStorage(enum.Enum):
    """What a module parameter of a group holds between FSDP's hooks."""

    BUFFER_VIEW = "buffer_view"  # a view of the full weights buffer (empty while sharded)
    PLACEHOLDER = "placeholder"  # a storage-free (N, K) tensor that only receives dW


class Scales(NamedTuple):
    """A group's scale tensors: one flat uint8 buffer per plane, and per parameter its view and
    its offset in that buffer (the same offset in every plane's buffer: both planes of an (M, K)
    weight have M*K/block scales). One buffer per plane lets the whole group's scales cross to
    JAX once per quantization instead of once per layer."""

    buffers: dict[Plane, torch.Tensor]
    views: dict[Plane, list[torch.Tensor]]  # views[plane][i]: blocks.scale_shape(shape_i, plane)
    offsets: list[int]


_NO_SCALES = Scales({}, {}, [])


class CodecContext(NamedTuple):
    """What ``WeightCodec.fill`` may read and write of one group (built by ``GroupBuffers``)."""

    label: str  # the group's label (names the amax collective)
    main: torch.Tensor  # fp32 main weights: the rank's shard, or the full buffer
    shapes: list[tuple[int, ...]]  # every parameter's shape, in layout order
    owned: list[OwnedPiece]  # the pieces of those parameters held in ``main``
    scales: dict[Plane, list[torch.Tensor]]  # written: scales[plane][i] (empty if unscaled)
    comm: Communicator  # the group's DP communicator (the amax all-reduce)
    main_sharded: bool  # main holds a 1/DP shard: the amax must be reduced over ranks
    kernels: KernelConfig | None  # FSDP's own quantize numerics (None: the device default)
    # The flat scale buffers per plane (parameter i's scales at scale_offsets[i]), which
    # ``scales[plane][i]`` view: a block-scaled fill writes each with one copy.
    scale_buffers: dict[Plane, torch.Tensor]
    scale_offsets: list[int]
    # Called once per block-scaled fill (or batched write) with the group's reduced packed block
    # amax (layout: BlockScaledCodec.quantize_images), after the scales are written; telemetry
    # reads it there, so that nothing keeps the buffer alive
    # (torch_side.instruments.numerics_telemetry). None: nobody listens.
    amax_observer: Callable[[torch.Tensor], None] | None = None
    # Block-atomic shards of a sharded main (torch_side.fsdp.flat_layout): the slice [lo, hi) of
    # each scale buffer that holds exactly this rank's blocks' scales. None: blocks may span ranks.
    scale_shard: tuple[int, int] | None = None


class WeightCodec:
    """Base: the facts every codec shares (from the format's row of ``FORMATS``)."""

    param_storage: ParamStorage
    quantizes_after_gather = False  # BF16GatherCodec: the layers read planes made locally

    def __init__(self, fmt: FormatKey):
        self.format = fmt
        self.spec: FormatSpec = format_spec(fmt)
        self.buffer_dtype = MixedPrecisionPolicy.model_weight_buffer_dtype(fmt)
        self.source_dtype: torch.dtype = torch_dtype(self.spec.source_dtype)

    @property
    def planes(self) -> tuple[Plane, ...]:
        """The planes the model weight buffers store (and all-gather)."""
        return self.spec.planes

    @property
    def compute_planes(self) -> tuple[Plane, ...]:
        """The planes the layers read."""
        return self.planes

    def stored_plane(self, plane: Plane) -> Plane:
        """The stored plane whose gather makes compute plane ``plane`` readable."""
        return plane

    def make_scales(self, shapes: Sequence[tuple[int, ...]], device: torch.device,
                    placed: tuple[Sequence[int], int] | None = None) -> Scales:
        """Scale tensors per plane, one per parameter (none for unscaled formats). ``placed``:
        (offsets, total) of the buffers when the layout fixes them (block-atomic shards)."""
        return _NO_SCALES

    def fill(self, ctx: CodecContext, targets: dict[Plane, torch.Tensor], phase: Phase) -> None:
        """Write ``targets[plane]`` (laid out like ``ctx.main``) from ``ctx.main``."""
        raise NotImplementedError

    def batch_key(self) -> Hashable | None:
        """Groups whose codecs give equal keys (and share a communicator, device and kernels)
        are refreshed together, with one amax all-reduce (``quantize_batch``;
        ``torch_side.fsdp.batched_refresh``). None: each group refreshes alone (``fill``)."""
        return None


class CastCodec(WeightCodec):
    """fp32 / bf16 model weights: ``buffer_dtype(main)``; parameters view the buffer."""

    param_storage = ParamStorage.BUFFER_VIEW

    def fill(self, ctx: CodecContext, targets: dict[Plane, torch.Tensor], phase: Phase) -> None:
        (plane,) = self.planes
        targets[plane].copy_(MixedPrecisionPolicy.high_precision_value(self.format, ctx.main))


class BlockScaledCodec(WeightCodec):
    """Base of the block-scaled formats' codecs: FSDP's distributed quantization of a group
    (DESIGN.md 5), with the numerics left to the format (module note).

    This class owns what is the same for every block-scaled format: the scale buffers, laid out
    by the format's ``ScaleBlocks`` (one flat uint8 buffer per plane, each parameter's scales at
    an offset aligned to 256 bytes; with block-atomic shards laid out like the group / block
    size), the ONE amax all-reduce MAX per group or per batch of groups (skipped when every rank
    holds whole parameters; with block-atomic shards replaced by an all-gather of each scale
    buffer from the slices of the blocks each rank owns, unless telemetry reads the reduced
    amax), the copies of the results into the group's buffers and the telemetry hand-off. A
    subclass supplies ``quantize_images``. FSDP stores one byte per element and per-block scales
    only: a format that packs elements or adds a tensor-level scale (``NVFP4``) is refused here
    by name.
    """

    param_storage = ParamStorage.PLACEHOLDER
    # Whether ``quantize_images`` returns tensors made by each call and kept by nothing else
    # (MXFP8: views of the JAX program's result), so that a group whose model buffers only the
    # gathers read (ZeRO-3's shards, ZeRO-1/2's staging areas) takes the images themselves as
    # those buffers instead of copying them (``GroupBuffers.refresh_from``). A codec whose images
    # are views of storage it reuses keeps the default: its images are copied.
    fresh_images: ClassVar[bool] = False

    def __init__(self, fmt: FormatKey):
        super().__init__(fmt)
        blocks = self.spec.blocks
        if blocks is None or blocks.elements_per_byte != 1 or blocks.tensor_scale_dtype:
            raise ValueError(
                f"{type(self).__name__}: weight format {self.format.value!r} has blocks "
                f"{blocks}; FSDP's block-scaled buffers hold one byte per element and one scale "
                f"per block (elements_per_byte=1, no tensor_scale_dtype)"
            )
        self.blocks: ScaleBlocks = blocks

    def make_scales(self, shapes: Sequence[tuple[int, ...]], device: torch.device,
                    placed: tuple[Sequence[int], int] | None = None) -> Scales:
        b, offsets, total = self.blocks, [], 0
        dims = [_2d(s) for s in shapes]
        if placed is not None:  # block-atomic shards: laid out like the group / block size
            offsets, total = list(placed[0]), placed[1]
        else:
            for s in dims:
                offsets.append(total)
                total += round_up(b.scale_numel(s), 256)  # aligned
        buffers = {p: torch.zeros(total, dtype=torch.uint8, device=device) for p in self.planes}
        views = {
            p: [buffers[p][o:o + b.scale_numel(s)].view(b.scale_shape(s, p))
                for s, o in zip(dims, offsets, strict=True)]
            for p in self.planes
        }
        return Scales(buffers, views, offsets)

    def batch_key(self) -> Hashable:
        return (self.format, self.source_dtype)

    def quantize_images(
        self, mains: list[torch.Tensor], pieces: list[list[Piece]],
        reduce_max: Callable[[torch.Tensor], None], device: torch.device,
        layouts: list[ScaleLayout], kernels: KernelConfig | None,
    ) -> BatchImages:
        """The format's numerics for groups ``j`` (one, or a batch): ``mains[j]`` fp32 main
        weights, ``pieces[j]`` where each parameter's owned slice sits in it, ``layouts[j]``
        its scale buffers' layout. In order:

        1. the partial block amax of ``source_dtype(slice)`` over the owned elements of every
           parameter, both planes, packed in ONE fp32 1-D tensor on ``device``: group after
           group, per parameter its rowwise then its columnwise block amax, each in its scale
           tensor's row-major order (``torch_side.instruments.numerics_telemetry`` reads this
           layout); zeros where a rank owns nothing;
        2. ``reduce_max(packed)`` exactly once (it replaces the packed amax by its maximum over
           the ranks, in place, or does nothing when every rank holds whole parameters);
        3. from the reduced amax, the full scales and the cast of the owned elements.

        Returns per group its ``GroupImages`` (each plane's bytes laid out like ``mains[j]``,
        zeros between pieces; the scale buffers laid out by ``layouts[j]``) and its slice of
        the reduced packed amax. The bytes must equal those of quantizing every whole
        ``source_dtype(parameter)`` on one rank, for any split over ranks.
        """
        raise NotImplementedError

    def quantize_batch(self, ctxs: list[CodecContext], phase: Phase, label: str) -> BatchImages:
        """``fill``'s numerics and collective for several groups at once (FSDP's batched
        refresh, ``torch_side.fsdp.batched_refresh``): the groups must share this codec's
        ``batch_key``, their communicator, device and kernels. ONE amax all-reduce (labelled
        ``label``) of the whole batch's packed amax, when some group's main is sharded. The
        caller then writes each group with ``write_images``."""
        first, reductions = ctxs[0], []
        assert all(c.comm is first.comm and c.main.device == first.main.device
                   and c.kernels == first.kernels for c in ctxs), [c.label for c in ctxs]

        # block-atomic shards: every block's amax is whole on its owner, whose scales are then
        # all-gathered (write_images), unless telemetry reads every block's reduced amax
        own_blocks = all(_gathers_scales(c) for c in ctxs)

        sharded = any(c.main_sharded for c in ctxs)  # else every rank holds whole parameters

        def reduce_max(packed: torch.Tensor) -> None:
            reductions.append(label)
            if own_blocks:
                return
            if sharded:
                first.comm.all_reduce(packed, Collective.ALL_REDUCE_MAX, phase, label)

        identity = own_blocks or not sharded or first.comm.world_size == 1
        made = self.quantize_images(
            [c.main for c in ctxs], [_pieces(c) for c in ctxs],
            AmaxReduction(reduce_max, identity), first.main.device,
            [_scale_layout(c) for c in ctxs], first.kernels,
        )
        if len(reductions) != 1:
            raise RuntimeError(
                f"{type(self).__name__}.quantize_images called reduce_max {len(reductions)} "
                f"times for {[c.label for c in ctxs]}; the recipe reduces the packed amax exactly "
                f"once (every rank must issue the same collectives)"
            )
        return made

    def fill(self, ctx: CodecContext, targets: dict[Plane, torch.Tensor], phase: Phase) -> None:
        made = self.quantize_batch([ctx], phase, f"{ctx.label}/amax")
        self.write_images(ctx, made.images[0], made.amax[0], targets, phase)

    def write_images(self, ctx: CodecContext, images: GroupImages, amax: torch.Tensor,
                     targets: Mapping[Plane, torch.Tensor | None],
                     phase: Phase) -> dict[Plane, torch.Tensor]:
        """Copy a group's images into its targets and scale buffers (one ``copy_`` each); a
        target given as None is not copied: the plane's image itself is handed back for the
        caller to keep (``fresh_images``). With block-atomic shards, all-gather each scale buffer
        from every rank's own slice; then show its reduced packed amax to
        ``ctx.amax_observer``. Returns where each plane's bytes now are."""
        data = {Plane.ROWWISE: (images.rowwise, images.rowwise_scale),
                Plane.COLWISE: (images.colwise, images.colwise_scale)}
        written: dict[Plane, torch.Tensor] = {}
        # whole-buffer copies: the images hold zeros where padding or other ranks' parts are
        for plane in self.planes:
            target = targets[plane]
            if target is not None:
                target.copy_(data[plane][0])
            written[plane] = data[plane][0] if target is None else target
            ctx.scale_buffers[plane].copy_(data[plane][1])
        if _gathers_scales(ctx):
            assert ctx.scale_shard is not None
            lo, hi = ctx.scale_shard
            for plane in self.planes:  # the slice is this rank's own blocks' scales
                buf = ctx.scale_buffers[plane]
                ctx.comm.all_gather(buf, buf[lo:hi].clone(), phase,
                                    f"{ctx.label}/scales/{plane.value}")
        if ctx.amax_observer is not None:
            ctx.amax_observer(amax)
        return written


class MXFP8Codec(BlockScaledCodec):
    """MXFP8 planes of ``bf16(main)``: the numerics are ``jax_side.mxfp8``'s slice kernels
    (``bridge.mxfp8_slices``), one program per step for a group alone, one for a batch. Its
    images are views of each program's own result (``fresh_images``)."""

    fresh_images = True

    def quantize_images(
        self, mains: list[torch.Tensor], pieces: list[list[Piece]],
        reduce_max: Callable[[torch.Tensor], None], device: torch.device,
        layouts: list[ScaleLayout], kernels: KernelConfig | None,
    ) -> BatchImages:
        kw: dict[str, Any] = {"kernels": kernels, "source_dtype": self.source_dtype}
        one_pass = getattr(reduce_max, "identity", False)  # amax and bytes from one read
        if one_pass or len(mains) > 1:
            return quantize_batch_into_images(mains, pieces, reduce_max, device, layouts,
                                              one_pass=one_pass, **kw)
        reduced: list[torch.Tensor] = []

        def keep(packed: torch.Tensor) -> None:
            reduce_max(packed)
            reduced.append(packed)

        images = quantize_into_images(mains[0], pieces[0], keep, device, layouts[0], **kw)
        return BatchImages([GroupImages(*images)], reduced)


def _pieces(ctx: CodecContext) -> list[Piece]:
    """Every parameter's piece in ``ctx.main`` (numel 0: this rank holds none of it)."""
    owned = {p.slot_index: p for p in ctx.owned}
    pieces = []
    for i, shape in enumerate(_2d(s) for s in ctx.shapes):
        p = owned.get(i)
        pieces.append(Piece(shape, 0, 0, 0) if p is None
                      else Piece(shape, p.param_offset, p.shard_offset, p.numel))
    return pieces


def _gathers_scales(ctx: CodecContext) -> bool:
    """Whether the group's scales are made by their owners and all-gathered (block-atomic shards
    of a sharded main, and no telemetry reading every block's reduced amax)."""
    return ctx.scale_shard is not None and ctx.amax_observer is None


def _2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """A block-scaled parameter's (M, K) (the policy routes only 2-D ones to such groups)."""
    m, k = shape
    return (m, k)


def _scale_layout(ctx: CodecContext) -> ScaleLayout:
    return ScaleLayout(tuple(ctx.scale_offsets), ctx.scale_buffers[Plane.ROWWISE].numel())


class BF16GatherCodec(WeightCodec):
    """Block-scaled compute from bf16 all-gathers (``GatherMode.BF16``; module note). Stored
    and gathered: bf16(main), one plane; read by the layers: the format's planes
    ``quantize_gathered`` makes from the full bf16 weights (``compute``: the format's own
    codec). Parameters are placeholders, as for the format itself, so dW arrives in
    the parameter's dtype (fp32), never rounded to bf16."""

    param_storage = ParamStorage.PLACEHOLDER
    quantizes_after_gather = True

    def __init__(self, fmt: FormatKey):
        compute = codec_for(fmt)
        if not isinstance(compute, BlockScaledCodec):
            raise ValueError(
                f"BF16GatherCodec: weight format {fmt.value!r} is not block-scaled; its weights "
                f"are gathered as they are (GatherMode.MXFP8)"
            )
        super().__init__(WeightFormat.BF16)  # what the buffers hold
        self.compute = compute
        self.format = fmt  # the format the layers compute with (the group's key)

    @property
    def compute_planes(self) -> tuple[Plane, ...]:
        return self.compute.planes

    def stored_plane(self, plane: Plane) -> Plane:
        return self.spec.forward_plane

    def make_scales(self, shapes: Sequence[tuple[int, ...]], device: torch.device,
                    placed: tuple[Sequence[int], int] | None = None) -> Scales:
        return self.compute.make_scales(shapes, device, placed)  # written by quantize_gathered

    def fill(self, ctx: CodecContext, targets: dict[Plane, torch.Tensor], phase: Phase) -> None:
        (plane,) = self.planes
        targets[plane].copy_(MixedPrecisionPolicy.high_precision_value(WeightFormat.BF16,
                                                                       ctx.main))

    def quantize_gathered(self, ctx: CodecContext, targets: dict[Plane, torch.Tensor]) -> None:
        """``targets[plane]`` (full, laid out like the gathered buffer ``ctx.main``) and
        ``ctx.scales`` from the full bf16 weights: every parameter whole, no collective
        (``ctx.main_sharded`` must be False)."""
        assert not ctx.main_sharded and ctx.main.dtype == torch.bfloat16, ctx
        self.compute.fill(ctx, targets, Phase.FORWARD)  # phase: only names a collective


CODECS: dict[FormatKey, type[WeightCodec]] = {
    WeightFormat.FP32: CastCodec,
    WeightFormat.BF16: CastCodec,
    WeightFormat.MXFP8_E4M3: MXFP8Codec,
}


def codec_for(fmt: FormatKey, gather: GatherMode = GatherMode.MXFP8) -> WeightCodec:
    """The codec of a format FSDP implements (a block-scaled one gathered as ``gather`` says);
    a clear error for any other."""
    spec = format_spec(fmt)
    if gather is GatherMode.BF16 and spec.blocks is not None:
        return BF16GatherCodec(fmt)
    try:
        cls = CODECS[fmt]
    except KeyError:
        what = "unscaled" if spec.blocks is None else (
            f"block-scaled, {spec.blocks.block_size}-element blocks of {spec.blocks.element_dtype}"
        )
        raise ValueError(
            f"weight format {fmt.value!r} ({what}) has no FSDP implementation in torch_side; "
            f"supported: {[f.value for f in CODECS]}. Choose one of them in "
            f"MixedPrecisionPolicy(linear_weight_format=..., other_format=...)"
        ) from None
    return cls(fmt)
