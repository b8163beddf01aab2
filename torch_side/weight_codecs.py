"""How FSDP makes a format's model weights from the fp32 main weights: one codec per format.

``CODECS`` maps every ``WeightFormat`` FSDP implements to a :class:`WeightCodec`; ``codec_for``
refuses any other format (e.g. ``NVFP4``, described in ``common.formats.FORMATS`` but not
implemented here) with a clear error. A codec answers, from the format's table row:

- which planes the model weights consist of and their buffer dtype (``spec``, ``buffer_dtype``);
- where module parameters live (:class:`ParamStorage`): views of the weights buffer (fp32/bf16:
  Torch modules compute with them directly), or storage-free placeholders that only receive
  gradients while the layer reads the planes FSDP injects (MXFP8: ``bridge.mxfp8_linear``);
- the scale tensors the format keeps (MXFP8: full, replicated E8M0 scales per plane);
- ``fill``: write this rank's part of every plane from ``main`` -- a cast, or the distributed
  MXFP8 quantization (DESIGN.md 5: partial amax, one all-reduce MAX, scales, cast of owned
  elements).

A codec's ``planes`` are what the model weight buffers store and all-gather; ``compute_planes``
what the layers read. They are the same planes except under ``GatherMode.BF16``
(:class:`BF16GatherCodec`): an MXFP8 weight is then stored and gathered as bf16(main), one plane
of 2 bytes per element, and after each gather every rank quantizes the group's full bf16 weights
itself (``quantize_gathered``, the MXFP8 codec's ``fill`` on the whole tensor with no amax
reduction) into buffers laid out like the MXFP8 planes -- the same bytes the distributed
quantization writes (DESIGN.md 5), read by the same linear programs at the same offsets.

``fill`` sees its group only through a :class:`CodecContext`: the main weights, which pieces of
which parameter shapes they hold, the scale tensors to write and the communicator for the amax
reduction -- exactly what a codec reads and writes, nothing else of the group.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

import torch

from common.formats import FormatSpec, Plane, WeightFormat, format_spec, scale_shape
from common.kernels import KernelConfig
from common.modes import GatherMode
from torch_side.collectives import Collective, Communicator, Phase
from torch_side.distributed_quantize import (
    BatchImages,
    GroupImages,
    Piece,
    ScaleLayout,
    quantize_batch_into_images,
    quantize_into_images,
)
from torch_side.flat_layout import OwnedPiece
from torch_side.policy import MixedPrecisionPolicy, torch_dtype

__all__ = [
    "CODECS",
    "BF16GatherCodec",
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
    weight have M*K/32 scales). One buffer per plane lets the whole group's scales cross to JAX
    once per quantization instead of once per layer."""

    buffers: dict[Plane, torch.Tensor]
    views: dict[Plane, list[torch.Tensor]]  # views[plane][i]: scale_shape(shape_i, plane)
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
    kernels: KernelConfig | None  # FSDP's own MXFP8 numerics (None: the device default)
    # Called once per MXFP8 fill (or batched write) with the group's reduced packed block amax
    # (layout: bridge.mxfp8_slices), after the scales are written; telemetry reads it there, so
    # that nothing keeps the buffer alive (torch_side.numerics_telemetry). None: nobody listens.
    amax_observer: Callable[[torch.Tensor], None] | None = None
    # The flat scale buffers per plane (parameter i's scales at scale_offsets[i]), which
    # ``scales[plane][i]`` view: an MXFP8 fill writes each with one copy.
    scale_buffers: dict[Plane, torch.Tensor] | None = None
    scale_offsets: list[int] | None = None


class WeightCodec:
    """Base: the facts every codec shares (from the format's row of ``FORMATS``)."""

    param_storage: ParamStorage
    quantizes_after_gather = False  # BF16GatherCodec: the layers read planes made locally

    def __init__(self, fmt: WeightFormat):
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

    def make_scales(self, shapes, device) -> Scales:
        """Scale tensors per plane, one per parameter (none for unscaled formats)."""
        return _NO_SCALES

    def fill(self, ctx: CodecContext, targets: dict[Plane, torch.Tensor], phase: Phase) -> None:
        """Write ``targets[plane]`` (laid out like ``ctx.main``) from ``ctx.main``."""
        raise NotImplementedError


class CastCodec(WeightCodec):
    """fp32 / bf16 model weights: ``buffer_dtype(main)``; parameters view the buffer."""

    param_storage = ParamStorage.BUFFER_VIEW

    def fill(self, ctx: CodecContext, targets, phase) -> None:
        (plane,) = self.planes
        targets[plane].copy_(MixedPrecisionPolicy.high_precision_value(self.format, ctx.main))


class MXFP8Codec(WeightCodec):
    """MXFP8 planes of ``bf16(main)`` by the batched distributed quantization."""

    param_storage = ParamStorage.PLACEHOLDER

    def make_scales(self, shapes, device) -> Scales:
        offsets, total = [], 0
        for s in shapes:
            offsets.append(total)
            total += -(-(s[0] * s[1] // self.spec.blocks.block_size) // 256) * 256  # aligned
        buffers = {p: torch.zeros(total, dtype=torch.uint8, device=device) for p in self.planes}
        views = {
            p: [buffers[p][o:o + s[0] * s[1] // self.spec.blocks.block_size].view(
                scale_shape(s, p)) for s, o in zip(shapes, offsets, strict=True)]
            for p in self.planes
        }
        return Scales(buffers, views, offsets)

    def fill(self, ctx: CodecContext, targets, phase) -> None:
        reduced: list[torch.Tensor] = []

        def reduce_max(packed: torch.Tensor) -> None:
            if ctx.main_sharded:  # else every rank holds whole parameters
                ctx.comm.all_reduce(packed, Collective.ALL_REDUCE_MAX, phase, f"{ctx.label}/amax")
            reduced.append(packed)

        images = quantize_into_images(
            ctx.main, _pieces(ctx), reduce_max, ctx.main.device, _scale_layout(ctx),
            kernels=ctx.kernels, source_dtype=self.source_dtype,
        )
        self.write_images(ctx, GroupImages(*images), reduced[0], targets)

    def quantize_batch(self, ctxs: list[CodecContext], phase: Phase, label: str) -> BatchImages:
        """``fill``'s numerics and collective for several groups at once (FSDP's batched
        refresh, ``torch_side.batched_refresh``): the groups must share this codec's source
        dtype, their communicator, device and kernels. ONE amax all-reduce (labelled ``label``)
        of the whole batch's packed amax, when some group's main is sharded. The caller then
        writes each group with ``write_images``."""
        first = ctxs[0]
        assert all(c.comm is first.comm and c.main.device == first.main.device
                   and c.kernels == first.kernels for c in ctxs), [c.label for c in ctxs]

        def reduce_max(packed: torch.Tensor) -> None:
            if any(c.main_sharded for c in ctxs):  # else every rank holds whole parameters
                first.comm.all_reduce(packed, Collective.ALL_REDUCE_MAX, phase, label)

        return quantize_batch_into_images(
            [c.main for c in ctxs], [_pieces(c) for c in ctxs], reduce_max, first.main.device,
            [_scale_layout(c) for c in ctxs], kernels=first.kernels,
            source_dtype=self.source_dtype,
        )

    def write_images(self, ctx: CodecContext, images: GroupImages, amax: torch.Tensor,
                     targets: dict[Plane, torch.Tensor]) -> None:
        """Copy a group's images into its targets and scale buffers (four ``copy_``), then show
        its reduced packed amax to ``ctx.amax_observer``."""
        # whole-buffer copies: the images hold zeros where padding or other ranks' parts are
        targets[Plane.ROWWISE].copy_(images.rowwise)
        targets[Plane.COLWISE].copy_(images.colwise)
        ctx.scale_buffers[Plane.ROWWISE].copy_(images.rowwise_scale)
        ctx.scale_buffers[Plane.COLWISE].copy_(images.colwise_scale)
        if ctx.amax_observer is not None:
            ctx.amax_observer(amax)


def _pieces(ctx: CodecContext) -> list[Piece]:
    """Every parameter's piece in ``ctx.main`` (numel 0: this rank holds none of it)."""
    owned = {p.slot_index: p for p in ctx.owned}
    pieces = []
    for i, shape in enumerate(ctx.shapes):
        p = owned.get(i)
        pieces.append(Piece(shape, 0, 0, 0) if p is None
                      else Piece(shape, p.param_offset, p.shard_offset, p.numel))
    return pieces


def _scale_layout(ctx: CodecContext) -> ScaleLayout:
    return ScaleLayout(tuple(ctx.scale_offsets), ctx.scale_buffers[Plane.ROWWISE].numel())


class BF16GatherCodec(WeightCodec):
    """MXFP8 compute from bf16 all-gathers (``GatherMode.BF16``; module note). Stored and
    gathered: bf16(main), one plane; read by the layers: the MXFP8 planes ``quantize_gathered``
    makes from the full bf16 weights. Parameters are placeholders, as for MXFP8, so dW arrives in
    the parameter's dtype (fp32), never rounded to bf16."""

    param_storage = ParamStorage.PLACEHOLDER
    quantizes_after_gather = True

    def __init__(self, fmt: WeightFormat):
        super().__init__(WeightFormat.BF16)  # what the buffers hold
        self.compute = MXFP8Codec(fmt)
        self.format = fmt  # the format the layers compute with (the group's key)

    @property
    def compute_planes(self) -> tuple[Plane, ...]:
        return self.compute.planes

    def stored_plane(self, plane: Plane) -> Plane:
        return self.spec.forward_plane

    def make_scales(self, shapes, device) -> Scales:
        return self.compute.make_scales(shapes, device)  # written by quantize_gathered

    def fill(self, ctx: CodecContext, targets, phase) -> None:
        (plane,) = self.planes
        targets[plane].copy_(MixedPrecisionPolicy.high_precision_value(WeightFormat.BF16,
                                                                       ctx.main))

    def quantize_gathered(self, ctx: CodecContext, targets: dict[Plane, torch.Tensor]) -> None:
        """``targets[plane]`` (full, laid out like the gathered buffer ``ctx.main``) and
        ``ctx.scales`` from the full bf16 weights: every parameter whole, no collective
        (``ctx.main_sharded`` must be False)."""
        assert not ctx.main_sharded and ctx.main.dtype == torch.bfloat16, ctx
        self.compute.fill(ctx, targets, Phase.FORWARD)  # phase: only names a collective


CODECS: dict[WeightFormat, type[WeightCodec]] = {
    WeightFormat.FP32: CastCodec,
    WeightFormat.BF16: CastCodec,
    WeightFormat.MXFP8_E4M3: MXFP8Codec,
}


def codec_for(fmt: WeightFormat, gather: GatherMode = GatherMode.MXFP8) -> WeightCodec:
    """The codec of a format FSDP implements (a block-scaled one gathered as ``gather`` says);
    a clear error for any other."""
    if gather is GatherMode.BF16 and fmt is WeightFormat.MXFP8_E4M3:
        return BF16GatherCodec(fmt)
    try:
        cls = CODECS[fmt]
    except KeyError:
        spec = format_spec(fmt)
        what = "unscaled" if spec.blocks is None else (
            f"block-scaled, {spec.blocks.block_size}-element blocks of {spec.blocks.element_dtype}"
        )
        raise ValueError(
            f"weight format {fmt.value!r} ({what}) has no FSDP implementation in torch_side; "
            f"supported: {[f.value for f in CODECS]}. Choose one of them in "
            f"MixedPrecisionPolicy(linear_weight_format=..., other_format=...)"
        ) from None
    return cls(fmt)
