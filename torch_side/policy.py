"""Mixed-precision policy: weight formats as an enum with one table of facts (DESIGN.md 5).

A :class:`MixedPrecisionPolicy` says which format the *model weights* of each parameter take
(what forward and backward read), plus the dtypes of the fp32 main weights, the main gradients
and the gradient communication. MXFP8 applies to the weights of ``bridge.MXFP8Linear`` layers in
``LinearMode.MXFP8`` whose shape allows it; every other parameter (norms, biases, embeddings,
plain ``nn.Linear``) takes ``other_format``. A linear
weight whose shape is not a multiple of 32 either raises or falls back to ``other_format``, by the
explicit :class:`UnalignedLinear` choice.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = [
    "FORMAT_FACTS",
    "FormatFacts",
    "MixedPrecisionPolicy",
    "UnalignedLinear",
    "WeightFormat",
]

MXFP8_BLOCK = 32


class WeightFormat(enum.Enum):
    """Format of the model weights that forward/backward read (room left for NVFP4)."""

    FP32 = "fp32"
    BF16 = "bf16"
    MXFP8_E4M3 = "mxfp8_e4m3"


@dataclasses.dataclass(frozen=True)
class FormatFacts:
    buffer_dtype: torch.dtype  # dtype of the model weight buffer (and the columnwise buffer)
    compute_dtype: torch.dtype  # high-precision dtype the weight is quantized from / computed in
    has_colwise_plane: bool  # needs a backward-specific (columnwise) weight buffer
    block_shape_multiple: int  # every dim of a 2-D weight must be a multiple of this (1: any)


FORMAT_FACTS: dict[WeightFormat, FormatFacts] = {
    WeightFormat.FP32: FormatFacts(torch.float32, torch.float32, False, 1),
    WeightFormat.BF16: FormatFacts(torch.bfloat16, torch.bfloat16, False, 1),
    WeightFormat.MXFP8_E4M3: FormatFacts(torch.uint8, torch.bfloat16, True, MXFP8_BLOCK),
}


class UnalignedLinear(enum.Enum):
    """What to do with a linear weight whose shape does not fit the block-scaled format."""

    RAISE = "raise"
    FALLBACK = "fallback"  # keep it in ``other_format`` (its own group)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Frozen mixed-precision policy; validated on construction.

    linear_weight_format: format of ``bridge.MXFP8Linear`` weights in ``LinearMode.MXFP8``
    (MXFP8 when their shapes allow it).
    other_format: format of every other parameter (must not be block-scaled).
    main_param_dtype: dtype of the main weights the optimizer updates (fp32).
    main_grad_dtype: dtype of the reduced gradient shards (fp32 or bf16).
    grad_comm_dtype: dtype gradients are reduced in (fp32 or bf16).
    unaligned_linear: RAISE or FALLBACK for linear weights whose shape is not a multiple of 32.
    """

    linear_weight_format: WeightFormat = WeightFormat.MXFP8_E4M3
    other_format: WeightFormat = WeightFormat.FP32
    main_param_dtype: torch.dtype = torch.float32
    main_grad_dtype: torch.dtype = torch.float32
    grad_comm_dtype: torch.dtype = torch.float32
    unaligned_linear: UnalignedLinear = UnalignedLinear.RAISE

    def __post_init__(self) -> None:
        for name in ("linear_weight_format", "other_format"):
            if not isinstance(getattr(self, name), WeightFormat):
                raise TypeError(
                    f"MixedPrecisionPolicy.{name}={getattr(self, name)!r}: expected a WeightFormat,"
                    f" e.g. WeightFormat.MXFP8_E4M3"
                )
        if FORMAT_FACTS[self.other_format].block_shape_multiple != 1:
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

    def weight_format(self, name: str, param: torch.Tensor, is_linear_weight: bool) -> WeightFormat:
        """The model weight format of one parameter (``name`` only appears in errors)."""
        if not is_linear_weight:
            return self.other_format
        fmt = self.linear_weight_format
        multiple = FORMAT_FACTS[fmt].block_shape_multiple
        shape = tuple(param.shape)
        if multiple == 1 or (len(shape) == 2 and all(d % multiple == 0 and d > 0 for d in shape)):
            return fmt
        if self.unaligned_linear is UnalignedLinear.FALLBACK:
            return self.other_format
        raise ValueError(
            f"parameter {name!r} of shape {shape} cannot be {fmt.value}: its dims must be "
            f"multiples of {multiple}; pad the layer, or pass MixedPrecisionPolicy("
            f"unaligned_linear=UnalignedLinear.FALLBACK) to keep it in {self.other_format.value}"
        )

    @staticmethod
    def buffer_dtype(fmt: WeightFormat) -> torch.dtype:
        """dtype of the model weight buffer for this format (uint8 bytes for MXFP8)."""
        return FORMAT_FACTS[fmt].buffer_dtype

    @staticmethod
    def needs_colwise(fmt: WeightFormat) -> bool:
        """Whether backward needs a separate columnwise (transpose) weight buffer."""
        return FORMAT_FACTS[fmt].has_colwise_plane

    @staticmethod
    def high_precision_value(fmt: WeightFormat, main: torch.Tensor) -> torch.Tensor:
        """The high-precision value the model weight is made from: ``compute_dtype(main)``."""
        return main.to(FORMAT_FACTS[fmt].compute_dtype)
