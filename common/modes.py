"""``LinearMode``: the one enum of how a linear layer multiplies, shared by every layer.

The bridge's Torch op, the Flax twin, the Torch twin, FSDP (which weights get MXFP8 planes) and
the applications all take this enum; there is no second spelling to convert between.
"""

from __future__ import annotations

import enum

from common.enums import parse_enum

__all__ = ["LinearMode"]


class LinearMode(enum.Enum):
    """MXFP8: quantized GEMMs on MXFP8 planes (the real op). HIGH_PRECISION: the same graph with
    plain dots and no quantization (the control, and gradcheck-style tests)."""

    MXFP8 = "mxfp8"
    HIGH_PRECISION = "high_precision"

    @classmethod
    def parse(cls, value: LinearMode | str) -> LinearMode:
        return parse_enum(cls, value, what="linear mode")
