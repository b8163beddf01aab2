"""The enums of how a linear layer multiplies (``LinearMode``) and how FSDP gathers its weights
(``GatherMode``), shared by every layer.

The bridge's Torch op, the Flax twin, the Torch twin, FSDP (which weights get MXFP8 planes) and
the applications all take ``LinearMode``; there is no second spelling to convert between.
``GatherMode`` is ``torch_side.MixedPrecisionPolicy.gather`` and ``mxfp8-train --gather``.
"""

from __future__ import annotations

import enum

from common.enums import parse_enum

__all__ = ["GatherMode", "LinearMode"]


class LinearMode(enum.Enum):
    """MXFP8: quantized GEMMs on MXFP8 planes (the real op). HIGH_PRECISION: the same graph with
    plain dots and no quantization (the control, and gradcheck-style tests)."""

    MXFP8 = "mxfp8"
    HIGH_PRECISION = "high_precision"

    @classmethod
    def parse(cls, value: LinearMode | str) -> LinearMode:
        return parse_enum(cls, value, what="linear mode")


class GatherMode(enum.Enum):
    """How FSDP all-gathers block-scaled (MXFP8) weights (``MixedPrecisionPolicy.gather``).

    MXFP8: the MXFP8 planes themselves, 1 byte per element per plane (forward the rowwise, backward
    the columnwise plane), quantized once per optimizer step by the distributed recipe.
    BF16: bf16(main), 2 bytes per element, once for forward and once for backward; every rank then
    quantizes the full bf16 weight itself (Megatron-LM's ``fp8_param_gather=False``). Both give
    the same MXFP8 bytes to the GEMMs (DESIGN.md 5: distributed quantization equals quantizing
    the full bf16(main) on one rank)."""

    MXFP8 = "mxfp8"
    BF16 = "bf16"

    @classmethod
    def parse(cls, value: GatherMode | str) -> GatherMode:
        return parse_enum(cls, value, what="weight gather mode")
