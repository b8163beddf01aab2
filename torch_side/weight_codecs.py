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
"""

from __future__ import annotations

import enum

import torch

from common.formats import FormatSpec, Plane, WeightFormat, format_spec, scale_shape
from common.kernels import KernelConfig
from torch_side.collectives import Collective, Phase
from torch_side.distributed_quantize import quantize_with_reducer
from torch_side.policy import MixedPrecisionPolicy, torch_dtype

__all__ = ["CODECS", "CastCodec", "MXFP8Codec", "ParamStorage", "WeightCodec", "codec_for"]


class ParamStorage(enum.Enum):
    """What a module parameter of a group holds between FSDP's hooks."""

    BUFFER_VIEW = "buffer_view"  # a view of the full weights buffer (empty while sharded)
    PLACEHOLDER = "placeholder"  # a storage-free (N, K) tensor that only receives dW


class WeightCodec:
    """Base: the facts every codec shares (from the format's row of ``FORMATS``)."""

    param_storage: ParamStorage

    def __init__(self, fmt: WeightFormat):
        self.format = fmt
        self.spec: FormatSpec = format_spec(fmt)
        self.buffer_dtype = MixedPrecisionPolicy.model_weight_buffer_dtype(fmt)
        self.source_dtype: torch.dtype = torch_dtype(self.spec.source_dtype)

    @property
    def planes(self) -> tuple[Plane, ...]:
        return self.spec.planes

    def make_scales(self, shapes, device) -> dict[Plane, list[torch.Tensor]]:
        """Scale tensors per plane, one per parameter (none for unscaled formats)."""
        return {}

    def fill(self, group, targets: dict[Plane, torch.Tensor], phase: Phase) -> None:
        """Write ``targets[plane]`` (laid out like ``group.main``) from ``group.main``."""
        raise NotImplementedError


class CastCodec(WeightCodec):
    """fp32 / bf16 model weights: ``buffer_dtype(main)``; parameters view the buffer."""

    param_storage = ParamStorage.BUFFER_VIEW

    def fill(self, group, targets, phase) -> None:
        (plane,) = self.planes
        targets[plane].copy_(MixedPrecisionPolicy.high_precision_value(self.format, group.main))


class MXFP8Codec(WeightCodec):
    """MXFP8 planes of ``bf16(main)`` by the batched distributed quantization."""

    param_storage = ParamStorage.PLACEHOLDER

    def make_scales(self, shapes, device) -> dict[Plane, list[torch.Tensor]]:
        return {
            p: [torch.zeros(scale_shape(s, p), dtype=torch.uint8, device=device) for s in shapes]
            for p in self.planes
        }

    def fill(self, group, targets, phase) -> None:
        pieces = {p.slot_index: p for p in group.main_pieces()}
        shards, starts = [], []
        for i in range(len(group.layout.slots)):
            p = pieces.get(i)
            shards.append(
                None if p is None else group.main[p.shard_offset : p.shard_offset + p.numel]
            )
            starts.append(0 if p is None else p.param_offset)

        def reduce_max(packed: torch.Tensor) -> None:
            if group.facts.main_weights_sharded:  # else every rank holds whole parameters
                group.comm.all_reduce(
                    packed, Collective.ALL_REDUCE_MAX, phase, f"{group.label}/amax"
                )

        shapes = [s.shape for s in group.layout.slots]
        kernels: KernelConfig = group.kernels
        results = quantize_with_reducer(
            shards, shapes, starts, reduce_max, group.device, kernels=kernels,
            source_dtype=self.source_dtype,
        )
        for i, res in enumerate(results):
            group.scales[Plane.ROWWISE][i].copy_(res.rowwise_scale)
            group.scales[Plane.COLWISE][i].copy_(res.colwise_scale)
            p = pieces.get(i)
            if p is not None:
                lo, hi = p.shard_offset, p.shard_offset + p.numel
                targets[Plane.ROWWISE][lo:hi].copy_(res.rowwise)
                targets[Plane.COLWISE][lo:hi].copy_(res.colwise)


CODECS: dict[WeightFormat, type[WeightCodec]] = {
    WeightFormat.FP32: CastCodec,
    WeightFormat.BF16: CastCodec,
    WeightFormat.MXFP8_E4M3: MXFP8Codec,
}


def codec_for(fmt: WeightFormat) -> WeightCodec:
    """The codec of a format FSDP implements; a clear error for any other."""
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
