"""The enums of how a model computes, shared by every layer and both frameworks.

- ``LinearMode``: how a linear layer multiplies (the bridge's Torch op, the Flax twin, the Torch
  twin, FSDP -- which weights get MXFP8 planes -- and the applications all take it).
- ``Activations``: the activation dtype and attention kernel of the GPT twins.
- ``GatherMode``: how FSDP all-gathers block-scaled weights (``MixedPrecisionPolicy.gather``,
  ``mxfp8-train --gather``).
- ``Compute``: the granularity at which a Torch model enters JAX (one op per linear, or one
  program per FSDP unit and direction; docs/DESIGN.md section 8).

There is no second spelling of any of them to convert between.
"""

from __future__ import annotations

import enum

from common.enums import Parseable

__all__ = ["Activations", "Compute", "GatherMode", "LinearMode"]


class LinearMode(Parseable, enum.Enum, what="linear mode"):
    """MXFP8: quantized GEMMs on block-scaled weight planes (the real op): x and dy quantized to
    MXFP8, the weight MXFP8 or the planes FSDP hands over in its group's format, which they carry
    (``jax_side.linear.FlatPlane``). HIGH_PRECISION: the same graph with plain dots and no
    quantization (the control, and gradcheck-style tests)."""

    MXFP8 = "mxfp8"
    HIGH_PRECISION = "high_precision"


class Activations(Parseable, enum.Enum, what="activations"):
    """Activation dtype and attention kernel of the GPT twins (Torch and Flax alike)."""

    FP32 = "fp32"  # fp32 everywhere, attention written out: the exact twin the parity tests use
    BF16 = "bf16"  # training speed: bf16 activations, fused attention, fp32 norm and loss math


class Compute(Parseable, enum.Enum, what="compute granularity"):
    """How a Torch model's registered blocks enter JAX (``bridge.units``)."""

    OP = "op"  # one Torch autograd op per linear layer (MXFP8Linear anywhere)
    UNIT = "unit"  # one jitted JAX program per block (FSDP unit) forward, one per backward


class GatherMode(Parseable, enum.Enum, what="weight gather mode"):
    """How FSDP all-gathers block-scaled (MXFP8) weights (``MixedPrecisionPolicy.gather``).

    MXFP8: the planes themselves (of the weights' block-scaled format: MXFP8 or one registered),
    1 byte per element per plane (forward the rowwise, backward the columnwise plane), quantized
    once per optimizer step by the distributed recipe.
    BF16: bf16(main), 2 bytes per element, once for forward and once for backward; every rank then
    quantizes the full bf16 weight itself (Megatron-LM's ``fp8_param_gather=False``). Both give
    the same MXFP8 bytes to the GEMMs (DESIGN.md 5: distributed quantization equals quantizing
    the full bf16(main) on one rank)."""

    MXFP8 = "mxfp8"
    BF16 = "bf16"
