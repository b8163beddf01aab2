"""Mixed-precision policy: which ``WeightFormat`` each parameter's model weights take (DESIGN.md 5).

A :class:`MixedPrecisionPolicy` says which format the *model weights* of each parameter take
(what forward and backward read), plus the dtypes of the fp32 main weights, the main gradients
and the gradient communication. The linear-weight format applies to the parameters a module
declares block-scaled through ``mxfp8_params()`` (``common.formats.BlockScaledParams``; e.g. the
weight of a ``bridge.MXFP8Linear`` in ``LinearMode.MXFP8``) whose shape allows it; every other
parameter (norms, biases, embeddings, plain ``nn.Linear``) takes ``other_format``. A linear
weight whose shape does not fit a block-scaled format either raises or falls back to
``other_format``, by the explicit :class:`UnalignedLinear` choice. ``gather``
(``common.modes.GatherMode``) says what a block-scaled weight's all-gathers carry: its MXFP8
planes (1 byte per element) or bf16(main) (2 bytes per element, quantized by every rank after the
gather); the GEMMs read the same MXFP8 bytes either way (``torch_side.fsdp.weight_codecs``).

Every fact about a format comes from the one table ``common.formats.FORMATS`` (buffer dtype,
source dtype, planes, block scaling); the static helpers below answer the questions FSDP asks of
a format from that table. Whether FSDP *implements* a format is a separate table
(``torch_side.fsdp.weight_codecs``), consulted by ``fully_shard``.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from common.enums import parse_enum
from common.formats import (
    FORMATS,
    FormatKey,
    FormatSpec,
    Plane,
    WeightFormat,
    block_scaled_params,
    format_spec,
)
from common.modes import GatherMode
from torch_side.fsdp.flat_layout import ShardLayout

__all__ = [
    "GatherMode",
    "MixedPrecisionPolicy",
    "UnalignedLinear",
    "WeightFormat",
    "torch_dtype",
]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name used in ``common.formats.FORMATS``."""
    return _TORCH_DTYPES[name]


class UnalignedLinear(enum.Enum):
    """What to do with a linear weight whose shape does not fit the block-scaled format."""

    RAISE = "raise"
    FALLBACK = "fallback"  # keep it in ``other_format`` (its own group)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Frozen mixed-precision policy; validated on construction.

    linear_weight_format: format of the parameters modules declare block-scaled (``mxfp8_params()``,
    e.g. ``bridge.MXFP8Linear`` weights in ``LinearMode.MXFP8``), when their shapes allow it.
    other_format: format of every other parameter (must not be block-scaled).
    main_param_dtype: dtype of the main weights the optimizer updates (fp32).
    main_grad_dtype: dtype of the reduced gradient shards (fp32 or bf16).
    grad_comm_dtype: dtype gradients are reduced in (fp32 or bf16).
    unaligned_linear: RAISE or FALLBACK for linear weights whose shape does not fit the format.
    gather: what the all-gathers of block-scaled weights carry (``GatherMode``): MXFP8 planes
    (default) or bf16(main), quantized after the gather; BF16 needs a block-scaled
    ``linear_weight_format``. Either way dW arrives in the parameter's dtype (fp32), never
    rounded to the gather's dtype.
    shard_layout: where block-scaled groups' shard boundaries may fall (``ShardLayout``): LCM
    (default, rows whole) or BLOCK_ATOMIC (whole 32-row scale blocks; more padding at large world
    sizes; ``torch_side.fsdp.flat_layout``). The bytes of every plane are the same either way.
    """

    linear_weight_format: FormatKey = WeightFormat.MXFP8_E4M3
    other_format: FormatKey = WeightFormat.FP32
    main_param_dtype: torch.dtype = torch.float32
    main_grad_dtype: torch.dtype = torch.float32
    grad_comm_dtype: torch.dtype = torch.float32
    unaligned_linear: UnalignedLinear = UnalignedLinear.RAISE
    gather: GatherMode = GatherMode.MXFP8
    shard_layout: ShardLayout = ShardLayout.LCM

    def __post_init__(self) -> None:
        for name in ("linear_weight_format", "other_format"):
            fmt = getattr(self, name)
            if not isinstance(fmt, FormatKey) or fmt not in FORMATS:
                raise TypeError(
                    f"MixedPrecisionPolicy.{name}={fmt!r}: expected a WeightFormat, e.g. "
                    f"WeightFormat.MXFP8_E4M3, or a format registered with "
                    f"common.formats.register_format"
                )
        if FORMATS[self.other_format].blocks is not None:
            raise ValueError(
                f"MixedPrecisionPolicy.other_format={self.other_format}: norms, biases and "
                f"embeddings cannot be block-scaled; use WeightFormat.BF16 or WeightFormat.FP32"
            )
        if self.main_param_dtype != torch.float32:
            raise ValueError(
                f"MixedPrecisionPolicy.main_param_dtype={self.main_param_dtype}: main weights are "
                f"fp32 (MXFP8 planes are quantized from bf16(fp32 main)); use torch.float32"
            )
        for name in ("main_grad_dtype", "grad_comm_dtype"):
            if getattr(self, name) not in (torch.float32, torch.bfloat16):
                raise ValueError(
                    f"MixedPrecisionPolicy.{name}={getattr(self, name)}: expected torch.float32 or"
                    f" torch.bfloat16"
                )
        if not isinstance(self.unaligned_linear, UnalignedLinear):
            raise TypeError(
                f"MixedPrecisionPolicy.unaligned_linear={self.unaligned_linear!r}: expected "
                f"UnalignedLinear.RAISE or UnalignedLinear.FALLBACK"
            )
        gather = parse_enum(GatherMode, self.gather, what="MixedPrecisionPolicy.gather")
        object.__setattr__(self, "gather", gather)
        object.__setattr__(self, "shard_layout", ShardLayout.parse(self.shard_layout))
        if gather is GatherMode.BF16 and FORMATS[self.linear_weight_format].blocks is None:
            raise ValueError(
                f"MixedPrecisionPolicy(gather=GatherMode.BF16, linear_weight_format="
                f"{self.linear_weight_format}): a bf16 gather replaces the all-gather of "
                f"block-scaled weights, but {self.linear_weight_format.value} weights are gathered "
                f"as they are; use linear_weight_format=WeightFormat.MXFP8_E4M3, or "
                f"gather=GatherMode.MXFP8"
            )

    def param_format(self, module: torch.nn.Module, pname: str, qualified_name: str) -> FormatKey:
        """The model weight format of ``module``'s own parameter ``pname``, from what the module
        declares (``common.formats.block_scaled_params``)."""
        declared = pname in block_scaled_params(module)
        return self.weight_format(qualified_name, getattr(module, pname), declared)

    def weight_format(self, name: str, param: torch.Tensor, block_scaled: bool) -> FormatKey:
        """The model weight format of one parameter, declared block-scaled or not (``name`` only
        appears in errors)."""
        if not block_scaled:
            return self.other_format
        fmt = self.linear_weight_format
        shape = tuple(param.shape)
        problem = FORMATS[fmt].shape_problem(shape)
        if problem is None:
            return fmt
        if self.unaligned_linear is UnalignedLinear.FALLBACK:
            return self.other_format
        raise ValueError(
            f"parameter {name!r} of shape {shape} cannot be {fmt.value}: {problem}; pad the "
            f"layer, or pass MixedPrecisionPolicy(unaligned_linear=UnalignedLinear.FALLBACK) to "
            f"keep it in {self.other_format.value}"
        )

    # ---- the questions FSDP asks of a format (answered from common.formats.FORMATS) --------
    @staticmethod
    def spec(fmt: FormatKey) -> FormatSpec:
        return format_spec(fmt)

    @staticmethod
    def model_weight_buffer_dtype(fmt: FormatKey) -> torch.dtype:
        """dtype of the model weight buffer (and of every plane's buffer): uint8 bytes for MXFP8."""
        return torch_dtype(format_spec(fmt).buffer_dtype)

    @staticmethod
    def requires_backward_specific_weight(fmt: FormatKey) -> bool:
        """Whether backward reads another plane than forward (MXFP8: the columnwise plane)."""
        spec = format_spec(fmt)
        return spec.backward_plane is not spec.forward_plane

    @staticmethod
    def planes(fmt: FormatKey) -> tuple[Plane, ...]:
        """The planes the model weights consist of (forward reads the first, backward the last)."""
        return format_spec(fmt).planes

    @staticmethod
    def high_precision_value(fmt: FormatKey, main: torch.Tensor) -> torch.Tensor:
        """The high-precision value the model weight is made from: ``source_dtype(main)``
        (bf16(main) for MXFP8, DESIGN.md 3; the weights themselves for fp32/bf16)."""
        return main.to(torch_dtype(format_spec(fmt).source_dtype))
